"""Step-counter schedules: every schedule keys off its transformation's own `count`.

Keeping the counter in the transformation's state (not a global step) keeps schedules right
under `optax.MultiSteps`, which calls the inner update only on its outer steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zero_count() -> jax.Array:
    """The initial step counter of every gradcomm state."""
    return jnp.zeros([], jnp.int32)


def every(count: jax.Array, period: int) -> jax.Array:
    """Whether the step that increments `count` (from 0) is one of steps k, 2k, ... (k = period)."""
    return (count + 1) % period == 0
