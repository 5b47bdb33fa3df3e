"""DiLoCo: local inner steps, and an outer optimizer on the mean change every H steps.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(2023), Algorithm 1. Each device runs the inner optimizer (any optax one; AdamW in the
paper) on its own params and gradients for H steps. Then the outer gradient, the change
of the params since the last outer step averaged over the devices,

    delta = anchor - mean_over_devices(params),

goes through the outer optimizer (Nesterov momentum in the paper), and its step from the
anchor gives the params that every device continues from, and the next anchor:

    params = anchor = anchor + outer_update(delta).

It is a `gradcomm.ParamsSync`, like `gradcomm.local_sgd`: it sets the params themselves
after the inner optimizer's step, the same bits on every device, and communicates only
then: one all-reduce of the params every H steps, which `gradcomm.wire` reports as such
(the branch "outer step"). With `outer=optax.sgd(1.0)` it is local SGD up to rounding:
`anchor - (anchor - mean)` rather than the mean itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _axes, _checks, _collectives, _schedule, wire
from gradcomm.sync import ParamsSync, _not_a_transformation, average_params


class DilocoState(NamedTuple):
    """State of `diloco`, the same on every device (replicated).

    Attributes:
      anchor: the params after the last outer step (theta^(t-1) of Algorithm 1); before
        the first, the initial params.
      outer_state: the outer optimizer's state (its momentum).
      count: the number of steps taken (calls of `update`).
    """

    anchor: Any
    outer_state: Any
    count: jax.Array


def diloco(
    axis_name: _axes.AxisName = "data",
    outer: optax.GradientTransformation | None = None,
    every: int = 500,
) -> ParamsSync:
    """DiLoCo's outer step (Douillard et al. 2023, Algorithm 1), as a `ParamsSync`.

    The inner optimizer is yours, run by each device on its own params. After steps H,
    2H, ... (H = `every`, counting from 1), this sync takes the outer gradient
    `delta = anchor - mean(params)`, the mean over the devices exact and the same bits on
    every device (`gradcomm.average_params`), applies `outer` to it with the anchor as
    its params, and sets both the params and the anchor to `anchor + outer_update(delta)`,
    the same bits on every device. On the other steps it returns the params as they are.
    The inner optimizer's state is left alone, as in the paper. Every device must start
    from the same params (`parallel.per_device(params, mesh)` places one copy per
    device): they are the first anchor.

        step = parallel.train_step(loss, optax.adamw(4e-4), mesh, params_per_device=True,
                                   sync=gradcomm.diloco("data", every=500))

    A hand-written `shard_map` loop adds one line after `optax.apply_updates`:
    `params, sync_state = sync.update(params, sync_state)`.

    Args:
      axis_name: the mesh axis (or tuple of axes) of the workers to average over.
      outer: the outer optimizer, an optax transformation applied to the outer gradient
        with the anchor as its params; default `optax.sgd(0.7, momentum=0.9,
        nesterov=True)`, the paper's Nesterov momentum.
      every: H >= 1, the inner steps between outer steps (the paper's H = 500).

    Returns:
      A `ParamsSync` whose state is a `DilocoState` (replicated: the anchor, the outer
      optimizer's state and a step count; it checkpoints like any state).

    Raises:
      ValueError: at construction for a malformed axis name, an `every` that is not a
        positive int or an `outer` that is not an optax transformation; at trace time for
        params that are not floating point; and where it is chained into an optax
        transformation (a `ParamsSync` goes to `train_step(..., sync=...)`).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from gradcomm.diloco import diloco
      >>> inner, sync = optax.sgd(1.0), diloco("data", every=2)
      >>> def run(p, g):  # two inner steps on this device's gradient g, then the outer one
      ...     opt_state, sync_state = inner.init(p), sync.init(p)
      ...     history = []
      ...     for _ in range(2):
      ...         updates, opt_state = inner.update(g, opt_state, p)
      ...         p = optax.apply_updates(p, updates)
      ...         p, sync_state = sync.update(p, sync_state)  # the one line
      ...         history.append(p)
      ...     return jnp.stack(history)
      >>> grads = jnp.array([[-1.0], [-3.0]])  # one row per device
      >>> jax.vmap(run, axis_name="data")(jnp.zeros((2, 1)), grads)[..., 0]
      Array([[1.       , 5.3199997],
             [3.       , 5.3199997]], dtype=float32)

      After step 1 each device has its own params; after step 2, delta = 0 - mean(2, 6)
      = -4, Nesterov's step is -0.7 (delta + 0.9 delta) = 5.32 (in float32), and both
      devices continue from there.

    References:
      Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam and Shen,
      "DiLoCo: Distributed Low-Communication Training of Language Models", arXiv
      2311.08105 (2023), Algorithm 1 (outer Nesterov momentum, learning rate 0.7,
      momentum 0.9; H = 500).
    """
    _axes.check_axis_name(axis_name)
    _checks.check_int(every, "every", minimum=1)
    if outer is None:
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    elif not isinstance(outer, optax.GradientTransformation):
        raise ValueError(
            f"outer must be an optax.GradientTransformation (the outer optimizer, such as "
            f"optax.sgd(0.7, momentum=0.9, nesterov=True)), got {outer!r}"
        )

    def init(params: Any) -> DilocoState:
        _checks.check_float_leaves(params, "diloco")
        return DilocoState(
            anchor=jax.tree.map(jnp.array, params),  # a copy: params may be donated
            outer_state=outer.init(params),
            count=_schedule.zero_count(),
        )

    @wire.branch("outer step", every=every)
    def outer_step(operands: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        params, anchor, outer_state = operands
        # The exact mean, the same bits on every device; typed as such, since the anchor
        # and the outer state it makes stay replicated.
        mean = jax.tree.map(
            lambda x: _collectives.assume_invariant(x, axis_name),
            average_params(params, axis_name),
        )
        delta = jax.tree.map(jnp.subtract, anchor, mean)  # the outer gradient
        updates, new_outer_state = outer.update(delta, outer_state, anchor)
        new = optax.apply_updates(anchor, updates)
        new_outer_state = jax.tree.map(_cast_like, new_outer_state, outer_state)
        return _typed_like((new, new, new_outer_state), operands)

    @jax.named_scope("gradcomm.diloco")
    def update(params: Any, state: DilocoState) -> tuple[Any, DilocoState]:
        _checks.check_float_leaves(params, "diloco")
        _axes.axis_size(axis_name)  # for the error message where it is not bound
        # Under shard_map, both branches must give each output the same varying axes.
        operands = _joined((params, state.anchor, state.outer_state), axis_name)
        due = _schedule.every(state.count, every)
        params, anchor, outer_state = lax.cond(due, outer_step, lambda ops: ops, operands)
        count = optax.safe_increment(state.count)
        return params, DilocoState(anchor=anchor, outer_state=outer_state, count=count)

    return ParamsSync(init, _not_a_transformation(update, "diloco"))


def _varying(tree: Any) -> frozenset[str]:
    """The mesh axes over which some leaf of `tree` varies (none outside shard_map)."""
    return frozenset().union(*(_axes.varying_axes(x) for x in jax.tree.leaves(tree)))


def _joined(operands: tuple[Any, Any, Any], axis_name: _axes.AxisName) -> tuple[Any, Any, Any]:
    """(params, anchor, outer_state), typed so that the outer step's results match them.

    The outer step's results vary where its inputs do, except over `axis_name`, which the
    mean removes: the state varies over the axes some state leaf varies over (none under
    `train_step`, where it is replicated) and those of the params other than
    `axis_name`'s; the params over those and their own.
    """
    params, anchor, outer_state = operands
    state_axes = _varying((anchor, outer_state)) | (
        _varying(params) - set(_axes.axis_names(axis_name))
    )
    param_axes = _varying(params) | state_axes
    return (
        _vary_all(params, param_axes),
        _vary_all(anchor, state_axes),
        _vary_all(outer_state, state_axes),
    )


def _vary_all(tree: Any, axes: frozenset[str]) -> Any:
    names = tuple(sorted(axes))
    return jax.tree.map(lambda x: _axes.vary(x, names), tree) if names else tree


def _typed_like(new: Any, old: Any) -> Any:
    """`new`, each leaf typed as varying over the axes of the matching leaf of `old`."""
    return jax.tree.map(lambda n, o: _axes.vary(n, tuple(sorted(_axes.varying_axes(o)))), new, old)


def _cast_like(new: jax.Array, old: jax.Array) -> jax.Array:
    """`new` in `old`'s dtype (an optimizer may promote a state leaf)."""
    return new if new.dtype == old.dtype else new.astype(old.dtype)
