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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _axes, _collectives, _flat, _packing
from gradcomm._topk import (
    SELECTORS,
    Selector,
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
    "sum_sparse_segments",
    "topk",
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

    dense = lax.fori_loop(0, values.shape[0], add, jnp.zeros(size, ct))
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
    sent: list[tuple[jax.Array, jax.Array]],
    sizes: list[int],
    axis_name: _axes.AxisName,
    *,
    divide_by: int | None = None,
) -> list[jax.Array]:
    """The sums over devices of several leaves' sparse vectors, in as few collectives as fit.

    Leaves for which (value, index) pairs would outweigh the dense leaf (see
    `sparse_bytes_exceed_dense`) go together through one `psum` of their dense form; all
    others of one dtype share a single all-gather of their pairs, decoded in device order
    (the module docstring says how).

    Args:
      sent: per leaf, `(values, indices)` from `topk` on the flattened leaf.
      sizes: per leaf, its number of elements.
      axis_name: the axis to sum over.
      divide_by: divide the sums by this (N for the mean over N devices); on sparse
        leaves only the sent entries are divided, which gives the same bits.

    Returns:
      Per leaf, the flat dense sum (or mean), in float32 or wider.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> x = jnp.array([[0.0, 3.0, 0.0, 1.0], [2.0, 5.0, 0.0, 0.0]])  # one row per device
      >>> f = lambda x: sparse.sum_sparse([sparse.topk(x, 1)], [4], "data", divide_by=2)
      >>> jax.vmap(f, axis_name="data")(x)[0][0]
      Array([0., 4., 0., 0.], dtype=float32)
    """
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
