"""The frame of every gradcomm transformation, and its step counter.

Every method's `update` opens the same way: it takes optax's `(updates, state, params,
**extra_args)`, runs under `jax.named_scope("gradcomm.<method>")`, checks its updates
(`_checks.check_updates`: float leaves, not already summed) and, where it reads them, that
it was given params, and resolves the axis (an axis that is not bound raises, naming the
bound ones). `transformation` is that opening, written once; the method supplies only its
`step`. `leafwise` hands the step the flattened leaves with their '/'-joined names, and
`with_residuals` adds error feedback's state, a residual per leaf.

Schedules key off the transformation's own `count` (`zero_count`, `every`), not a global
step, which keeps them right under `optax.MultiSteps`: it calls the inner update only on
its outer steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomm import _axes, _checks

Leaves = list[jax.Array]


def transformation(
    who: str,
    axis_name: _axes.AxisName,
    init_fn: Callable[[Any], Any],
    step: Callable[[Any, Any, Any], tuple[Any, Any]],
    *,
    needs_params: bool = False,
    checked_axes: _axes.AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    """An optax transformation whose `update` checks its inputs, then calls `step`.

    Args:
      who: the method's name, in error messages and in the scope `gradcomm.<who>`.
      axis_name: the axis the method communicates over; it must be bound.
      init_fn: the transformation's `init`.
      step: `step(updates, state, params) -> (new_updates, new_state)`.
      needs_params: raise a `ValueError` where `update` is called without params.
      checked_axes: the axes the updates must vary over (default `axis_name`).

    Returns:
      An `optax.GradientTransformationExtraArgs`; `update` ignores extra args.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from gradcomm import _transform
      >>> step = lambda updates, state, params: (jax.lax.pmean(updates, "d"), state)
      >>> tx = _transform.transformation("mean", "d", lambda params: optax.EmptyState(), step)
      >>> mean = lambda g: tx.update(g, optax.EmptyState())[0]
      >>> jax.vmap(mean, axis_name="d")(jnp.array([1.0, 3.0]))
      Array([2., 2.], dtype=float32)
    """
    checked = axis_name if checked_axes is None else checked_axes

    @jax.named_scope(f"gradcomm.{who}")
    def update_fn(
        updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        del extra_args
        if needs_params:
            _checks.require_params(params, who)
        _checks.check_updates(updates, checked, who)
        _axes.axis_size(axis_name)  # an axis that is not bound raises, naming the bound ones
        return step(updates, state, params)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def leafwise(
    who: str,
    axis_name: _axes.AxisName,
    init_fn: Callable[[Any], Any],
    step: Callable[[Leaves, list[str], Any], tuple[Leaves, Any]],
) -> optax.GradientTransformationExtraArgs:
    """`transformation` for a method that works on the list of leaves.

    Args:
      who: as for `transformation`.
      axis_name: as for `transformation`.
      init_fn: the transformation's `init`.
      step: `step(leaves, names, state) -> (outputs, new_state)`, with the leaves of the
        updates in tree order, their '/'-joined names, and one output per leaf.

    Returns:
      An `optax.GradientTransformationExtraArgs`; `update` ignores params and extra args.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from gradcomm import _transform
      >>> step = lambda leaves, names, state: ([jax.lax.pmean(x, "d") for x in leaves], state)
      >>> tx = _transform.leafwise("mean", "d", lambda params: optax.EmptyState(), step)
      >>> mean = lambda g: tx.update(g, optax.EmptyState())[0]
      >>> jax.vmap(mean, axis_name="d")({"w": jnp.array([1.0, 3.0])})["w"]
      Array([2., 2.], dtype=float32)
    """

    def tree_step(updates: Any, state: Any, params: Any) -> tuple[Any, Any]:
        del params
        leaves, names, treedef = _checks.named_leaves(updates)
        out, new_state = step(leaves, names, state)
        return jax.tree.unflatten(treedef, out), new_state

    return transformation(who, axis_name, init_fn, tree_step)


def with_residuals(
    who: str,
    axis_name: _axes.AxisName,
    state_type: Callable[..., NamedTuple],
    step: Callable[[Leaves, list[str], Leaves], tuple[Leaves, Leaves]],
) -> optax.GradientTransformationExtraArgs:
    """`leafwise` for error feedback: the state is a residual per leaf.

    Args:
      who: as for `transformation`.
      axis_name: as for `transformation`.
      state_type: the state, a NamedTuple with the one field `residual`.
      step: `step(leaves, names, residuals) -> (outputs, new_residuals)`, lists in the
        order of the updates' leaves.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state starts as zeros like the
      params.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from typing import Any, NamedTuple
      >>> from gradcomm import _transform
      >>> class DelayState(NamedTuple):
      ...     residual: Any
      >>> delay = lambda leaves, names, residuals: (residuals, leaves)  # last step's
      >>> tx = _transform.with_residuals("delay", "d", DelayState, delay)
      >>> g = jnp.array([[1.0, 2.0]])  # one device
      >>> run = lambda g: tx.update(g, tx.init(jnp.zeros(2)))
      >>> out, state = jax.vmap(run, axis_name="d")(g)
      >>> out[0], state.residual[0]
      (Array([0., 0.], dtype=float32), Array([1., 2.], dtype=float32))
    """

    def init_fn(params: Any) -> NamedTuple:
        return state_type(residual=jax.tree.map(jnp.zeros_like, params))

    def residual_step(leaves: Leaves, names: list[str], state: Any) -> tuple[Leaves, Any]:
        out, residuals = step(leaves, names, jax.tree.leaves(state.residual))
        structure = jax.tree.structure(state.residual)
        return out, state_type(residual=jax.tree.unflatten(structure, residuals))

    return leafwise(who, axis_name, init_fn, residual_step)


def zero_count() -> jax.Array:
    """The initial step counter of every gradcomm state."""
    return jnp.zeros([], jnp.int32)


def every(count: jax.Array, period: int) -> jax.Array:
    """Whether the step that increments `count` (from 0) is one of steps k, 2k, ... (k = period)."""
    return (count + 1) % period == 0
