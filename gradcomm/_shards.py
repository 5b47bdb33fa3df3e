"""Leaves sharded over mesh axes that are not a method's data axes (tensor parallelism).

On a mesh such as `('data', 'model')`, inside `jax.shard_map` over every axis, the gradient
of a parameter split over `'model'` holds one piece of the tensor on each device of
`'model'`. Under `check_vma=True` (`shard_map`'s default) JAX types it as varying over
`'model'`; the gradient of a parameter replicated over `'model'` is not (JAX summed it over
`'model'`). So a leaf's shard axes are the manual axes it varies over, less the data axes
(`shard_axes`). A method that needs a statistic of the whole tensor (a norm, a maximum, a
top-k threshold) reduces its per-piece statistic over those axes (`reduce_per_leaf`).

The types do not say which dimension is split. A method that needs it (a matrix product,
a random draw per element) takes the leaves' `PartitionSpec`s (`leaf_specs`,
`global_index`). Where the types are not checked (`check_vma=False`) nothing can be read,
and a mesh with axes beyond the data axes raises (`shard_axes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from gradcomm._axes import AxisName, axis_names, axis_size, varying_axes

Axes = tuple[str, ...]


def other_manual_axes(axis_name: AxisName) -> Axes:
    """The manual mesh axes bound here that are not `axis_name`'s, in mesh order."""
    mesh = jax.sharding.get_abstract_mesh()
    data = set(axis_names(axis_name))
    manual = getattr(mesh, "manual_axes", ())
    return tuple(n for n in getattr(mesh, "axis_names", ()) if n in manual and n not in data)


def shard_axes(x: jax.Array, axis_name: AxisName, who: str) -> Axes:
    """The mesh axes, beyond `axis_name`, over which `x` holds one piece per device.

    Empty outside `shard_map`, or where the mesh has no other manual axis.

    Raises:
      ValueError: where the mesh has other manual axes but `shard_map` runs with
        `check_vma=False`: then no leaf says whether it is sharded over them.
    """
    others = other_manual_axes(axis_name)
    if not others:
        return ()
    if not all(name in varying_axes(lax.axis_index(name)) for name in others):
        raise ValueError(
            f"{who} runs inside shard_map over mesh axes {others} besides its data axes "
            f"{axis_names(axis_name)}, with check_vma=False: it cannot tell which leaves "
            f"are sharded over them, so it cannot compute whole-tensor results. Run "
            f"shard_map with check_vma=True (its default), or map over the data axes only."
        )
    varying = varying_axes(x)
    return tuple(n for n in others if n in varying)


def num_shards(axes: Axes) -> int:
    """How many pieces a leaf sharded over `axes` has: the product of their sizes."""
    return math.prod(axis_size(n) for n in axes)


def reduce_per_leaf(
    values: jax.Array,
    leaf_axes: Sequence[Axes],
    reduce: Callable[[jax.Array, Axes], jax.Array] = lax.psum,
) -> jax.Array:
    """Per-leaf statistics `(..., leaves)` reduced over each leaf's shard axes.

    One collective per distinct set of shard axes, on the columns of the leaves sharded
    that way; the other columns are returned as they are.
    """
    groups: dict[Axes, list[int]] = {}
    for i, axes in enumerate(leaf_axes):
        if axes:
            groups.setdefault(axes, []).append(i)
    for axes, ids in groups.items():
        index = np.asarray(ids, np.int32)
        values = values.at[..., index].set(reduce(values[..., index], axes))
    return values


def leaf_specs(specs: Any, tree: Any, who: str) -> list[PartitionSpec | None]:
    """`specs` (None, or a pytree of `PartitionSpec`s shaped like `tree`) per leaf of `tree`.

    A None in `specs` (or `specs=None`) stands for a leaf whose spec was not given.
    """
    leaves = jax.tree.leaves(tree)
    if specs is None:
        return [None] * len(leaves)
    is_spec = lambda s: s is None or isinstance(s, PartitionSpec)  # noqa: E731
    try:
        flat = jax.tree.structure(tree).flatten_up_to(specs)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{who}: specs must be a pytree of PartitionSpecs shaped like the updates "
            f"({jax.tree.structure(tree)}): {e}"
        ) from None
    for spec in flat:
        if not is_spec(spec):
            raise ValueError(f"{who}: specs holds {spec!r}, which is not a PartitionSpec")
    return list(flat)


def dim_axes(spec: PartitionSpec, ndim: int, data: set[str]) -> list[Axes]:
    """Per dimension, the mesh axes (beyond the data axes) that split it."""
    entries = list(spec) + [None] * (ndim - len(spec))
    if len(entries) > ndim:
        raise ValueError(f"PartitionSpec {spec} has more entries than the leaf's {ndim} dims")
    out = []
    for entry in entries:
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        out.append(tuple(n for n in names if n not in data))
    return out


def global_index(
    x: jax.Array, spec: PartitionSpec | None, axes: Axes, axis_name: AxisName, who: str, name: str
) -> jax.Array | None:
    """Each element's index in the whole (row-major, flattened) tensor, as uint32 `x.shape`.

    None where `x` is not sharded (`axes` empty): its own flat index is the global one.

    Raises:
      ValueError: where `x` is sharded but `spec` is None, or `spec` names other shard
        axes than the types say.
    """
    if not axes:
        return None
    if spec is None:
        raise ValueError(
            f"{who}: leaf {name!r} is sharded over mesh axes {axes}, and {who} needs to know "
            f"which of its dimensions they split: pass specs=, a pytree of the params' "
            f"PartitionSpecs (the in_specs of shard_map)"
        )
    dims = dim_axes(spec, x.ndim, set(axis_names(axis_name)))
    named = {n for d in dims for n in d}
    if named != set(axes):
        raise ValueError(
            f"{who}: leaf {name!r} varies over mesh axes {axes} besides the data axes, but "
            f"its spec {spec} splits it over {sorted(named)}: pass the params' PartitionSpecs"
        )
    shape = [size * num_shards(d) for size, d in zip(x.shape, dims, strict=True)]
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    index = jnp.zeros(x.shape, jnp.uint32)
    for dim, (d, stride) in enumerate(zip(dims, strides, strict=True)):
        coord = lax.broadcasted_iota(jnp.uint32, x.shape, dim)
        if d:
            coord = coord + lax.axis_index(d).astype(jnp.uint32) * jnp.uint32(x.shape[dim])
        index = index + coord * jnp.uint32(stride)
    return index


# FSDP (ZeRO-3): params split over the data axes themselves, along their leading dimension.
# Each device receives only its shard of the combined gradient: a reduce-scatter.


def scattered(spec: PartitionSpec | None, axis_name: AxisName, who: str, name: str) -> bool:
    """Whether a leaf's spec splits it over the data axes (FSDP): its first entry names them.

    Raises:
      ValueError: where the spec names data axes anywhere else, or only some of them.
    """
    if spec is None or not len(spec):
        return False
    data = axis_names(axis_name)
    entries = [() if e is None else (e if isinstance(e, tuple) else (e,)) for e in spec]
    if tuple(entries[0]) == data and not any(set(e) & set(data) for e in entries[1:]):
        return True
    if any(set(e) & set(data) for e in entries):
        raise ValueError(
            f"{who}: leaf {name!r} has spec {spec}, which splits it over data axes other "
            f"than along its leading dimension by all of {data}: FSDP splits a param's "
            f"leading dimension over every data axis, P({data if len(data) > 1 else data[0]!r}"
            f", ...)"
        )
    return False


def to_rows(leaves: Sequence[jax.Array], n: int, who: str) -> jax.Array:
    """Whole leaves as `(n, m)`: row j the concatenation of every leaf's shard j (flat).

    Shard j of a leaf is its j-th of n equal slices along its leading dimension, the
    piece that FSDP keeps on device j.
    """
    rows = []
    for leaf in leaves:
        if not leaf.ndim or leaf.shape[0] % n:
            raise ValueError(
                f"{who}: FSDP splits a leaf's leading dimension over the {n} devices of the "
                f"data axes, but a leaf has shape {leaf.shape}: give it a leading dimension "
                f"divisible by {n}, or keep it whole (P())"
            )
        rows.append(leaf.reshape(n, -1))
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1)


def from_rows(row: jax.Array, shapes: Sequence[tuple[int, ...]], n: int) -> list[jax.Array]:
    """One row of `to_rows` back to the leaves' shards, each `(shape[0] // n, *shape[1:])`."""
    out, start = [], 0
    for shape in shapes:
        local = (shape[0] // n, *shape[1:])
        size = math.prod(local)
        out.append(row[start : start + size].reshape(local))
        start += size
    return out
