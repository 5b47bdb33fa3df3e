"""How Streaming DiLoCo's outer gradients travel: E3M0 (4-bit) or bfloat16 `_compressed` codecs.

E3M0 is a 4-bit float with 1 sign bit, 3 exponent bits and no mantissa (Streaming DiLoCo,
Douillard et al. 2025). The paper does not say how values are scaled and rounded; here,
with a scale per leaf slice (its largest magnitude), a value is sent as the nearest of 0
and 2^-6 ... 2^0 times the scale (ties upward), two codes to a byte. Code bits:
`sign << 3 | e`, the level `2^(e - 7)` for e = 1..7 and 0 for e = 0. A slice whose scale
is not finite decodes as NaN. bfloat16 sends each value rounded to bfloat16 (to nearest,
ties to even), without a scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from gradcomm import _compressed, _packing

OuterDtype = Literal["float32", "bfloat16", "e3m0"]

_SMALLEST = -6  # E3M0's smallest level is 2^-6 of the scale; half of it rounds to 0


def encode_e3m0(x: jax.Array, scale: jax.Array) -> jax.Array:
    """4-bit codes (uint8 values in [0, 16)) of float32 `x` at `scale` (broadcast).

    The ratio |x| / scale is formed from the two numbers' mantissas and exponents, not
    by a division: XLA:CPU divides by multiplying with the reciprocal, which flushes to
    zero for a scale above 2^126.
    """
    safe = jnp.where((scale > 0) & jnp.isfinite(scale), scale, 1.0)
    mx, ex = jnp.frexp(jnp.abs(x))
    ms, es = jnp.frexp(safe)
    mantissa, eq = jnp.frexp(mx / ms)  # |x| / scale = mantissa 2^exponent, in [0.5, 1)
    exponent = ex - es + eq
    k = jnp.where(mantissa >= 0.75, exponent, exponent - 1)  # the nearest power of two
    k = jnp.clip(k, _SMALLEST, 0)
    zero = (x == 0) | (exponent <= _SMALLEST - 1)  # below half the smallest level
    e = jnp.where(zero, 0, k - _SMALLEST + 1)
    sign = (x < 0) & (e > 0)
    return (sign.astype(jnp.uint8) << 3) | e.astype(jnp.uint8)


def decode_e3m0(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """The float32 values of 4-bit `codes` at `scale` (NaN where the scale is not finite).

    A level is the product of the scale and 2^(e - 7), built from its bits: exact wherever
    the level is a normal float32 (XLA:CPU flushes smaller ones to zero). `jnp.ldexp`
    gives the same normal values through a float power per entry, which made this decode
    the larger part of an exchange's compute.
    """
    e = (codes & 7).astype(jnp.int32)
    power = lax.bitcast_convert_type((e + 127 + _SMALLEST - 1) << 23, jnp.float32)
    level = jnp.where(e > 0, scale * power, 0.0)
    value = jnp.where(codes & 8 != 0, -level, level)
    return jnp.where(jnp.isfinite(scale), value, jnp.nan)


def _encode_e3m0_rows(
    rows: Sequence[jax.Array], leg: _compressed.Leg, counts: Sequence[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Rows to 4-bit codes two to a byte, with a scale per leaf slice (on either leg)."""
    del leg, counts
    scales = jnp.stack([jnp.max(jnp.abs(r), axis=-1) for r in rows], axis=-1)
    codes = jnp.concatenate(
        [encode_e3m0(r, scales[..., i, None]) for i, r in enumerate(rows)], axis=-1
    )
    halves = codes.reshape(*codes.shape[:-1], 2, -1)
    return _packing.pack(halves, 16, jnp.uint8), scales


def _decode_e3m0_rows(
    words: jax.Array, scales: jax.Array, widths: Sequence[int]
) -> list[jax.Array]:
    codes = _packing.unpack(words, 16).reshape(*words.shape[:-1], -1)
    return [
        decode_e3m0(codes[..., a:b], scales[..., i, None])
        for i, (a, b) in enumerate(_compressed.bounds(widths))
    ]


def _encode_bf16_rows(
    rows: Sequence[jax.Array], leg: _compressed.Leg, counts: Sequence[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Rows to bfloat16, as bytes (two per value), without scales."""
    del leg, counts
    values = jnp.concatenate([r.astype(jnp.bfloat16) for r in rows], axis=-1)
    words = lax.bitcast_convert_type(values, jnp.uint8).reshape(*values.shape[:-1], -1)
    return words, jnp.zeros((*values.shape[:-1], 0), jnp.float32)


def _decode_bf16_rows(
    words: jax.Array, scales: jax.Array, widths: Sequence[int]
) -> list[jax.Array]:
    del scales
    pairs = words.reshape(*words.shape[:-1], -1, 2)
    values = lax.bitcast_convert_type(pairs, jnp.bfloat16).astype(jnp.float32)
    return [values[..., a:b] for a, b in _compressed.bounds(widths)]


# On a leaf split over other mesh axes than the data axes (`_compressed.compressed_mean`).
E3M0_WHO = "streaming_diloco(outer_dtype='e3m0')"
E3M0_FIX = (
    "Use outer_dtype='bfloat16' (rounded entry by entry: each piece gets the whole tensor's "
    "bits) or 'float32', or keep such leaves replicated over those axes"
)

CODECS = {
    "e3m0": _compressed.Codec(_encode_e3m0_rows, _decode_e3m0_rows, multiple=2),
    "bfloat16": _compressed.Codec(_encode_bf16_rows, _decode_bf16_rows, multiple=1, scaled=False),
}
