"""Numerics the methods share: the dtype sums are computed in, and exact power-of-two
scaling (operands scaled without changing a bit of their ratios)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def compute_dtype(dtype: Any) -> np.dtype:
    """The accumulation dtype for a floating dtype: at least float32."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


def exact_pow2(e: jax.Array, dtype: np.dtype) -> jax.Array:
    """2**e for integer e in the normal range of `dtype`, built from bits (exact)."""
    info = jnp.finfo(dtype)
    itype = jnp.int32 if info.bits == 32 else jnp.int64
    bits = (e.astype(itype) + (info.maxexp - 1)) << info.nmant
    return lax.bitcast_convert_type(bits, dtype)


def pow2_scale(m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Power-of-two scales for maxima `m >= 0`, and their exact reciprocals.

    `scale >= m` is the smallest such power of two, clamped so that both it and its
    reciprocal are normal numbers. A zero maximum gets scale 0 (it adds nothing to a
    group) and reciprocal 1; a non-finite one gets 1 and 1, so the inf or NaN reaches the
    dot products and poisons the leaf.
    """
    info = jnp.finfo(m.dtype)
    _, e = jnp.frexp(m)
    e = jnp.clip(e, info.minexp, info.maxexp - 2)
    finite = jnp.isfinite(m)
    scale = jnp.where(m == 0, 0, jnp.where(finite, exact_pow2(e, m.dtype), 1))
    inverse = jnp.where((m == 0) | ~finite, 1, exact_pow2(-e, m.dtype))
    return scale.astype(m.dtype), inverse.astype(m.dtype)
