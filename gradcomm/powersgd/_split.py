"""PowerSGD under tensor parallelism: a leaf split over mesh axes beyond the data axes.

Such a leaf is a piece of a whole matrix (`gradcomm.powersgd`'s `specs`). `Split` says
which axes split the matrix's rows and which its columns; a factor summed over them
(`sum_part`) travels over the data axes as each device's share of its rows, and
`whole` puts it back together.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from gradcomm import _axes, _collectives, _shards


class Split(NamedTuple):
    """How a leaf is split over mesh axes beyond the data axes (empty where it is whole)."""

    shape: tuple[int, ...]  # the whole leaf's
    rows: tuple[str, ...]  # the axes splitting its matrix's rows (any dimension but the last)
    cols: tuple[str, ...]  # the axes splitting its matrix's columns (its last dimension)


def _leaf_split(
    x: jax.Array, name: str, spec: PartitionSpec | None, axis_name: _axes.AxisName
) -> Split:
    """`x`'s `Split`, from its varying type (`_shards.shard_axes`) and its spec."""
    shape = tuple(int(d) for d in np.shape(x))
    axes = _shards.shard_axes(x, axis_name, "powersgd")
    if not axes or len(shape) < 2:  # whole, or a vector: averaged elementwise
        return Split(shape, (), ())
    if spec is None:
        raise ValueError(
            f"powersgd: leaf {name!r} is sharded over mesh axes {axes}, and powersgd needs to "
            f"know which of its dimensions they split (the whole leaf's matrix, and which "
            f"factor sums over them): pass specs=, a pytree of the params' PartitionSpecs "
            f"(the in_specs of shard_map)"
        )
    dims = _shards.dim_axes(spec, len(shape), set(_axes.axis_names(axis_name)))
    named = {n for d in dims for n in d}
    if named != set(axes):
        raise ValueError(
            f"powersgd: leaf {name!r} varies over mesh axes {axes} besides the data axes, but "
            f"its spec {spec} splits it over {sorted(named)}: pass the params' PartitionSpecs "
            f"as specs="
        )
    whole = tuple(size * _shards.num_shards(d) for size, d in zip(shape, dims, strict=True))
    return Split(whole, tuple(n for d in dims[:-1] for n in d), dims[-1])


def splits(
    leaves: list[Any], names: list[str], tree: Any, specs: Any, axis_name: _axes.AxisName
) -> list[Split]:
    """Each leaf's `Split`; all whole where no mesh axis beyond the data axes is bound
    (outside `shard_map`, or inside one over the data axes only)."""
    if not _shards.other_manual_axes(axis_name):
        return [Split(tuple(int(d) for d in np.shape(x)), (), ()) for x in leaves]
    flat = _shards.leaf_specs(specs, tree, "powersgd")
    return [
        _leaf_split(x, name, spec, axis_name)
        for x, name, spec in zip(leaves, names, flat, strict=True)
    ]


def sum_part(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """This device's part of the sum of `x` over `axes`: the sum's rows split among them
    (zero rows pad it to a multiple of their number), so that the mean over the data axes
    that follows sends each factor's bytes once, not once per device of `axes`."""
    if not axes:
        return x
    pad = -x.shape[0] % _shards.num_shards(axes)
    x = jnp.pad(x, ((0, pad), (0, 0)))
    return lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)


def whole(part: jax.Array, axes: tuple[str, ...], rows: int) -> jax.Array:
    """The whole factor of `rows` rows from each device's part (`sum_part`'s inverse)."""
    if not axes:
        return part
    return _collectives.all_gather_invariant(part, axes, tiled=True)[:rows]


def piece_start(split: Split, n_local: int) -> jax.Array:
    """Where this device's columns start in the whole leaf's last dimension."""
    return lax.axis_index(split.cols) * n_local
