"""Top-k sparsification with error feedback: the engine under LAGS-SGD and gradient dropping.

The pieces that every sparse method shares:

* `topk(x, k, selector)`: exactly k (value, index) pairs of largest magnitude from a flat
  array, ties to lower indices, by `lax.top_k` or by a block-sampled threshold refined to
  the same entries without a sort (`gradcomm.sparse._topk`, re-exported here).
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
  gathered over the shard axes and exactly k of them kept. Ties at the threshold go to
  lower positions in the whole leaf's row-major order where the caller gives each
  element's place in it (`order=`, from `_shards.global_index`: the methods do where
  they are given the params' `PartitionSpec`s), so the entries are the whole leaf's in
  every layout; else in shard-major order (piece s's element j is `s * piece + j`), the
  row-major order only where the leaf is split along its leading dimension, so a leaf
  split along another one may send other tied entries. `sum_sparse(..., shards=)` and
  `sum_sparse_over_shards` then exchange it at fixed capacity: piece s sends slice s of
  the k pairs (ceil(k / S)) over the data axes, the pieces pool what they received over
  the shard axes, and each decodes its own entries in data-device order. Over the data
  axes that is 1/S of the whole leaf's bytes; over the shard axes each device sends
  (S - 1) min(k, piece) candidate pairs and (S - 1) N ceil(k / S) pooled ones. The bits
  are those of the whole leaf's exchange, and each piece's residual keeps exactly what
  it did not send.
* FSDP (ZeRO-3: a leaf split along its leading dimension over the data axes themselves,
  `sum_sparse(..., scatter=)`, `sum_scattered`): each device selects from its whole
  gradient as without FSDP (the same k, pairs and residual; the residual is whole-sized
  and per device, `zero_residuals`) and keeps only its shard of the sum, the same bits as
  the slice of the whole sum. The pairs go in the same fixed-capacity all-gather, each
  device decoding its own shard only: (N - 1) k pairs per device, not the (N - 1) / N k
  of a reduce-scatter of the compressed vector. No fixed-capacity exact exchange sends
  fewer: a device's k pairs may all fall in one shard, and the sum over one shard may
  need every other device's k pairs (disjoint indices), so each device must be able to
  receive (N - 1) k pairs, whatever its shard; as every message is sized in advance,
  it receives that many on every step, which is the all-gather. (Per-destination buffers
  of capacity about k / N reach the target only where a step's pairs spread evenly
  enough, with a fallback on the steps where they do not: a data-dependent choice of
  message, which gradcomm does not make.) What does reach it is choosing each shard's
  entries on their own (`fsdp_topk="per_shard"`, `topk_per_shard`): then device j is
  owed exactly c pairs by every other device, and one `all_to_all` sends them, (N - 1) c
  pairs per device, (N - 1) / N of the leaf's k. Where the pairs' all-gather would cost more
  than a dense reduce-scatter of the leaf, (N - 1) / N of its bytes (density above about
  1 / (2N) in float32), the dense sent vectors go in an `all_to_all` of their rows,
  summed in device order (the decode's bits); the leaves `sparse_bytes_exceed_dense`
  sends dense go in a `lax.psum_scatter`, half the all-reduce.

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
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _axes, _checks, _collectives, _flat, _packing, _shards
from gradcomm.sparse._topk import (
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
    "FsdpTopK",
    "PerShardTopK",
    "Selector",
    "ShardedTopK",
    "accumulate",
    "as_residual",
    "check_density",
    "check_fsdp_axes",
    "check_selector",
    "check_whole_residual",
    "densify",
    "exchange",
    "fsdp_leaves",
    "kth_largest",
    "magnitude_bits",
    "num_kept",
    "own_shard",
    "reduce_scatter_dense",
    "scatter_bytes_exceed_dense",
    "segment",
    "shard_index",
    "sparse_bytes_exceed_dense",
    "sum_scattered",
    "sum_sparse",
    "sum_sparse_over_shards",
    "sum_sparse_segments",
    "topk",
    "topk_over_shards",
    "topk_per_shard",
    "unsent",
    "zero_residuals",
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
def _dense_sent(values: jax.Array, indices: jax.Array, size: int) -> jax.Array:
    """A device's sent pairs as a dense `(size,)` vector in their compute dtype."""
    return densify(values.astype(_axes.compute_dtype(values.dtype)), indices, size)


def _divided(total: jax.Array, divide_by: int | None) -> jax.Array:
    """`total`, divided by `divide_by` where one is given (a mean)."""
    return total if divide_by is None else total / divide_by


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
    sent: Sequence[tuple[jax.Array, jax.Array] | ShardedTopK | PerShardTopK],
    sizes: list[int],
    axis_name: _axes.AxisName,
    *,
    divide_by: int | None = None,
    shards: Sequence[_shards.Axes] | None = None,
    scatter: Sequence[bool] | None = None,
) -> list[jax.Array]:
    """The sums over devices of several leaves' sparse vectors, in as few collectives as fit.

    Leaves for which (value, index) pairs would outweigh the dense leaf (see
    `sparse_bytes_exceed_dense`) go together through one `psum` of their dense form; all
    others of one dtype share a single all-gather of their pairs, decoded in device order
    (the module docstring says how). Leaves sharded over mesh axes beyond `axis_name`
    take `topk_over_shards`'s exchange (see there), with the same bits as on the whole
    leaf. FSDP leaves (`scatter`) come back as this device's shard of the sum, the same
    bits as its slice of the whole sum (`sum_scattered` says how they travel).

    Args:
      sent: per leaf, `(values, indices)` from `topk` on the flattened leaf, or, for a
        leaf sharded over mesh axes, a `ShardedTopK` from `topk_over_shards`, or, for
        an FSDP leaf, a `PerShardTopK` from `topk_per_shard`.
      sizes: per leaf, its number of elements (on this device: a sharded leaf's piece).
      axis_name: the axis to sum over.
      divide_by: divide the sums by this (N for the mean over N devices); on sparse
        leaves only the sent entries are divided, which gives the same bits.
      shards: per leaf, the mesh axes it is sharded over (`gradcomm._shards.shard_axes`;
        empty for a whole leaf). None: no leaf is sharded.
      scatter: per leaf, whether it is split over `axis_name` along its leading dimension
        (FSDP, `gradcomm._shards.scattered`): its pairs index the whole flat leaf, whose
        size N divides, and this device (j of N) receives only elements `[j * size / N,
        (j + 1) * size / N)` of the sum, its shard. None: no leaf is.

    Returns:
      Per leaf, the flat dense sum (or mean), in float32 or wider (a sharded leaf's piece
      of it; an FSDP leaf's shard of it).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> x = jnp.array([[0.0, 3.0, 0.0, 1.0], [2.0, 5.0, 0.0, 0.0]])  # one row per device
      >>> f = lambda x: sparse.sum_sparse([sparse.topk(x, 1)], [4], "data", divide_by=2)
      >>> jax.vmap(f, axis_name="data")(x)[0][0]
      Array([0., 4., 0., 0.], dtype=float32)
    """
    if scatter is not None and any(scatter):
        return sum_scattered(sent, sizes, axis_name, scatter, divide_by=divide_by, shards=shards)
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
        dense = [_dense_sent(sent[i][0], sent[i][1], sizes[i]) for i in dense_ids]
        for i, total in zip(dense_ids, lax.psum(dense, axis_name), strict=True):
            out[i] = _divided(total, divide_by)
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


# FSDP (ZeRO-3): a leaf split along its leading dimension over the data axes themselves.
# Each device selects from its whole gradient as without FSDP and keeps only its shard of
# the sum (the module docstring says what travels, and why).


def scatter_bytes_exceed_dense(size: int, k: int, itemsize: int, n: int) -> bool:
    """Whether an all-gather of k (value, index) pairs sends more than a dense reduce-scatter.

    All-gather: (n - 1) k (itemsize + 4) bytes per device; reduce-scatter of the dense
    leaf (or an all-to-all of its rows): (n - 1) / n * size * itemsize. An FSDP leaf
    (`sum_scattered`) for which this holds is cheaper to send dense.

    Args:
      size: the whole leaf's number of elements.
      k: the pairs each device sends.
      itemsize: the values' bytes each.
      n: the number of devices.

    Returns:
      True where the pairs cost at least the dense reduce-scatter (always for n = 1).

    Example:
      >>> from gradcomm import sparse
      >>> sparse.scatter_bytes_exceed_dense(1000, 10, 4, 8)  # 560 bytes against 3500
      False
      >>> sparse.sparse_bytes_exceed_dense(1000, 100, 4, 8)  # 5600 against an all-reduce's 7000
      False
      >>> sparse.scatter_bytes_exceed_dense(1000, 100, 4, 8)  # 5600 against 3500
      True
    """
    return (n - 1) * k * (itemsize + 4) >= (n - 1) / n * size * itemsize if n > 1 else True


def fsdp_leaves(
    specs: object, updates: object, names: Sequence[str], axis_name: _axes.AxisName, who: str
) -> list[bool]:
    """Per leaf of `updates`, whether `specs` splits it over `axis_name` (FSDP).

    Args:
      specs: None, or the params' `PartitionSpec`s, a pytree shaped like `updates`.
      updates: the updates (or params).
      names: the leaves' names, for error messages.
      axis_name: the data axes.
      who: the method, for error messages.

    Returns:
      One bool per leaf: its spec's first entry names every data axis
      (`gradcomm._shards.scattered`).

    Raises:
      ValueError: where `specs` is not shaped like `updates`, holds something other than
        `PartitionSpec`s, or splits a leaf over data axes elsewhere than FSDP does.

    Example:
      >>> import jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from gradcomm import sparse
      >>> tree = {"b": jnp.zeros(4), "w": jnp.zeros((4, 2))}
      >>> sparse.fsdp_leaves({"b": P(), "w": P("data")}, tree, ["b", "w"], "data", "lags")
      [False, True]
    """
    if specs is None:
        return [False] * len(names)
    return [
        _shards.scattered(spec, axis_name, who, name)
        for spec, name in zip(_shards.leaf_specs(specs, updates, who), names, strict=True)
    ]


def zero_residuals(params: object, specs: object, axis_name: _axes.AxisName, who: str) -> object:
    """Error feedback's first residuals: zeros like the params, FSDP leaves' whole-sized.

    A residual holds what this device has not sent of its own whole gradient, so an FSDP
    leaf's residual is the whole leaf's size although its param is a shard. Inside a map
    over `axis_name` (`shard_map`, as `gradcomm.parallel.init_state` runs `init`), an FSDP
    leaf of `params` is this device's shard, `(rows / N, ...)`, and its residual is
    zeros of `(1, rows, ...)`; outside one (`jax.eval_shape(tx.init, ...)` on the whole
    params, or `init` before a `vmap`), the leaf is whole and its residual `(1,
    *leaf.shape)`. The leading axis of one is this device's slot on the device axis: the
    param's spec, `P("data", ...)`, which `optax.tree_map_params` gives every state leaf
    shaped like the params (`gradcomm.parallel`), then splits that axis over the devices,
    so the residuals are laid out per device, `(N, rows, ...)`, one whole-sized residual
    on each.

    Args:
      params: the params as this device holds them (a pytree).
      specs: None, or the params' `PartitionSpec`s.
      axis_name: the data axes.
      who: the method, for error messages.

    Returns:
      The residuals, a pytree like `params`.

    Raises:
      ValueError: as `fsdp_leaves`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from gradcomm import sparse
      >>> params = {"b": jnp.zeros(3), "w": jnp.zeros((4, 2))}  # outside a map: whole
      >>> r = sparse.zero_residuals(params, {"b": P(), "w": P("data")}, "data", "lags")
      >>> r["b"].shape, r["w"].shape
      ((3,), (1, 4, 2))
    """
    leaves, names, treedef = _checks.named_leaves(params)
    if specs is None or not leaves:  # (optax.tree_map_params passes a leafless tree)
        return jax.tree.map(jnp.zeros_like, params)
    split = fsdp_leaves(specs, params, names, axis_name, who)
    try:
        n = int(lax.axis_size(axis_name))
    except NameError:  # outside a map: the params are whole
        n = 1
    out = []
    for leaf, s, name in zip(leaves, split, names, strict=True):
        shape = np.shape(leaf)
        if s and not shape:
            raise ValueError(f"{who}: leaf {name!r} is a scalar, which FSDP cannot split")
        whole = (1, shape[0] * n, *shape[1:]) if s else shape
        out.append(jnp.zeros_like(leaf, shape=whole))
    return jax.tree.unflatten(treedef, out)


def check_whole_residual(
    residual: jax.Array, update: jax.Array, n: int, who: str, name: str
) -> None:
    """Raises where an FSDP leaf's residual is not its whole update's size.

    Args:
      residual: the leaf's residual (whole-sized, `zero_residuals`).
      update: the leaf's whole update (the gradient of the gathered param).
      n: the number of devices.
      who: the method, for error messages.
      name: the leaf's name, for error messages.

    Raises:
      ValueError: where the sizes differ, or `update`'s leading dimension is not a
        multiple of n.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> sparse.check_whole_residual(jnp.zeros((1, 4, 2)), jnp.zeros((4, 2)), 2, "lags", "w")
    """
    if not np.ndim(update) or np.shape(update)[0] % n:
        raise ValueError(
            f"{who}: FSDP splits a leaf's leading dimension over the {n} devices of the "
            f"data axes, but leaf {name!r} has shape {np.shape(update)}: give it a leading "
            f"dimension divisible by {n}, or keep it whole (P())"
        )
    if jnp.size(residual) != jnp.size(update):
        raise ValueError(
            f"{who}: leaf {name!r} is split over the data axes (FSDP), so its residual "
            f"holds this device's unsent part of its whole gradient, {jnp.size(update)} "
            f"elements, but it has {jnp.size(residual)} (shape {np.shape(residual)}). "
            f"Build the state with init inside the map, on this device's shard of the "
            f"params (gradcomm.parallel.init_state does), on a mesh of as many "
            f"data-parallel devices as the update's"
        )


def check_fsdp_axes(axes: _shards.Axes, who: str, name: str) -> None:
    """Raises where an FSDP leaf is also split over mesh axes besides the data axes.

    Args:
      axes: the leaf's shard axes (`gradcomm._shards.shard_axes`).
      who: the method, for error messages.
      name: the leaf's name, for error messages.

    Raises:
      ValueError: where `axes` is not empty.

    Example:
      >>> from gradcomm import sparse
      >>> sparse.check_fsdp_axes((), "lags", "w")  # whole over the other axes: fine
    """
    if axes:
        raise ValueError(
            f"{who}: leaf {name!r} is split over the data axes (FSDP) and over mesh axes "
            f"{axes} besides them: {who} takes one or the other on a leaf, not both (keep "
            f"it whole over {axes}, or give it no data axis in its spec)"
        )


def own_shard(flat: jax.Array, n: int, axis_name: _axes.AxisName) -> jax.Array:
    """This device's shard of a flat whole leaf: elements `[j s, (j + 1) s)`, s = size / n.

    That is the leading-dimension slice j of n that FSDP keeps on device j.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> f = lambda x: sparse.own_shard(x, 2, "data")
      >>> jax.vmap(f, axis_name="data")(jnp.arange(8.0).reshape(2, 4))  # row d: device d's
      Array([[0., 1.],
             [6., 7.]], dtype=float32)
    """
    s = flat.shape[0] // n
    return lax.dynamic_slice_in_dim(flat, lax.axis_index(axis_name) * s, s)


def shard_index(indices: jax.Array, size: int, n: int, axis_name: _axes.AxisName) -> jax.Array:
    """Indices into a flat whole leaf made relative to this device's shard (`own_shard`).

    Those outside it become the shard's size, which `.at[...]` with `mode="drop"` skips.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> f = lambda i: sparse.shard_index(i, 8, 2, "data")
      >>> jax.vmap(f, axis_name="data")(jnp.array([[1, 5], [1, 5]], jnp.int32))
      Array([[1, 4],
             [4, 1]], dtype=int32)
    """
    s = size // n
    local = indices - lax.axis_index(axis_name).astype(indices.dtype) * s
    return jnp.where((local >= 0) & (local < s), local, s)


def reduce_scatter_dense(xs: Sequence[jax.Array], axis_name: _axes.AxisName) -> list[jax.Array]:
    """This device's shard of the sum of flat dense whole leaves: a `lax.psum_scatter` per
    dtype, the FSDP counterpart of a `lax.psum` of them.

    Each leaf's size must be a multiple of N; device j receives elements `[j s, (j + 1)
    s)` of each sum (s = size / N). XLA:CPU adds a reduce-scatter's terms as it adds an
    all-reduce's, in device order, so each shard is the same bits as the slice of the
    psum there; a ring all-reduce is a reduce-scatter and an all-gather, so on NCCL too.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> f = lambda x: sparse.reduce_scatter_dense([x], "data")[0]
      >>> jax.vmap(f, axis_name="data")(jnp.array([[1.0, 2.0], [4.0, 8.0]]))
      Array([[ 5.],
             [10.]], dtype=float32)
    """
    n = _axes.axis_size(axis_name)
    out: list[jax.Array | None] = [None] * len(xs)
    for group in _flat.dtype_groups(list(xs)):
        rows = _shards.to_rows([xs[i] for i in group], n, "sum_sparse")
        mine = lax.psum_scatter(rows, axis_name, scatter_dimension=0, tiled=True)[0]
        pieces = _shards.from_rows(mine, [xs[i].shape for i in group], n)
        for i, piece in zip(group, pieces, strict=True):
            out[i] = piece
    return out


def _all_to_all_in_device_order(
    xs: Sequence[jax.Array], axis_name: _axes.AxisName
) -> list[jax.Array]:
    """This device's shard of the sum of flat dense whole leaves: an `all_to_all` of their
    rows per dtype, then `((0 + x_0) + x_1) + ...` in device order: the bits of the sparse
    decode (`_sum_in_device_order`) of the same sent entries, on every backend (adding a
    zero changes no sum, which is never -0.0 there)."""
    n = _axes.axis_size(axis_name)
    out: list[jax.Array | None] = [None] * len(xs)
    for group in _flat.dtype_groups(list(xs)):
        rows = _shards.to_rows([xs[i] for i in group], n, "sum_sparse")
        received = lax.all_to_all(rows, axis_name, 0, 0, tiled=True)  # row d: device d's
        acc = jnp.zeros(received.shape[1], received.dtype)
        for d in range(n):  # device order
            acc = acc + received[d]
        pieces = _shards.from_rows(acc, [xs[i].shape for i in group], n)
        for i, piece in zip(group, pieces, strict=True):
            out[i] = piece
    return out


FsdpTopK = Literal["whole", "per_shard"]
"""How an FSDP leaf's entries are chosen: the whole leaf's top k ("whole", the same
entries as without FSDP, sent in an all-gather) or each shard's own ("per_shard",
`topk_per_shard`, sent in an all-to-all: a reduce-scatter of the compressed vector)."""
FSDP_TOPKS: tuple[str, ...] = ("whole", "per_shard")


def check_fsdp_topk(fsdp_topk: str, specs: object, who: str) -> None:
    """Raises for an unknown `fsdp_topk`, or "per_shard" without the `specs` that name
    the FSDP leaves (it would change nothing, without a word)."""
    if fsdp_topk not in FSDP_TOPKS:
        raise ValueError(f"{who}: fsdp_topk must be one of {FSDP_TOPKS}, got {fsdp_topk!r}")
    if fsdp_topk == "per_shard" and specs is None:
        raise ValueError(
            f"{who}: fsdp_topk='per_shard' selects FSDP leaves' entries shard by shard, and "
            f"FSDP leaves are the ones whose specs split them over the data axes: pass "
            f"specs=, the params' PartitionSpecs"
        )


class PerShardTopK(NamedTuple):
    """An FSDP leaf's entries chosen shard by shard (`topk_per_shard`).

    Attributes:
      values: `(N c,)` shard 0's c entries, then shard 1's, and so on.
      indices: `(N c,)` int32: their indices in the whole flat leaf (shard j's lie in
        `[j s, (j + 1) s)`, s = size / N).
    """

    values: jax.Array
    indices: jax.Array


def topk_per_shard(x: jax.Array, n: int, c: int, selector: Selector = "exact") -> PerShardTopK:
    """The c entries of largest magnitude of each of the n shards of a flat whole leaf.

    Shard j is elements `[j s, (j + 1) s)` (s = size / n), the leading-dimension slice
    that FSDP keeps on device j: each shard is chosen from as a layer of its own, at the
    leaf's density (LAGS's layer-wise selection, one level down), so that the pairs
    bound for device j are known to be c, and `sum_scattered` sends each device only its
    own: `(n - 1) c` pairs, about (n - 1) / n of the leaf's k, a reduce-scatter of the
    compressed vector. Each shard's selection is a top-c compressor, with the contraction
    `|x - C(x)|^2 <= (1 - c / s) |x|^2` of a top-k one at the same density. Ties go to
    lower indices, as in `topk`.

    Args:
      x: a 1-D array whose size n divides.
      n: the number of shards (devices on the data axes).
      c: how many entries to keep per shard, 1 <= c <= size / n.
      selector: as for `topk`.

    Returns:
      A `PerShardTopK`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> sparse.topk_per_shard(jnp.array([1.0, -4.0, 3.0, 0.5]), 2, 1)
      PerShardTopK(values=Array([-4.,  3.], dtype=float32), indices=Array([1, 2], dtype=int32))
    """
    s = x.shape[0] // n
    values, indices = jax.vmap(lambda row: topk(row, c, selector))(x.reshape(n, s))
    indices = indices + (jnp.arange(n, dtype=jnp.int32) * s)[:, None]
    return PerShardTopK(values.reshape(-1), indices.reshape(-1))


def _sum_per_shard(
    sent: Sequence[PerShardTopK],
    sizes: Sequence[int],
    axis_name: _axes.AxisName,
    divide_by: int | None,
) -> list[jax.Array]:
    """This device's shard of the sum of per-shard picks (`topk_per_shard`): per dtype,
    one `all_to_all` sends each device the pairs of its shard, summed in device order
    (the decode's bits). Where the pairs would outweigh the dense shard, the dense rows
    travel instead (`_all_to_all_in_device_order`, the same bits)."""
    n = _axes.axis_size(axis_name)
    out: list[jax.Array | None] = [None] * len(sent)
    dense, pairs = [], []
    for i, picked in enumerate(sent):
        c, itemsize = picked.values.shape[0] // n, picked.values.dtype.itemsize
        (dense if c * (itemsize + 4) >= sizes[i] // n * itemsize else pairs).append(i)
    if dense:
        rows = [_dense_sent(sent[i].values, sent[i].indices, sizes[i]) for i in dense]
        for i, total in zip(dense, _all_to_all_in_device_order(rows, axis_name), strict=True):
            out[i] = _divided(total, divide_by)
    for group in _flat.dtype_groups([sent[i].values for i in pairs]):
        ids = [pairs[g] for g in group]
        parts = [sizes[i] // n for i in ids]
        starts = _flat.offsets(parts)
        values = [sent[i].values.reshape(n, -1) for i in ids]
        # Each pair's index in this device's shard, moved to its leaf's place among the
        # group's shards: the receiver decodes them all in one pass.
        local = [
            sent[i].indices.reshape(n, -1)
            - (jnp.arange(n, dtype=jnp.int32) * part)[:, None]
            + start
            for i, part, start in zip(ids, parts, starts[:-1], strict=True)
        ]
        payload = jnp.concatenate(
            [lax.bitcast_convert_type(v, jnp.uint8).reshape(n, -1) for v in values + local],
            axis=1,
        )  # row j: the pairs bound for device j
        received = lax.all_to_all(payload, axis_name, 0, 0, tiled=True)  # row d: device d's
        cut = sum(v.shape[1] for v in values) * values[0].dtype.itemsize
        total = _sum_in_device_order(
            _from_bytes(received[:, :cut], values[0].dtype),
            _from_bytes(received[:, cut:], jnp.dtype(jnp.int32)),
            starts[-1],
            divide_by,
        )
        for i, (start, end) in zip(ids, itertools.pairwise(starts), strict=True):
            out[i] = total[start:end]
    return out


def sum_scattered(
    sent: Sequence[tuple[jax.Array, jax.Array] | ShardedTopK | PerShardTopK],
    sizes: list[int],
    axis_name: _axes.AxisName,
    scatter: Sequence[bool],
    *,
    divide_by: int | None = None,
    shards: Sequence[_shards.Axes] | None = None,
) -> list[jax.Array]:
    """`sum_sparse` where some leaves are FSDP-split: each device keeps its shard of those.

    Each device's pairs of an FSDP leaf index its whole (flat) gradient, as without
    FSDP; device j of N receives only elements `[j s, (j + 1) s)` of the sum (s = size /
    N: the leaf's leading-dimension slice j), the same bits as the slice of `sum_sparse`'s
    whole sum. The leaves travel as follows (per dtype, one collective each):

    * where `sparse_bytes_exceed_dense` holds (the leaves `sum_sparse` sends dense), by a
      `lax.psum_scatter` of the dense sent vectors (`reduce_scatter_dense`): (N - 1) / N
      of the leaf's bytes, half the all-reduce's;
    * else where `scatter_bytes_exceed_dense` holds (the pairs' all-gather would cost more
      than the dense reduce-scatter), by an `all_to_all` of the dense rows summed in
      device order: the same bytes as a reduce-scatter, and the sparse decode's bits;
    * per-shard picks (`PerShardTopK`, from `topk_per_shard`) by one `all_to_all` per
      dtype that sends each device its shard's pairs: (N - 1) c pairs per device, a
      reduce-scatter of the compressed vector; dense rows where pairs outweigh them;
    * the others in the one fixed-capacity all-gather of pairs that `sum_sparse` sends
      (with the group's whole leaves), each device decoding only its own shard of the
      FSDP leaves: (N - 1) k pairs per device, as without FSDP, with 1/N of the decode's
      dense buffer.

    Why not fewer pairs (the module docstring): a fixed-capacity exchange cannot know
    where a device's k pairs fall, and exactly summing every device's pairs into one
    shard can need all (N - 1) k of the others', so each device must be able to receive
    that many whatever its shard: the all-gather's bytes.

    Args:
      sent: per leaf, `(values, indices)` from `topk` on the whole flattened leaf (a
        `ShardedTopK` for a leaf sharded over other mesh axes, which must not be FSDP;
        a `PerShardTopK` for an FSDP leaf chosen shard by shard).
      sizes: per leaf, its number of elements (an FSDP leaf's whole size, a multiple of N).
      axis_name: the data axes.
      scatter: per leaf, whether it is FSDP-split.
      divide_by: as for `sum_sparse`.
      shards: as for `sum_sparse`.

    Returns:
      Per leaf, the flat sum (or mean) in float32 or wider: an FSDP leaf's shard of it
      (`size / N` elements), the others as `sum_sparse` gives them.

    Raises:
      ValueError: for an FSDP leaf that is also sharded over other mesh axes, or whose
        size N does not divide.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> x = jnp.array([[0.0, 3.0, 0.0, 1.0], [2.0, 5.0, 0.0, 0.0]])  # one row per device
      >>> f = lambda x: sparse.sum_scattered([sparse.topk(x, 1)], [4], "data", [True])[0]
      >>> jax.vmap(f, axis_name="data")(x)  # device j: elements 2j, 2j + 1 of [0, 8, 0, 0]
      Array([[0., 8.],
             [0., 0.]], dtype=float32)
    """
    n = _axes.axis_size(axis_name)
    count = len(sent)
    shards = [()] * count if shards is None else list(shards)
    for i, (split, axes) in enumerate(zip(scatter, shards, strict=True)):
        if split and axes:
            raise ValueError(
                f"sum_sparse: leaf {i} is split over the data axes (FSDP) and over mesh axes "
                f"{axes}: an FSDP leaf must be whole over the other axes"
            )
        if split and sizes[i] % n:
            raise ValueError(
                f"sum_sparse: leaf {i} is split over the {n} data-parallel devices (FSDP), "
                f"but its size {sizes[i]} is not a multiple of {n}"
            )
    out: list[jax.Array | None] = [None] * count
    per_shard = [i for i in range(count) if isinstance(sent[i], PerShardTopK)]
    if any(not scatter[i] for i in per_shard):
        raise ValueError("sum_sparse: per-shard picks (topk_per_shard) are for FSDP leaves")
    if per_shard:
        sums = _sum_per_shard(
            [sent[i] for i in per_shard], [sizes[i] for i in per_shard], axis_name, divide_by
        )
        for i, total in zip(per_shard, sums, strict=True):
            out[i] = total
    sharded = [i for i in range(count) if shards[i]]
    if sharded:
        sums = _sum_with_shards(
            [sent[i] for i in sharded],
            [sizes[i] for i in sharded],
            axis_name,
            [shards[i] for i in sharded],
            divide_by,
        )
        for i, total in zip(sharded, sums, strict=True):
            out[i] = total
    whole_dense, split_dense, rows, pairs = [], [], [], []
    for i in range(count):
        if shards[i] or i in per_shard:
            continue
        values = sent[i][0]
        k, itemsize = values.shape[0], values.dtype.itemsize
        if sparse_bytes_exceed_dense(sizes[i], k, itemsize, n):
            (split_dense if scatter[i] else whole_dense).append(i)
        elif scatter[i] and scatter_bytes_exceed_dense(sizes[i], k, itemsize, n):
            rows.append(i)
        else:
            pairs.append(i)

    def dense(i: int) -> jax.Array:
        return _dense_sent(*sent[i][:2], sizes[i])

    if whole_dense:
        totals = lax.psum([dense(i) for i in whole_dense], axis_name)
        for i, total in zip(whole_dense, totals, strict=True):
            out[i] = _divided(total, divide_by)
    for ids, reduce in ((split_dense, reduce_scatter_dense), (rows, _all_to_all_in_device_order)):
        if ids:
            for i, total in zip(ids, reduce([dense(i) for i in ids], axis_name), strict=True):
                out[i] = _divided(total, divide_by)
    j = lax.axis_index(axis_name)
    for group in _flat.dtype_groups([sent[i][0] for i in pairs]):
        # One all-gather for the group, whole leaves' columns first; two decodes, so that
        # a whole leaf's sum stays typed as the same on every device: the whole leaves'
        # (as `sum_sparse` decodes them) and this device's shards of the FSDP ones (each
        # pair outside its leaf's shard dropped), over their concatenation.
        whole = [pairs[g] for g in group if not scatter[pairs[g]]]
        split = [pairs[g] for g in group if scatter[pairs[g]]]
        all_values, all_indices = _gather_pairs([sent[i][:2] for i in whole + split], axis_name)
        cut = sum(sent[i][0].shape[0] for i in whole)
        if whole:
            columns = _flat.offsets([sent[i][0].shape[0] for i in whole])
            starts = _flat.offsets([sizes[i] for i in whole])
            shift = np.repeat(starts[:-1], np.diff(columns)).astype(np.int32)
            total = _sum_in_device_order(
                all_values[:, :cut], all_indices[:, :cut] + shift, starts[-1], divide_by
            )
            for i, (start, end) in zip(whole, itertools.pairwise(starts), strict=True):
                out[i] = total[start:end]
        if split:
            widths = [sent[i][0].shape[0] for i in split]
            parts = [sizes[i] // n for i in split]
            starts = _flat.offsets(parts)
            column_start = np.repeat(np.asarray(starts[:-1], np.int32), widths)
            column_size = np.repeat(np.asarray(parts, np.int32), widths)
            local = all_indices[:, cut:] - j.astype(jnp.int32) * column_size
            inside = (local >= 0) & (local < column_size)
            index = jnp.where(inside, local + column_start, starts[-1])
            total = _sum_in_device_order(all_values[:, cut:], index, starts[-1], divide_by)
            for i, (start, end) in zip(split, itertools.pairwise(starts), strict=True):
                out[i] = total[start:end]
    return out
