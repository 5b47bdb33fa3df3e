"""Top-k selection for the sparse methods: exactly k (value, index) pairs of a flat array.

`topk(x, k, selector)` keeps the k entries of largest magnitude, ties to lower indices.
`"exact"` is `lax.top_k` on |x|. `"sampled"` follows the sampled-threshold idea of DGC and
Marian, in fixed-size buffers and with no sort (a sort, or a `lax.top_k` with a large k, is
slow on a CPU): the sample is each block of b elements' maximum; the k-th largest maximum,
to 20 bits, found by bisection on the bits of |x|, lies below the k-th largest element, so
the blocks that reach it hold the whole top-k; their elements above it are compacted into a
buffer of about 2k, among which bisection finds the exact k-th largest. Where ties or
near-ties overflow a buffer (Adam's near-constant first updates, a mostly-zero leaf), that
stage keeps exactly the top k by a full bisection instead. The result is the exact top-k
with ties to lower indices, the same entries as `"exact"`, for one pass over x plus work in
proportion to the number of blocks and to k. Non-finite values rank above everything, so
they are sent, not kept.

`magnitude_bits` and `kth_largest` (thresholds by bisection on the bits of |x|) serve
gradient dropping's warm-up too. `gradcomm.sparse` re-exports what the methods use.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _checks, _packing

Selector = Literal["exact", "sampled"]
SELECTORS: tuple[str, ...] = get_args(Selector)


def check_selector(selector: str) -> None:
    """Raises a `ValueError` for a selector other than "exact" or "sampled"."""
    if selector not in SELECTORS:
        raise ValueError(f"selector must be one of {SELECTORS}, got {selector!r}")


def check_density(density: Any, arg: str = "density") -> float:
    """A density in (0, 1], as a float."""
    if isinstance(density, bool) or not isinstance(density, int | float | np.floating):
        raise ValueError(
            f"{arg} must be a number in (0, 1], got {density!r}" + _checks.static_hint(density, arg)
        )
    if not (0 < density <= 1):
        raise ValueError(f"{arg} must be in (0, 1], got {density!r}")
    return float(density)


def num_kept(size: int, density: float) -> int:
    """k for a leaf of `size` elements: round(density * size), at least 1, at most size."""
    return min(size, max(1, round(density * size)))


def _magnitude(x: jax.Array) -> jax.Array:
    """|x| as the selection key; inf and NaN rank first, so they go out."""
    return jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.inf)


def magnitude_bits(x: jax.Array) -> jax.Array:
    """`_magnitude(x)` as signed integers of the same order: int32, or int64 for float64.

    Non-negative floats order like their bit patterns, so thresholds on |x| can be found
    by bisection on the bits. Narrow floats are widened to float32 first (exactly).
    """
    wide = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    itype = jnp.int64 if wide == jnp.float64 else jnp.int32
    return lax.bitcast_convert_type(_magnitude(x.astype(wide)), itype)


def kth_largest(
    keys: jax.Array,
    k: jax.Array | int,
    *,
    top_bits: int | None = None,
    axes: tuple[str, ...] = (),
) -> jax.Array:
    """The k-th largest of non-negative integer keys (k may be traced), by bisection.

    Args:
      keys: a 1-D array of `magnitude_bits` (entries below 0 count as absent).
      k: the rank, 1 <= k <= the number of keys that are >= 0.
      top_bits: find only the leading bits (after the sign bit) of the k-th largest and
        zero the rest: a lower bound reached in fewer passes.
      axes: mesh axes over which `keys` is one piece of a larger array (a leaf sharded
        for tensor parallelism, `gradcomm._shards`): each pass sums its count over them
        (a scalar `psum`), so the result is the whole array's k-th largest, the same on
        every piece.

    Returns:
      The largest t with `count(keys >= t) >= k` (among multiples of the dropped bits).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> keys = sparse.magnitude_bits(jnp.array([0.5, -3.0, 1.0, 2.0]))
      >>> float(jax.lax.bitcast_convert_type(sparse.kth_largest(keys, 2), jnp.float32))
      2.0
    """
    bits = 8 * keys.dtype.itemsize - 1
    lowest = bits - (top_bits or bits)
    one = jnp.ones((), keys.dtype)
    # Counting in float32 (exact below 2^24) lets XLA:CPU fuse the comparison into a
    # vectorized sum, about twice as fast as an integer count.
    total = keys.size * math.prod(lax.axis_size(name) for name in axes)
    count_dtype = jnp.float32 if total < 2**24 else jnp.int32

    def step(i: jax.Array, t: jax.Array) -> jax.Array:
        trial = t | (one << (bits - 1 - i).astype(keys.dtype))
        count = jnp.sum(jnp.where(keys >= trial, 1, 0).astype(count_dtype))
        if axes:
            count = lax.psum(count, axes)
        return jnp.where(count >= k, trial, t)

    return lax.fori_loop(0, bits - lowest, step, jnp.zeros_like(keys, shape=()))


def _ranks(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For a 1-D mask: how many True entries precede each entry (int32), and the total.

    Counted from 32-bit words of the mask and their population counts: a cumulative sum
    over every entry is slow on a CPU.
    """
    size = mask.shape[0]
    words = -(-size // 32)
    flags = jnp.pad(mask, (0, 32 * words - size)).reshape(words, 32)
    shifts = jnp.arange(32, dtype=jnp.uint32)
    packed = jnp.sum(flags.astype(jnp.uint32) << shifts, axis=1, dtype=jnp.uint32)
    counts = lax.population_count(packed).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    below = lax.population_count(packed[:, None] & ((jnp.uint32(1) << shifts) - 1))
    ranks = (starts[:, None] + below.astype(jnp.int32)).reshape(-1)[:size]
    return ranks, starts[-1] + counts[-1]


def _compact(mask: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """The positions of a 1-D mask's True entries, ascending, and how many there are.

    Returns `(positions, count)`: int32 `(capacity,)`, padded with `mask.size` past the
    count (and cut at `capacity` where the count exceeds it), placed by one scatter.
    """
    size = mask.shape[0]
    ranks, count = _ranks(mask)
    target = jnp.where(mask, ranks, capacity)
    positions = (
        jnp.full(capacity, size, jnp.int32)
        .at[target]
        .set(jnp.arange(size, dtype=jnp.int32), mode="drop")
    )
    return positions, count


def _block_size(size: int, k: int) -> int:
    """Blocks for the sampled selector: the power of two nearest sqrt(size / k), in [4, 64].

    It balances the two halves of the work: the blocks (size / b of them) and the
    candidate elements (about k blocks of b).
    """
    return max(4, min(64, 2 ** round(math.log2(math.sqrt(size / k)))))


def _sampled_fits(size: int, k: int) -> bool:
    """Whether the sampled selector pays: a leaf of at least 2^14 (smaller ones take
    `lax.top_k`, cheap there) with at least 2k blocks."""
    return size >= 1 << 14 and size // _block_size(size, k) >= 2 * k


def _exactly_k(keys: jax.Array, k: int, order: jax.Array | None = None) -> jax.Array:
    """The mask of the top k keys: exactly k entries.

    Ties at the k-th largest key go to lower positions in the array, or, with `order`
    (distinct non-negative int32, one per key), to lower `order`: among the ties, the m
    with the smallest `order` (m = k less the keys above them), found by a second
    bisection, for the m-th largest `2^31 - 1 - order`.
    """
    kth = kth_largest(keys, k)
    above = keys > kth
    ties = keys == kth
    m = k - jnp.sum(above, dtype=jnp.int32)
    if order is None:
        return above | (ties & (_ranks(ties)[0] < m))
    rank = jnp.where(ties, jnp.int32(2**31 - 1) - order.astype(jnp.int32), -1)
    return above | (ties & (rank >= kth_largest(rank, m)))


def _superset(keys: jax.Array, k: int, capacity: int) -> jax.Array:
    """Ascending positions (`capacity`, padded with `keys.size`) that hold the top k keys.

    Usually those at or above the k-th largest key rounded down to 20 bits (found in 19
    passes); where ties or near-ties make them overflow `capacity`, exactly the top k
    (ties to lower positions; 31 passes).
    """
    floor = kth_largest(keys, k, top_bits=19)
    positions, count = _compact(keys >= floor, capacity)
    return lax.cond(
        count <= capacity, lambda: positions, lambda: _compact(_exactly_k(keys, k), capacity)[0]
    )


def _sampled_indices(x: jax.Array, k: int) -> jax.Array:
    """The exact top-k indices of `_magnitude(x)`, ties to lower indices, ascending."""
    size = x.shape[0]
    block = _block_size(size, k)
    blocks = size // block
    grid = x[: blocks * block].reshape(blocks, block)
    # Block maxima as an elementwise maximum over the b columns: one loop that XLA fuses
    # with whatever produced x (a reduction would first write x out).
    maxima = functools.reduce(jnp.maximum, [magnitude_bits(grid[:, j]) for j in range(block)])
    # Candidate blocks: every top-k element of the whole blocks lies in a block among the
    # top k maxima. The tail (under b elements, not padded: a pad copies x) always joins.
    chosen = _superset(maxima, k, min(blocks, k + k // 4 + 256))
    candidates = jnp.take(grid, chosen, axis=0, mode="fill", fill_value=0)
    keys = jnp.where((chosen < blocks)[:, None], magnitude_bits(candidates), -1).reshape(-1)
    index = (chosen[:, None] * block + jnp.arange(block, dtype=jnp.int32)).reshape(-1)
    if blocks * block < size:
        tail = jnp.arange(blocks * block, size, dtype=jnp.int32)
        keys = _packing.concatenate([keys, magnitude_bits(x[blocks * block :])])
        index = _packing.concatenate([index, tail])
    # Candidate elements above the floor, still in index order; then exactly k of them.
    picked = _superset(keys, k, min(keys.size, 2 * k + 256))
    keys = jnp.take(keys, picked, mode="fill", fill_value=-1)
    index = jnp.take(index, picked, mode="fill", fill_value=0)
    return jnp.take(index, _compact(_exactly_k(keys, k), k)[0])


@jax.named_scope("compress")
def topk(x: jax.Array, k: int, selector: Selector = "exact") -> tuple[jax.Array, jax.Array]:
    """The k entries of largest magnitude of a flat array.

    Args:
      x: a 1-D array.
      k: how many entries to keep, 1 <= k <= x.size.
      selector: "exact" (`lax.top_k`) or "sampled" (block maxima as the sample, then an
        exact refinement among the candidates: the same entries, see the module
        docstring).

    Returns:
      `(values, indices)`: `x[indices]` and int32 indices, both of shape `(k,)`. Ties are
      broken towards lower indices. "exact" orders them by decreasing magnitude;
      "sampled" in no set order.

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
    if selector == "sampled" and _sampled_fits(size, k):
        indices = _sampled_indices(x, k)
    else:
        indices = lax.top_k(_magnitude(x), k)[1].astype(jnp.int32)
    return x[indices], indices
