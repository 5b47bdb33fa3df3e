"""Small integers packed densely into uint32 words, in mixed radix.

Values in [0, base) are packed k to a word, k the largest integer with base^k <= 2^32, as
the base-`base` digits of the word: ternary codes (base 3) pack 20 to a word (1.6 bits
each, 5 per byte), and sums of N ternary values (base 2N + 1) pack in about
log2(2N + 1) bits each. Packing is Horner's rule in uint32 (no overflow, since the largest
word is base^k - 1); unpacking divides each word by each power of the base.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.cache
def values_per_word(base: int) -> int:
    """How many base-`base` digits fit in a uint32 word."""
    if base < 2:
        raise ValueError(f"base must be at least 2, got {base}")
    k = 1
    while base ** (k + 1) <= 2**32:
        k += 1
    return k


def pack(values: jax.Array, base: int) -> jax.Array:
    """Packs the last axis of `values` (integers in [0, base)) into uint32 words.

    The last axis must be a multiple of `values_per_word(base)`; the result's last axis is
    that many times shorter.
    """
    k = values_per_word(base)
    if values.shape[-1] % k:
        raise ValueError(f"last axis {values.shape[-1]} is not a multiple of {k}")
    digits = values.astype(jnp.uint32).reshape(*values.shape[:-1], -1, k)
    word = digits[..., k - 1]
    for i in range(k - 2, -1, -1):
        word = word * jnp.uint32(base) + digits[..., i]
    return word


def unpack(words: jax.Array, base: int) -> jax.Array:
    """Inverse of `pack`: uint32 words to their digits (as uint32), along the last axis."""
    powers = jnp.asarray([base**i for i in range(values_per_word(base))], jnp.uint32)
    digits = (words[..., None] // powers) % jnp.uint32(base)
    return digits.reshape(*words.shape[:-1], -1)
