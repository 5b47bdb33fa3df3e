"""The sparse exchange's wire and decode: (value, index) pairs in one all-gather per dtype.

Each device's pairs travel as one byte buffer per dtype, values then int32 indices, in a
fixed-capacity all-gather (`_gather_pairs`), never a variable-size message, and are decoded
in device order (`_sum_in_device_order`, the `gradcomm.sparse` docstring says why that gives
the same bits everywhere). `_sum_whole` is `sum_sparse` on whole leaves (neither sharded nor
FSDP): the dense ones in one `psum`, the others in one all-gather and one decode per dtype.

The decode's loop, one scatter-add per device, against the exact alternatives with a fixed
number of operations whatever N, built and measured with the same bits: a scatter-max for
each index's first owner and a grid of the other devices' values (k N (N - 1) / 2 of them),
1.2 to 1.8 times the loop's time on XLA:CPU; and one stable sort by index, N - 1 shifted
adds and one scatter (`experiments/benchmarks/bench_decode.py`), 1 to 17 times the loop's
time on XLA:CPU and, on an H100, 0.4 to 2.0 times it (both under 0.35 ms, bound by kernel
launches; the sort ahead in 8 of 28 cells, 7 of them at the smallest k, 279). The loop's
work, N k updates, is what the exchange must do anyway.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _axes, _collectives, _flat, _numeric, _packing


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
    """Every device's pairs `(n, k)` summed into a dense `(size,)`, in device order (the
    `gradcomm.sparse` docstring). Indices outside `[0, size)` are dropped.

    With `divide_by`, the entries that were sent are divided by it afterwards: the same
    bits as dividing the dense sum, without a pass over it.
    """
    ct = _numeric.compute_dtype(values.dtype)

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


def sparse_bytes_exceed_dense(size: int, k: int, itemsize: int, n: int) -> bool:
    """Whether an all-gather of k (value, index) pairs sends more than a ring all-reduce.

    All-gather: (n - 1) k (itemsize + 4) bytes per device; all-reduce: 2 (n - 1) / n *
    size * itemsize. Such leaves are cheaper to send dense (zeros where not kept).
    """
    return (n - 1) * k * (itemsize + 4) >= 2 * (n - 1) / n * size * itemsize if n > 1 else True


def densify(values: jax.Array, indices: jax.Array, size: int) -> jax.Array:
    """The sent sparse vector as a dense `(size,)` array (zeros elsewhere)."""
    return jnp.zeros(size, values.dtype).at[indices].set(values, unique_indices=True)


@jax.named_scope("exchange")
def _dense_sent(values: jax.Array, indices: jax.Array, size: int) -> jax.Array:
    """A device's sent pairs as a dense `(size,)` vector in their compute dtype."""
    return densify(values.astype(_numeric.compute_dtype(values.dtype)), indices, size)


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


def _sum_whole(
    sent: Sequence[tuple[jax.Array, jax.Array]],
    sizes: list[int],
    axis_name: _axes.AxisName,
    divide_by: int | None,
) -> list[jax.Array]:
    """`sum_sparse` on whole leaves (none sharded over other mesh axes, none FSDP): those
    for which pairs would outweigh the dense leaf in one `psum`, the others of one dtype in
    one all-gather of their pairs and one decode."""
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
