"""The 16-bit exchanges of `low_precision`: the psum, the all_to_all, the ring and pairwise.

Each takes a buffer's leaves and returns their mean (or, for FSDP leaves, this device's
shard of it) in the 16-bit `dtype`, with the buffer's two flags (`flags`): its mean
is not finite, some device's inputs were not. The module docstring of
`gradcomm.low_precision` describes the formulations and their bytes.
"""

from __future__ import annotations

import itertools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _axes, _collectives, _flat, _numeric, _packing, _shards


def all_finite(xs: list[jax.Array]) -> jax.Array:
    """Whether every element of every array in `xs` is finite (a bool scalar)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))


def flags(mean_nonfinite: jax.Array, inputs_nonfinite: jax.Array) -> jax.Array:
    """A buffer's flags, int32 `(2,)`: its mean is not finite; some device's inputs were not."""
    return jnp.stack([mean_nonfinite, inputs_nonfinite]).astype(jnp.int32)


def _round_to(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """x in the 16-bit `dtype`, rounded there whatever XLA does with the casts.

    Over one device XLA drops the all-reduce, and with its default excess precision (on a
    GPU) then folds the cast to 16 bits and back away: the "mean" came back unrounded. No
    simplification crosses an optimization barrier. (`lax.reduce_precision` would flush
    float16's subnormals to zero.)
    """
    return lax.optimization_barrier(x.astype(dtype))


def psum_mean(
    groups: list[list[jax.Array]], axis_name: _axes.AxisName, n: int, dtype: np.dtype
) -> tuple[list[list[jax.Array]], list[jax.Array]]:
    """The means by one `psum` in `dtype` of the leaves divided by n, and the flags, per group.

    One more element per group counts the devices whose inputs in it were not finite; the
    leaves and they travel in one (variadic) all-reduce, each operand keeping its type.
    """
    operands = []
    for xs in groups:
        operands += [_round_to(x.astype(_numeric.compute_dtype(x.dtype)) / n, dtype) for x in xs]
        operands.append(jnp.where(all_finite(xs), 0, 1).astype(dtype))
    sums = lax.psum(tuple(operands), axis_name)
    means, group_flags, start = [], [], 0
    for xs in groups:
        *group_sums, nonfinite_inputs = sums[start : start + len(xs) + 1]
        start += len(xs) + 1
        means.append(group_sums)
        group_flags.append(flags(~all_finite(group_sums), nonfinite_inputs != 0))
    return means, group_flags


_INPUTS_NONFINITE, _CHUNK_NONFINITE = 1, 2  # the flag word's bits


def _sum_in_device_order(rows: jax.Array, n: int, dtype: np.dtype) -> jax.Array:
    """The mean of the `(n, m)` bits received from the devices: float32 sums in device
    order (every element summed the same way), divided by n and rounded to `dtype`."""
    received = lax.bitcast_convert_type(rows, dtype).astype(jnp.float32)
    acc = received[0]
    for j in range(1, n):  # device order: every chunk is summed the same way
        acc = acc + received[j]
    return (acc / n).astype(dtype)


def _reduce_scatter(
    values: jax.Array, axis_name: _axes.AxisName, how: Literal["pairwise", "ring"]
) -> jax.Array:
    """`_collectives.reduce_scatter_ring` or `reduce_scatter_pairwise` of `(n, m)` values."""
    ring = how == "ring"
    reduce = _collectives.reduce_scatter_ring if ring else _collectives.reduce_scatter_pairwise
    return reduce(values, axis_name)


def bits_mean(
    xs: list[jax.Array],
    finite: jax.Array,
    axis_name: _axes.AxisName,
    n: int,
    dtype: np.dtype,
    how: Literal["all_to_all", "pairwise", "ring"],
) -> tuple[list[jax.Array], jax.Array]:
    """The mean of 16-bit values moved as bits: a reduce-scatter, then a gather.

    "all_to_all": an `all_to_all`, float32 sums in device order divided by n, an `all_gather`.
    "ring" and "pairwise": each value divided by n and rounded to `dtype` (as in the
    psum), summed by `_collectives.reduce_scatter_ring` and an `all_gather`, or by
    `_collectives.reduce_scatter_pairwise` (a power-of-two N) and a gather by recursive
    doubling; each sum of two in float32, rounded to `dtype`. (N - 1) / N of the buffer
    each way in all three. Returns the flat means of the leaves (in `dtype`) and the
    flags (`flags`).
    """
    sizes = [x.size for x in xs]
    total = sum(sizes)
    chunk = -(-total // n)
    if how != "all_to_all":
        xs = [x.astype(_numeric.compute_dtype(x.dtype)) / n for x in xs]
    parts = [lax.bitcast_convert_type(jnp.ravel(x).astype(dtype), jnp.uint16) for x in xs]
    if n * chunk > total:
        parts.append(jnp.zeros(n * chunk - total, jnp.uint16))
    flat = _axes.vary(_packing.concatenate(parts), axis_name)
    if how != "all_to_all":
        mean = _reduce_scatter(
            lax.bitcast_convert_type(flat.reshape(n, chunk), dtype), axis_name, how
        )
    else:
        mine = lax.all_to_all(flat, axis_name, 0, 0, tiled=True).reshape(n, chunk)
        mean = _sum_in_device_order(mine, n, dtype)
    flag = jnp.where(finite, 0, _INPUTS_NONFINITE) | jnp.where(
        jnp.all(jnp.isfinite(mean)), 0, _CHUNK_NONFINITE
    )
    word = _packing.concatenate(
        [lax.bitcast_convert_type(mean, jnp.uint16), flag.astype(jnp.uint16)[None]]
    )
    gather = (
        _collectives.all_gather_pairwise if how == "pairwise" else _collectives.all_gather_invariant
    )
    gathered = gather(word, axis_name)  # (n, chunk + 1)
    words = gathered[:, chunk]
    mean_flags = flags(
        jnp.any(words & _CHUNK_NONFINITE != 0), jnp.any(words & _INPUTS_NONFINITE != 0)
    )
    values = lax.bitcast_convert_type(gathered[:, :chunk].reshape(-1), dtype)
    means = [values[start:end] for start, end in itertools.pairwise(_flat.offsets(sizes))]
    return means, mean_flags


def scatter_mean(
    xs: list[jax.Array],
    axis_name: _axes.AxisName,
    n: int,
    dtype: np.dtype,
    how: Literal["all_to_all", "pairwise", "psum", "ring"],
) -> tuple[list[jax.Array], jax.Array]:
    """This device's shards of the mean of whole FSDP leaves: the reduce-scatter alone.

    The leaves are rounded to `dtype` as in `bits_mean` (divided by n first, except for
    "all_to_all") and laid out as `(n, m)` by `_shards.to_rows`, row j every leaf's shard j;
    device j receives row j reduced as the exchange reduces: "all_to_all" by an `all_to_all`
    and float32 sums in device order divided by n, "psum" by a `lax.psum_scatter` in
    `dtype`, "ring" and "pairwise" by `_collectives.reduce_scatter_ring` and
    `reduce_scatter_pairwise`. Returns the leaves' shards (in `dtype`) and this device's
    flags (`flags`: its shards' mean is not finite, its inputs were not).
    """
    finite = all_finite(xs)
    if how != "all_to_all":
        xs = [x.astype(_numeric.compute_dtype(x.dtype)) / n for x in xs]
    parts = [lax.bitcast_convert_type(x.astype(dtype), jnp.uint16) for x in xs]
    rows = _axes.vary(_shards.to_rows(parts, n, "low_precision"), axis_name)  # (n, m)
    if how == "all_to_all":
        mine = lax.all_to_all(rows, axis_name, 0, 0, tiled=True)
        mean = _sum_in_device_order(mine, n, dtype)
    elif how == "psum":
        values = lax.bitcast_convert_type(rows, dtype)
        mean = lax.psum_scatter(values, axis_name, scatter_dimension=0, tiled=True)[0]
    else:
        mean = _reduce_scatter(lax.bitcast_convert_type(rows, dtype), axis_name, how)
    shards = _shards.from_rows(mean, [x.shape for x in xs], n)
    return shards, flags(~jnp.all(jnp.isfinite(mean)), ~finite)
