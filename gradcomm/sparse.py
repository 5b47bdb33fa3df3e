"""Top-k sparsification with error feedback: the engine under LAGS-SGD and gradient dropping.

Three pieces, shared by every sparse method:

* `topk(x, k, selector)`: exactly k (value, index) pairs of largest magnitude from a flat
  array, ties to lower indices, by `lax.top_k` or by a block-sampled threshold refined to
  the same entries without a sort (`gradcomm._topk`, re-exported here).
* `sum_sparse(sent, sizes, axis_name)`: one fixed-capacity all-gather of every device's
  (value, index) pairs (values and indices in one byte buffer; never a variable-size
  message), decoded once per dtype in device order (see below); optionally divided by N
  on the entries that were sent, which gives the bits of dividing the dense sum without a
  pass over it.
  `sum_sparse_segments` decodes one sparse vector over a concatenation of leaves (SLGS).
* Error feedback: the residual keeps exactly what was not sent. `residual' = acc - sent`
  is computed as `acc` with the sent entries set to zero, so
  `residual' + sent == acc` bit for bit.
* Leaves sharded over mesh axes beyond the data axes (tensor parallelism, S pieces,
  `gradcomm._shards`): k and every size test are the whole leaf's. `topk_over_shards`
  finds the whole leaf's top k: each piece's own top min(k, piece) candidates are
  gathered over the shard axes and exactly k of them kept (ties to lower positions in
  shard-major order: piece s's element j is `s * piece + j`, the row-major order where
  the leaf is split along its leading dimension only). `sum_sparse(..., shards=)` and
  `sum_sparse_over_shards` then exchange it at fixed capacity: piece s sends slice s of
  the k pairs (ceil(k / S)) over the data axes, the pieces pool what they received over
  the shard axes, and each decodes its own entries in data-device order. Over the data
  axes that is 1/S of the whole leaf's bytes; over the shard axes each device sends
  (S - 1) min(k, piece) candidate pairs and (S - 1) N ceil(k / S) pooled ones. The bits
  are those of the whole leaf's exchange, and each piece's residual keeps exactly what
  it did not send.

The decode sums, index by index, the values of the devices that sent it in device order,
`((0 + v_0) + v_1) + ...`: one scatter-add per device, in one loop over the devices for all
the leaves of a dtype (each leaf's indices moved to its place in their concatenation). Each
device's indices are distinct, so no scatter adds twice into one place and the order of a
scatter's own updates cannot matter: the same bits on every device and every run, on every
backend, duplicates across devices included. The exact alternatives with a fixed number
of operations whatever N were built and measured, with the same bits: a scatter-max for each
index's first owner and a grid of the other devices' values (k N (N - 1) / 2 of them), 1.2 to
1.8 times the loop's time on XLA:CPU; and one stable sort by index, N - 1 shifted adds and
one scatter (`experiments/bench_decode.py`), 1 to 17 times the loop's time on XLA:CPU and,
on an H100, 0.4 to 2.0 times it (both under 0.35 ms, bound by kernel launches; the sort
ahead in 8 of 28 cells, 7 of them at the smallest k, 279). The loop's work, N k updates,
is what the exchange must do anyway.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _axes, _collectives, _flat, _packing, _shards
from gradcomm._topk import (
    SELECTORS,
    Selector,
    _compact,
    _exactly_k,
    check_density,
    check_selector,
    kth_largest,
    magnitude_bits,
    num_kept,
    topk,
)

__all__ = [
    "SELECTORS",
    "Selector",
    "ShardedTopK",
    "accumulate",
    "as_residual",
    "check_density",
    "check_selector",
    "densify",
    "exchange",
    "kth_largest",
    "magnitude_bits",
    "num_kept",
    "segment",
    "sparse_bytes_exceed_dense",
    "sum_sparse",
    "sum_sparse_over_shards",
    "sum_sparse_segments",
    "topk",
    "topk_over_shards",
    "unsent",
]


def _from_bytes(data: jax.Array, dtype: np.dtype) -> jax.Array:
    """`(n, m * itemsize)` uint8 back to `(n, m)` of `dtype`."""
    n, width = data.shape
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(data, dtype)
    return lax.bitcast_convert_type(data.reshape(n, width // dtype.itemsize, dtype.itemsize), dtype)


def _to_bytes(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


@jax.named_scope("combine")
def _sum_in_device_order(
    values: jax.Array, indices: jax.Array, size: int, divide_by: int | None
) -> jax.Array:
    """Every device's pairs `(n, k)` summed into a dense `(size,)`, in device order (module
    docstring). Indices outside `[0, size)` are dropped.

    With `divide_by`, the entries that were sent are divided by it afterwards: the same
    bits as dividing the dense sum, without a pass over it.
    """
    ct = _axes.compute_dtype(values.dtype)

    def add(d: int, dense: jax.Array) -> jax.Array:
        return dense.at[indices[d]].add(values[d].astype(ct), mode="drop")

    # The loop's carry is typed like its body's result: varying over the mesh axes that
    # the pairs vary over (a sharded leaf's indices vary over its shard axes).
    zeros = jnp.zeros(size, ct)
    varying = tuple(sorted(_axes.varying_axes(values) | _axes.varying_axes(indices)))
    if varying:
        zeros = lax.pcast(zeros, varying, to="varying")
    dense = lax.fori_loop(0, values.shape[0], add, zeros)
    if divide_by is not None:
        sent = indices.reshape(-1)  # repeats set equal values
        dense = dense.at[sent].set(dense[sent] / divide_by, mode="drop")
    return dense


def segment(indices: jax.Array, start: int, size: int) -> jax.Array:
    """Indices into a concatenation, made relative to the segment `[start, start + size)`.

    Those outside it become `size`, which `.at[...]` with `mode="drop"` skips.

    Args:
      indices: int32 indices into the concatenation.
      start: where the segment starts.
      size: the segment's length.

    Returns:
      The indices minus `start` inside the segment, `size` outside.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> sparse.segment(jnp.array([1, 4, 6]), 3, 3)
      Array([3, 1, 3], dtype=int32)
    """
    inside = (indices >= start) & (indices < start + size)
    return jnp.where(inside, indices - start, size)


def exchange(
    values: jax.Array,
    indices: jax.Array,
    size: int,
    axis_name: _axes.AxisName,
    *,
    divide_by: int | None = None,
) -> jax.Array:
    """The sum over devices of sparse vectors given as fixed-capacity (value, index) pairs.

    Args:
      values: `(k,)` values of this device's sparse vector (any float dtype).
      indices: `(k,)` int32 indices into a vector of `size`, distinct on each device.
      size: the length of the dense vector.
      axis_name: the axis to sum over.
      divide_by: divide the sum by this (the mean over N devices for N).

    Returns:
      The dense `(size,)` sum, accumulated in float32 or wider in device order (the same
      bits on every device) and returned in that dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> values = jnp.array([[1.0, 2.0], [4.0, 8.0]])  # one row per device
      >>> indices = jnp.array([[0, 3], [3, 1]], jnp.int32)  # both send index 3
      >>> f = lambda v, i: sparse.exchange(v, i, 4, "data")
      >>> jax.vmap(f, axis_name="data")(values, indices)[0]
      Array([1., 8., 0., 6.], dtype=float32)
    """
    return sum_sparse([(values, indices)], [size], axis_name, divide_by=divide_by)[0]


def sparse_bytes_exceed_dense(size: int, k: int, itemsize: int, n: int) -> bool:
    """Whether an all-gather of k (value, index) pairs sends more than a ring all-reduce.

    All-gather: (n - 1) k (itemsize + 4) bytes per device; all-reduce: 2 (n - 1) / n *
    size * itemsize. Such leaves are cheaper to send dense (zeros where not kept).
    """
    return (n - 1) * k * (itemsize + 4) >= 2 * (n - 1) / n * size * itemsize if n > 1 else True


# Error feedback (LAGS eq. 5, SLGS, gradient dropping's Algorithm 1): each device adds its
# update to what it has not sent yet, sends part of the sum, and keeps the rest.


def accumulate(residual: jax.Array, update: jax.Array) -> jax.Array:
    """Error feedback's accumulator `residual + update`, flat, in their promoted dtype."""
    return (residual + update).ravel()


def as_residual(kept: jax.Array, residual: jax.Array) -> jax.Array:
    """A flat new residual in the old one's dtype and shape: the state's dtype never drifts
    (a bf16 residual plus f32 updates stays bf16), so a jitted step never retraces."""
    return kept.astype(residual.dtype).reshape(residual.shape)


def unsent(
    acc: jax.Array, indices: jax.Array, residual: jax.Array, *, unique_indices: bool = True
) -> jax.Array:
    """The new residual `acc - sent`: `acc` with the sent entries set to zero, exactly, as
    `as_residual`. Indices outside `acc` are dropped; `unique_indices` promises that the
    others do not repeat."""
    kept = acc.at[indices].set(0, unique_indices=unique_indices, mode="drop")
    return as_residual(kept, residual)


def densify(values: jax.Array, indices: jax.Array, size: int) -> jax.Array:
    """The sent sparse vector as a dense `(size,)` array (zeros elsewhere)."""
    return jnp.zeros(size, values.dtype).at[indices].set(values, unique_indices=True)


@jax.named_scope("exchange")
def _gather_pairs(
    sent: list[tuple[jax.Array, jax.Array]], axis_name: _axes.AxisName
) -> tuple[jax.Array, jax.Array]:
    """One all-gather of every device's pairs (values of one dtype): `(n, sum k)` each."""
    dtype = sent[0][0].dtype
    payload = _packing.concatenate(
        [_to_bytes(values) for values, _ in sent] + [_to_bytes(indices) for _, indices in sent]
    )
    gathered = _collectives.all_gather_invariant(payload, axis_name)  # (n, bytes)
    split = sum(values.shape[0] for values, _ in sent) * dtype.itemsize
    return (
        _from_bytes(gathered[:, :split], dtype),
        _from_bytes(gathered[:, split:], jnp.dtype(jnp.int32)),
    )


def sum_sparse(
    sent: Sequence[tuple[jax.Array, jax.Array] | ShardedTopK],
    sizes: list[int],
    axis_name: _axes.AxisName,
    *,
    divide_by: int | None = None,
    shards: Sequence[_shards.Axes] | None = None,
) -> list[jax.Array]:
    """The sums over devices of several leaves' sparse vectors, in as few collectives as fit.

    Leaves for which (value, index) pairs would outweigh the dense leaf (see
    `sparse_bytes_exceed_dense`) go together through one `psum` of their dense form; all
    others of one dtype share a single all-gather of their pairs, decoded in device order
    (the module docstring says how). Leaves sharded over mesh axes beyond `axis_name`
    take `topk_over_shards`'s exchange (see there), with the same bits as on the whole
    leaf.

    Args:
      sent: per leaf, `(values, indices)` from `topk` on the flattened leaf, or, for a
        leaf sharded over mesh axes, a `ShardedTopK` from `topk_over_shards`.
      sizes: per leaf, its number of elements (on this device: a sharded leaf's piece).
      axis_name: the axis to sum over.
      divide_by: divide the sums by this (N for the mean over N devices); on sparse
        leaves only the sent entries are divided, which gives the same bits.
      shards: per leaf, the mesh axes it is sharded over (`gradcomm._shards.shard_axes`;
        empty for a whole leaf). None: no leaf is sharded.

    Returns:
      Per leaf, the flat dense sum (or mean), in float32 or wider (a sharded leaf's piece
      of it).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> x = jnp.array([[0.0, 3.0, 0.0, 1.0], [2.0, 5.0, 0.0, 0.0]])  # one row per device
      >>> f = lambda x: sparse.sum_sparse([sparse.topk(x, 1)], [4], "data", divide_by=2)
      >>> jax.vmap(f, axis_name="data")(x)[0][0]
      Array([0., 4., 0., 0.], dtype=float32)
    """
    if shards is not None and any(shards):
        return _sum_with_shards(sent, sizes, axis_name, shards, divide_by)
    n = _axes.axis_size(axis_name)
    out: list[jax.Array | None] = [None] * len(sent)
    exceed = [
        sparse_bytes_exceed_dense(size, values.shape[0], values.dtype.itemsize, n)
        for (values, _), size in zip(sent, sizes, strict=True)
    ]
    dense_ids = [i for i, dense in enumerate(exceed) if dense]
    sparse_ids = [i for i, dense in enumerate(exceed) if not dense]
    if dense_ids:
        dense = [
            densify(sent[i][0].astype(_axes.compute_dtype(sent[i][0].dtype)), sent[i][1], sizes[i])
            for i in dense_ids
        ]
        for i, total in zip(dense_ids, lax.psum(dense, axis_name), strict=True):
            out[i] = total if divide_by is None else total / divide_by
    for group in _flat.dtype_groups([sent[i][0] for i in sparse_ids]):
        ids = [sparse_ids[j] for j in group]
        all_values, all_indices = _gather_pairs([sent[i] for i in ids], axis_name)
        # One decode for the group: each leaf's indices moved to its place in the
        # concatenation (leaves are disjoint there, so each sums exactly as alone).
        columns = _flat.offsets([sent[i][0].shape[0] for i in ids])
        starts = _flat.offsets([sizes[i] for i in ids])
        shift = np.repeat(starts[:-1], np.diff(columns)).astype(np.int32)
        total = _sum_in_device_order(all_values, all_indices + shift, starts[-1], divide_by)
        for i, (start, end) in zip(ids, itertools.pairwise(starts), strict=True):
            out[i] = total[start:end]
    return out


def sum_sparse_segments(
    sent: tuple[jax.Array, jax.Array],
    sizes: list[int],
    axis_name: _axes.AxisName,
    *,
    divide_by: int | None = None,
) -> list[jax.Array]:
    """The sum over devices of one sparse vector over the concatenation of segments.

    `sum_sparse` on the concatenation of leaves of `sizes`, cut into the segments: one
    decode for the whole concatenation, whatever the number of segments.

    Args:
      sent: `(values, indices)` from `topk` on the concatenation.
      sizes: the segments' sizes, in order.
      axis_name: the axis to sum over.
      divide_by: as for `sum_sparse`.

    Returns:
      Per segment, its flat dense sum (or mean), in float32 or wider.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> x = jnp.array([[0.0, 3.0, 0.0], [2.0, 0.0, 0.0]])  # one row per device
      >>> f = lambda x: sparse.sum_sparse_segments(sparse.topk(x, 1), [1, 2], "data")
      >>> jax.vmap(f, axis_name="data")(x)[1][0]
      Array([3., 0.], dtype=float32)
    """
    starts = _flat.offsets(sizes)
    [flat] = sum_sparse([sent], [starts[-1]], axis_name, divide_by=divide_by)
    return [flat[start:end] for start, end in itertools.pairwise(starts)]


# Leaves sharded over mesh axes beyond the data axes (tensor parallelism): a leaf's piece on
# each device of its shard axes (`gradcomm._shards`). k, the threshold and every size test
# are the whole leaf's; the exchange over the data axes sends each piece's share of the
# whole leaf's pairs.


class ShardedTopK(NamedTuple):
    """The top k of a tensor split into pieces over mesh axes, as one piece holds it.

    Attributes:
      values: `(c,)` this piece's candidates: its own top `c = min(k, piece size)`.
      indices: `(c,)` int32: a candidate's index in the piece where it is among the whole
        tensor's top k, the piece's size where not (past its end, so `.at[...]` with
        `mode="drop"` skips it). A piece may hold anywhere from 0 to c of the top k.
      entries: `(k,)` the values of the whole tensor's top k, the same on every piece.
      positions: `(k,)` int32: their positions in the whole tensor's order (see
        `topk_over_shards`), the same on every piece.
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
) -> list[ShardedTopK]:
    """The k entries of largest magnitude of a tensor split into pieces over mesh axes.

    Each device holds one piece of each group: `pieces[g]` is its piece of group g, split
    over the mesh axes `axes[g]` into S_g pieces (`()`: not split, S_g = 1). The whole
    tensor is the groups one after the other, each in shard-major order: piece s's
    element j is element `s * size + j` of its group, with s the device's index over the
    group's axes (row-major in the order given). That is the row-major order of the
    whole leaf where it is split along its leading dimension only (by axes listed in its
    `PartitionSpec`'s order); where it is split along another dimension the set is the
    same, and only the order that breaks ties at the threshold differs. Ties go to lower
    positions in that order.

    Each piece takes its own top `min(k, size)` candidates (`topk`, ties to lower
    indices): a piece holds at most k of the whole top k, and where it holds tied
    entries of it, its first ones. One all-gather over the group's axes hands every
    piece every candidate (S_g `min(k, size)` pairs); among them all, in the whole order
    (each piece lists its ties in ascending index), exactly k are the whole top k, found
    by bisection on the bits of their magnitudes (`kth_largest`) with ties ranked by
    position. Every piece finds the same k.

    Args:
      pieces: per group, this device's piece, flat, all of one float dtype.
      axes: per group, the mesh axes its pieces are split over (`_shards.shard_axes`).
      k: how many entries to keep, 1 <= k <= the whole size.
      selector: for the candidates, "exact" or "sampled" (see `topk`).

    Returns:
      Per group, a `ShardedTopK`: the piece's candidates and which of them are in the
      top k, and the whole top k as (value, position) pairs, shared by the groups.

    Raises:
      ValueError: where k is out of range, or the whole tensor has 2^31 elements or more.

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
    every_values, every_positions, own = [], [], []
    offset = start = 0
    for x, a in zip(pieces, axes, strict=True):
        size = x.shape[0]
        c = min(k, size)
        values, indices = topk(x, c, selector)
        if a:
            candidates, where = _gather_over([values, indices], a)  # (S, c) each
            piece = lax.axis_index(a)
        else:
            candidates, where, piece = values[None], indices[None], 0
        count = candidates.shape[0]
        base = (offset + size * np.arange(count)[:, None]).astype(np.int32)
        every_values.append(candidates.reshape(-1))
        every_positions.append((where + base).reshape(-1))
        own.append((values, indices, start + piece * c, c, size))
        offset += count * size
        start += count * c
    every_values = _packing.concatenate(every_values)
    every_positions = _packing.concatenate(every_positions)
    chosen = _exactly_k(magnitude_bits(every_values), k)
    picked = _compact(chosen, k)[0]
    entries, positions = every_values[picked], every_positions[picked]
    out = []
    for values, indices, begin, c, size in own:
        mine = lax.dynamic_slice_in_dim(chosen, begin, c)
        out.append(ShardedTopK(values, jnp.where(mine, indices, size), entries, positions))
    return out


def _local_dense(picked: ShardedTopK, size: int) -> jax.Array:
    """A piece's selected entries as a dense `(size,)` array in the compute dtype."""
    ct = _axes.compute_dtype(picked.values.dtype)
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
        sums = sum_sparse(
            [sent[i] for i in whole], [sizes[i] for i in whole], axis_name, divide_by=divide_by
        )
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
            out[i] = total if divide_by is None else total / divide_by
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
        return [t if divide_by is None else t / divide_by for t in sums]
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
