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

On a mesh with axes besides the data axes (tensor parallelism: inside `jax.shard_map` over
`('data', 'model')`, params split over `'model'` beside params replicated over it), the
mean is elementwise and each leaf of the params, the anchor and the outer state keeps
its type, its own varying axes joined with those the outer step gives it. An elementwise
outer optimizer (SGD, momentum, Nesterov, Adam) then gives each piece the whole tensor's
piece of its step, bit for bit. One that needs statistics of whole tensors (a global
norm to clip by, a per-tensor trust ratio as in LAMB) computes them on each device's
pieces here: they would need reducing over the model axes, which this does not do (and
a replicated leaf mixed with sharded ones would come out typed as varying over them).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _axes, _checks, _collectives, _transform, perfmodel, registry, wire
from gradcomm.sync import ParamsSync, _params_sync, average_params


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
    eager: bool = False,
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
                                   sync=gradcomm.diloco("data", every=500),
                                   metrics="per_device")  # no collective between syncs

    A hand-written `shard_map` loop adds one line after `optax.apply_updates`:
    `params, sync_state = sync.update(params, sync_state)`.

    Args:
      axis_name: the mesh axis (or tuple of axes) of the workers to average over.
      outer: the outer optimizer, an optax transformation applied to the outer gradient
        with the anchor as its params; default `optax.sgd(0.7, momentum=0.9,
        nesterov=True)`, the paper's Nesterov momentum. With params sharded over a model
        axis it sees each device's pieces: an elementwise one is exact, one that needs
        whole-tensor statistics (a global norm) would need them reduced over the model
        axes, which is not done (see the module docstring).
      every: H >= 1, the inner steps between outer steps (the paper's H = 500).
      eager: Kale et al.'s eager updates: the exchange overlaps the whole next period and
        each device's outer step uses its own outer gradient now with the others' from
        the last period; `gradcomm.streaming_diloco(axis_name, outer, every,
        fragments=1, outer_dtype="float32", eager=True)`, whose state it returns.

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
      >>> jax.jit(jax.vmap(run, axis_name="data"))(jnp.zeros((2, 1)), grads)[..., 0]
      Array([[1.       , 5.3199997],
             [3.       , 5.3199997]], dtype=float32)

      After step 1 each device has its own params; after step 2, delta = 0 - mean(2, 6)
      = -4, Nesterov's step is -0.7 (delta + 0.9 delta) = 5.32 (in float32), and both
      devices continue from there.

    References:
      Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam and Shen,
      "DiLoCo: Distributed Low-Communication Training of Language Models", arXiv
      2311.08105 (2023), Algorithm 1 (outer Nesterov momentum, learning rate 0.7,
      momentum 0.9; H = 500). Kale, Douillard and Donchev, "Eager Updates For
      Overlapped Communication and Computation in DiLoCo", arXiv 2502.12996 (2025).
    """
    if eager is True:
        from gradcomm.streaming_diloco import streaming_diloco  # it builds on this module

        return streaming_diloco(axis_name, outer, every, 1, outer_dtype="float32", eager=True)
    if eager is not False:
        raise ValueError(f"eager must be True or False, got {eager!r}")
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
            count=_transform.zero_count(),
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

    def step(params: Any, state: DilocoState) -> tuple[Any, DilocoState]:
        _checks.check_float_leaves(params, "diloco")
        operands = (params, state.anchor, state.outer_state)
        if _axes.is_manual(axis_name):
            # Under shard_map, both branches must give each output the same varying axes.
            operands = _joined(operands, outer_step)
        due = _transform.every(state.count, every)
        params, anchor, outer_state = lax.cond(due, outer_step, lambda ops: ops, operands)
        count = optax.safe_increment(state.count)
        return params, DilocoState(anchor=anchor, outer_state=outer_state, count=count)

    return _params_sync("diloco", axis_name, init, step)


def _joined(operands: tuple[Any, Any, Any], outer_step: Any) -> tuple[Any, Any, Any]:
    """(params, anchor, outer_state), each leaf typed like the outer step's result for it.

    The outer step's results vary where its inputs do, leaf by leaf, except over
    `axis_name`, which the mean removes: the new params and anchor where the anchor and
    the params' shard axes (a model axis they are split over) do, the outer state where
    the outer optimizer takes them. Its abstract evaluation (`jax.eval_shape`, which runs
    nothing) reads them; each operand is made to vary over its own axes and its
    result's, and the evaluation is repeated on those until no type grows (a few rounds
    at most: each adds axes). So a leaf replicated over a model axis stays replicated
    over it, beside a leaf sharded over it; under `train_step`, whose state is
    replicated, the anchor and outer state stay invariant and the params vary over the
    data axes only.
    """
    while True:
        results = jax.eval_shape(outer_step, operands)
        joined = _typed_like(operands, results, join=True)
        if _types(joined) == _types(operands):
            return joined
        operands = joined


def _types(tree: Any) -> list[frozenset[str]]:
    return [_axes.varying_axes(x) for x in jax.tree.leaves(tree)]


def _typed_like(new: Any, old: Any, *, join: bool = False) -> Any:
    """`new`, each leaf typed as varying over the axes of the matching leaf of `old` (and,
    with `join`, over its own besides). `old` may hold `jax.ShapeDtypeStruct`s."""

    def typed(n: jax.Array, o: Any) -> jax.Array:
        axes = _axes.varying_axes(o) | (_axes.varying_axes(n) if join else frozenset())
        return _axes.vary(n, tuple(sorted(axes)))

    return jax.tree.map(typed, new, old)


def _cast_like(new: jax.Array, old: jax.Array) -> jax.Array:
    """`new` in `old`'s dtype (an optimizer may promote a state leaf)."""
    return new if new.dtype == old.dtype else new.astype(old.dtype)


registry.register(registry.Method(
    diloco, "params", title="DiLoCo", paper="Douillard et al., 2023", page="diloco",
    collectives=perfmodel.averaging, per_device=True,
))  # fmt: skip
