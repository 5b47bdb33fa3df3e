"""TernGrad's mean over the devices: the shared scales, then the codes' exchange.

`ternary_mean` ternarizes each leaf with the scale shared by the devices (`_scales`) and
sums the codes as `exchange` says, through `_ternary`'s exchanges (or, with "psum", a
`lax.psum` of the dequantized floats); FSDP leaves come out as this device's shard of the
mean, by a reduce-scatter of their codes. `scatter_mean` reduce-scatters the FSDP leaves
kept in float (`dense`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gradcomm import _axes, _flat, _numeric, _shards, sparse
from gradcomm.terngrad import _scales, _ternary


def ternary_mean(
    leaves: list[jax.Array],
    key: jax.Array,
    axis_name: _axes.AxisName,
    n: int,
    clip: float | None,
    exchange: str,
    axes: list[_shards.Axes],
    indices: list[jax.Array | None],
    sizes: list[int],
    fsdp: list[bool],
) -> list[jax.Array]:
    """The mean over the devices of the ternarized leaves (eqs. 1-4), sent as `exchange` says.

    `axes` are each leaf's shard axes, `indices` its elements' indices in the whole tensor
    (None where it is whole) and `sizes` the whole tensors' sizes. The leaves go in one
    group per set of shard axes, each with its own reductions and exchange. Where `fsdp`
    is set, the leaf's result is this device's shard of the mean (its slice along the
    leading dimension), by a reduce-scatter of the codes; the others' is the whole mean.
    """
    ct = _numeric.compute_dtype(jnp.result_type(*leaves))
    gs = [leaf.astype(ct) for leaf in leaves]
    starts = _flat.offsets(sizes)
    key_words = _ternary.key_words(key)
    groups: dict[_shards.Axes, list[int]] = {}
    for i, shard in enumerate(axes):
        groups.setdefault(shard, []).append(i)
    totals: list[jax.Array | None] = [None] * len(gs)
    for shard, ids in groups.items():
        group = [gs[i] for i in ids]
        bounds = _scales.clip_bounds(group, clip, shard)
        local = jnp.stack([_scales.local_scale(g, b) for g, b in zip(group, bounds, strict=True)])
        if shard:
            local = lax.pmax(local, shard)
        scales = _scales.round_up_scale(lax.pmax(local, axis_name), n)
        scale = dict(zip(ids, scales, strict=True))
        draws = {
            i: (g, b, scale[i], key_words, starts[i], indices[i])
            for g, b, i in zip(group, bounds, ids, strict=True)
        }
        whole = [i for i in ids if not fsdp[i]]
        split = [i for i in ids if fsdp[i]]
        sums: dict[int, jax.Array] = {}
        if exchange == "psum":
            terms = {i: _ternary.codes(*draw).astype(ct) * scale[i] for i, draw in draws.items()}
            if whole:
                totals_whole = lax.psum([terms[i] for i in whole], axis_name)
                sums.update(zip(whole, totals_whole, strict=True))
            if split:
                rows = _shards.to_rows([terms[i] for i in split], n, "terngrad")
                mine = lax.psum_scatter(rows, axis_name, scatter_dimension=0, tiled=True)[0]
                pieces = _shards.from_rows(mine, [gs[i].shape for i in split], n)
                sums.update(zip(split, pieces, strict=True))
        else:
            if whole:
                packed = [_ternary.pack_leaf(*draws[i]) for i in whole]
                how = _ternary.auto_exchange(n) if exchange == "auto" else exchange
                rows = _ternary.code_sums(packed, axis_name, n, how)
                sums.update(
                    (i, _unpack_sums(digits, scale[i], n, ct, gs[i].shape))
                    for i, digits in zip(whole, rows, strict=True)
                )
            if split:  # FSDP: a reduce-scatter of the codes, shard j summed on device j
                packed = [_ternary.pack_shards(*draws[i][:-1], n, indices[i]) for i in split]
                rows = _ternary.shard_code_sums(packed, axis_name, n)
                sums.update(
                    (i, _unpack_sums(digits, scale[i], n, ct, shard_shape(gs[i].shape, n)))
                    for i, digits in zip(split, rows, strict=True)
                )
        for i in ids:
            totals[i] = sums[i]
    return [(t / n).astype(leaf.dtype) for t, leaf in zip(totals, leaves, strict=True)]


def shard_shape(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The shape of one of n FSDP shards of a leaf: its leading dimension split n ways."""
    return (shape[0] // n, *shape[1:])


def _unpack_sums(
    digits: list[jax.Array], scale: jax.Array, n: int, ct: Any, shape: tuple[int, ...]
) -> jax.Array:
    """Digit rows of code sums plus n (`_ternary.code_sums`) to the sum of the terms, `shape`."""
    size = math.prod(shape)
    return _ternary.unpack_leaf([(r.astype(ct) - n) * scale for r in digits], size).reshape(shape)


def check_fsdp(leaf: jax.Array, n: int) -> None:
    """Raises where an FSDP leaf's leading dimension does not split into n shards (the
    reshape that `_shards.to_rows` traces to check it is left unused)."""
    _shards.to_rows([leaf], n, "terngrad")


def scatter_mean(leaves: list[jax.Array], axis_name: _axes.AxisName, n: int) -> list[jax.Array]:
    """This device's shard of the mean of each whole leaf, in float: a reduce-scatter per
    dtype (`gradcomm.sparse.reduce_scatter_dense`), as `gradcomm.allreduce` with FSDP
    specs. Empty leaves give empty shards."""
    sums = sparse.reduce_scatter_dense(leaves, axis_name)
    return [
        jnp.zeros(shard_shape(leaf.shape, n), leaf.dtype)
        if s is None
        else (s / n).astype(leaf.dtype)
        for leaf, s in zip(leaves, sums, strict=True)
    ]
