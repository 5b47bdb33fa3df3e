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

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import (
    _axes,
    _checks,
    _numeric,
    _shards,
    _transform,
    perfmodel,
    registry,
    sparse,
    wire,
)

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
    specs: Any = None,
    fsdp_topk: sparse.FsdpTopK = "whole",
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
    After warm-up, ties at the threshold go to lower positions in the whole tensor's
    row-major order where `specs` gives the leaf's `PartitionSpec`
    (`_shards.global_index`), which sends the whole tensor's entries in every layout;
    without it, in shard-major order (piece s's element j at `s * piece + j`), the
    row-major order only where the leaf is split along its leading dimension, so a leaf
    split along another one may send other tied entries. (During warm-up every tied
    entry goes, whatever the order.)

    With FSDP (ZeRO-3, `specs`: a param split along its leading dimension over
    `axis_name`, `P("data", ...)`, as `gradcomm.parallel.shard_params` places it), the
    gradient of such a leaf comes in whole (that of the gathered param) and leaves as
    this device's shard of C, the same bits as the slice of C without FSDP: E, the top k
    and the residual are the whole gradient's, as above; G's pairs go in the same
    all-gather and each device decodes only its shard (`sparse.sum_scattered`: (N - 1) k
    pairs per device, as without FSDP, since no fixed-capacity exchange can send the
    (N - 1) / N k of a reduce-scatter exactly; see `gradcomm.sparse`; with
    `fsdp_topk="per_shard"` each shard's own top entries at the same drop ratio, and an
    all-to-all sends each device its shard's pairs, (N - 1) / N k: a reduce-scatter of
    the compressed vector, as `gradcomm.lags` says), and the warm-up's
    dense S goes in a reduce-scatter, (N - 1) / N of the bytes of its all-reduce. In
    C = (G + L) / N and (G - S + L) / N, L and S are then this device's shard of its own
    L and S: device j's shard is the slice of device j's C without FSDP. As each shard
    lives on one device only, there is one copy of the params and nothing drifts: shard
    j steps with device j's local gradient (no `sync` is needed, nor possible on FSDP
    leaves). A leaf not split over the data axes still gets each device's own C, which
    `parallel.train_step` allows only with per-device params (FSDP needs replicated
    ones): with `local`, split every param, or use `local=None`. The residual is this
    device's unsent part of its whole gradient, whole-sized and per device: `init`
    builds it, `(1, rows, ...)`, from the shard it is given inside the map
    (`parallel.init_state`; outside a map, from the whole param), and
    `parallel.train_step` keeps it `(N, rows, ...)`. Params and the optimizer's state
    after gradient dropping are 1/N per device; the residual is not.

    Args:
      axis_name: the mesh axis (or tuple of axes) of the nodes.
      drop_ratio: the dropped fraction in [0, 1) (0.99 sends 1%, Marian's convention).
      local: None (C = G / N), "sum" (C = (G + L) / N) or "compensated"
        (C = (G - S + L) / N), with L this device's gradient (without the residual) and S
        what it sent.
      warmup_steps: length of the drop-ratio warm-up (the paper's 1000); 0 turns it off.
      selector: "sampled" or "exact" top-k, as in `gradcomm.lags`.
      specs: None, or the params' `PartitionSpec`s (a pytree like them; None for a
        leaf whose spec is not given). A leaf whose spec splits its leading dimension
        over `axis_name`, `P("data", ...)`, is FSDP-split: its gradient comes in whole
        and leaves as this device's shard of C, its leading dimension divided by N
        (which must divide it); an FSDP leaf must not also be split over another mesh
        axis. A leaf split over other mesh axes (known by its type) breaks ties by its
        spec in the whole tensor's row-major order (see above), so its spec must name
        those axes.
      fsdp_topk: "whole" or "per_shard": which entries of an FSDP leaf G holds after
        the warm-up, as for `gradcomm.lags`; needs `specs`.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `GradientDroppingState`.

    Raises:
      ValueError: for a drop ratio outside [0, 1), an unknown `local`, selector or
        `fsdp_topk`, `fsdp_topk="per_shard"` without `specs`, or a bad `warmup_steps`;
        at trace time for an unbound axis, a non-floating leaf, or a mesh with axes
        beyond `axis_name` under `shard_map(check_vma=False)`; with `specs`, for
        specs not shaped like the gradients, an FSDP leaf whose leading dimension N does
        not divide, that is split over other mesh axes too, or whose residual is not
        whole-sized, or a leaf split over other mesh axes than its spec names.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.gradient_dropping("data", drop_ratio=0.5, local="compensated",
      ...                                 warmup_steps=0)
      >>> grads = jnp.array([[4.0, 1.0], [0.0, -2.0]])  # one row per device
      >>> state = tx.init(grads[0])
      >>> jax.jit(jax.vmap(lambda g: tx.update(g, state)[0], axis_name="data"))(grads)[0]
      Array([ 2. , -0.5], dtype=float32)

      With FSDP, device j keeps element j of its C (the leaf split over "data"):

      >>> from jax.sharding import PartitionSpec as P
      >>> tx = gradcomm.gradient_dropping("data", drop_ratio=0.5, local="compensated",
      ...                                 warmup_steps=0, specs=P("data"))
      >>> state = tx.init(grads[0])  # outside a map: the residual from the whole param
      >>> jax.jit(jax.vmap(lambda g: tx.update(g, state)[0], axis_name="data"))(grads)
      Array([[ 2.],
             [-1.]], dtype=float32)

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
    sparse.check_fsdp_topk(fsdp_topk, specs, "gradient_dropping")

    def init_fn(params: Any) -> GradientDroppingState:
        return GradientDroppingState(
            count=_transform.zero_count(),
            residual=sparse.zero_residuals(params, specs, axis_name, "gradient_dropping"),
        )

    def step(
        leaves: list[jax.Array], names: list[str], state: GradientDroppingState
    ) -> tuple[list[jax.Array], GradientDroppingState]:
        n = _axes.axis_size(axis_name)
        residuals = jax.tree.leaves(state.residual)
        # The residual is shaped like the updates, which `specs` must match.
        leaf_specs = _shards.leaf_specs(specs, state.residual, "gradient_dropping")
        fsdp = sparse.fsdp_leaves(specs, state.residual, names, axis_name, "gradient_dropping")
        for i in (i for i, split in enumerate(fsdp) if split):
            sparse.check_whole_residual(residuals[i], leaves[i], n, "gradient_dropping", names[i])
        ids = [i for i, leaf in enumerate(leaves) if leaf.size]
        accs = [sparse.accumulate(residuals[i], leaves[i]) for i in ids]
        # A leaf sharded over mesh axes beyond axis_name (tensor parallelism) is a piece
        # here: its k, threshold and size tests are the whole leaf's.
        shards = [_shards.shard_axes(a, axis_name, "gradient_dropping") for a in accs]
        for axes, i in zip(shards, ids, strict=True):
            if fsdp[i]:
                sparse.check_fsdp_axes(axes, "gradient_dropping", names[i])
        wholes = [a.size * _shards.num_shards(axes) for a, axes in zip(accs, shards, strict=True)]
        # An FSDP leaf (whole here, the gradient of the gathered param) leaves as this
        # device's shard: its slice of the sums, of L and of S.
        split = [fsdp[i] for i in ids]

        def mine(x: jax.Array, i: int) -> jax.Array:
            return sparse.own_shard(x, n, axis_name) if fsdp[i] else x

        def local_gradient(i: int, dtype: Any) -> jax.Array:
            return mine(leaves[i].ravel().astype(dtype), i)

        def select(a: jax.Array, axes: tuple[str, ...], whole: int, i: int) -> Any:
            if fsdp[i] and fsdp_topk == "per_shard":
                return sparse.topk_per_shard(
                    a, n, sparse.num_kept(whole // n, 1 - drop_ratio), selector
                )
            k = sparse.num_kept(whole, 1 - drop_ratio)
            if not axes:
                return sparse.topk(a, k, selector)
            order = None
            if leaf_specs[i] is not None:  # ties in the whole leaf's row-major order
                index = _shards.global_index(
                    leaves[i], leaf_specs[i], axes, axis_name, "gradient_dropping", names[i]
                )
                order = [index.ravel().astype(jnp.int32)]
            return sparse.topk_over_shards([a], [axes], k, selector, order)[0]

        def steady() -> tuple[list[jax.Array], list[jax.Array]]:
            sent = [
                select(a, ax, w, i) for a, ax, w, i in zip(accs, shards, wholes, ids, strict=True)
            ]
            sizes = [a.size for a in accs]
            # G arrives divided by N where nothing is added to it.
            totals = sparse.sum_sparse(
                sent,
                sizes,
                axis_name,
                divide_by=None if local else n,
                shards=shards,
                scatter=split if any(split) else None,
            )
            combined, kept = [], []
            for total, picked, a, axes, i in zip(totals, sent, accs, shards, ids, strict=True):
                values, idx = picked[:2]  # a piece's unselected indices lie past its end
                if local is not None:
                    lg = local_gradient(i, total.dtype)
                    c = (total + lg) / n
                    if local == "compensated":  # (G + (L - S)) / N differs only where S is
                        # Where S lies in c: an FSDP leaf's indices outside this device's
                        # shard, like a piece's unselected ones, point past its end.
                        at = sparse.shard_index(idx, a.size, n, axis_name) if fsdp[i] else idx
                        clipped = jnp.minimum(at, c.size - 1) if axes or fsdp[i] else at
                        patch = (total[clipped] + (lg[clipped] - values.astype(total.dtype))) / n
                        if axes or fsdp[i]:
                            c = c.at[at].set(patch, mode="drop")
                        else:
                            c = c.at[at].set(patch, unique_indices=True)
                    total = c
                combined.append(total)
                kept.append(sparse.unsent(a, idx, residuals[i], unique_indices=not axes))
            return combined, kept

        def warming() -> tuple[list[jax.Array], list[jax.Array]]:
            rate = drop_rate(state.count, drop_ratio, warmup_steps)
            sent, kept = [], []
            for a, axes, whole, i in zip(accs, shards, wholes, ids, strict=True):
                keep = jnp.clip(jnp.round((1 - rate) * whole), 1, whole).astype(jnp.int32)
                dense, residual = _drop_by_threshold(a, keep, axes)
                sent.append(dense.astype(_numeric.compute_dtype(dense.dtype)))
                kept.append(sparse.as_residual(residual, residuals[i]))
            if any(split):  # FSDP leaves' shards by a reduce-scatter, the others' psum
                totals: list[Any] = [None] * len(sent)
                for group, reduce in (
                    ([j for j, s in enumerate(split) if not s], lax.psum),
                    ([j for j, s in enumerate(split) if s], sparse.reduce_scatter_dense),
                ):
                    if group:
                        sums = reduce([sent[j] for j in group], axis_name)
                        for j, total in zip(group, sums, strict=True):
                            totals[j] = total
            else:
                totals = lax.psum(sent, axis_name)
            combined = []
            for total, dense, i in zip(totals, sent, ids, strict=True):
                if local == "sum":
                    total = total + local_gradient(i, total.dtype)
                elif local == "compensated":
                    total = total + (local_gradient(i, total.dtype) - mine(dense, i))
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
        for i in (i for i, split in enumerate(fsdp) if split):
            out[i] = leaves[i][: leaves[i].shape[0] // n]  # the shard's shape (and an empty one)
        for j, i in enumerate(ids):
            out[i] = combined[j].astype(leaves[i].dtype).reshape(out[i].shape)
            new_residuals[i] = kept[j]
        new_state = GradientDroppingState(
            count=optax.safe_increment(state.count),
            residual=jax.tree.unflatten(jax.tree.structure(state.residual), new_residuals),
        )
        return out, new_state

    return _transform.leafwise("gradient_dropping", axis_name, init_fn, step)


def _pattern(options: Mapping[str, Any], s: perfmodel.Setting) -> list[perfmodel.Collective]:
    """The top-k pairs of the updates that are not dropped, gathered."""
    return sparse.collectives({"density": 1 - options["drop_ratio"]}, s)


registry.register(registry.Method(
    gradient_dropping, "before", title="Gradient dropping", paper="Aji et al., EMNLP 2019",
    page="dropping", collectives=_pattern, window="backward",
))  # fmt: skip
