"""SLGS-SGD, LAGS's single-layer baseline (Shi et al., ECAI 2020): one top-k over the
whole flattened model, with residuals. `gradcomm.lags` re-exports it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomm import _axes, _flat, _packing, _shards, registry, sparse
from gradcomm.lags import _specs


class SlgsState(NamedTuple):
    """State of `slgs`: per leaf, what this device has not sent (the residual)."""

    residual: Any


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
      >>> out = jax.jit(jax.vmap(lambda u: tx.update(u, state)[0], axis_name="data"))(updates)
      >>> out["a"][0], out["b"][0]
      (Array([2., 0.], dtype=float32), Array([1.5, 0. ], dtype=float32))

    References:
      Shi et al., ECAI 2020: the SLGS-SGD baseline of sections 3 and 6.
    """
    _axes.check_axis_name(axis_name)
    sparse.check_density(density)
    sparse.check_selector(selector)

    def init_fn(params: Any) -> SlgsState:
        return SlgsState(residual=jax.tree.map(jnp.zeros_like, params))

    def step(inputs: _specs.Inputs) -> tuple[list[jax.Array], list[jax.Array]]:
        leaves, names, residuals, fsdp, leaf_specs = inputs
        if any(fsdp):
            raise ValueError(
                f"slgs: specs split a leaf over the data axes {axis_name!r} (FSDP), which "
                f"slgs does not take: give its leaves no data axis in their specs"
            )
        n = _axes.axis_size(axis_name)
        dtype = jnp.result_type(*leaves)
        accs = [
            sparse.accumulate(r, u).astype(dtype) for r, u in zip(residuals, leaves, strict=True)
        ]
        shards = [_shards.shard_axes(a, axis_name, "slgs") for a in accs]
        if any(shards):
            order = None
            if all(
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

    return _specs.with_specs("slgs", axis_name, SlgsState, init_fn, specs, step)


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
        out.append(_specs.whole_order(leaf, spec, axes, axis_name, "slgs", name, offset))
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


registry.register(registry.Method(
    slgs, "after", title="SLGS", paper="Shi et al., ECAI 2020", page="lags",
    collectives=sparse.collectives,
))  # fmt: skip
