"""TernGrad's codes and their exchanges: drawing ternary codes, packing them 5 to a byte,
and summing them over the devices in packed form (the mechanism behind `gradcomm.terngrad`).

The random bits are a counter-based hash of each element's index (in the whole tensor,
for a piece of a leaf sharded over other mesh axes), keyed per device and step by
`jax.random` (threefry): two rounds of a 32-bit mixer, one vectorized pass, where
threefry per element costs about ten times as much on a CPU. Each leaf is packed on its
own, digit-major (`gradcomm._packing`), so that drawing, clipping and packing are one
pass over the leaf and unpacking one pass over the codes. `code_sums` is the exchange:
an all-gather of the packed codes, or an all-to-all of them and an all-gather of their
sums in base 2N + 1 (`auto_exchange` takes the one that sends fewer bits).

For FSDP leaves (split along their leading dimension over the data axes, each device
keeping its shard of the result), `pack_shards` packs the codes of each of a leaf's n
shards on its own, numbered by their place in the whole leaf, and `shard_code_sums` is a
reduce-scatter of them: one all-to-all of the packed codes, after which device j sums
shard j of every device's codes; (N - 1) / N of the packed codes sent per device, and no
sums travel back.
"""

from __future__ import annotations

import itertools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _axes, _collectives, _flat, _packing

Packed = Literal["all_gather", "all_to_all"]  # the exchanges of the packed codes


def _mix(x: jax.Array) -> jax.Array:
    """lowbias32 (C. Wellons, hash-prospector): a bijective uint32 mixer with low bias."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def key_words(key: jax.Array) -> jax.Array:
    """Two uint32 words from a `jax.random` key (threefry): the key of the element hash."""
    return jax.random.bits(key, (2,), jnp.uint32)


def _random_words(
    words: jax.Array, start: int, size: int, index: jax.Array | None = None
) -> jax.Array:
    """`size` pseudo-random uint32 words for elements `start + index`.

    `index` (uint32, `(size,)`) defaults to `0, 1, ...`. Counter-based: element e gets
    `mix(mix(e ^ k0) + k1)`, (k0, k1) = `words`, a keyed bijection of the element index
    (numbered modulo 2^32) evaluated in one vectorized pass; threefry per element costs
    about ten times as much on a CPU.
    """
    if index is None:
        index = lax.iota(jnp.uint32, size)
    index = index + jnp.uint32(start % 2**32)
    return _mix(_mix(index ^ words[0]) + words[1])


def codes(
    g: jax.Array,
    bound: jax.Array,
    scale: jax.Array,
    words: jax.Array,
    start: int = 0,
    index: jax.Array | None = None,
) -> jax.Array:
    """Eqs. 1 and 3: codes sign(g) * b (int32), b ~ Bernoulli(|clip(g)| / scale).

    Each element gets a 23-bit uniform at the midpoints, u = (r + 1/2) / 2^23 (exact in
    float32), and b = 1 where u < |clip(g)| / scale: P(b = 1) is the ratio rounded to a
    multiple of 2^-23. A zero scale gives zeros, an infinite one zeros (so 0 * inf = NaN).
    Elements are numbered `start + index` in the random stream keyed by `words` (from
    `key_words`): `index` (uint32, shaped like `g`) is each element's place in the whole
    tensor where `g` is a piece of it (`gradcomm._shards.global_index`), and defaults to
    its place in the flat `g`.
    """
    flat_index = None if index is None else index.ravel()
    r = (_random_words(words, start, g.size, flat_index) >> 9).reshape(g.shape)
    u = (r.astype(g.dtype) + 0.5) * 2.0**-23
    ratio = jnp.minimum(jnp.abs(g), bound) / scale
    return jnp.where(u < ratio, jnp.sign(g), 0).astype(jnp.int32)


PER_BYTE = _packing.values_per_word(3, 8)  # 5 ternary codes to a byte


def auto_exchange(n: int) -> Packed:
    """The packed exchange that sends fewer bits per element at this axis size: "auto"'s."""
    code_bits = 8 / PER_BYTE
    sum_bits = 32 / _packing.values_per_word(2 * n + 1)
    gather = (n - 1) * code_bits
    scatter = (n - 1) / n * (code_bits + sum_bits)
    return "all_gather" if gather <= scatter else "all_to_all"


def sum_dtype(n: int) -> np.dtype:
    """The narrowest unsigned dtype that holds sums of n codes offset by n, in [0, 2n]."""
    return np.dtype(next(t for t in (np.uint8, np.uint16, np.uint32) if 2 * n <= np.iinfo(t).max))


def _row_starts(size: int) -> tuple[int, list[int]]:
    """How a leaf of `size` codes lies in b = ceil(size / 5) bytes, digit-major.

    Digit i of the bytes holds the codes `[start_i, start_i + b)`: `i b` for the first
    four, and `size - b` for the last, which then repeats the up to 4 codes before it
    instead of padding (the same codes: they are a function of the element). Leaves too
    small for that (4 b > size) are padded. Returns `(b, starts)`.
    """
    b = -(-size // PER_BYTE)
    starts = [i * b for i in range(PER_BYTE)]
    if (PER_BYTE - 1) * b <= size:
        starts[-1] = size - b
    return b, starts


@jax.named_scope("compress")
def pack_leaf(
    g: jax.Array,
    bound: jax.Array,
    scale: jax.Array,
    words: jax.Array,
    start: int,
    index: jax.Array | None = None,
) -> jax.Array:
    """The codes of one leaf, 5 to a byte: `(b,)` uint8.

    Elements are numbered as `codes` numbers them: `start + index`, `index` by default
    each element's place in the flat `g`. The bytes hold `g`'s own elements in its own
    (flat) order, whatever `index` says.
    """
    flat = g.ravel()
    b, starts = _row_starts(flat.size)
    pad = max(starts[-1] + b - flat.size, 0)  # a tiny leaf: pad it
    flat = jnp.pad(flat, (0, pad)) if pad else flat
    flat_index = None if index is None else jnp.pad(index.ravel(), (0, pad))

    def row(s: int) -> jax.Array:
        piece = lax.slice(flat, (s,), (s + b,))
        if flat_index is None:
            return codes(piece, bound, scale, words, start + s)
        return codes(piece, bound, scale, words, start, lax.slice(flat_index, (s,), (s + b,)))

    rows = [row(s) + 1 for s in starts]
    return _packing.pack(rows, 3, jnp.uint8)


def _shard_index(n: int, m: int, start: int, width: int) -> jax.Array:
    """Columns `[start, start + width)` of a leaf's `(n, m)` view (n shards of m elements),
    as each element's index in the flat leaf: `(n, width)` uint32."""
    shape = (n, width)
    rows = lax.broadcasted_iota(jnp.uint32, shape, 0) * jnp.uint32(m)
    return rows + lax.broadcasted_iota(jnp.uint32, shape, 1) + jnp.uint32(start)


@jax.named_scope("compress")
def pack_shards(
    g: jax.Array,
    bound: jax.Array,
    scale: jax.Array,
    words: jax.Array,
    start: int,
    n: int,
    index: jax.Array | None = None,
) -> jax.Array:
    """The codes of one leaf's n shards, each packed as `pack_leaf` packs a leaf: `(n, b)`.

    Shard j is the j-th of n equal slices of `g` along its leading dimension (the piece
    that FSDP keeps on device j), contiguous in the flat `g`; row j of the result holds
    its bytes, which `unpack_leaf(rows, g.size // n)` reads back. Elements are numbered as
    `codes` numbers them in the whole `g`: `start + index`, `index` by default each
    element's place in the flat `g`; so the codes are `pack_leaf`'s, only laid out per
    shard.
    """
    flat = g.reshape(n, -1)
    m = flat.shape[1]
    b, starts = _row_starts(m)
    pad = max(starts[-1] + b - m, 0)  # tiny shards: pad them
    flat = jnp.pad(flat, ((0, 0), (0, pad))) if pad else flat
    full = None if index is None else index.reshape(n, m)
    full = jnp.pad(full, ((0, 0), (0, pad))) if pad and full is not None else full

    def row(s: int) -> jax.Array:
        piece = lax.slice(flat, (0, s), (n, s + b))
        where = _shard_index(n, m, s, b) if full is None else lax.slice(full, (0, s), (n, s + b))
        return codes(piece, bound, scale, words, start, where)

    rows = [row(s) + 1 for s in starts]
    return _packing.pack(rows, 3, jnp.uint8)


@jax.named_scope("combine")
def unpack_leaf(rows: list[jax.Array], size: int) -> jax.Array:
    """Inverse of `pack_leaf`'s layout: the digit rows `(b,)` of one leaf to `(size,)`."""
    b, starts = _row_starts(size)
    if starts[-1] + b > size:
        return jnp.concatenate(rows)[:size]
    return _packing.concatenate([*rows[:-1], rows[-1][(PER_BYTE - 1) * b - starts[-1] :]])


@jax.named_scope("exchange")
def code_sums(
    packed: list[jax.Array], axis_name: _axes.AxisName, n: int, exchange: Packed
) -> list[list[jax.Array]]:
    """Per leaf, the digit rows of the sum over devices of its codes plus n: in [0, 2n].

    `packed` holds each leaf's bytes from `pack_leaf`; they travel together. The sums
    (unsigned, `sum_dtype(n)`) are the same on every device. With "all_gather", every
    device sums every device's bytes; with "all_to_all", device j sums chunk j of every
    device's bytes and the sums travel in base 2n + 1, in uint32 words.
    """
    dtype = sum_dtype(n)
    offsets = _flat.offsets([p.size for p in packed])
    flat = _packing.concatenate(packed)
    if exchange == "all_gather":
        gathered = _collectives.all_gather_invariant(flat, axis_name)  # (n, bytes)
        return [
            list(_packing.digit_sums(gathered[:, start:end], 3, dtype))
            for start, end in itertools.pairwise(offsets)
        ]
    per_sum = _packing.values_per_word(2 * n + 1)
    chunk = -(-flat.size // n)  # bytes per device, a whole number of sum words per digit
    chunk += -chunk % per_sum
    flat = jnp.pad(flat, (0, n * chunk - flat.size))
    mine = lax.all_to_all(flat, axis_name, 0, 0, tiled=True).reshape(n, chunk)
    partial = _packing.digit_sums(mine, 3, jnp.uint32)  # chunk j of every device
    words = _packing.pack(partial.reshape(PER_BYTE, per_sum, -1), 2 * n + 1)
    gathered = _collectives.all_gather_invariant(words, axis_name)  # (n, PER_BYTE, words)
    digits = _packing.unpack(gathered, 2 * n + 1, axis=0).astype(dtype)
    sums = digits.transpose(2, 1, 0, 3).reshape(PER_BYTE, -1)  # (PER_BYTE, n * chunk)
    return [
        [sums[i, start:end] for i in range(PER_BYTE)] for start, end in itertools.pairwise(offsets)
    ]


@jax.named_scope("exchange")
def shard_code_sums(
    packed: list[jax.Array], axis_name: _axes.AxisName, n: int
) -> list[list[jax.Array]]:
    """Per leaf, the digit rows of the sum over devices of the codes of this device's
    shard, plus n: in [0, 2n] (`sum_dtype(n)`), each row `(b,)` for `unpack_leaf`.

    `packed` holds each leaf's `(n, b)` bytes from `pack_shards`. They travel as one
    `(n, bytes)` buffer, row j every leaf's shard j, in one all-to-all: device j receives
    row j of every device's buffer and sums it, and nothing else travels. Each device sends
    (n - 1) / n of its packed codes: a reduce-scatter of the codes.
    """
    dtype = sum_dtype(n)
    offsets = _flat.offsets([p.shape[1] for p in packed])
    flat = packed[0] if len(packed) == 1 else jnp.concatenate(packed, axis=1)
    mine = lax.all_to_all(flat, axis_name, 0, 0, tiled=True)  # row i: from device i
    sums = _packing.digit_sums(mine, 3, dtype)  # (PER_BYTE, bytes)
    return [
        [sums[i, start:end] for i in range(PER_BYTE)] for start, end in itertools.pairwise(offsets)
    ]
