"""LAGS-SGD: layer-wise adaptive top-k sparsification with residuals (Shi et al., ECAI 2020).

Each device adds the leaf's update to its residual, sends the k(l) entries of largest
magnitude, keeps the rest, and the devices average what was sent (eq. 5, Algorithm 1):

    acc = residual + update;   residual' = acc - TopK(acc, k(l));
    update' = (1/P) sum_p TopK(acc_p, k(l)).

The density k(l)/d(l) may differ per leaf; `lags_plan` picks it so that each leaf's
communication hides behind the backward pass of the leaves after it (eq. 18).
`slgs` is the single-layer baseline: one top-k over the whole flattened model.
Diagnostics: `lags_delta` (Assumption 1, eq. 20) and `lags_speedup_bound` (eq. 19). The
planner (`lags_plan`, `lags_profile`, `lags_speedup_bound`, `LagsPlan`) is
`gradcomm.lags._plan`'s, re-exported here; the top-k, the exchange and error feedback are
`gradcomm.sparse`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _axes, _checks, _flat, _leafwise, _packing, _shards, sparse
from gradcomm.lags._plan import LagsPlan, lags_plan, lags_profile, lags_speedup_bound

__all__ = [
    "Density",
    "LagsPlan",
    "LagsState",
    "SlgsState",
    "lags",
    "lags_delta",
    "lags_plan",
    "lags_profile",
    "lags_speedup_bound",
    "slgs",
]


class LagsState(NamedTuple):
    """State of `lags`: per leaf, what this device has not sent (the residual)."""

    residual: Any


class SlgsState(NamedTuple):
    """State of `slgs`: per leaf, what this device has not sent (the residual)."""

    residual: Any


Density = float | Mapping[str, float] | LagsPlan


def _check_density_spec(density: Density) -> None:
    if isinstance(density, LagsPlan):
        density = density.densities
    if isinstance(density, Mapping):
        if not density:
            raise ValueError("density mapping is empty")
        for name, value in density.items():
            sparse.check_density(value, f"density[{name!r}]")
    else:
        sparse.check_density(density)


def _leaf_densities(density: Density, names: list[str]) -> list[float]:
    """The density of each leaf; a mapping matches leaf names or '/'-prefixes of them."""
    if isinstance(density, LagsPlan):
        density = density.densities
    if not isinstance(density, Mapping):
        return [float(density)] * len(names)
    matched = _checks.match_names(list(density), names, "density")
    missing = [name for name, m in zip(names, matched, strict=True) if m is None]
    if missing:
        raise ValueError(f"density gives no value for leaves {missing}")
    return [float(density[m]) for m in matched]


def lags(
    axis_name: _axes.AxisName = "data",
    *,
    density: Density = 0.001,
    selector: sparse.Selector = "sampled",
    specs: Any = None,
    fsdp_topk: sparse.FsdpTopK = "whole",
) -> optax.GradientTransformationExtraArgs:
    """LAGS-SGD: each leaf's top-k entries, with residuals, averaged over the devices.

    Place it after `optax.sgd` (eq. 5 sparsifies learning-rate-scaled updates):
    `optax.chain(optax.sgd(0.1), gradcomm.lags("data", density=0.001))`; before an optimizer
    it sparsifies gradients. Per device and leaf: `acc = residual + update`, send
    `TopK(acc, k)` with `k = round(density * size)` (at least 1), keep `acc - TopK(acc, k)`
    as the new residual, bit for bit. Every device gets the same average.

    Leaves whose (value, index) pairs would outweigh them dense (small biases at moderate
    densities) are sent dense; all other leaves of one dtype are merged into one
    fixed-capacity all-gather (the paper merges small tensors the same way).

    Inside `shard_map` over a mesh with axes beyond `axis_name` (tensor parallelism), a
    leaf sharded over them is a piece of its tensor: k, the size test and the top k are
    the whole tensor's (`sparse.topk_over_shards`), each piece sends about 1/S of the
    pairs over `axis_name`, and the result is the whole tensor's, bit for bit. Ties at
    the threshold (Adam's first updates before lags are nearly all of one magnitude) go
    to lower positions in the whole tensor's row-major order where `specs` gives the
    leaf's `PartitionSpec` (`_shards.global_index`), which selects the whole tensor's
    entries in every layout; without it, to lower positions in shard-major order (piece
    s's element j at `s * piece + j`), which is the row-major order only where the leaf
    is split along its leading dimension: a leaf split along another one (a
    column-split kernel, `P(None, "model")`) may then send other tied entries than the
    whole tensor would.

    With FSDP (ZeRO-3, `specs`: a param split along its leading dimension over
    `axis_name`, `P("data", ...)`, as `gradcomm.parallel.shard_params` places it), the
    update of such a leaf comes in whole (the gradient of the gathered param) and leaves
    as this device's shard of the mean, the same bits as the slice of the mean without
    FSDP: each device selects from its whole accumulator as above (same k, same pairs,
    same residual), the pairs go in the same all-gather, and each device decodes only its
    shard (`sparse.sum_scattered`). That is (N - 1) k pairs per device, as without FSDP:
    no fixed-capacity exchange can send the (N - 1) / N k of a reduce-scatter exactly
    (see `gradcomm.sparse`). `fsdp_topk="per_shard"` sends that: each of an FSDP leaf's
    N shards is a layer of its own, its top `round(density * size / N)` entries chosen
    on every device (`sparse.topk_per_shard`), and one all-to-all sends device j the
    pairs of shard j, (N - 1) / N of the leaf's k per device: a reduce-scatter of the
    compressed vector. The entries differ from the whole leaf's top k where a shard
    holds more or fewer of them than its share. The residual is this device's unsent
    part of its own whole gradient, so it stays whole-sized and per device: `init`
    builds it, `(1, rows, ...)`, from the shard it is given inside the map
    (`parallel.init_state`; outside a map, from the whole param), and
    `parallel.train_step` keeps it `(N, rows, ...)`, one per device. Params and the
    optimizer's state after lags are 1/N per device; the residual is not. Place lags
    before the optimizer, or after a stateless one (`optax.chain(optax.sgd(0.1),
    lags)`): an optimizer before it would see whole gradients with state shaped like
    the shards (Adam's moments would have to be whole and per device, N times FSDP's),
    which `parallel.init_state` rejects.

    Args:
      axis_name: the mesh axis (or tuple of axes) to average over.
      density: k/d in (0, 1]: one float for every leaf, a mapping from leaf names (or
        '/'-prefixes, like 'Dense_1') to densities covering every leaf, or a `LagsPlan`.
        The paper uses 0.001 (compression ratio 1000) for CNNs.
      selector: "sampled" (a block-sampled threshold refined to exactly k without a sort:
        the same entries as `lax.top_k`, several times faster on a CPU for large k; see
        `gradcomm.sparse`) or "exact" (`lax.top_k`).
      specs: None, or the params' `PartitionSpec`s (a pytree like them; None for a
        leaf whose spec is not given). A leaf whose spec splits its leading dimension
        over `axis_name`, `P("data", ...)`, is FSDP-split: its update comes in whole and
        leaves as this device's shard of the mean, its leading dimension divided by N
        (which must divide it); an FSDP leaf must not also be split over another mesh
        axis. A leaf split over other mesh axes (known by its type) breaks ties by its
        spec in the whole tensor's row-major order (see above), so its spec must name
        those axes.
      fsdp_topk: "whole" (an FSDP leaf's whole top k, the entries chosen without FSDP,
        (N - 1) k pairs per device) or "per_shard" (each shard's own top entries at the
        same density, (N - 1) / N k pairs per device: a reduce-scatter); needs `specs`.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `LagsState`.

    Raises:
      ValueError: for a density outside (0, 1], an unknown selector or fsdp_topk, or
        fsdp_topk="per_shard" without specs at construction;
        at trace time for density names that match no leaf or leaves with no density,
        an unbound axis, a non-floating leaf, or a mesh with axes beyond `axis_name`
        under `shard_map(check_vma=False)` (which hides which leaves are sharded); with
        `specs`, for specs not shaped like the updates, an FSDP leaf whose leading
        dimension N does not divide, that is split over other mesh axes too, or whose
        residual is not whole-sized, or a leaf split over other mesh axes than its spec
        names.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.lags("data", density=0.5)
      >>> updates = jnp.array([[4.0, 1.0], [0.0, -2.0]])  # one row per device
      >>> state = tx.init(updates[0])
      >>> out, state = jax.vmap(lambda u: tx.update(u, state), axis_name="data")(updates)
      >>> out[0], state.residual
      (Array([ 2., -1.], dtype=float32), Array([[0., 1.],
             [0., 0.]], dtype=float32))

      With FSDP, device j keeps element j of the mean (its shard of a leaf split over
      "data"), and its whole-sized residual:

      >>> from jax.sharding import PartitionSpec as P
      >>> tx = gradcomm.lags("data", density=0.5, specs=P("data"))
      >>> state = tx.init(updates[0])  # outside a map: from the whole param, (1, 2)
      >>> out, state = jax.vmap(lambda u: tx.update(u, state), axis_name="data")(updates)
      >>> out, state.residual.shape
      (Array([[ 2.],
             [-1.]], dtype=float32), (2, 1, 2))

    References:
      Shi et al., "Layer-wise Adaptive Gradient Sparsification for Distributed Deep
      Learning with Convergence Guarantees", ECAI 2020: eq. 5 and Algorithm 1.
    """
    _axes.check_axis_name(axis_name)
    _check_density_spec(density)
    sparse.check_selector(selector)
    sparse.check_fsdp_topk(fsdp_topk, specs, "lags")

    def step(
        leaves: list[jax.Array],
        names: list[str],
        residuals: list[jax.Array],
        fsdp: list[bool] | None = None,
        leaf_specs: list[Any] | None = None,
    ) -> tuple[list[jax.Array], list[jax.Array]]:
        n = _axes.axis_size(axis_name)
        densities = _leaf_densities(density, names)
        out, new_residuals = list(leaves), list(residuals)
        fsdp = fsdp or [False] * len(leaves)
        leaf_specs = leaf_specs or [None] * len(leaves)
        for i in (i for i, split in enumerate(fsdp) if split):
            sparse.check_whole_residual(residuals[i], leaves[i], n, "lags", names[i])
            out[i] = _shard_shaped(leaves[i], n)  # an empty leaf's (empty) shard
        ids = [i for i, leaf in enumerate(leaves) if leaf.size]
        sent, sizes, shards = [], [], []
        for i in ids:
            acc = sparse.accumulate(residuals[i], leaves[i])
            axes = _shards.shard_axes(acc, axis_name, "lags")
            if fsdp[i]:
                sparse.check_fsdp_axes(axes, "lags", names[i])
            k = sparse.num_kept(acc.size * _shards.num_shards(axes), densities[i])
            if axes:  # a piece of the leaf: the whole leaf's top k
                spec = leaf_specs[i]  # given: ties in the whole leaf's row-major order
                order = None
                if spec is not None:
                    order = [_whole_order(leaves[i], spec, axes, axis_name, "lags", names[i])]
                picked = sparse.topk_over_shards([acc], [axes], k, selector, order)[0]
                sent.append(picked)
                kept = sparse.unsent(acc, picked.indices, residuals[i], unique_indices=False)
            elif fsdp[i] and fsdp_topk == "per_shard":
                c = sparse.num_kept(acc.size // n, densities[i])
                sent.append(sparse.topk_per_shard(acc, n, c, selector))
                kept = sparse.unsent(acc, sent[-1].indices, residuals[i])
            else:
                values, indices = sparse.topk(acc, k, selector)
                sent.append((values, indices))
                kept = sparse.unsent(acc, indices, residuals[i])
            sizes.append(acc.size)
            shards.append(axes)
            new_residuals[i] = kept
        scatter = [fsdp[i] for i in ids] if any(fsdp) else None
        means = sparse.sum_sparse(
            sent, sizes, axis_name, divide_by=n, shards=shards, scatter=scatter
        )
        for i, mean in zip(ids, means, strict=True):
            out[i] = mean.astype(leaves[i].dtype).reshape(out[i].shape)
        return out, new_residuals

    if specs is None:
        return _leafwise.with_residuals("lags", axis_name, LagsState, step)

    # With specs: `_leafwise.with_residuals`' frame, with FSDP residuals and flags.
    def init_fn(params: Any) -> LagsState:
        return LagsState(residual=sparse.zero_residuals(params, specs, axis_name, "lags"))

    @jax.named_scope("gradcomm.lags")
    def update_fn(
        updates: Any, state: LagsState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LagsState]:
        del params, extra_args
        _checks.check_updates(updates, axis_name, "lags")
        leaves, names, treedef = _checks.named_leaves(updates)
        fsdp = sparse.fsdp_leaves(specs, updates, names, axis_name, "lags")
        leaf_specs = _shards.leaf_specs(specs, updates, "lags")
        out, residuals = step(leaves, names, jax.tree.leaves(state.residual), fsdp, leaf_specs)
        structure = jax.tree.structure(state.residual)
        return jax.tree.unflatten(treedef, out), LagsState(
            residual=jax.tree.unflatten(structure, residuals)
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _whole_order(
    leaf: jax.Array,
    spec: Any,
    axes: tuple[str, ...],
    axis_name: _axes.AxisName,
    who: str,
    name: str,
    offset: int = 0,
) -> jax.Array:
    """`offset` plus each element's index in the whole row-major leaf, flat int32: an
    `order` for `sparse.topk_over_shards` (`leaf`: this device's piece, shaped)."""
    index = _shards.global_index(leaf, spec, axes, axis_name, who, name)
    if index is None:  # a whole leaf: its own index
        return jnp.arange(offset, offset + leaf.size, dtype=jnp.int32)
    return (index.ravel() + jnp.uint32(offset)).astype(jnp.int32)


def _shard_shaped(leaf: jax.Array, n: int) -> jax.Array:
    """The leading-dimension slice 0 of n of a whole FSDP leaf: its shard's shape and
    dtype (n divides the leading dimension: `sparse.check_whole_residual` checked)."""
    return leaf[: leaf.shape[0] // n]


def slgs(
    axis_name: _axes.AxisName = "data",
    *,
    density: float = 0.001,
    selector: sparse.Selector = "sampled",
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """SLGS-SGD, the single-layer baseline of LAGS: one top-k over the whole flattened model.

    Like `lags`, but the k = round(density * D) entries (D the model's size) are chosen
    across all leaves at once, so a leaf may send many entries or none. Leaves are joined in
    their common dtype.

    The whole model's order, which breaks ties at the threshold (ties go to lower
    positions), is the concatenation of its whole leaves, flattened row-major, in tree
    order. With leaves sharded over mesh axes beyond `axis_name` (tensor parallelism), D
    is the whole model's size and the top k the whole model's
    (`sparse.topk_over_shards`). Where `specs` gives every sharded leaf's
    `PartitionSpec`, ties go in that order (each element's place in its whole leaf from
    `_shards.global_index`), so the entries sent are the whole model's in every layout.
    Without it the order is one group of leaves per set of shard axes, first seen
    first, each group in shard-major order over this device's concatenation of its
    pieces: where leaves are split along another dimension than their leading one, or
    groups reorder them, tied entries may differ from the whole model's. Each device of
    those axes sends 1/S of the k pairs (`sparse.sum_sparse_over_shards`); the result is
    the whole model's, bit for bit, for the entries chosen.

    Args:
      axis_name: the mesh axis (or tuple of axes) to average over.
      density: k/D in (0, 1].
      selector: "exact" or "sampled", as for `lags`.
      specs: None, or the params' `PartitionSpec`s (a pytree like them; None for a
        leaf whose spec is not given): they order ties as above where every leaf split
        over mesh axes beyond `axis_name` has one. A spec must name the mesh axes its
        leaf is split over (known by its type); none may split a leaf over `axis_name`
        (slgs does not take FSDP).

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is an `SlgsState`.

    Raises:
      ValueError: for a density outside (0, 1] or an unknown selector at construction; at
        trace time as for `lags`, and, with `specs`, for specs not shaped like the
        updates, a spec that splits a leaf over `axis_name`, or a leaf split over other
        mesh axes than its spec names.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.slgs("data", density=0.25)
      >>> updates = {"a": jnp.array([[4.0, 1.0], [0.0, 0.0]]),  # one row per device
      ...            "b": jnp.array([[0.5, 0.0], [3.0, 0.0]])}
      >>> state = tx.init({"a": jnp.zeros(2), "b": jnp.zeros(2)})
      >>> out = jax.vmap(lambda u: tx.update(u, state)[0], axis_name="data")(updates)
      >>> out["a"][0], out["b"][0]
      (Array([2., 0.], dtype=float32), Array([1.5, 0. ], dtype=float32))

    References:
      Shi et al., ECAI 2020: the SLGS-SGD baseline of sections 3 and 6.
    """
    _axes.check_axis_name(axis_name)
    sparse.check_density(density)
    sparse.check_selector(selector)

    def step(
        leaves: list[jax.Array],
        names: list[str],
        residuals: list[jax.Array],
        leaf_specs: list[Any] | None = None,
    ) -> tuple[list[jax.Array], list[jax.Array]]:
        n = _axes.axis_size(axis_name)
        dtype = jnp.result_type(*leaves)
        accs = [
            sparse.accumulate(r, u).astype(dtype) for r, u in zip(residuals, leaves, strict=True)
        ]
        shards = [_shards.shard_axes(a, axis_name, "slgs") for a in accs]
        if any(shards):
            order = None
            if leaf_specs is not None and all(
                spec is not None for spec, axes in zip(leaf_specs, shards, strict=True) if axes
            ):  # ties in the whole model's order: its whole leaves in tree order
                order = _model_order(leaves, leaf_specs, shards, names, axis_name)
            return _slgs_over_shards(
                leaves, residuals, accs, shards, axis_name, density, selector, order
            )
        acc = _packing.concatenate(accs)
        values, indices = sparse.topk(acc, sparse.num_kept(acc.size, density), selector)
        sizes = [a.size for a in accs]
        means = sparse.sum_sparse_segments((values, indices), sizes, axis_name, divide_by=n)
        out, new_residuals = [], []
        for leaf, r, a, mean, start in zip(
            leaves, residuals, accs, means, _flat.offsets(sizes), strict=False
        ):
            # The leaf's acc with its sent entries zeroed: no model-sized slicing.
            segment = sparse.segment(indices, start, a.size)
            out.append(mean.astype(leaf.dtype).reshape(leaf.shape))
            new_residuals.append(sparse.unsent(a, segment, r, unique_indices=False))
        return out, new_residuals

    if specs is None:
        return _leafwise.with_residuals("slgs", axis_name, SlgsState, step)

    # With specs: `_leafwise.with_residuals` with each leaf's spec (the residual is shaped
    # like the params and the updates).
    def init_fn(params: Any) -> SlgsState:
        return SlgsState(residual=jax.tree.map(jnp.zeros_like, params))

    def residual_step(
        leaves: list[jax.Array], names: list[str], state: SlgsState
    ) -> tuple[list[jax.Array], SlgsState]:
        if any(sparse.fsdp_leaves(specs, state.residual, names, axis_name, "slgs")):
            raise ValueError(
                f"slgs: specs split a leaf over the data axes {axis_name!r} (FSDP), which "
                f"slgs does not take: give its leaves no data axis in their specs"
            )
        leaf_specs = _shards.leaf_specs(specs, state.residual, "slgs")
        out, residuals = step(leaves, names, jax.tree.leaves(state.residual), leaf_specs)
        structure = jax.tree.structure(state.residual)
        return out, SlgsState(residual=jax.tree.unflatten(structure, residuals))

    return _leafwise.transformation("slgs", axis_name, init_fn, residual_step)


def _model_order(
    leaves: list[jax.Array],
    leaf_specs: list[Any],
    shards: list[tuple[str, ...]],
    names: list[str],
    axis_name: _axes.AxisName,
) -> list[jax.Array]:
    """Per leaf, each element's position in the whole model (its whole leaves, flattened
    row-major, one after the other in tree order), flat int32, as this device's piece."""
    out, offset = [], 0
    for leaf, spec, axes, name in zip(leaves, leaf_specs, shards, names, strict=True):
        out.append(_whole_order(leaf, spec, axes, axis_name, "slgs", name, offset))
        offset += leaf.size * _shards.num_shards(axes)
    return out


def _slgs_over_shards(
    leaves: list[jax.Array],
    residuals: list[jax.Array],
    accs: list[jax.Array],
    shards: list[tuple[str, ...]],
    axis_name: _axes.AxisName,
    density: float,
    selector: sparse.Selector,
    order: list[jax.Array] | None = None,
) -> tuple[list[jax.Array], list[jax.Array]]:
    """SLGS where some leaves are pieces of tensors sharded over mesh axes (`_shards`).

    The leaves form one group per set of shard axes (first seen first), each this
    device's concatenation of its pieces; the whole model is the groups in that order,
    each in shard-major order (`sparse.topk_over_shards`), the exchange's numbering.
    Ties at the threshold go in that order too, or, with `order` (per leaf, each
    element's position in the whole model, `_model_order`), in that one. k is the
    whole model's; the exchange sends each device's share of it.
    """
    n = _axes.axis_size(axis_name)
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, (a, axes) in enumerate(zip(accs, shards, strict=True)):
        if a.size:
            groups.setdefault(axes, []).append(i)
    axes = list(groups)
    pieces = [_packing.concatenate([accs[i] for i in ids]) for ids in groups.values()]
    sizes = [piece.size for piece in pieces]
    whole = sum(size * _shards.num_shards(a) for size, a in zip(sizes, axes, strict=True))
    orders = None
    if order is not None:
        orders = [_packing.concatenate([order[i] for i in ids]) for ids in groups.values()]
    k = sparse.num_kept(whole, density)
    picked = sparse.topk_over_shards(pieces, axes, k, selector, orders)
    means = sparse.sum_sparse_over_shards(picked, sizes, axes, axis_name, divide_by=n)
    out, new_residuals = list(leaves), list(residuals)
    for ids, p, mean in zip(groups.values(), picked, means, strict=True):
        starts = _flat.offsets([accs[i].size for i in ids])
        for i, start, end in zip(ids, starts, starts[1:], strict=False):
            out[i] = mean[start:end].astype(leaves[i].dtype).reshape(leaves[i].shape)
            segment = sparse.segment(p.indices, start, end - start)
            new_residuals[i] = sparse.unsent(accs[i], segment, residuals[i], unique_indices=False)
    return out, new_residuals


def lags_delta(
    acc: Any,
    density: Density,
    axis_name: _axes.AxisName = "data",
    *,
    selector: sparse.Selector = "sampled",
    specs: Any = None,
) -> Any:
    """Assumption 1's check, eq. 20, per leaf: delta(l) <= 1 means the assumption holds.

        delta = |sum_p x_p - sum_p TopK(x_p, k)|^2 / E|sum_p x_p - RandK(sum_p x_p, k)|^2,

    with `x_p = residual + update` on device p (what `lags` selects from) and the
    denominator's expectation `(1 - k/d) |sum_p x_p|^2`. Call inside `shard_map` (or a named
    `vmap`) over `axis_name`; it sums dense vectors, so it is a diagnostic, not a fast path.
    A leaf sharded over other mesh axes (tensor parallelism) gives its whole tensor's
    delta, with its top k's ties at the threshold broken as `lags` breaks them: in the
    whole tensor's row-major order where `specs` gives its `PartitionSpec`, else in
    shard-major order.

    Args:
      acc: this device's pytree of accumulated updates.
      density: as for `lags`.
      axis_name: the axis the devices are on.
      selector: as for `lags`.
      specs: None, or the `PartitionSpec`s of `acc`'s leaves (a pytree like it; None for
        a leaf whose spec is not given), as for `lags`.

    Returns:
      A pytree of float32 scalars like `acc` (0 where k = d).

    Raises:
      ValueError: for density names that match no leaf or leaves with no density, an
        unknown selector, specs not shaped like `acc`, or a leaf split over other mesh
        axes than its spec names.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> x = jnp.array([[3.0, 0.1, 0.2, 0.0], [2.5, 0.0, -0.1, 0.1]])
      >>> delta = jax.vmap(lambda a: gradcomm.lags_delta(a, 0.25, "d"), axis_name="d")(x)
      >>> bool(delta[0] < 1)
      True

    References:
      Shi et al., ECAI 2020: Assumption 1 and eq. 20.
    """
    _check_density_spec(density)
    sparse.check_selector(selector)
    leaves, names, treedef = _checks.named_leaves(acc)
    densities = _leaf_densities(density, names)
    leaf_specs = _shards.leaf_specs(specs, acc, "lags_delta")
    deltas = []
    for leaf, d, spec, name in zip(leaves, densities, leaf_specs, names, strict=True):
        x = leaf.ravel().astype(_axes.compute_dtype(leaf.dtype))
        axes = _shards.shard_axes(x, axis_name, "lags_delta")
        whole = x.size * _shards.num_shards(axes)
        k = sparse.num_kept(whole, d)
        if axes:  # a piece of a sharded leaf: the whole leaf's top k, norms summed
            order = None
            if spec is not None:
                order = [_whole_order(leaf, spec, axes, axis_name, "lags_delta", name)]
            picked = sparse.topk_over_shards([x], [axes], k, selector, order)[0]
            mine = jnp.zeros_like(x).at[picked.indices].set(picked.values, mode="drop")
        else:
            mine = sparse.densify(*sparse.topk(x, k, selector), x.size)
        total, sent = lax.psum((x, mine), axis_name)
        missed, norm = jnp.sum(jnp.square(total - sent)), jnp.sum(jnp.square(total))
        if axes:
            missed, norm = lax.psum((missed, norm), axes)
        expected = (1 - k / whole) * norm
        deltas.append(jnp.where(expected > 0, missed / expected, 0.0).astype(jnp.float32))
    return jax.tree.unflatten(treedef, deltas)
