"""Gradient dropping with local gradients (Aji, Heafield and Bogoychev, EMNLP 2019), and local SGD.

Gradient dropping (Algorithm 1): each node adds its local gradient L to its residual E,
sends the entries of E outside the dropped fraction (the top 1% at drop ratio 0.99), keeps
the rest, and all nodes sum what was sent: G = sum_n S_n. The paper then combines G with
the node's dense local gradient (section 3),

    C = G + L   ("sum"),   or   C = G - S + L   ("compensated"),

which gradcomm divides by N, so that with nothing dropped the result is the dense mean.
Nodes then drift apart, so parameters are averaged every few hundred steps (3.1).

Local SGD (federated averaging) is the other baseline: no gradient exchange at all,
parameters averaged every few steps.

Parameter averaging and exact bits: see `gradcomm.parallel.train_step`. A delta
`a - p` added to different p cannot give every device the same bits, so under
`train_step` the transformations defer the averaging to the step, which assigns the
exact mean.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _base, sparse, wire

Local = Literal["sum", "compensated"]
LOCAL_MODES = (None, *get_args(Local))


class GradientDroppingState(NamedTuple):
    """State of `gradient_dropping`: the step counter, the residual E, the averaging marker."""

    count: jax.Array
    residual: Any
    averaging: _base.ParamsAveraging


class LocalSgdState(NamedTuple):
    """State of `local_sgd`: the step counter and the averaging marker."""

    count: jax.Array
    averaging: _base.ParamsAveraging


def drop_rate(count: jax.Array, drop_ratio: float, warmup_steps: int) -> jax.Array:
    """The dropped fraction at step `count` (from 0): drop_ratio^(warmup_steps / (1 + t)).

    Marian's warm-up: nearly nothing is dropped at first, drop_ratio from step
    `warmup_steps` on (with the paper's 1000 steps, the exponent is 1000 / (1 + t)).
    """
    if warmup_steps == 0:
        return jnp.asarray(drop_ratio, jnp.float32)
    t = count.astype(jnp.float32)
    warm = jnp.float32(drop_ratio) ** (warmup_steps / (1 + t))
    return jnp.where(count < warmup_steps, warm, jnp.float32(drop_ratio))


def _drop_by_threshold(acc: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Algorithm 1, lines 4-7, for a traced count `keep`: (sent, residual), both dense.

    The threshold is the keep-th largest |acc| (found by bisection on its bits, no sort);
    entries at least that large are sent (ties at the threshold all go).
    """
    magnitude = sparse.magnitude_bits(acc)
    mask = magnitude >= sparse.kth_largest(magnitude, keep)
    return jnp.where(mask, acc, 0), jnp.where(mask, 0, acc)


def gradient_dropping(
    axis_name: _base.AxisName = "data",
    *,
    drop_ratio: float = 0.99,
    local: Local | None = None,
    average_every: int | None = None,
    warmup_steps: int = 1000,
    selector: sparse.Selector = "sampled",
) -> optax.GradientTransformationExtraArgs:
    """Gradient dropping with error feedback, optionally combined with the local gradient.

    Place it before the optimizer (it acts on gradients):
    `optax.chain(gradcomm.gradient_dropping("data", local="compensated"), optax.adam(1e-3))`.
    Per leaf, on each device: `E = residual + L`; after warm-up the `round((1 - drop_ratio)
    * size)` (at least 1) entries of largest magnitude, S, are sent in one fixed-capacity
    all-gather and `E - S` is kept, bit for bit. During warm-up the kept fraction follows
    `drop_rate` and, as it changes every step, S is sent densely (a psum); the threshold
    is then Algorithm 1's: every entry at least as large as the k-th largest goes.

    Args:
      axis_name: the mesh axis (or tuple of axes) of the nodes.
      drop_ratio: the dropped fraction in [0, 1) (0.99 sends 1%, Marian's convention).
      local: None (C = G / N), "sum" (C = (G + L) / N) or "compensated"
        (C = (G - S + L) / N), with L this device's gradient (without the residual) and S
        what it sent.
      average_every: average the parameters after steps k, 2k, ... (the paper uses 500).
        The optimizer's state is not averaged, as in the paper. This needs
        `gradcomm.parallel.train_step(..., params_per_device=True)`, which assigns the
        exact mean; in another loop, leave it unset and run
        `gradcomm.periodic_average(axis_name, every=k)` on the params after each step.
      warmup_steps: length of the drop-ratio warm-up (the paper's 1000); 0 turns it off.
      selector: "sampled" or "exact" top-k, as in `gradcomm.lags`.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `GradientDroppingState`.

    Raises:
      ValueError: for a drop ratio outside [0, 1), an unknown `local` or selector, a bad
        `average_every` or `warmup_steps`; at trace time for an unbound axis, a
        non-floating leaf, or `average_every` outside `parallel.train_step`.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.gradient_dropping("data", drop_ratio=0.5, local="compensated",
      ...                                 warmup_steps=0)
      >>> grads = jnp.array([[4.0, 1.0], [0.0, -2.0]])  # one row per device
      >>> state = tx.init(grads[0])
      >>> jax.vmap(lambda g: tx.update(g, state)[0], axis_name="data")(grads)[0]
      Array([ 2. , -0.5], dtype=float32)

    References:
      Aji, Heafield and Bogoychev, "Combining Global Sparse Gradients with Local Gradients
      in Distributed Neural Network Training", EMNLP 2019: Algorithm 1, sections 3, 3.1.
    """
    _base.check_axis_name(axis_name)
    if (
        isinstance(drop_ratio, bool)
        or not isinstance(drop_ratio, int | float)
        or not (0 <= drop_ratio < 1)
    ):
        raise ValueError(
            f"drop_ratio must be in [0, 1), got {drop_ratio!r}"
            + _base.static_hint(drop_ratio, "drop_ratio")
        )
    if local not in LOCAL_MODES:
        raise ValueError(f"local must be one of {LOCAL_MODES}, got {local!r}")
    _base.check_int(average_every, "average_every", minimum=1, optional=True)
    _base.check_int(warmup_steps, "warmup_steps", minimum=0)
    sparse.check_selector(selector)

    def init_fn(params: Any) -> GradientDroppingState:
        return GradientDroppingState(
            count=_base.zero_count(),
            residual=jax.tree.map(jnp.zeros_like, params),
            averaging=_base.ParamsAveraging(due=jnp.zeros([], bool)),
        )

    @jax.named_scope("gradcomm.gradient_dropping")
    def update_fn(
        updates: Any, state: GradientDroppingState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, GradientDroppingState]:
        _base.check_updates(updates, axis_name, "gradient_dropping")
        if average_every is not None:
            if params is None:
                raise ValueError("gradient_dropping(average_every=...) needs params")
            if not extra_args.get(_base.DEFER_AVERAGING):
                raise ValueError(
                    "gradient_dropping(average_every=...) sets the params to their exact "
                    "mean, which gradcomm.parallel.train_step(..., params_per_device=True) "
                    "does when it asks; no request arrived here. In another loop, or inside "
                    "a wrapper that drops extra arguments (optax.MultiSteps), leave "
                    "average_every unset and average the params yourself after each step: "
                    "sync = gradcomm.periodic_average(axis_name, every=k), then "
                    "`params, sync_state = sync.update(params, sync_state)` (or "
                    "train_step(..., sync=sync))"
                )
        n = _base.axis_size(axis_name)
        leaves, treedef = jax.tree.flatten(updates)
        residuals = jax.tree.leaves(state.residual)
        ids = [i for i, leaf in enumerate(leaves) if leaf.size]
        accs = [sparse.accumulate(residuals[i], leaves[i]) for i in ids]

        def local_gradient(i: int, dtype: Any) -> jax.Array:
            return leaves[i].ravel().astype(dtype)

        def steady() -> tuple[list[jax.Array], list[jax.Array]]:
            sent = [sparse.topk(a, sparse.num_kept(a.size, 1 - drop_ratio), selector) for a in accs]
            sizes = [a.size for a in accs]
            # G arrives divided by N where nothing is added to it.
            totals = sparse.sum_sparse(sent, sizes, axis_name, divide_by=None if local else n)
            combined = []
            for total, (values, idx), i in zip(totals, sent, ids, strict=True):
                if local is not None:
                    lg = local_gradient(i, total.dtype)
                    c = (total + lg) / n
                    if local == "compensated":  # (G + (L - S)) / N differs only where S is
                        patch = (total[idx] + (lg[idx] - values.astype(total.dtype))) / n
                        c = c.at[idx].set(patch, unique_indices=True)
                    total = c
                combined.append(total)
            kept = [
                sparse.unsent(a, idx, residuals[i])
                for (_, idx), a, i in zip(sent, accs, ids, strict=True)
            ]
            return combined, kept

        def warming() -> tuple[list[jax.Array], list[jax.Array]]:
            rate = drop_rate(state.count, drop_ratio, warmup_steps)
            mine, kept = [], []
            for a, i in zip(accs, ids, strict=True):
                keep = jnp.clip(jnp.round((1 - rate) * a.size), 1, a.size).astype(jnp.int32)
                sent, residual = _drop_by_threshold(a, keep)
                mine.append(sent.astype(_base.compute_dtype(sent.dtype)))
                kept.append(sparse.as_residual(residual, residuals[i]))
            combined = []
            for total, sent, i in zip(lax.psum(mine, axis_name), mine, ids, strict=True):
                if local == "sum":
                    total = total + local_gradient(i, total.dtype)
                elif local == "compensated":
                    total = total + (local_gradient(i, total.dtype) - sent)
                combined.append(total / n)
            return combined, kept

        if not ids:
            combined, kept = [], []
        elif warmup_steps == 0:
            combined, kept = steady()
        else:
            combined, kept = lax.cond(
                state.count < warmup_steps,
                wire.branch("warm-up", first=warmup_steps)(warming),
                wire.branch("sparse")(steady),
            )

        out, new_residuals = list(leaves), list(residuals)
        for j, i in enumerate(ids):
            out[i] = combined[j].astype(leaves[i].dtype).reshape(leaves[i].shape)
            new_residuals[i] = kept[j]
        new_state = GradientDroppingState(
            count=optax.safe_increment(state.count),
            residual=jax.tree.unflatten(jax.tree.structure(state.residual), new_residuals),
            averaging=_base.ParamsAveraging(due=_base.averaging_due(state.count, average_every)),
        )
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def local_sgd(
    axis_name: _base.AxisName = "data", *, every: int = 20
) -> optax.GradientTransformationExtraArgs:
    """Local SGD (federated averaging): no gradient exchange, parameters averaged every k steps.

    Place it last, after the optimizer: `optax.chain(optax.sgd(0.1), gradcomm.local_sgd(
    "data", every=20))`, with params kept per device. Each device applies its own update;
    after steps k, 2k, ... (counting from 1) the parameters are averaged across devices.
    The same averaging as an explicit rule on the params: `gradcomm.periodic_average`,
    passed to `train_step(..., sync=...)` or run in your own loop.
    Under `gradcomm.parallel.train_step(..., params_per_device=True)` the step assigns the
    exact mean (every device the same bits). Elsewhere the update at those steps is
    `mean(params + update) - params`, the mean up to the rounding of adding it back.
    The optimizer's state is not averaged. Chained after another method's optimizer, this
    is the periodic model averaging of gradient dropping with local gradients (3.1).

    Args:
      axis_name: the mesh axis (or tuple of axes) to average over.
      every: the averaging period k >= 1 (the paper's federated-averaging baseline uses 20,
        its periodic averaging 500).

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `LocalSgdState`.

    Raises:
      ValueError: for a bad `every` at construction; at trace time without params.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.local_sgd("data", every=1)
      >>> params = jnp.array([[1.0], [3.0]])  # one row per device
      >>> step = lambda u, p: tx.update(u, tx.init(p), p)[0]
      >>> new = jax.vmap(lambda p: p + step(jnp.zeros(1), p), axis_name="data")(params)
      >>> new[:, 0]
      Array([2., 2.], dtype=float32)

    References:
      McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
      Data", AISTATS 2017, as the baseline of Aji et al., EMNLP 2019 (sections 2.2, 3.1).
    """
    _base.check_axis_name(axis_name)
    _base.check_int(every, "every", minimum=1)

    def init_fn(params: Any) -> LocalSgdState:
        del params
        return LocalSgdState(
            count=_base.zero_count(), averaging=_base.ParamsAveraging(due=jnp.zeros([], bool))
        )

    @jax.named_scope("gradcomm.local_sgd")
    def update_fn(
        updates: Any, state: LocalSgdState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LocalSgdState]:
        _base.require_params(params, "local_sgd")
        _base.check_updates(updates, axis_name, "local_sgd")
        _base.axis_size(axis_name)
        due = _base.averaging_due(state.count, every)
        if not extra_args.get(_base.DEFER_AVERAGING):

            def averaged(updates: Any) -> Any:
                target = lax.pmean(jax.tree.map(jnp.add, params, updates), axis_name)
                return jax.tree.map(jnp.subtract, target, params)

            named = wire.branch("average params", every=every)(averaged)
            updates = lax.cond(due, named, lambda u: u, updates)
        new_state = LocalSgdState(
            count=optax.safe_increment(state.count), averaging=_base.ParamsAveraging(due=due)
        )
        return updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
