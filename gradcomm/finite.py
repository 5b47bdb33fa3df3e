"""Skipping non-finite steps with one decision for every device.

`optax.apply_if_finite` tests the updates it receives. Wrapped around a gradcomm method,
those are this device's own: one device with an overflow skips the step, and with it the
method's collectives, while the others wait for it. `apply_if_finite` here reduces the flag
first, so every device skips or applies together.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _axes, _checks, _shards


def apply_if_finite(
    inner: optax.GradientTransformation,
    max_consecutive_errors: int,
    axis_name: _axes.AxisName = "data",
) -> optax.GradientTransformationExtraArgs:
    """`optax.apply_if_finite` whose decision is the same on every device.

    A step is skipped on every device when the updates of any device hold a NaN or an
    infinity, unless more than `max_consecutive_errors` steps in a row were. A skipped step
    returns zero updates and keeps the inner state. The flag is reduced over `axis_name`
    (one `pmin` of a scalar) before the inner transformation runs, and the inner
    transformation runs on every step, its result selected, so no device leaves a
    collective that another enters.

    On a mesh with axes besides `axis_name` (tensor parallelism: inside `jax.shard_map` over
    `('data', 'model')`, a leaf sharded over `'model'`), the flag is also reduced over the
    axes the leaves are sharded over, read from their varying types (`check_vma=True`,
    `shard_map`'s default; with `check_vma=False`, over every other axis of the map), in
    the same `pmin`: a NaN in one piece of a tensor skips the step on every device that
    holds a piece of it, so the pieces stay one model.

    Args:
      inner: the transformation to guard, typically a chain holding a gradcomm method.
      max_consecutive_errors: how many non-finite steps in a row are skipped; the next one
        is applied (a non-negative int).
      axis_name: the mesh axis, or tuple of axes, the devices share the decision over
        (and the axes some leaf is sharded over, besides).

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is `optax.ApplyIfFiniteState`,
      so optax's tools that read it keep working.

    Raises:
      ValueError: at construction for a malformed axis name or a negative or non-integer
        `max_consecutive_errors`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, gradcomm
      >>> tx = gradcomm.apply_if_finite(
      ...     optax.chain(gradcomm.allreduce("data"), optax.sgd(1.0)), 3, "data")
      >>> grads = jnp.array([[1.0], [jnp.nan]])  # device 1 alone overflowed
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(step, axis_name="data")(grads)  # skipped on both
      Array([[0.],
             [0.]], dtype=float32)

    References:
      optax.apply_if_finite; the shared flag is what PyTorch's sharded gradient scalers do
      with their `found_inf` (an all-reduce across ranks before the step).
    """
    _axes.check_axis_name(axis_name)
    _checks.check_int(max_consecutive_errors, "max_consecutive_errors", minimum=0)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> optax.ApplyIfFiniteState:
        return optax.ApplyIfFiniteState(
            notfinite_count=jnp.zeros([], jnp.int32),
            last_finite=jnp.array(True),
            total_notfinite=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
        )

    @jax.named_scope("gradcomm.apply_if_finite")
    def update_fn(
        updates: Any, state: optax.ApplyIfFiniteState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, optax.ApplyIfFiniteState]:
        leaves = jax.tree.leaves(updates)
        here = jnp.all(jnp.array([jnp.all(jnp.isfinite(u)) for u in leaves]))
        axes = _decision_axes(leaves, axis_name)
        everywhere = lax.pmin(_axes.vary(here.astype(jnp.int32), axes), axes)
        finite = everywhere == 1
        count = jnp.where(finite, 0, optax.safe_increment(state.notfinite_count))
        accept = finite | (count > max_consecutive_errors)
        new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
        return jax.tree.map(lambda u: jnp.where(accept, u, jnp.zeros_like(u)), new_updates), (
            optax.ApplyIfFiniteState(
                notfinite_count=count,
                last_finite=finite,
                total_notfinite=jnp.where(
                    finite, state.total_notfinite, optax.safe_increment(state.total_notfinite)
                ),
                inner_state=jax.tree.map(
                    lambda new, old: jnp.where(accept, new, old).astype(old.dtype),
                    new_inner,
                    state.inner_state,
                ),
            )
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _decision_axes(leaves: list[Any], axis_name: _axes.AxisName) -> _axes.AxisName:
    """`axis_name`, and the mesh axes besides it over which some leaf is sharded.

    The devices of a leaf's shard axes hold pieces of one tensor (tensor parallelism):
    a NaN in one piece must make all of them skip, or the pieces of one model diverge.
    Where `shard_map` runs with `check_vma=False` the types do not say which leaves are
    sharded: then every other manual axis of the mesh, a superset that only makes more
    devices agree.
    """
    others = _shards.other_manual_axes(axis_name)
    if not others:
        return axis_name
    if all(name in _axes.varying_axes(lax.axis_index(name)) for name in others):
        varying = frozenset().union(*(_axes.varying_axes(x) for x in leaves))
        others = tuple(name for name in others if name in varying)
    return (*_axes.axis_names(axis_name), *others) if others else axis_name
