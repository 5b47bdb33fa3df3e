"""Parameter synchronization: rules that set per-device params to one value on every device.

Methods that let each device's params drift apart (local SGD, gradient dropping with local
gradients, gossip) need, now and then, to make them one again. An optax update cannot do
it exactly: `p + (a - p)` rounds differently for different `p`, so the copies would differ
in their last bits. A `ParamsSync` is applied to the params themselves, after the
optimizer's step, and returns a value that is the same bits on every device:

    params = optax.apply_updates(params, updates)
    params, sync_state = sync.update(params, sync_state)   # inside the map

`gradcomm.parallel.train_step(..., sync=...)` runs that line for you; a hand-written
`shard_map` loop adds it. `average_params` is the exact mean on its own.

On a mesh with axes besides the data axes (tensor parallelism: inside `jax.shard_map` over
`('data', 'model')`, params split over `'model'` beside params replicated over it), the
mean is elementwise: each device averages its piece with the same piece on the other
devices of the data axes, which is the whole tensor's mean, bit for bit, and each leaf
keeps its type (a param replicated over `'model'` stays replicated over it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax import lax

from gradcomm import _axes, _checks, _transform, perfmodel, registry, wire


class ParamsSync(NamedTuple):
    """A rule applied to the params after each optimizer step (see the module docstring).

    Attributes:
      init: `init(params) -> state`, from one device's params; the state starts the
        same on every device.
      update: `update(params, state) -> (params, state)`, inside the map over the data
        axes. The averaging rules return params that are the same bits on every device
        whenever they change them (Streaming DiLoCo's delayed mix and eager updates do
        not: each device keeps its own share). State leaves that it makes differ between
        devices are kept per device by `parallel.train_step`, the rest replicated.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any], tuple[Any, Any]]


def _params_sync(
    who: str,
    axis_name: _axes.AxisName,
    init: Callable[[Any], Any],
    step: Callable[[Any, Any], tuple[Any, Any]],
) -> ParamsSync:
    """The `ParamsSync` of a rule: its update runs under `jax.named_scope("gradcomm.<who>")`,
    resolves the axis (an axis that is not bound raises, naming the bound ones) and calls
    `step(params, state)`; it raises where optax calls it as a transformation's
    `update(updates, state, params)` (a `ParamsSync` is a pair of functions, so
    `optax.chain` would accept it)."""

    @jax.named_scope(f"gradcomm.{who}")
    def update(params: Any, state: Any, *misplaced: Any, **extra_args: Any) -> tuple[Any, Any]:
        if misplaced or extra_args:
            raise ValueError(
                f"{who} returns a gradcomm.ParamsSync, which sets the params after the "
                f"optimizer's step; it is not an optax transformation to chain. Pass it as "
                f"parallel.train_step(..., sync=...), or call "
                f"`params, sync_state = sync.update(params, sync_state)` after "
                f"optax.apply_updates in your own loop"
            )
        _axes.axis_size(axis_name)
        return step(params, state)

    return ParamsSync(init, update)


class PeriodicAverageState(NamedTuple):
    """State of `periodic_average`: the number of steps taken."""

    count: jax.Array


def average_params(params: Any, axis_name: _axes.AxisName = "data") -> Any:
    """The mean over the devices of per-device params, the same bits on every device.

    One all-reduce of the params. The result is typed as varying over `axis_name`, like
    the params it replaces, so it can stand in a `lax.cond` branch beside them.

    Args:
      params: this device's params (a pytree of floating-point arrays).
      axis_name: the mesh axis (or tuple of axes) to average over.

    Returns:
      The params' mean over the devices.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> params = jnp.array([[1.0, 2.0], [3.0, 6.0]])  # one row per device
      >>> jax.vmap(lambda p: gradcomm.average_params(p, "data"), axis_name="data")(params)
      Array([[2., 4.],
             [2., 4.]], dtype=float32)
    """
    _checks.check_float_leaves(params, "average_params")
    return jax.tree.map(lambda x: _axes.vary(x, axis_name), lax.pmean(params, axis_name))


def periodic_average(axis_name: _axes.AxisName = "data", *, every: int = 20) -> ParamsSync:
    """Sets the params to their exact mean over the devices after steps k, 2k, ...

    Local SGD's model averaging (federated averaging), and the periodic averaging that
    gradient dropping with local gradients needs (Aji and Heafield, EMNLP 2017, section
    3.1). The conditional is named for `gradcomm.wire`, which reports its bytes as one
    all-reduce every k steps.

    Args:
      axis_name: the mesh axis (or tuple of axes) to average over.
      every: the period k >= 1.

    Returns:
      A `ParamsSync` whose state is a `PeriodicAverageState`.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> sync = gradcomm.periodic_average("data", every=2)
      >>> params = jnp.array([[1.0], [3.0]])  # one row per device
      >>> def two_steps(p):
      ...     state = sync.init(p)
      ...     first, state = sync.update(p, state)   # step 1: unchanged
      ...     second, state = sync.update(first, state)  # step 2: averaged
      ...     return first, second
      >>> first, second = jax.vmap(two_steps, axis_name="data")(params)
      >>> first[:, 0], second[:, 0]
      (Array([1., 3.], dtype=float32), Array([2., 2.], dtype=float32))

    References:
      McMahan et al., AISTATS 2017 (federated averaging); Aji and Heafield, EMNLP 2017,
      section 3.1.
    """
    return _periodic(axis_name, every, "periodic_average")


def local_sgd(axis_name: _axes.AxisName = "data", *, every: int = 20) -> ParamsSync:
    """Local SGD (federated averaging): each device steps alone, params averaged every k steps.

    There is no gradient exchange: each device applies its own optimizer (any optax one)
    to its own gradients, and after steps k, 2k, ... (counting from 1) the params are set
    to their exact mean, the same bits on every device. The optimizer's state is not
    averaged. It is `periodic_average` under the name the papers use; with
    `gradient_dropping(local=...)` the same rule is its periodic model averaging (3.1).

        step = parallel.train_step(loss, optax.sgd(0.1), mesh, params_per_device=True,
                                   sync=gradcomm.local_sgd("data", every=20),
                                   metrics="per_device")  # no collective between syncs

    A hand-written `shard_map` loop adds one line after `optax.apply_updates`:
    `params, sync_state = sync.update(params, sync_state)`.

    Args:
      axis_name: the mesh axis (or tuple of axes) to average over.
      every: the averaging period k >= 1 (the federated-averaging baseline of Aji et al.
        uses 20).

    Returns:
      A `ParamsSync` whose state is a `PeriodicAverageState`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, gradcomm
      >>> tx, sync = optax.sgd(1.0), gradcomm.local_sgd("data", every=1)
      >>> params = jnp.array([[1.0], [3.0]])  # one row per device
      >>> def step(p, g):
      ...     updates, _ = tx.update(g, tx.init(p), p)
      ...     return sync.update(optax.apply_updates(p, updates), sync.init(p))[0]
      >>> jax.vmap(step, axis_name="data")(params, jnp.array([[0.0], [2.0]]))[:, 0]
      Array([1., 1.], dtype=float32)

    References:
      McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
      Data", AISTATS 2017, as the baseline of Aji, Heafield and Bogoychev, EMNLP 2019
      (sections 2.2, 3.1).
    """
    return _periodic(axis_name, every, "local_sgd")


def _periodic(axis_name: _axes.AxisName, every: int, who: str) -> ParamsSync:
    """`periodic_average`'s rule, its errors naming the factory `who` the user called."""
    _axes.check_axis_name(axis_name)
    _checks.check_int(every, "every", minimum=1)

    def init(params: Any) -> PeriodicAverageState:
        del params
        return PeriodicAverageState(count=_transform.zero_count())

    def step(params: Any, state: PeriodicAverageState) -> tuple[Any, PeriodicAverageState]:
        due = _transform.every(state.count, every)
        average = wire.branch("average params", every=every)(lambda p: average_params(p, axis_name))
        params = lax.cond(due, average, lambda p: p, params)
        return params, PeriodicAverageState(count=optax.safe_increment(state.count))

    return _params_sync(who, axis_name, init, step)


registry.register(registry.Method(
    local_sgd, "params", title="Local SGD", paper="baseline", page="dropping",
    collectives=perfmodel.averaging, per_device=True,
))  # fmt: skip

registry.register(registry.Method(
    periodic_average, "params", title="Periodic averaging", paper="baseline", page="dropping",
    collectives=perfmodel.averaging, per_device=True,
))  # fmt: skip
