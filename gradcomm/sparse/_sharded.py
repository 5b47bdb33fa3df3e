"""Leaves sharded over mesh axes beyond the data axes (tensor parallelism, `gradcomm._shards`).

A leaf's piece lies on each device of its shard axes. k, the threshold and every size test
are the whole leaf's: `topk_over_shards` finds the whole leaf's top k from each piece's own
candidates, and the exchange over the data axes sends each piece's share of the whole
leaf's pairs (`_share`), with the bits of the whole leaf's exchange.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _axes, _collectives, _flat, _numeric, _packing, _shards
from gradcomm.sparse._decode import (
    _divided,
    _from_bytes,
    _gather_pairs,
    _sum_in_device_order,
    _sum_whole,
    _to_bytes,
    sparse_bytes_exceed_dense,
)
from gradcomm.sparse._topk import (
    Selector,
    _compact,
    _exactly_k,
    check_selector,
    magnitude_bits,
    topk,
)


class ShardedTopK(NamedTuple):
    """The top k of a tensor split into pieces over mesh axes, as one piece holds it.

    Attributes:
      values: `(c,)` this piece's candidates: its own top `c = min(k, piece size)`.
      indices: `(c,)` int32: a candidate's index in the piece where it is among the whole
        tensor's top k, the piece's size where not (past its end, so `.at[...]` with
        `mode="drop"` skips it). A piece may hold anywhere from 0 to c of the top k.
      entries: `(k,)` the values of the whole tensor's top k, the same on every piece.
      positions: `(k,)` int32: their positions in the whole tensor's shard-major order
        (see `topk_over_shards`; the exchange's numbering), the same on every piece.
    """

    values: jax.Array
    indices: jax.Array
    entries: jax.Array
    positions: jax.Array


def _gather_over(arrays: Sequence[jax.Array], axes: _shards.Axes) -> list[jax.Array]:
    """One all-gather over `axes` of several arrays (any dtypes) as one byte buffer: each
    comes back with a leading axis, one row per device of `axes` (row-major), typed as
    identical on all of them."""
    payload = _packing.concatenate([_to_bytes(a) for a in arrays])
    gathered = _collectives.all_gather_invariant(payload, axes)  # (S, bytes)
    out, start = [], 0
    for a in arrays:
        width = a.size * a.dtype.itemsize
        rows = _from_bytes(gathered[:, start : start + width], np.dtype(a.dtype))
        out.append(rows.reshape(gathered.shape[0], *a.shape))
        start += width
    return out


def topk_over_shards(
    pieces: Sequence[jax.Array],
    axes: Sequence[_shards.Axes],
    k: int,
    selector: Selector = "exact",
    order: Sequence[jax.Array] | None = None,
) -> list[ShardedTopK]:
    """The k entries of largest magnitude of a tensor split into pieces over mesh axes.

    Each device holds one piece of each group: `pieces[g]` is its piece of group g, split
    over the mesh axes `axes[g]` into S_g pieces (`()`: not split, S_g = 1). The whole
    tensor is the groups one after the other, each in shard-major order: piece s's
    element j is element `s * size + j` of its group, with s the device's index over the
    group's axes (row-major in the order given). These shard-major positions number the
    pairs on the wire (`ShardedTopK.positions`) whatever breaks ties.

    Ties at the threshold go to lower positions in the whole tensor's order: without
    `order`, the shard-major one, which is the row-major order of the whole leaf where
    it is split along its leading dimension only, by axes its `PartitionSpec` lists in
    the order given (`_shards.shard_axes` gives them in mesh order); elsewhere only the
    tied entries chosen at the threshold can differ from the whole leaf's. With `order`, each
    element's position in an order given per element: `_shards.global_index`, its index
    in the whole row-major tensor, gives the whole leaf's top k, tied entries included,
    in every layout.

    Each piece takes its own top `min(k, size)` candidates (`topk`, ties to lower
    indices): a piece holds at most k of the whole top k, and where it holds tied
    entries of it, its first ones (so `order`, within a piece, must increase with the
    index: a piece's row-major order is the whole tensor's restricted to it). One
    all-gather over the group's axes hands every piece every candidate (S_g
    `min(k, size)` pairs, with their `order`); among them all exactly k are the whole
    top k, found by bisection on the bits of their magnitudes (`kth_largest`) with ties
    ranked by position (with `order`, by a second bisection on it). Every piece finds
    the same k.

    Args:
      pieces: per group, this device's piece, flat, all of one float dtype.
      axes: per group, the mesh axes its pieces are split over (`_shards.shard_axes`).
      k: how many entries to keep, 1 <= k <= the whole size.
      selector: for the candidates, "exact" or "sampled" (see `topk`).
      order: None (ties in shard-major order), or per group an integer array like its
        piece: each element's position in the whole tensor's order (all groups in one
        numbering, distinct, in `[0, 2^31)`, increasing with the index within a piece),
        such as `_shards.global_index(...).ravel()`.

    Returns:
      Per group, a `ShardedTopK`: the piece's candidates and which of them are in the
      top k, and the whole top k as (value, shard-major position) pairs, shared by the
      groups.

    Raises:
      ValueError: where k is out of range, the whole tensor has 2^31 elements or more,
        or `order` does not give one array like each piece.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from gradcomm import parallel, sparse
      >>> auto = jax.sharding.AxisType.Auto  # inputs placed by jit
      >>> mesh = parallel.make_mesh({"model": 2}, devices=jax.devices()[:2], axis_types=auto)
      >>> def top2(x):  # x: this device's half of [3, 0, 1, -5]
      ...     picked = sparse.topk_over_shards([x], [("model",)], 2)[0]
      ...     return picked.indices, picked.positions
      >>> f = jax.jit(jax.shard_map(top2, mesh=mesh, in_specs=P("model"),
      ...                           out_specs=(P("model"), P())))
      >>> f(jnp.array([3.0, 0.0, 1.0, -5.0]))  # pieces' picks (2 past a piece) and the top 2
      (Array([0, 2, 1, 2], dtype=int32), Array([0, 3], dtype=int32))

    References:
      The top-k of LAGS (Shi et al., ECAI 2020, eq. 5), SLGS and gradient dropping (Aji
      and Heafield, EMNLP 2017, Algorithm 1), on a tensor-parallel leaf.
    """
    check_selector(selector)
    whole = sum(x.shape[0] * _shards.num_shards(a) for x, a in zip(pieces, axes, strict=True))
    if not 1 <= k <= whole:
        raise ValueError(f"k must be in [1, {whole}], got {k}")
    if whole >= 2**31:
        raise ValueError(f"a sharded top-k needs fewer than 2^31 elements, got {whole}")
    if order is not None and [np.shape(o) for o in order] != [x.shape for x in pieces]:
        raise ValueError(
            f"order must hold one array like each piece, {[x.shape for x in pieces]}, got "
            f"{[np.shape(o) for o in order]}"
        )
    every_values, every_positions, every_order, own = [], [], [], []
    offset = start = 0
    for g, (x, a) in enumerate(zip(pieces, axes, strict=True)):
        size = x.shape[0]
        c = min(k, size)
        values, indices = topk(x, c, selector)
        sent = [values, indices]
        if order is not None:  # the candidates' places in the whole order travel along
            sent.append(jnp.asarray(order[g]).astype(jnp.int32)[indices])
        if a:
            gathered = _gather_over(sent, a)  # (S, c) each
            piece = lax.axis_index(a)
        else:
            gathered, piece = [column[None] for column in sent], 0
        candidates, where = gathered[:2]
        count = candidates.shape[0]
        base = (offset + size * np.arange(count)[:, None]).astype(np.int32)
        every_values.append(candidates.reshape(-1))
        every_positions.append((where + base).reshape(-1))
        every_order.extend(o.reshape(-1) for o in gathered[2:])
        own.append((values, indices, start + piece * c, c, size))
        offset += count * size
        start += count * c
    every_values = _packing.concatenate(every_values)
    every_positions = _packing.concatenate(every_positions)
    ranks = _packing.concatenate(every_order) if order is not None else None
    chosen = _exactly_k(magnitude_bits(every_values), k, ranks)
    picked = _compact(chosen, k)[0]
    entries, positions = every_values[picked], every_positions[picked]
    out = []
    for values, indices, begin, c, size in own:
        mine = lax.dynamic_slice_in_dim(chosen, begin, c)
        out.append(ShardedTopK(values, jnp.where(mine, indices, size), entries, positions))
    return out


def _local_dense(picked: ShardedTopK, size: int) -> jax.Array:
    """A piece's selected entries as a dense `(size,)` array in the compute dtype."""
    ct = _numeric.compute_dtype(picked.values.dtype)
    return jnp.zeros(size, ct).at[picked.indices].set(picked.values.astype(ct), mode="drop")


@jax.named_scope("exchange")
def _share(
    lists: Sequence[tuple[jax.Array, jax.Array]], axes: _shards.Axes, axis_name: _axes.AxisName
) -> tuple[jax.Array, jax.Array]:
    """Every device's (value, position) lists over `axis_name`, each piece sending a share.

    Every piece over `axes` holds the same lists (the whole tensors' top k on its data
    device); piece s sends slice s of each, `ceil(k / S)` pairs, in one all-gather over
    the data axes, and the pieces then pool what they received by one all-gather over
    `axes`. Returns `(n, S * Q)` values and positions (padding at -1), Q the slices'
    total: row d holds data device d's lists.
    """
    count = _shards.num_shards(axes)
    piece = lax.axis_index(axes) if axes else 0
    slices = []
    for entries, positions in lists:
        k = entries.shape[0]
        q = -(-k // count)
        if count * q > k:
            entries = jnp.pad(entries, (0, count * q - k))
            positions = jnp.pad(positions, (0, count * q - k), constant_values=-1)
        slices.append(
            (
                lax.dynamic_slice_in_dim(entries, piece * q, q),
                lax.dynamic_slice_in_dim(positions, piece * q, q),
            )
        )
    values, positions = _gather_pairs(slices, axis_name)  # (n, Q)
    if axes:
        values, positions = _gather_over([values, positions], axes)  # (S, n, Q)
    else:
        values, positions = values[None], positions[None]
    n = values.shape[1]
    return (
        values.transpose(1, 0, 2).reshape(n, -1),
        positions.transpose(1, 0, 2).reshape(n, -1),
    )


def _sum_with_shards(
    sent: Sequence[tuple[jax.Array, jax.Array] | ShardedTopK],
    sizes: list[int],
    axis_name: _axes.AxisName,
    shards: Sequence[_shards.Axes],
    divide_by: int | None,
) -> list[jax.Array]:
    """`sum_sparse` where some leaves are sharded: the whole leaves as before, the sharded
    ones by `_share`, one exchange per dtype and set of shard axes."""
    n = _axes.axis_size(axis_name)
    out: list[jax.Array | None] = [None] * len(sent)
    whole = [i for i, a in enumerate(shards) if not a]
    if whole:
        sums = _sum_whole([sent[i] for i in whole], [sizes[i] for i in whole], axis_name, divide_by)
        for i, total in zip(whole, sums, strict=True):
            out[i] = total
    dense_ids, groups = [], {}
    for i, a in enumerate(shards):
        if not a:
            continue
        entries = sent[i].entries
        full = sizes[i] * _shards.num_shards(a)
        if sparse_bytes_exceed_dense(full, entries.shape[0], entries.dtype.itemsize, n):
            dense_ids.append(i)
        else:
            groups.setdefault((np.dtype(entries.dtype), a), []).append(i)
    if dense_ids:
        dense = [_local_dense(sent[i], sizes[i]) for i in dense_ids]
        for i, total in zip(dense_ids, lax.psum(dense, axis_name), strict=True):
            out[i] = _divided(total, divide_by)
    for (_, axes), ids in groups.items():
        # Positions are each leaf's own; a leaf's columns map them to its piece, placed
        # in the concatenation of the group's pieces (one decode for the group).
        values, positions = _share(
            [(sent[i].entries, sent[i].positions) for i in ids], axes, axis_name
        )
        count = _shards.num_shards(axes)
        widths = [-(-sent[i].entries.shape[0] // count) for i in ids]
        local = [sizes[i] for i in ids]
        starts = _flat.offsets(local)
        column_size = np.tile(np.repeat(np.asarray(local, np.int32), widths), count)
        column_start = np.tile(np.repeat(np.asarray(starts[:-1], np.int32), widths), count)
        index = positions - lax.axis_index(axes) * column_size
        inside = (index >= 0) & (index < column_size)
        index = jnp.where(inside, index + column_start, starts[-1])
        total = _sum_in_device_order(values, index, starts[-1], divide_by)
        for i, (start, end) in zip(ids, itertools.pairwise(starts), strict=True):
            out[i] = total[start:end]
    return out


def sum_sparse_over_shards(
    picked: Sequence[ShardedTopK],
    sizes: list[int],
    axes: Sequence[_shards.Axes],
    axis_name: _axes.AxisName,
    *,
    divide_by: int | None = None,
) -> list[jax.Array]:
    """The sum over devices of one `topk_over_shards` over several groups (SLGS's model).

    Sent dense (one `psum` of each group's piece) where the whole tensor's pairs would
    outweigh it (`sparse_bytes_exceed_dense` on the whole size and k); else each device
    of the union of the groups' axes sends its share of the k pairs over `axis_name` and
    the devices pool what they received (`ceil(k / S)` pairs per device, S the union's
    size: about 1/S of the bytes of the whole tensor's exchange). Each group's piece is
    decoded in data-device order, with the bits of `sum_sparse` on the whole tensor.

    Args:
      picked: per group, `topk_over_shards`'s result for this device's piece.
      sizes: per group, its piece's size.
      axes: per group, its shard axes, as given to `topk_over_shards`.
      axis_name: the (data) axis to sum over.
      divide_by: as for `sum_sparse`.

    Returns:
      Per group, its piece of the flat dense sum (or mean), in float32 or wider.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from gradcomm import parallel, sparse
      >>> auto = jax.sharding.AxisType.Auto  # inputs placed by jit
      >>> axes, devices = {"data": 2, "model": 2}, jax.devices()[:4]
      >>> mesh = parallel.make_mesh(axes, devices=devices, axis_types=auto)
      >>> def top1(x):  # x: (1, 2), this device's half of its data row
      ...     picked = sparse.topk_over_shards([x[0]], [("model",)], 1)
      ...     return sparse.sum_sparse_over_shards(picked, [2], [("model",)], "data")[0]
      >>> x = jnp.array([[0.0, 3.0, 0.0, 1.0], [2.0, 0.0, 0.0, 5.0]])  # one row per data device
      >>> f = jax.jit(jax.shard_map(top1, mesh=mesh, in_specs=P("data", "model"),
      ...                           out_specs=P("model")))
      >>> f(x)
      Array([0., 3., 0., 5.], dtype=float32)

    References:
      Shi et al., ECAI 2020: the SLGS-SGD baseline, on a tensor-parallel model.
    """
    n = _axes.axis_size(axis_name)
    counts = [_shards.num_shards(a) for a in axes]
    whole = sum(c * size for c, size in zip(counts, sizes, strict=True))
    entries, positions = picked[0].entries, picked[0].positions
    if sparse_bytes_exceed_dense(whole, entries.shape[0], entries.dtype.itemsize, n):
        dense = [_local_dense(p, size) for p, size in zip(picked, sizes, strict=True)]
        sums = lax.psum(dense, axis_name)
        return [_divided(t, divide_by) for t in sums]
    union = tuple(
        name for name in _shards.other_manual_axes(axis_name) if any(name in a for a in axes)
    )
    values, positions = _share([(entries, positions)], union, axis_name)
    out, offset = [], 0
    for a, size, count in zip(axes, sizes, counts, strict=True):
        index = positions - (offset + (lax.axis_index(a) * size if a else 0))
        index = jnp.where((index >= 0) & (index < size), index, size)
        out.append(_sum_in_device_order(values, index, size, divide_by))
        offset += count * size
    return out
