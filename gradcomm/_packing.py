"""Small integers packed densely into unsigned words, in mixed radix, digit-major.

Values in [0, base) are packed k to a word, k the largest integer with base^k <= 2^bits,
as the base-`base` digits of the word: ternary codes (base 3) pack 5 to a uint8 (1.6 bits
each, the same density as 20 to a uint32), and sums of N ternary values (base 2N + 1)
pack into uint32 words in about log2(2N + 1) bits each.

The layout is digit-major: `(k, m)` values become `m` words, row i being digit i of every
word. Packing is Horner's rule over the rows in the word's own dtype (no overflow, since
the largest word is base^k - 1); unpacking divides every word by one power of the base
per row, a constant that the compiler turns into a multiply and a shift. Each row is a
contiguous, vectorizable loop (word-major packing, k consecutive values per word, would
divide by a different power at every element), and bytes vectorize 4x wider than words.

`concatenate` lays flat arrays end to end into one buffer (the packed wire buffers, a
model-sized vector), part by part, which XLA:CPU runs far faster than `jnp.concatenate`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@functools.cache
def values_per_word(base: int, bits: int = 32) -> int:
    """How many base-`base` digits fit in an unsigned word of `bits` bits."""
    if base < 2:
        raise ValueError(f"base must be at least 2, got {base}")
    if base > 2**bits:
        raise ValueError(f"base {base} does not fit in {bits} bits")
    k = 1
    while base ** (k + 1) <= 2**bits:
        k += 1
    return k


def pack(values: jax.Array | Sequence[jax.Array], base: int, dtype: Any = jnp.uint32) -> jax.Array:
    """Packs axis -2 of `values` (integers in [0, base)) into unsigned words.

    Args:
      values: integers in [0, base), shaped `(..., k, m)` with `k = values_per_word(base,
        bits)` and `bits` the width of `dtype`; or a sequence of the k digit rows, each
        `(..., m)`, which spares the compiler a stacked intermediate.
      base: the radix.
      dtype: the unsigned word type (uint8, uint16 or uint32).

    Returns:
      Words of `dtype` shaped `(..., m)`: word j is `sum_i values[..., i, j] * base**i`.
    """
    dtype = np.dtype(dtype)
    k = values_per_word(base, 8 * dtype.itemsize)
    if not isinstance(values, Sequence):
        if values.ndim < 2:
            raise ValueError(f"values must have shape (..., {k}, m), got {values.shape}")
        values = [values[..., i, :] for i in range(values.shape[-2])]
    if len(values) != k:
        raise ValueError(f"base {base} in {dtype} packs {k} digits a word, got {len(values)}")
    word = values[k - 1].astype(dtype)
    for i in range(k - 2, -1, -1):
        word = word * dtype.type(base) + values[i].astype(dtype)
    return word


def _digit(words: jax.Array, base: int, i: int) -> jax.Array:
    """Digit i of every word."""
    t = words.dtype.type
    return (words // t(base**i)) % t(base)


def unpack(words: jax.Array, base: int, axis: int = -2) -> jax.Array:
    """Inverse of `pack`: the digits of `words`, stacked along `axis` (-2: `(..., k, m)`).

    The digits keep the words' dtype. Stacking along axis 0 instead (`(k, ..., m)`) keeps
    each digit one contiguous block.
    """
    k = values_per_word(base, 8 * words.dtype.itemsize)
    return jnp.stack([_digit(words, base, i) for i in range(k)], axis=axis)


def digit_sums(words: jax.Array, base: int, dtype: jnp.dtype) -> jax.Array:
    """The digits of `words` `(n, m)` summed over the n rows: `(k, m)` of `dtype`.

    Equal to `unpack(words, base).sum(0)`, computed digit by digit so that each is a
    vectorized pass over the words; `dtype` must hold n * (base - 1).
    """
    n = words.shape[0]
    k = values_per_word(base, 8 * words.dtype.itemsize)
    rows = []
    for i in range(k):
        digits = _digit(words, base, i).astype(dtype)
        total = digits[0]
        for j in range(1, n):
            total = total + digits[j]
        rows.append(total)
    return jnp.stack(rows)


def concatenate(parts: Sequence[jax.Array]) -> jax.Array:
    """The concatenation of 1-D arrays of one dtype, written part by part into one buffer.

    Same result as `jnp.concatenate`. XLA:CPU (JAX 0.10) runs a fused concatenate of
    parts of unequal sizes (one model-sized, some bias-sized) up to 50x slower than a
    copy, and turns a first update of a zero buffer into a slow pad; here the buffer is
    materialized by writing its last element first (the value, not a constant, so that
    the write is not folded away), and each part's producer then fuses into its own
    in-place `dynamic_update_slice`.
    """
    if len(parts) == 1:
        return parts[0]
    total = sum(p.shape[0] for p in parts)
    last = parts[-1][parts[-1].shape[0] - 1 :]
    buffer = lax.dynamic_update_slice(jnp.zeros(total, last.dtype), last, (total - 1,))
    offset = 0
    for part in parts:
        buffer = lax.dynamic_update_slice(buffer, part, (offset,))
        offset += part.shape[0]
    return buffer
