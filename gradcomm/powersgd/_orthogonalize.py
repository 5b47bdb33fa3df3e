"""PowerSGD's orthogonalization: Gram-Schmidt, twice per column, scaled by powers of two.

`orthogonalize` is public (`gradcomm.powersgd.orthogonalize`); `inverse_scales` also
scales Q's columns before `M Q` in `gradcomm.powersgd`'s step.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from gradcomm import _numeric

HIGHEST = lax.Precision.HIGHEST


def inverse_scales(x: jax.Array, axis: int, axes: tuple[str, ...] = ()) -> jax.Array:
    """Exact powers of two that bring the largest magnitude along `axis` into [0.5, 1]; the
    largest over the devices of `axes` (each holding a piece of `x` along `axis`)."""
    peak = jnp.max(jnp.abs(x), axis=axis)
    if axes:
        peak = lax.pmax(peak, axes)
    _, inverse = _numeric.pow2_scale(peak)
    return inverse


def _normalize(c: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
    """`c / |c|`, scaled first so that the norm neither under- nor overflows; zero stays
    zero, and a NaN or infinity gives NaN. `c` may be split over the devices of `axes`."""
    c = c * inverse_scales(c, 0, axes)
    squares = jnp.sum(c * c)
    if axes:
        squares = lax.psum(squares, axes)
    norm = jnp.sqrt(squares)
    return c / jnp.where(norm == 0, 1, norm)


def orthogonalize(p: jax.Array, *, axes: str | Sequence[str] = ()) -> jax.Array:
    """Gram-Schmidt on the columns of `p` `(m, r)`, in order: orthonormal columns.

    Each column loses its projections on the earlier ones twice ("twice is enough"), so
    the result stays orthonormal to working precision when columns are nearly dependent
    (a matrix of rank below r). A column that is exactly zero, or becomes zero, stays zero
    (not NaN): it adds nothing to the approximation `P Q^T`. Norms are taken after
    scaling by an exact power of two, so columns near the limits of the float range
    neither under- nor overflow. NaN or infinity in `p` gives NaN.

    Where `p`'s rows are split over devices (each device of the mesh axes `axes` holds some
    of them, inside `jax.shard_map`), the column dot products, norms and scales are summed
    (or maximized) over `axes`, so that each device gets its rows of the whole matrix's
    result: 5 r - 2 small collectives over `axes` per call, none where `axes` is empty.

    Args:
      p: a floating-point `(m, r)` array, or this device's rows of one; compute in float32
        or wider.
      axes: the mesh axis, or tuple of axes, over which `p`'s rows are split; empty (the
        default) where `p` is whole.

    Returns:
      `p`'s orthonormalized columns (zero columns kept zero), in `p`'s dtype; this
      device's rows of them where `axes` is given.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradcomm.powersgd import orthogonalize
      >>> p = jnp.array([[3.0, -1.0, 0.0], [4.0, 7.0, 0.0], [0.0, 0.0, 0.0]])
      >>> jnp.round(orthogonalize(p), 6)  # the zero column stays zero
      Array([[ 0.6, -0.8,  0. ],
             [ 0.8,  0.6,  0. ],
             [ 0. ,  0. ,  0. ]], dtype=float32)
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    columns: list[jax.Array] = []
    for j in range(p.shape[1]):
        c = p[:, j] * inverse_scales(p[:, j], 0, axes)
        if columns:
            basis = jnp.stack(columns, axis=1)
            for _ in range(2):
                dots = jnp.matmul(c, basis, precision=HIGHEST)
                if axes:
                    dots = lax.psum(dots, axes)
                c = c - jnp.matmul(basis, dots, precision=HIGHEST)
        columns.append(_normalize(c, axes))
    return jnp.stack(columns, axis=1)
