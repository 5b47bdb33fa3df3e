"""The frame of a leaf-by-leaf method's `update`, written once for lags, slgs and terngrad.

Each of them checks its updates (`_checks.check_updates`), flattens them with their
'/'-joined names, runs its method on the list of leaves, and rebuilds the tree, all under
`jax.named_scope("gradcomm.<method>")`. `transformation` is that frame;
`with_residuals` adds error feedback's state: a residual per leaf, zeros at first,
handed to the method as a list beside the leaves.
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
    init_fn: Callable[[Any], NamedTuple],
    step: Callable[[Leaves, list[str], Any], tuple[Leaves, Any]],
) -> optax.GradientTransformationExtraArgs:
    """An optax transformation that hands `step` the checked, flattened updates.

    Args:
      who: the method's name, in error messages and in the scope `gradcomm.<who>`.
      axis_name: the axis the updates must vary over (`_checks.check_updates`).
      init_fn: the transformation's `init`.
      step: `step(leaves, names, state) -> (outputs, new_state)`, with the leaves of the
        updates in tree order, their names, and one output per leaf.

    Returns:
      An `optax.GradientTransformationExtraArgs`; `update` ignores params and extra args.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from gradcomm import _leafwise
      >>> step = lambda leaves, names, state: ([jax.lax.pmean(x, "d") for x in leaves], state)
      >>> tx = _leafwise.transformation("mean", "d", lambda params: optax.EmptyState(), step)
      >>> mean = lambda g: tx.update(g, optax.EmptyState())[0]
      >>> jax.vmap(mean, axis_name="d")({"w": jnp.array([1.0, 3.0])})["w"]
      Array([2., 2.], dtype=float32)
    """

    @jax.named_scope(f"gradcomm.{who}")
    def update_fn(
        updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        del params, extra_args
        _checks.check_updates(updates, axis_name, who)
        leaves, names, treedef = _checks.named_leaves(updates)
        out, new_state = step(leaves, names, state)
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def with_residuals(
    who: str,
    axis_name: _axes.AxisName,
    state_type: Callable[..., NamedTuple],
    step: Callable[[Leaves, list[str], Leaves], tuple[Leaves, Leaves]],
) -> optax.GradientTransformationExtraArgs:
    """`transformation` for error feedback: the state is a residual per leaf.

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
      >>> import jax.numpy as jnp
      >>> from typing import Any, NamedTuple
      >>> from gradcomm import _leafwise
      >>> class DelayState(NamedTuple):
      ...     residual: Any
      >>> delay = lambda leaves, names, residuals: (residuals, leaves)  # last step's
      >>> tx = _leafwise.with_residuals("delay", "d", DelayState, delay)
      >>> out, state = tx.update(jnp.array([1.0, 2.0]), tx.init(jnp.zeros(2)))
      >>> out, state.residual
      (Array([0., 0.], dtype=float32), Array([1., 2.], dtype=float32))
    """

    def init_fn(params: Any) -> NamedTuple:
        return state_type(residual=jax.tree.map(jnp.zeros_like, params))

    def residual_step(leaves: Leaves, names: list[str], state: Any) -> tuple[Leaves, Any]:
        out, residuals = step(leaves, names, jax.tree.leaves(state.residual))
        structure = jax.tree.structure(state.residual)
        return out, state_type(residual=jax.tree.unflatten(structure, residuals))

    return transformation(who, axis_name, init_fn, residual_step)
