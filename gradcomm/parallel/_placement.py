"""Meshes and placement: data-parallel axes, replicated and per-device trees, batches.

Re-exported by `gradcomm.parallel`, whose docstring has the whole picture.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomm import _axes


def make_mesh(
    axes: Mapping[str, int] | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_types: AxisType = AxisType.Explicit,
) -> Mesh:
    """A mesh over `devices` (default: all devices) with named data-parallel axes.

    Args:
      axes: axis name to size, in mesh order; default `{"data": len(devices)}`. A 2-D
        mesh for hierarchical methods is `{"node": 4, "local": 2}`. Pairwise exchanges
        need no special axes (`pairwise_axes` factors one anyway). On CPU and GPU the
        devices' row-major order does not depend on how the axes are factored.
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
        _axes.check_axis_name(name, "axes")
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
    D-PSGD's i <-> i ^ 2^r moves) run each swap as a two-member collective whose replica
    groups are the pairs, over one axis or over these (given all of them as `axis_name`):
    the same program, so these axes are not needed for speed. The device
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
    _axes.check_axis_name(name, "name")
    n = jax.device_count() if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"pairwise_axes needs a power-of-two number of devices, got {n!r}")
    if n == 1:
        return {f"{name}0": 1}
    return {f"{name}{j}": 2 for j in range(n.bit_length() - 1)}


def data_axes(mesh: Mesh, axes: _axes.AxisName | None) -> tuple[str, ...]:
    names = mesh.axis_names if axes is None else _axes.axis_names(axes)
    unknown = [a for a in names if a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"axes {unknown} are not in the mesh, whose axes are {mesh.axis_names}")
    return tuple(names)


def device_spec(mesh: Mesh, axes: _axes.AxisName | None = None) -> P:
    """The spec of a leading axis split over the data axes (all mesh axes by default)."""
    names = data_axes(mesh, axes)
    return P(names if len(names) > 1 else names[0])


def num_shards(mesh: Mesh, axes: _axes.AxisName | None = None) -> int:
    """The number of data-parallel devices: the product of the data axes' sizes."""
    return math.prod(mesh.shape[a] for a in data_axes(mesh, axes))


def _spec_names(spec: P) -> set[str]:
    return {n for e in spec if e is not None for n in (e if isinstance(e, tuple) else (e,))}


def is_fsdp(spec: P, names: tuple[str, ...]) -> bool:
    """Whether a param's spec splits its leading dimension over the data axes (FSDP)."""
    if not len(spec) or spec[0] is None:
        return False
    return tuple(_axes.axis_names(spec[0])) == tuple(names)


def _fsdp_per_device(name: str, spec: P) -> ValueError:
    return ValueError(
        f"param {name} is split over the data axes (FSDP, spec {spec}), but params are per "
        f"device: methods that keep one copy of the params per device (sgp, dpsgd, local "
        f"SGD, DiLoCo, gradient dropping's local gradients) let the copies differ, and "
        f"FSDP's one split copy cannot hold them. Keep params whole over the data axes with "
        f"these methods, or use FSDP with replicated params (params_per_device=False)"
    )


def model_specs(params: Any, mesh: Mesh, names: tuple[str, ...], params_per_device: bool) -> Any:
    """Per param leaf, how it is split over the mesh (beside per-device copies).

    Read from the leaves' `NamedSharding`s (without the leading device axis of per-device
    params): `P('model', None)` for a kernel split by rows over a `'model'` axis (tensor
    parallelism); `P('data', ...)`, the leading dimension split over every data axis, for
    FSDP (ZeRO-3). Host arrays, and replicated leaves, give `P()`.

    Raises:
      ValueError: for a leaf split over the data axes any other way, split over data
        axes while params are per device, or over axes the mesh does not have.
    """
    lead = names if len(names) > 1 else names[0]

    def spec_of(path: Any, x: Any) -> P:
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            return P()
        entries = list(sharding.spec)[1 if params_per_device else 0 :]
        while entries and entries[-1] is None:
            entries.pop()
        spec, name = P(*entries), jax.tree_util.keystr(path) or "<root>"
        data = (
            _spec_names(P(*entries[1:])) & set(names)
            if is_fsdp(spec, names)
            else (_spec_names(spec) & set(names))
        )
        if params_per_device and is_fsdp(spec, names):
            raise _fsdp_per_device(name, spec)
        if data:
            raise ValueError(
                f"param {name} is split over the data axes {sorted(_spec_names(spec) & set(names))}"
                f" (spec {spec}): train_step splits a param over the data axes {names} only "
                f"along its leading dimension, P({lead!r}, ...) (FSDP), and over other mesh "
                f"axes anyhow (tensor parallelism)"
            )
        unknown = _spec_names(spec) - set(mesh.axis_names)
        if unknown:
            raise ValueError(f"param {name} is split over {sorted(unknown)}, not axes of {mesh}")
        return spec

    return jax.tree_util.tree_map_with_path(spec_of, params)


def with_device_axis(specs: Any, lead: P | None) -> Any:
    """`specs` (a pytree of `PartitionSpec`s) with a leading device axis `lead` prepended."""
    if lead is None:
        return specs
    return jax.tree.map(lambda s: P(*lead, *s), specs, is_leaf=lambda x: isinstance(x, P))


def shard_params(
    tree: Any,
    mesh: Mesh,
    specs: Any,
    *,
    per_device: bool = False,
    axes: _axes.AxisName | None = None,
) -> Any:
    """Places params split over the mesh as `specs` say: tensor parallelism, or FSDP.

    Args:
      tree: a pytree of arrays: the whole params, one copy.
      mesh: the mesh.
      specs: a pytree of `PartitionSpec`s like `tree`: `P(None, "model")` for a kernel
        split by columns over a model axis (tensor parallelism), `P("data")` for one
        whose leading dimension is split over the data axes (FSDP), `P()` to keep a leaf
        whole.
      per_device: place one copy per data-parallel device, along a leading device axis
        (as `per_device` does), for methods that keep params per device; `specs` may then
        split them over model axes only.
      axes: with `per_device`, the data-parallel axes (default: the mesh axes that `specs`
        does not name, in mesh order).

    Returns:
      The params on the mesh, each leaf split as its spec says.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import PartitionSpec as P
      >>> from gradcomm import parallel
      >>> mesh = parallel.make_mesh({"data": 2, "model": 2}, devices=jax.devices()[:4])
      >>> params = {"w": np.ones((4, 6), np.float32), "b": np.ones(6, np.float32)}
      >>> placed = parallel.shard_params(params, mesh, {"w": P(None, "model"), "b": P()})
      >>> placed["w"].sharding.spec, placed["w"].addressable_shards[0].data.shape
      (P(None, 'model'), (4, 3))
    """
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    lead = None
    if per_device:
        named = set().union(*(_spec_names(s) for s in jax.tree.leaves(specs, is_leaf=is_spec)))
        others = tuple(a for a in mesh.axis_names if a not in named)
        data = data_axes(mesh, axes) if axes else others
        for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec):
            if not data or _spec_names(spec) & set(data):
                raise _fsdp_per_device(jax.tree_util.keystr(path) or "<root>", spec)
        lead = device_spec(mesh, data)
        n = num_shards(mesh, data)
        copies = lambda x: np.broadcast_to(np.asarray(x)[None], (n, *np.shape(x)))  # noqa: E731
        tree = jax.tree.map(copies, tree)
    specs = with_device_axis(specs, lead)
    return jax.tree.map(lambda x, s: place(x, NamedSharding(mesh, s)), tree, specs)


def place(tree: Any, sharding: NamedSharding) -> Any:
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
    return place(tree, NamedSharding(mesh, P()))


def per_device(tree: Any, mesh: Mesh, axes: _axes.AxisName | None = None) -> Any:
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
    return place(stacked, NamedSharding(mesh, device_spec(mesh, axes)))


def shard_batch(batch: Any, mesh: Mesh, axes: _axes.AxisName | None = None) -> Any:
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
    return place_batch(batch, NamedSharding(mesh, device_spec(mesh, axes)), num_shards(mesh, axes))


def place_batch(batch: Any, sharding: NamedSharding, n: int) -> Any:
    """`shard_batch` with its sharding and device count `n` already known."""
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        if not np.ndim(x) or np.shape(x)[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
                f"{np.shape(x)}: its leading axis must be divisible by the {n} devices"
            )
    return place(batch, sharding)


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
        # Whole where this process holds all of it (a leaf split over a model axis too);
        # in several processes, its first local piece.
        local = np.asarray(x if x.is_fully_addressable else x.addressable_data(0))
        return local[0] if per_device else local

    return jax.tree.map(fetch, tree)


def check_copies(tree: Any, n: int, what: str, hint: str) -> None:
    """Raises unless every leaf of a per-device tree holds exactly `n` copies."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        shape = np.shape(x)
        if not shape or shape[0] != n:
            raise ValueError(
                f"{what} {jax.tree_util.keystr(path) or '<root>'} has shape {shape}, but "
                f"per-device values need a leading axis of one copy per data-parallel "
                f"device, {n} on this mesh; {hint}"
            )
