"""`init_state`: a transformation's state on every device, per device only where it must be.

`layout` (`_layout`) says which leaves are per device; with a `ParamsSync`, the state is a
`TrainState` holding the sync's state beside it, laid out by `sync_layout` (replicated but
for the leaves its update makes differ, such as eager DiLoCo's own outer gradients).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import Mesh, NamedSharding

from gradcomm import _axes, _collectives
from gradcomm.parallel._layout import (
    layout,
    local_params,
    local_shapes,
    stack,
    state_model_specs,
    state_specs,
    sync_layout,
)
from gradcomm.parallel._overlap import check_layerwise, layerwise
from gradcomm.parallel._placement import (
    check_copies,
    data_axes,
    device_spec,
    model_specs,
    num_shards,
    place,
    with_device_axis,
)
from gradcomm.sync import ParamsSync


class TrainState(NamedTuple):
    """What `init_state` returns with a `sync`: the transformation's state and the sync's.

    The sync's state is replicated, but for the leaves its update makes differ between
    devices, which carry a leading device axis like the transformation's.
    """

    tx: Any
    sync: Any


def check_sync(sync: ParamsSync | None, params_per_device: bool) -> None:
    if sync is None:
        return
    if not isinstance(sync, ParamsSync):
        raise ValueError(
            f"sync must be a gradcomm.ParamsSync (gradcomm.periodic_average(...)), got {sync!r}"
        )
    if not params_per_device:
        raise ValueError(
            "sync sets per-device params to one value; replicated params are one value "
            "already: pass params_per_device=True (with per-device params), or drop sync"
        )


def sync_state_of(
    sync: ParamsSync, params: Any, mesh: Mesh, names: tuple[str, ...], models: Any
) -> Any:
    """The sync's state from the first device's per-device params, inside the map: the
    same on every data-parallel device (the leaves `sync_layout` finds per device start
    as that copy on every device), and split over model axes like the params its leaves
    mirror (`models`), in one process or several."""
    shapes = local_shapes(params, True)
    flags = sync_layout(sync, params, mesh, names)
    models_of_state = state_model_specs(sync, shapes, models)
    out_specs = state_specs(
        jax.eval_shape(sync.init, shapes), flags, device_spec(mesh, names), models_of_state
    )
    param_spec = with_device_axis(models, device_spec(mesh, names))

    def body(params: Any) -> Any:
        first = jax.tree.map(
            lambda x: _collectives.all_gather_invariant(x[0], names)[0], params
        )  # device 0's copy, typed the same on every data-parallel device
        leaves, treedef = jax.tree.flatten(sync.init(first))
        leaves = [_axes.vary(x, names) if f else x for x, f in zip(leaves, flags, strict=True)]
        return stack(jax.tree.unflatten(treedef, leaves), flags)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(param_spec,), out_specs=out_specs)
    return jax.jit(mapped)(params)


def init_state(
    tx: optax.GradientTransformation,
    params: Any,
    mesh: Mesh,
    *,
    axes: _axes.AxisName | None = None,
    params_per_device: bool = False,
    sync: ParamsSync | None = None,
    overlap: bool = False,
) -> Any:
    """Initialises `tx`'s state on every device, per device only where it must be.

    `tx.init` runs inside `shard_map`, once per device. A state leaf that the
    transformation makes differ between devices (see the module docstring) gets a leading
    device axis; the others are replicated.

    Args:
      tx: the transformation.
      params: replicated params (or per-device ones with `params_per_device=True`).
      mesh: the mesh.
      axes: the data-parallel axes (default: all mesh axes).
      params_per_device: whether `params` carry a leading device axis.
      sync: the `ParamsSync` that `train_step` will run (needs `params_per_device`).
      overlap: the state of a step built with `overlap=True`: a tuple of `tx`'s states,
        one per layer (top-level entry of `params`).

    Returns:
      The state: per-device leaves of shape `(num_shards, *leaf_shape)` sharded over
      `axes`, the others replicated. With `sync`, a `TrainState` of that state and the
      sync's (laid out the same way).

    Example:
      >>> import jax.numpy as jnp, optax, gradcomm
      >>> from gradcomm import parallel
      >>> mesh = parallel.make_mesh()
      >>> tx = optax.chain(optax.adam(1e-3), gradcomm.adasum("data"))
      >>> state = parallel.init_state(tx, parallel.replicate(jnp.zeros(3), mesh), mesh)
      >>> adam = state[0][0]  # each device's Adam sees its own gradients
      >>> adam.mu.shape == (mesh.devices.size, 3), adam.count.shape  # the count is shared
      (True, ())
    """
    check_sync(sync, params_per_device)
    if overlap:
        check_layerwise(tx, jax.eval_shape(tx.init, local_shapes(params, params_per_device)))
        tx = layerwise(tx)
    names = data_axes(mesh, axes)
    spec = device_spec(mesh, names)
    if params_per_device:
        hint = (
            "place one copy per device with `parallel.per_device(params, mesh)`, or pass "
            "replicated params with params_per_device=False"
        )
        check_copies(params, num_shards(mesh, names), "param", hint)
    models = model_specs(params, mesh, names, params_per_device)
    param_spec = with_device_axis(models, spec if params_per_device else None)
    params = jax.tree.map(lambda x, s: place(x, NamedSharding(mesh, s)), params, param_spec)
    flags = layout(tx, params, mesh, names, params_per_device)

    def body(params: Any) -> Any:
        return stack(tx.init(local_params(params, params_per_device)), flags)

    shapes = jax.eval_shape(tx.init, local_shapes(params, params_per_device))
    state_models = state_model_specs(tx, local_shapes(params, params_per_device), models)
    out_specs = state_specs(shapes, flags, spec, state_models)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(param_spec,), out_specs=out_specs)
    state = jax.jit(mapped)(params)
    if sync is None:
        return state
    return TrainState(state, sync_state_of(sync, params, mesh, names, models))
