"""Top-k sparsification with error feedback: the engine under LAGS-SGD and gradient dropping.

Three pieces, shared by every sparse method:

* `topk(x, k, selector)`: exactly k (value, index) pairs of largest magnitude from a flat
  array. `"exact"` is `lax.top_k` on |x|. `"sampled"` follows the sampled-threshold idea of
  DGC and Marian, in a form that needs no variable-size compaction (which XLA does slowly
  on CPU): the sample is each block of b elements' maximum, the threshold is the k-th
  largest of those maxima, and the refinement is an exact top-k over the k blocks that
  reach it. Every element of the true top-k lies in a block whose maximum reaches the
  threshold, so this returns the exact top-k values (ties may pick other indices), at the
  cost of one pass over x and two small top-k's instead of one top-k over all of x.
  Non-finite values rank above everything, so they are sent rather than kept.
* `exchange(values, indices, size, axis_name)`: a fixed-capacity all-gather of every
  device's (value, index) pairs (one collective, values and indices in one byte buffer;
  never a variable-size message), decoded by scatter-adds in device order, so every
  device computes the same bits.
* Error feedback: the residual keeps exactly what was not sent. `residual' = acc - sent`
  is computed as `acc` with the sent entries set to zero, so
  `residual' + sent == acc` bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _base

SELECTORS = ("exact", "sampled")


def check_selector(selector: str) -> None:
    if selector not in SELECTORS:
        raise ValueError(f"selector must be one of {SELECTORS}, got {selector!r}")


def check_density(density: Any, arg: str = "density") -> float:
    """A density in (0, 1], as a float."""
    if isinstance(density, bool) or not isinstance(density, int | float | np.floating):
        raise ValueError(f"{arg} must be a number in (0, 1], got {density!r}")
    if not (0 < density <= 1):
        raise ValueError(f"{arg} must be in (0, 1], got {density!r}")
    return float(density)


def num_kept(size: int, density: float) -> int:
    """k for a leaf of `size` elements: round(density * size), at least 1, at most size."""
    return min(size, max(1, round(density * size)))


def _magnitude(x: jax.Array) -> jax.Array:
    """|x| as the selection key; inf and NaN rank first, so they go out."""
    return jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.inf)


def _block_size(size: int, k: int) -> int:
    """Blocks for the sampled selector: a power of two up to 64 keeping >= 2k blocks."""
    block = 64
    while block > 1 and size // block < 2 * k:
        block //= 2
    return block


def topk(x: jax.Array, k: int, selector: str = "exact") -> tuple[jax.Array, jax.Array]:
    """The k entries of largest magnitude of a flat array.

    Args:
      x: a 1-D array.
      k: how many entries to keep, 1 <= k <= x.size.
      selector: "exact" (`lax.top_k`) or "sampled" (block maxima as the sample, then an
        exact top-k within the selected blocks: the same values, see the module docstring).

    Returns:
      `(values, indices)`: `x[indices]` and int32 indices, both of shape `(k,)`. Ties are
      broken towards lower indices.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> values, indices = sparse.topk(jnp.array([0.5, -3.0, 1.0, 2.0]), 2)
      >>> values, indices
      (Array([-3.,  2.], dtype=float32), Array([1, 3], dtype=int32))
    """
    check_selector(selector)
    size = x.shape[0]
    if not 1 <= k <= size:
        raise ValueError(f"k must be in [1, {size}], got {k}")
    key = _magnitude(x)
    block = _block_size(size, k)
    if selector == "exact" or block < 4:
        indices = lax.top_k(key, k)[1]
    else:
        blocks = jnp.pad(key, (0, -size % block), constant_values=-1).reshape(-1, block)
        chosen = lax.top_k(blocks.max(1), k)[1]
        within = lax.top_k(blocks[chosen].reshape(-1), k)[1]
        indices = chosen[within // block] * block + within % block
    indices = indices.astype(jnp.int32)
    return x[indices], indices


def _from_bytes(data: jax.Array, dtype: np.dtype) -> jax.Array:
    """`(n, m * itemsize)` uint8 back to `(n, m)` of `dtype`."""
    n, width = data.shape
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(data, dtype)
    return lax.bitcast_convert_type(data.reshape(n, width // dtype.itemsize, dtype.itemsize), dtype)


def exchange(
    values: jax.Array, indices: jax.Array, size: int, axis_name: _base.AxisName
) -> jax.Array:
    """The sum over devices of sparse vectors given as fixed-capacity (value, index) pairs.

    Args:
      values: `(k,)` values of this device's sparse vector (any float dtype).
      indices: `(k,)` int32 indices into a vector of `size`, distinct on each device.
      size: the length of the dense vector.
      axis_name: the axis to sum over.

    Returns:
      The dense `(size,)` sum, accumulated in float32 or wider in device order (the same
      bits on every device) and returned in that dtype.
    """
    n = _base.axis_size(axis_name)
    k = values.shape[0]
    payload = jnp.concatenate(
        [
            lax.bitcast_convert_type(values, jnp.uint8).reshape(-1),
            lax.bitcast_convert_type(indices, jnp.uint8).reshape(-1),
        ]
    )
    gathered = _base.all_gather_invariant(payload, axis_name)  # (n, bytes)
    split = k * values.dtype.itemsize
    all_values = _from_bytes(gathered[:, :split], values.dtype)
    all_indices = _from_bytes(gathered[:, split:], jnp.dtype(jnp.int32))
    ct = _base.compute_dtype(values.dtype)

    def add(i: int, dense: jax.Array) -> jax.Array:
        return dense.at[all_indices[i]].add(all_values[i].astype(ct), unique_indices=True)

    return lax.fori_loop(0, n, add, jnp.zeros(size, ct))


def sparse_bytes_exceed_dense(size: int, k: int, itemsize: int, n: int) -> bool:
    """Whether an all-gather of k (value, index) pairs sends more than a ring all-reduce.

    All-gather: (n - 1) k (itemsize + 4) bytes per device; all-reduce: 2 (n - 1) / n *
    size * itemsize. Such leaves are cheaper to send dense (zeros where not kept).
    """
    return (n - 1) * k * (itemsize + 4) >= 2 * (n - 1) / n * size * itemsize if n > 1 else True


def drop_sent(acc: jax.Array, indices: jax.Array) -> jax.Array:
    """The residual `acc - sent`: acc (flat) with the sent entries set to zero, exactly."""
    return acc.at[indices].set(0, unique_indices=True)


def densify(values: jax.Array, indices: jax.Array, size: int) -> jax.Array:
    """The sent sparse vector as a dense `(size,)` array (zeros elsewhere)."""
    return jnp.zeros(size, values.dtype).at[indices].set(values, unique_indices=True)


def sum_sparse(
    sent: list[tuple[jax.Array, jax.Array]], sizes: list[int], axis_name: _base.AxisName
) -> list[jax.Array]:
    """The sums over devices of several leaves' sparse vectors, in as few collectives as fit.

    Leaves for which (value, index) pairs would outweigh the dense leaf (see
    `sparse_bytes_exceed_dense`) go together through one `psum` of their dense form; all
    others of one dtype are merged into a single `exchange`, their indices offset into
    one concatenated vector.

    Args:
      sent: per leaf, `(values, indices)` from `topk` on the flattened leaf.
      sizes: per leaf, its number of elements.
      axis_name: the axis to sum over.

    Returns:
      Per leaf, the flat dense sum, in float32 or wider.
    """
    n = _base.axis_size(axis_name)
    out: list[jax.Array | None] = [None] * len(sent)
    dense_ids, groups = [], {}
    for i, ((values, _), size) in enumerate(zip(sent, sizes, strict=True)):
        if sparse_bytes_exceed_dense(size, values.shape[0], values.dtype.itemsize, n):
            dense_ids.append(i)
        else:
            groups.setdefault(values.dtype, []).append(i)
    if dense_ids:
        dense = [
            densify(sent[i][0].astype(_base.compute_dtype(sent[i][0].dtype)), sent[i][1], sizes[i])
            for i in dense_ids
        ]
        for i, total in zip(dense_ids, lax.psum(dense, axis_name), strict=True):
            out[i] = total
    for ids in groups.values():
        offsets = np.cumsum([0] + [sizes[i] for i in ids])
        values = jnp.concatenate([sent[i][0] for i in ids])
        indices = jnp.concatenate([sent[i][1] + off for i, off in zip(ids, offsets, strict=False)])
        total = exchange(values, indices, int(offsets[-1]), axis_name)
        for i, start, end in zip(ids, offsets[:-1], offsets[1:], strict=True):
            out[i] = total[start:end]
    return out
