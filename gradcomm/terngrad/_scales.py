"""TernGrad's scales: the clipping bound (eq. 21), each device's scale and the shared one.

Each device clips a leaf at `clip * sigma` (sigma its standard deviation, over the whole
tensor where the leaf is a piece of one sharded over other mesh axes), and its scale is
the largest clipped magnitude; the devices share the maximum of their scales (eq. 4),
rounded up (`round_up_scale`) so that every sum of up to N terms +-s is exact in any
order, which makes `exchange="psum"` give the packed exchanges' bits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _numeric, _shards


def check_clip(clip: float | jax.Array | None) -> None:
    """A positive finite number, None, or a traced float scalar (`optax.inject_hyperparams`
    passes hyperparameters as traced values; those are used as they come)."""
    if isinstance(clip, jax.core.Tracer) and jnp.ndim(clip) == 0:
        if not jnp.issubdtype(clip.dtype, jnp.floating):
            raise ValueError(f"clip must be a float, got a traced {clip.dtype}")
        return
    if isinstance(clip, jax.Array | np.ndarray) and np.ndim(clip) == 0:
        clip = float(clip)
    if clip is not None and not (
        isinstance(clip, int | float) and math.isfinite(clip) and clip > 0
    ):
        raise ValueError(f"clip must be a positive number (or None for no clipping), got {clip!r}")


def clip_bound(g: jax.Array, clip: float | None) -> jax.Array:
    """Eq. 21: the clipping bound `clip * sigma` of a leaf; inf where sigma is 0 or clip None.

    sigma is computed on g scaled by an exact power of two, so 1e30 gradients do not
    overflow it. A non-finite sigma (from an inf or NaN in g) also gives inf.
    """
    if clip is None:
        return jnp.asarray(jnp.inf, g.dtype)
    _, inverse = _numeric.pow2_scale(jnp.max(jnp.abs(g)))
    sigma = jnp.std(g * inverse)
    return jnp.where(sigma > 0, clip * sigma / inverse, jnp.inf)


def _sharded_clip_bounds(
    gs: list[jax.Array], clip: float | jax.Array, axes: _shards.Axes
) -> list[jax.Array]:
    """`clip_bound` of the whole tensors of which `gs` are the pieces, sharded over `axes`.

    The same steps over the whole tensor: the power of two from the maximum over the
    pieces (`lax.pmax`), then the mean and the mean squared deviation from it, each a sum
    over the pieces (`lax.psum`): two passes, as `jnp.std`, so a constant leaf keeps a
    sigma of about 0 instead of the cancellation of a one-pass sum of squares.
    """
    count = np.asarray([g.size * _shards.num_shards(axes) for g in gs], gs[0].dtype)
    top = lax.pmax(jnp.stack([jnp.max(jnp.abs(g)) for g in gs]), axes)
    _, inverse = _numeric.pow2_scale(top)
    xs = [g * inverse[i] for i, g in enumerate(gs)]
    mean = lax.psum(jnp.stack([jnp.sum(x) for x in xs]), axes) / count
    squares = jnp.stack([jnp.sum(jnp.square(x - mean[i])) for i, x in enumerate(xs)])
    sigma = jnp.sqrt(lax.psum(squares, axes) / count)
    return list(jnp.where(sigma > 0, clip * sigma / inverse, jnp.inf))


def clip_bounds(gs: list[jax.Array], clip: float | None, axes: _shards.Axes) -> list[jax.Array]:
    """The clipping bounds of leaves sharded over `axes` (none: each leaf is whole)."""
    if clip is None or not axes:
        return [clip_bound(g, clip) for g in gs]
    return _sharded_clip_bounds(gs, clip, axes)


def local_scale(g: jax.Array, bound: jax.Array) -> jax.Array:
    """`max|clip(g, -bound, bound)|`, which is `min(max|g|, bound)`: no pass over the clip.

    An inf or NaN in g gives +inf: the maximum over devices then need not propagate NaN.
    """
    top = jnp.max(jnp.abs(g), initial=0)
    return jnp.where(jnp.isfinite(top), jnp.minimum(top, bound), jnp.inf)


def round_up_scale(scale: jax.Array, n: int) -> jax.Array:
    """Rounds normal scales up to nmant + 1 - ceil(log2(n + 1)) significant bits.

    Then k * scale is exact for every integer |k| <= n, so however a sum of n terms
    +-scale is ordered, it is exact.
    """
    info = jnp.finfo(scale.dtype)
    bits = info.nmant + 1 - n.bit_length()
    mantissa, exponent = jnp.frexp(scale)  # mantissa in [0.5, 1)
    mantissa = jnp.ceil(mantissa * 2.0**bits) * 2.0 ** (1 - bits)  # in [1, 2]
    rounded = mantissa * _numeric.exact_pow2(exponent - 1, scale.dtype)
    normal = jnp.isfinite(scale) & (scale >= info.tiny)
    return jnp.where(normal, rounded, scale)
