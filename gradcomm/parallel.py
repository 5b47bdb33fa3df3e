"""Data-parallel plumbing: meshes, placement, per-device state and the sharded train step.

gradcomm transformations run inside `jax.shard_map`, one program per device. Some of their
state differs per device (each device runs its own optimizer under Adasum; residuals, keys
and push-sum weights are per device): outside the map such a leaf carries a leading device
axis sharded over the data axes. State that the transformation keeps identical everywhere
(Adam's moments after an all-reduce, step counters) stays replicated. `init_state` finds
which is which from JAX's types (a value "varies" over an axis unless a collective made it
identical), and `train_step` reads the layout back from the state's shardings. A user places
params, initialises state and builds a jitted step without writing a `PartitionSpec`.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np, optax, gradcomm
  >>> from gradcomm import parallel
  >>> mesh = parallel.make_mesh()                     # every device on one "data" axis
  >>> tx = optax.chain(optax.adam(1e-2), gradcomm.adasum("data"))
  >>> loss = lambda p, b: jnp.mean((b["x"] @ p - b["y"]) ** 2)
  >>> params = parallel.replicate(jnp.zeros(3), mesh)
  >>> state = parallel.init_state(tx, params, mesh)
  >>> step = parallel.train_step(loss, tx, mesh)
  >>> n = parallel.num_shards(mesh)
  >>> batch = {"x": np.ones((4 * n, 3), np.float32), "y": np.ones(4 * n, np.float32)}
  >>> params, state, metrics = step(params, state, batch)
  >>> float(metrics["loss"])
  1.0
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomm import _base, wire
from gradcomm.sync import ParamsSync


def make_mesh(
    axes: Mapping[str, int] | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_types: AxisType = AxisType.Explicit,
) -> Mesh:
    """A mesh over `devices` (default: all devices) with named data-parallel axes.

    Args:
      axes: axis name to size, in mesh order; default `{"data": len(devices)}`. A 2-D
        mesh for hierarchical methods is `{"node": 4, "local": 2}`; a data axis factored
        into size-2 axes for pairwise exchanges is `pairwise_axes("data", 8)`, or
        `{**pairwise_axes("node", 4), "local": 2}` beside a local axis. On CPU and GPU
        the devices' row-major order does not depend on how the axes are factored.
      devices: the devices, in order; default `jax.devices()` (all processes).
      axis_types: the JAX axis type for every axis.

    Returns:
      A `jax.sharding.Mesh`.

    Example:
      >>> import jax
      >>> from gradcomm import parallel
      >>> mesh = parallel.make_mesh({"node": 2, "local": 2}, devices=jax.devices()[:4])
      >>> dict(mesh.shape), parallel.num_shards(mesh), parallel.device_spec(mesh)
      ({'node': 2, 'local': 2}, 4, P(('node', 'local'),))
    """
    devices = list(jax.devices() if devices is None else devices)
    axes = {"data": len(devices)} if axes is None else dict(axes)
    for name, size in axes.items():
        _base.check_axis_name(name, "axes")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"axis {name!r} needs a positive integer size, got {size!r}")
    if math.prod(axes.values()) != len(devices):
        raise ValueError(
            f"mesh axes {axes} hold {math.prod(axes.values())} devices, "
            f"but {len(devices)} were given"
        )
    return jax.make_mesh(
        tuple(axes.values()),
        tuple(axes),
        axis_types=(axis_types,) * len(axes),
        devices=devices,
    )


def pairwise_axes(name: str = "data", n: int | None = None) -> dict[str, int]:
    """Mesh axes of size 2 that together hold `n` data-parallel devices: `name0`, `name1`, ...

    Methods whose exchanges are pairwise swaps (Adasum's halving and gathering, SGP's and
    D-PSGD's i <-> i ^ 2^r moves) run each swap as a two-member collective over one of
    these axes when given all of them as `axis_name` (`exchange="auto"` does so on CPU
    across processes, where gloo runs a swapping `ppermute` at half speed). The device
    index over the tuple is row-major, `name0` the most significant bit, so device i
    holds the same place as on the one-axis mesh `{name: n}`: the same batch shard, the
    same bits.

    Args:
      name: the prefix of the axis names.
      n: the number of devices, a power of two; default `jax.device_count()`.

    Returns:
      `{f"{name}0": 2, f"{name}1": 2, ...}` with log2(n) entries (`{f"{name}0": 1}` for
      n = 1), to pass to `make_mesh`, alone or beside other axes.

    Example:
      >>> import jax, gradcomm
      >>> from gradcomm import parallel
      >>> axes = parallel.pairwise_axes("data", 4)
      >>> axes
      {'data0': 2, 'data1': 2}
      >>> mesh = parallel.make_mesh(axes, devices=jax.devices()[:4])
      >>> tx = gradcomm.adasum(tuple(axes))  # swaps over data1, then data0
      >>> step = parallel.train_step(lambda p, b: (p * b).sum(), tx, mesh)  # all axes
    """
    _base.check_axis_name(name, "name")
    n = jax.device_count() if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"pairwise_axes needs a power-of-two number of devices, got {n!r}")
    if n == 1:
        return {f"{name}0": 1}
    return {f"{name}{j}": 2 for j in range(n.bit_length() - 1)}


def _axes(mesh: Mesh, axes: _base.AxisName | None) -> tuple[str, ...]:
    names = mesh.axis_names if axes is None else _base.axis_names(axes)
    unknown = [a for a in names if a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"axes {unknown} are not in the mesh, whose axes are {mesh.axis_names}")
    return tuple(names)


def device_spec(mesh: Mesh, axes: _base.AxisName | None = None) -> P:
    """The spec of a leading axis split over the data axes (all mesh axes by default)."""
    names = _axes(mesh, axes)
    return P(names if len(names) > 1 else names[0])


def num_shards(mesh: Mesh, axes: _base.AxisName | None = None) -> int:
    """The number of data-parallel devices: the product of the data axes' sizes."""
    return math.prod(mesh.shape[a] for a in _axes(mesh, axes))


def _place(tree: Any, sharding: NamedSharding) -> Any:
    """Puts every leaf on `sharding`, from host or device data, in one or many processes.

    A `jax.ShapeDtypeStruct` leaf stays one, with `sharding`: what lowering needs.
    """

    def place(x: Any) -> jax.Array:
        if isinstance(x, jax.ShapeDtypeStruct):  # for lowering (`wire.measure`): no data
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if isinstance(x, jax.Array):
            if x.sharding.is_equivalent_to(sharding, x.ndim):
                return x
            if x.is_fully_addressable:
                return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(place, tree)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Places a pytree (params) on every device of the mesh, one identical copy each.

    Args:
      tree: a pytree of arrays (NumPy or JAX).
      mesh: the mesh.

    Returns:
      The pytree as `jax.Array`s replicated over the mesh (`PartitionSpec()`).

    Example:
      >>> import jax, numpy as np
      >>> from gradcomm import parallel
      >>> mesh = parallel.make_mesh(devices=jax.devices()[:2])
      >>> parallel.replicate({"w": np.ones(3)}, mesh)["w"].sharding.spec
      P()
    """
    return _place(tree, NamedSharding(mesh, P()))


def per_device(tree: Any, mesh: Mesh, axes: _base.AxisName | None = None) -> Any:
    """One copy of each leaf per data-parallel device: a leading device axis, sharded.

    Args:
      tree: a pytree of arrays: one device's values.
      mesh: the mesh.
      axes: the data-parallel axes (default: all mesh axes).

    Returns:
      The pytree with a leading axis of one copy per device, sharded over `axes`: what
      `train_step(..., params_per_device=True)` takes.

    Example:
      >>> import jax, numpy as np
      >>> from gradcomm import parallel
      >>> mesh = parallel.make_mesh(devices=jax.devices()[:2])
      >>> parallel.per_device({"w": np.ones(3)}, mesh)["w"].shape
      (2, 3)
    """
    n = num_shards(mesh, axes)
    stacked = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x)[None], (n, *np.shape(x))), tree)
    return _place(stacked, NamedSharding(mesh, device_spec(mesh, axes)))


def shard_batch(batch: Any, mesh: Mesh, axes: _base.AxisName | None = None) -> Any:
    """Splits a global batch's leading axis evenly over the data-parallel devices.

    Args:
      batch: a pytree of arrays whose leading axes are divisible by the device count.
      mesh: the mesh.
      axes: the data-parallel axes (default: all mesh axes).

    Returns:
      The batch sharded over `axes` along its leading axis.

    Raises:
      ValueError: for a leaf whose leading axis the devices do not divide.

    Example:
      >>> import jax, numpy as np
      >>> from gradcomm import parallel
      >>> mesh = parallel.make_mesh(devices=jax.devices()[:2])
      >>> x = parallel.shard_batch(np.arange(8.0).reshape(4, 2), mesh)
      >>> [s.data.shape for s in x.addressable_shards]
      [(2, 2), (2, 2)]
    """
    n = num_shards(mesh, axes)
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        if not np.ndim(x) or np.shape(x)[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
                f"{np.shape(x)}: its leading axis must be divisible by the {n} devices"
            )
    return _place(batch, NamedSharding(mesh, device_spec(mesh, axes)))


def host_copy(tree: Any, *, per_device: bool = False) -> Any:
    """This process's first copy of each leaf, as NumPy (device 0's, for per-device trees).

    Args:
      tree: a pytree of `jax.Array`s, replicated or (with `per_device`) per device.
      per_device: whether the leaves carry a leading device axis, which is dropped.

    Returns:
      The pytree as NumPy arrays: one copy, which works in every process of a multi-host
      run (it reads only this process's devices).

    Example:
      >>> import jax, numpy as np
      >>> from gradcomm import parallel
      >>> mesh = parallel.make_mesh(devices=jax.devices()[:2])
      >>> copies = parallel.per_device({"w": np.arange(3.0)}, mesh)
      >>> parallel.host_copy(copies, per_device=True)["w"]
      array([0., 1., 2.], dtype=float32)
    """

    def fetch(x: jax.Array) -> np.ndarray:
        local = np.asarray(x.addressable_data(0))
        return local[0] if per_device else local

    return jax.tree.map(fetch, tree)


def _averaging_due(state: Any) -> jax.Array | None:
    """Whether any `ParamsAveraging` marker in a transformation's state asks for averaging."""
    markers = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, _base.ParamsAveraging))
    flags = [m.due for m in markers if isinstance(m, _base.ParamsAveraging)]
    return jnp.any(jnp.stack(flags)) if flags else None


def _per_device_leaves(state: Any, spec: P) -> list[bool]:
    """Which leaves of a placed state carry a leading device axis (sharded as `spec`)."""
    flags = []
    for x in jax.tree.leaves(state):
        sharding = getattr(x, "sharding", None)
        leading = (
            sharding.spec[0] if isinstance(sharding, NamedSharding) and sharding.spec else None
        )
        flags.append(leading is not None and leading == spec[0])
    return flags


def _check_copies(tree: Any, n: int, what: str, hint: str) -> None:
    """Raises unless every leaf of a per-device tree holds exactly `n` copies."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        shape = np.shape(x)
        if not shape or shape[0] != n:
            raise ValueError(
                f"{what} {jax.tree_util.keystr(path) or '<root>'} has shape {shape}, but "
                f"per-device values need a leading axis of one copy per data-parallel "
                f"device, {n} on this mesh; {hint}"
            )


_RELAY_HINT = (
    "per-device state (residuals, keys, push-sum weights, each device's optimizer "
    "moments) belongs to the devices that made it and cannot be re-laid onto another "
    "number of devices. Restore it onto a mesh with as many data-parallel devices as it "
    "was saved from, or start this state afresh on this mesh with "
    "`parallel.init_state(tx, params, mesh)` (replicated leaves, such as step counts and "
    "the moments of an optimizer after an all-reduce, restore onto any mesh)"
)


def _check_state_layout(
    state: Any, flags: Sequence[bool], local: Any, n: int, names: tuple[str, ...]
) -> None:
    """Raises for state leaves whose device axis does not fit the mesh (see `TrainStep`).

    `local` holds one device's state shapes (`tx.init`'s): a per-device leaf must have
    shape `(n, *local)`, a replicated one `local`.
    """
    leaves = jax.tree_util.tree_leaves_with_path(state)
    local_leaves = jax.tree.leaves(local)
    if len(local_leaves) != len(leaves):
        return  # not this transformation's state: its update reports the mismatch
    for (path, x), want, per_device in zip(leaves, local_leaves, flags, strict=True):
        shape, name = tuple(np.shape(x)), jax.tree_util.keystr(path) or "<root>"
        if shape == tuple(want.shape) or shape[1:] != tuple(want.shape):
            continue  # replicated as expected, or a mismatch the update reports
        if per_device and shape[0] != n:
            raise ValueError(
                f"state leaf {name} holds {shape[0]} per-device copies (shape {shape}), "
                f"but this mesh has {n} data-parallel devices; {_RELAY_HINT}"
            )
        if not per_device:
            raise ValueError(
                f"state leaf {name} has a leading device axis of {shape[0]} copies (shape "
                f"{shape}) but is not sharded over the data axes {names}; "
                f"pass the state as `parallel.init_state` placed it: restore a checkpoint "
                f"with the shardings of `init_state`'s state (for example "
                f"`jax.tree.map(orbax.checkpoint.utils.to_shape_dtype_struct, state)` as "
                f"the restore target)"
            )


def _state_specs(state: Any, flags: Sequence[bool], spec: P) -> Any:
    _leaves, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, [spec if f else P() for f in flags])


def _unstack(tree: Any, flags: Sequence[bool]) -> Any:
    """Inside the map: drops the (size 1) device axis of the flagged leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [x[0] if f else x for x, f in zip(leaves, flags, strict=True)]
    )


def _stack(tree: Any, flags: Sequence[bool]) -> Any:
    """Inside the map: adds the device axis back to the flagged leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [x[None] if f else x for x, f in zip(leaves, flags, strict=True)]
    )


def _local_params(params: Any, params_per_device: bool) -> Any:
    """Inside the map: this device's params (per-device ones carry a size-1 device axis)."""
    return jax.tree.map(lambda x: x[0], params) if params_per_device else params


def _local_shapes(params: Any, params_per_device: bool) -> Any:
    """One device's view of the params' shapes."""
    cut = 1 if params_per_device else 0
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[cut:], x.dtype), params)


def _mean(params: Any, names: tuple[str, ...]) -> Any:
    """The mean of per-device params, typed as per-device again (for `lax.cond`)."""
    return jax.tree.map(lambda x: _base.vary(x, names), lax.pmean(params, names))


_NO_OPERAND = object()


def _select(index: Any, outs: Sequence[Any]) -> Any:
    """The branch outputs joined by `index`: each leaf typed as varying where any branch's is."""
    index = jnp.asarray(index).astype(jnp.int32)

    def pick(*xs: jax.Array) -> jax.Array:
        out = xs[0]
        for i, x in enumerate(xs[1:], 1):
            out = jnp.where(index == i, x, out)
        return out.astype(xs[0].dtype)

    return jax.tree.map(pick, *outs)


def _joined_cond(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any,
                 operand: Any = _NO_OPERAND) -> Any:  # fmt: skip
    return _joined_switch(pred, [false_fun, true_fun], *operands, operand=operand)


def _joined_switch(index: Any, branches: Sequence[Callable], *operands: Any,
                   operand: Any = _NO_OPERAND) -> Any:  # fmt: skip
    operands = operands if operand is _NO_OPERAND else (operand,)
    return _select(index, [branch(*operands) for branch in branches])


@contextlib.contextmanager
def _joined_branches() -> Any:
    """While the layout is probed, `lax.cond` and `lax.switch` run every branch and select.

    A real `cond` needs its branches to agree on which values vary over the data axes.
    Wrappers such as `optax.MultiSteps` return a state leaf unchanged in one branch and
    recomputed from this device's gradients in the other, so until the leaf is known to
    be per device, tracing fails and the fixed point cannot find it. Selected, each output
    is typed as varying wherever any branch makes it vary: the layout the real `cond`
    needs. The probe only reads types, so running every branch costs nothing. (It swaps
    the `jax.lax` module's functions for the length of one `eval_shape`: another thread
    tracing at that moment would see them too.)
    """
    saved = lax.cond, lax.switch
    lax.cond, lax.switch = _joined_cond, _joined_switch
    try:
        yield
    finally:
        lax.cond, lax.switch = saved


def _check_decisions(shapes: Any, flags: Sequence[bool]) -> None:
    """Raises where an optax wrapper's skip decision would differ between devices."""
    guards = (optax.ApplyIfFiniteState, optax.MultiStepsState)
    flag_tree = jax.tree.unflatten(jax.tree.structure(shapes), flags)

    def is_guard(x: Any) -> bool:
        return isinstance(x, guards)

    for node in jax.tree.leaves(flag_tree, is_leaf=is_guard):
        if isinstance(node, optax.ApplyIfFiniteState) and node.last_finite:
            raise ValueError(
                "optax.apply_if_finite here tests this device's own updates, so one device "
                "could skip a step, and the collectives in it, that the others take. Use "
                "gradcomm.apply_if_finite(inner, max_consecutive_errors, axis_name), whose "
                "decision every device shares, or place optax.apply_if_finite after the "
                "method has reduced the updates."
            )
        if isinstance(node, optax.MultiStepsState) and node.mini_step:
            raise ValueError(
                "optax.MultiSteps here decides per device whether to skip (its "
                "should_skip_update_fn reads this device's own updates), so devices could "
                "disagree about the step. Give it a skip function whose answer every device "
                "shares, or guard the inner transformation with gradcomm.apply_if_finite."
            )


def _layout(
    tx: optax.GradientTransformation,
    params: Any,
    mesh: Mesh,
    names: tuple[str, ...],
    params_per_device: bool,
) -> list[bool]:
    """Which state leaves must live per device: the fixed point of tracing one update.

    Start with every leaf replicated; trace `tx.update` on per-device gradients; every state
    leaf that comes out varying over the data axes must be per device. Repeat until no
    leaf changes (leaves only ever move to per device, so this ends). The tracing joins
    conditional branches (`_joined_branches`), and the result is checked for optax
    wrappers that would decide per device (`_check_decisions`).
    """
    param_spec = device_spec(mesh, names) if params_per_device else P()
    tx = optax.with_extra_args_support(tx)
    shapes = jax.eval_shape(tx.init, _local_shapes(params, params_per_device))
    flags = [False] * len(jax.tree.leaves(shapes))
    while True:
        found: list[bool] = []

        def probe(params: Any, flags: list[bool] = flags, found: list[bool] = found) -> jax.Array:
            params = _local_params(params, params_per_device)
            leaves, treedef = jax.tree.flatten(tx.init(params))
            leaves = [_base.vary(x, names) if f else x for x, f in zip(leaves, flags, strict=True)]
            grads = jax.tree.map(lambda x: _base.vary(jnp.zeros_like(x), names), params)
            _, new_state = tx.update(
                grads, jax.tree.unflatten(treedef, leaves), params, **{_base.DEFER_AVERAGING: True}
            )
            found.extend(
                bool(_base.varying_axes(x) & set(names)) for x in jax.tree.leaves(new_state)
            )
            return jnp.zeros(())

        probe_map = jax.shard_map(probe, mesh=mesh, in_specs=(param_spec,), out_specs=P())
        with _base.shapes_only(), _joined_branches():
            jax.eval_shape(probe_map, params)
        new = [f or g for f, g in zip(flags, found, strict=True)]
        if new == flags:
            _check_decisions(shapes, flags)
            return flags
        flags = new


class TrainState(NamedTuple):
    """What `init_state` returns with a `sync`: the transformation's state and the sync's.

    The sync's state is replicated (the same on every device, by `ParamsSync`'s contract).
    """

    tx: Any
    sync: Any


def _check_sync(sync: ParamsSync | None, params_per_device: bool) -> None:
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


def _sync_state(sync: ParamsSync, params: Any, mesh: Mesh, params_per_device: bool) -> Any:
    """The sync's state from one device's params, replicated on the mesh."""
    local = host_copy(params, per_device=params_per_device)
    return _place(jax.jit(sync.init)(local), NamedSharding(mesh, P()))


def init_state(
    tx: optax.GradientTransformation,
    params: Any,
    mesh: Mesh,
    *,
    axes: _base.AxisName | None = None,
    params_per_device: bool = False,
    sync: ParamsSync | None = None,
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

    Returns:
      The state: per-device leaves of shape `(num_shards, *leaf_shape)` sharded over
      `axes`, the others replicated. With `sync`, a `TrainState` of that state and the
      sync's (replicated).
    """
    _check_sync(sync, params_per_device)
    names = _axes(mesh, axes)
    spec = device_spec(mesh, names)
    param_spec = spec if params_per_device else P()
    if params_per_device:
        hint = "place one copy per device with `parallel.per_device(params, mesh)`"
        _check_copies(params, num_shards(mesh, names), "param", hint)
    params = _place(params, NamedSharding(mesh, param_spec))
    flags = _layout(tx, params, mesh, names, params_per_device)

    def body(params: Any) -> Any:
        return _stack(tx.init(_local_params(params, params_per_device)), flags)

    shapes = jax.eval_shape(tx.init, _local_shapes(params, params_per_device))
    out_specs = _state_specs(shapes, flags, spec)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=param_spec, out_specs=out_specs)
    state = jax.jit(mapped)(params)
    if sync is None:
        return state
    return TrainState(state, _sync_state(sync, params, mesh, params_per_device))


class TrainStep:
    """The jitted data-parallel step built by `train_step`.

    Call it as `params, state, metrics = step(params, state, batch)` with a state from
    `init_state` (or restored from a checkpoint with its shardings); host inputs are placed
    on the mesh first. A replicated state leaf restores onto a mesh of any size; a
    per-device one (and per-device params) only onto as many data-parallel devices as
    made it: other counts raise a `ValueError` that says what to do.
    `step.lower(params, state, batch)` lowers it, which is what
    `gradcomm.wire.measure(step, params, state, batch)` uses.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        tx: optax.GradientTransformation,
        mesh: Mesh,
        names: tuple[str, ...],
        params_per_device: bool,
        has_aux: bool,
        donate: bool,
        sync: ParamsSync | None = None,
    ) -> None:
        _check_sync(sync, params_per_device)
        self._sync = sync
        self._tx, self._mesh, self._names = optax.with_extra_args_support(tx), mesh, names
        self._params_per_device, self._has_aux, self._donate = params_per_device, has_aux, donate
        self._grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
        self._spec = device_spec(mesh, names)
        self._param_spec = self._spec if params_per_device else P()
        self._num_shards = num_shards(mesh, names)
        self._compiled: dict[Any, Any] = {}

    def _body(self, flags: list[bool]) -> Callable[..., Any]:
        names, tx = self._names, self._tx

        def body(params: Any, state: Any, batch: Any) -> tuple[Any, Any, dict[str, jax.Array]]:
            params = _local_params(params, self._params_per_device)
            # Differentiating replicated (invariant) params would make JAX sum the gradient
            # over the devices; the transformation must see each device's own gradient.
            out, grads = self._grad_fn(jax.tree.map(lambda x: _base.vary(x, names), params), batch)
            loss, aux = out if self._has_aux else (out, {})
            state = _unstack(state, flags)
            tx_state = state.tx if self._sync else state
            with _base.averaging_periods() as periods:
                updates, tx_state = tx.update(
                    grads, tx_state, params, **{_base.DEFER_AVERAGING: True}
                )
            params = optax.apply_updates(params, updates)
            if self._params_per_device:
                due = _averaging_due(tx_state)
                if due is not None:  # the exact mean, the same bits on every device
                    average = functools.partial(_mean, names=names)
                    if len(set(periods)) == 1:  # a known schedule: named for gradcomm.wire
                        average = wire.branch("average params", every=periods[0])(average)
                    params = lax.cond(due, average, lambda p: p, params)
                if self._sync:
                    params, sync_state = self._sync.update(params, state.sync)
                    tx_state = TrainState(tx_state, sync_state)
                params = jax.tree.map(lambda x: x[None], params)
            else:
                for path, leaf in jax.tree_util.tree_leaves_with_path(params):
                    varying = _base.varying_axes(leaf) & set(names)
                    if varying:
                        raise ValueError(
                            f"params are replicated, but after this transformation param "
                            f"{jax.tree_util.keystr(path)} differs across axes "
                            f"{sorted(varying)}; end the chain with a synchronising method "
                            f"(gradcomm.allreduce, gradcomm.adasum) or pass "
                            f"params_per_device=True"
                        )
            metrics = lax.pmean({"loss": loss, **aux}, names)
            return params, _stack(tx_state, flags), metrics

        return body

    def _jitted(self, params: Any, state: Any) -> Any:
        if isinstance(state, TrainState) != bool(self._sync):
            raise ValueError(
                "a step built with sync takes the TrainState of init_state(..., sync=sync)"
                if self._sync
                else "this state holds a sync's state (a TrainState): build the step with "
                "the same sync, train_step(..., sync=sync)"
            )
        shapes = tuple(np.shape(x) for x in jax.tree.leaves(state))
        if self._num_shards == 1:
            # One device: with Auto axes, JAX drops the size-1 device axis from a state
            # leaf's sharding, which then cannot say which leaves are per device; the
            # transformation's layout says, once per state structure (it traces an update).
            key = (jax.tree.structure(state), shapes)
            if key in self._compiled:
                return self._compiled[key]
            flags = _layout(self._tx, params, self._mesh, self._names, self._params_per_device)
            if self._sync:  # the sync's state is replicated
                flags += [False] * len(jax.tree.leaves(state.sync))
        else:
            flags = _per_device_leaves(state, self._spec)
            key = (jax.tree.structure(state), tuple(flags), shapes)
        if key not in self._compiled:
            local = jax.eval_shape(self._tx.init, _local_shapes(params, self._params_per_device))
            if self._sync:
                local = TrainState(local, state.sync)
            _check_state_layout(state, flags, local, self._num_shards, self._names)
            state_specs = _state_specs(state, flags, self._spec)
            mapped = jax.shard_map(
                self._body(flags),
                mesh=self._mesh,
                in_specs=(self._param_spec, state_specs, self._spec),
                out_specs=(self._param_spec, state_specs, P()),
            )
            self._compiled[key] = jax.jit(mapped, donate_argnums=(0, 1) if self._donate else ())
        return self._compiled[key]

    def _place(self, params: Any, state: Any, batch: Any) -> tuple[Any, Any, Any]:
        mesh = self._mesh
        if self._params_per_device:
            hint = (
                "per-device params carry one copy per device (`parallel.per_device(params, "
                "mesh)`); to move them to another number of devices, pick one copy "
                "(`parallel.host_copy(params, per_device=True)`) and place it again"
            )
            _check_copies(params, self._num_shards, "param", hint)
        return (
            _place(params, NamedSharding(mesh, self._param_spec)),
            state,
            shard_batch(batch, mesh, self._names),
        )

    def __call__(self, params: Any, state: Any, batch: Any) -> tuple[Any, Any, dict]:
        return self._jitted(params, state)(*self._place(params, state, batch))

    def lower(self, params: Any, state: Any, batch: Any) -> Any:
        return self._jitted(params, state).lower(*self._place(params, state, batch))


def train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axes: _base.AxisName | None = None,
    params_per_device: bool = False,
    has_aux: bool = False,
    donate: bool = False,
    sync: ParamsSync | None = None,
) -> TrainStep:
    """Builds the jitted data-parallel step `(params, state, batch) -> (params, state, metrics)`.

    On each device: the loss and gradient of `loss_fn(params, local_batch)`, then
    `tx.update(grads, state, params)` (the transformation's collectives run here), then
    `optax.apply_updates`. Metrics are averaged over devices.

    Periodic parameter averaging (`gradcomm.local_sgd`, `gradient_dropping(average_every=
    k)`) happens here: the step passes `defer_params_averaging=True` to the
    transformation, which then returns its plain update and marks the step in its state,
    and the step sets the per-device params to their exact mean (the same bits on every
    device, which no additive update could guarantee). `sync` says the same out loud: a
    `gradcomm.ParamsSync` (`gradcomm.periodic_average(axes, every=k)`) that runs on the
    params after each step, as a hand-written loop would run it.

    Args:
      loss_fn: `loss_fn(params, batch) -> loss`, or `(loss, metrics_dict)` with `has_aux`.
      tx: the transformation, usually a chain holding a gradcomm method.
      mesh: the mesh; the step shards batches over `axes`.
      axes: the data-parallel axes (default: all mesh axes).
      params_per_device: keep one copy of params per device (leading device axis), for
        methods after which devices hold different params (gossip, local SGD). Otherwise
        params are replicated, and a transformation that leaves them different across
        devices is an error at trace time.
      has_aux: whether `loss_fn` returns `(loss, metrics)`.
      donate: donate params and state buffers to the step.
      sync: a `gradcomm.ParamsSync` applied to the params after each step (needs
        `params_per_device`); the state is then the `TrainState` that
        `init_state(..., sync=sync)` returns.

    Returns:
      A `TrainStep`: `step(params, state, batch)` returns the new params, the new state and
      a dict of metrics (`"loss"` and any auxiliary ones).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, gradcomm
      >>> from gradcomm import parallel
      >>> mesh = parallel.make_mesh(devices=jax.devices()[:2])
      >>> tx = optax.chain(gradcomm.allreduce(), optax.sgd(0.1))
      >>> params = parallel.replicate({"w": np.zeros(2, np.float32)}, mesh)
      >>> state = parallel.init_state(tx, params, mesh)
      >>> loss_fn = lambda p, batch: jnp.mean((batch @ p["w"] - 1.0) ** 2)
      >>> step = parallel.train_step(loss_fn, tx, mesh)
      >>> params, state, metrics = step(params, state, np.ones((4, 2), np.float32))
      >>> parallel.host_copy(params)["w"], float(metrics["loss"])
      (array([0.2, 0.2], dtype=float32), 1.0)
    """
    names = _axes(mesh, axes)
    return TrainStep(loss_fn, tx, mesh, names, params_per_device, has_aux, donate, sync)
