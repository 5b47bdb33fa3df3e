"""Gradient dropping with local gradients (Aji, Heafield and Bogoychev, EMNLP 2019).

Gradient dropping (Algorithm 1): each node adds its local gradient L to its residual E,
sends the entries of E outside the dropped fraction (the top 1% at drop ratio 0.99), keeps
the rest, and all nodes sum what was sent: G = sum_n S_n. The paper then combines G with
the node's dense local gradient (section 3),

    C = G + L   ("sum"),   or   C = G - S + L   ("compensated"),

which gradcomm divides by N, so that with nothing dropped the result is the dense mean.
Nodes then drift apart, so parameters are averaged every few hundred steps (3.1). That
is a rule on the params, not on the gradients, and it lives in `gradcomm.sync`:
`periodic_average(axis_name, every=500)`, passed as `train_step(..., sync=...)` or run in a
hand-written loop after each step. Local SGD, the paper's other baseline, is the same rule
with no gradient exchange at all (`gradcomm.local_sgd`).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _axes, _checks, _schedule, _shards, sparse, wire

Local = Literal["sum", "compensated"]
LOCAL_MODES = (None, *get_args(Local))


class GradientDroppingState(NamedTuple):
    """State of `gradient_dropping`: the step counter (the warm-up reads it), the residual E."""

    count: jax.Array
    residual: Any


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


def _drop_by_threshold(
    acc: jax.Array, keep: jax.Array, axes: tuple[str, ...] = ()
) -> tuple[jax.Array, jax.Array]:
    """Algorithm 1, lines 4-7, for a traced count `keep`: (sent, residual), both dense.

    The threshold is the keep-th largest |acc| (found by bisection on its bits, no sort);
    entries at least that large are sent (ties at the threshold all go). Where `acc` is
    one piece of a leaf sharded over mesh `axes`, the threshold is the whole leaf's (each
    pass's count summed over them).
    """
    magnitude = sparse.magnitude_bits(acc)
    mask = magnitude >= sparse.kth_largest(magnitude, keep, axes=axes)
    return jnp.where(mask, acc, 0), jnp.where(mask, 0, acc)


def gradient_dropping(
    axis_name: _axes.AxisName = "data",
    *,
    drop_ratio: float = 0.99,
    local: Local | None = None,
    warmup_steps: int = 1000,
    selector: sparse.Selector = "sampled",
) -> optax.GradientTransformationExtraArgs:
    """Gradient dropping with error feedback, optionally combined with the local gradient.

    Place it before the optimizer (it acts on gradients):
    `optax.chain(gradcomm.gradient_dropping("data", local="compensated"), optax.adam(1e-3))`.
    With `local`, the devices' params drift apart; the paper averages them every 500
    steps, a rule on the params: `sync = gradcomm.periodic_average("data", every=500)`,
    passed as `parallel.train_step(..., params_per_device=True, sync=sync)`. A
    hand-written `shard_map` loop adds one line after `optax.apply_updates`:
    `params, sync_state = sync.update(params, sync_state)`.
    Per leaf, on each device: `E = residual + L`; after warm-up the `round((1 - drop_ratio)
    * size)` (at least 1) entries of largest magnitude, S, are sent in one fixed-capacity
    all-gather and `E - S` is kept, bit for bit. During warm-up the kept fraction follows
    `drop_rate` and, as it changes every step, S is sent densely (a psum); the threshold
    is then Algorithm 1's: every entry at least as large as the k-th largest goes.

    Inside `shard_map` over a mesh with axes beyond `axis_name` (tensor parallelism), a
    leaf sharded over them is a piece of its tensor: the kept count, the threshold and
    the size tests are the whole tensor's (`sparse.topk_over_shards`, or during warm-up
    each bisection pass's count summed over the shard axes), each piece sends about 1/S
    of the pairs, and every `local` mode gives the whole tensor's result, bit for bit.

    Args:
      axis_name: the mesh axis (or tuple of axes) of the nodes.
      drop_ratio: the dropped fraction in [0, 1) (0.99 sends 1%, Marian's convention).
      local: None (C = G / N), "sum" (C = (G + L) / N) or "compensated"
        (C = (G - S + L) / N), with L this device's gradient (without the residual) and S
        what it sent.
      warmup_steps: length of the drop-ratio warm-up (the paper's 1000); 0 turns it off.
      selector: "sampled" or "exact" top-k, as in `gradcomm.lags`.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `GradientDroppingState`.

    Raises:
      ValueError: for a drop ratio outside [0, 1), an unknown `local` or selector, or a bad
        `warmup_steps`; at trace time for an unbound axis, a non-floating leaf, or a mesh
        with axes beyond `axis_name` under `shard_map(check_vma=False)`.

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
    _axes.check_axis_name(axis_name)
    if (
        isinstance(drop_ratio, bool)
        or not isinstance(drop_ratio, int | float)
        or not (0 <= drop_ratio < 1)
    ):
        raise ValueError(
            f"drop_ratio must be in [0, 1), got {drop_ratio!r}"
            + _checks.static_hint(drop_ratio, "drop_ratio")
        )
    if local not in LOCAL_MODES:
        raise ValueError(f"local must be one of {LOCAL_MODES}, got {local!r}")
    _checks.check_int(warmup_steps, "warmup_steps", minimum=0)
    sparse.check_selector(selector)

    def init_fn(params: Any) -> GradientDroppingState:
        return GradientDroppingState(
            count=_schedule.zero_count(),
            residual=jax.tree.map(jnp.zeros_like, params),
        )

    @jax.named_scope("gradcomm.gradient_dropping")
    def update_fn(
        updates: Any, state: GradientDroppingState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, GradientDroppingState]:
        del params, extra_args
        _checks.check_updates(updates, axis_name, "gradient_dropping")
        n = _axes.axis_size(axis_name)
        leaves, treedef = jax.tree.flatten(updates)
        residuals = jax.tree.leaves(state.residual)
        ids = [i for i, leaf in enumerate(leaves) if leaf.size]
        accs = [sparse.accumulate(residuals[i], leaves[i]) for i in ids]
        # A leaf sharded over mesh axes beyond axis_name (tensor parallelism) is a piece
        # here: its k, threshold and size tests are the whole leaf's.
        shards = [_shards.shard_axes(a, axis_name, "gradient_dropping") for a in accs]
        wholes = [a.size * _shards.num_shards(axes) for a, axes in zip(accs, shards, strict=True)]

        def local_gradient(i: int, dtype: Any) -> jax.Array:
            return leaves[i].ravel().astype(dtype)

        def select(a: jax.Array, axes: tuple[str, ...], whole: int) -> Any:
            k = sparse.num_kept(whole, 1 - drop_ratio)
            if axes:
                return sparse.topk_over_shards([a], [axes], k, selector)[0]
            return sparse.topk(a, k, selector)

        def steady() -> tuple[list[jax.Array], list[jax.Array]]:
            sent = [select(a, ax, w) for a, ax, w in zip(accs, shards, wholes, strict=True)]
            sizes = [a.size for a in accs]
            # G arrives divided by N where nothing is added to it.
            totals = sparse.sum_sparse(
                sent, sizes, axis_name, divide_by=None if local else n, shards=shards
            )
            combined, kept = [], []
            for total, picked, a, axes, i in zip(totals, sent, accs, shards, ids, strict=True):
                values, idx = picked[:2]  # a piece's unselected indices lie past its end
                if local is not None:
                    lg = local_gradient(i, total.dtype)
                    c = (total + lg) / n
                    if local == "compensated":  # (G + (L - S)) / N differs only where S is
                        at = jnp.minimum(idx, a.size - 1) if axes else idx
                        patch = (total[at] + (lg[at] - values.astype(total.dtype))) / n
                        if axes:
                            c = c.at[idx].set(patch, mode="drop")
                        else:
                            c = c.at[idx].set(patch, unique_indices=True)
                    total = c
                combined.append(total)
                kept.append(sparse.unsent(a, idx, residuals[i], unique_indices=not axes))
            return combined, kept

        def warming() -> tuple[list[jax.Array], list[jax.Array]]:
            rate = drop_rate(state.count, drop_ratio, warmup_steps)
            mine, kept = [], []
            for a, axes, whole, i in zip(accs, shards, wholes, ids, strict=True):
                keep = jnp.clip(jnp.round((1 - rate) * whole), 1, whole).astype(jnp.int32)
                sent, residual = _drop_by_threshold(a, keep, axes)
                mine.append(sent.astype(_axes.compute_dtype(sent.dtype)))
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
        )
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
