"""Bytes on the wire, read from the compiled program.

`measure(fn, *args)` compiles `fn` for `args` and walks the optimized HLO: every collective
it finds is costed by a bandwidth-optimal model of what one device sends per call,

    all-reduce of S bytes           2 (n-1)/n S
    all-gather with output S        (n-1)/n S
    reduce-scatter with input S     (n-1)/n S
    all-to-all of S                 (n-1)/n S
    collective-permute of S         S
    collective-broadcast of S       S

with n the size of its replica group. A while loop costs its body times its known trip
count, a call or fusion what it calls, and asynchronous pairs (`*-start` / `*-done`)
count once.

A conditional runs one of its branches per call. Which one, step after step, the HLO does
not say, so a branch function may name itself and its schedule with `branch(label,
every=k)` (it runs on one step in k: a switch over P phases gives each phase every=P),
`branch(label, first=w)` (it runs during the first w steps only: a warm-up) or
`branch(label)` (it runs on the other steps). `branch` is a `jax.named_scope`; its name
reaches the `op_name` of the compiled instructions, where `analyze_hlo` reads it. The
report then gives three figures per call, each counting the collectives outside
conditionals in full:

- `total`: the worst case, every conditional's largest branch;
- `steady`: a typical step after the warm-ups: a conditional's default branch where it has
  one, else the mean of its periodic branches weighted by how often they run;
- `average`: the mean over `period` steps after the warm-ups (`period` the least common
  multiple of the every's), each periodic branch weighted by 1/k.

On a mesh, each collective also names the mesh axes its replica groups span (those along
which its members' coordinates differ: a psum over "data" of a ("data", "model") mesh
spans ("data",)), and `WireReport.by_axes` sums the bytes per set of axes. `measure`
learns the mesh from the compiled program's shardings or its arguments'; `analyze_hlo`
takes it as an argument.

A conditional whose branches name nothing (a user's `lax.cond`) costs its largest branch
in all three, so it is never under-counted; in one that is named, a branch that names
nothing runs on the other steps. Nested conditionals compose, and a conditional in a
while loop counts as often as the loop runs. gradcomm's own schedules are named:
gradient dropping's warm-up, SGP's all-reduce steps and gossip phases, and the periodic
parameter average of the `gradcomm.periodic_average` and `gradcomm.local_sgd` syncs (run
on the params by `parallel.train_step(..., sync=...)`): one all-reduce every k steps.

Example:
  >>> import jax, jax.numpy as jnp, gradcomm
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = gradcomm.parallel.make_mesh()
  >>> psum = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
  ...                      in_specs=P(), out_specs=P())
  >>> report = gradcomm.wire.measure(psum, jnp.zeros(1024, jnp.float32))
  >>> n = mesh.size
  >>> report.total == 2 * (n - 1) / n * 4096
  True

  A dense all-reduce during the first 10 steps, then a quarter of the vector:

  >>> def dense(x):
  ...     with gradcomm.wire.branch("dense", first=10):
  ...         return jax.lax.psum(x, "data")
  >>> def sparse(x):
  ...     with gradcomm.wire.branch("sparse"):
  ...         return x.at[:256].set(jax.lax.psum(x[:256], "data"))
  >>> def step(x, count):
  ...     return jax.lax.cond(count < 10, dense, sparse, x)
  >>> mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), P()), out_specs=P())
  >>> report = gradcomm.wire.measure(mapped, jnp.zeros(1024, jnp.float32), 0)
  >>> report.total == 2 * (n - 1) / n * 4096, report.steady == report.total / 4
  (True, True)
  >>> sorted(b.label for c in report.conditionals for b in c.branches)
  ['dense', 'sparse']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

# The program is read by _hlo, costed and its branches weighted by _wire_cost; the report
# classes are _wire_report's.
from gradcomm import _checks
from gradcomm.wire import _cost, _hlo
from gradcomm.wire._report import Branch, Collective, Conditional, WireReport

__all__ = [
    "Branch",
    "Collective",
    "Conditional",
    "Scope",
    "WireReport",
    "analyze_hlo",
    "branch",
    "measure",
]

_F = TypeVar("_F", bound=Callable[..., Any])

# A mesh as `analyze_hlo` takes it: a jax mesh, or its axis names and sizes in mesh order.
MeshLike = Mesh | AbstractMesh | Mapping[str, int]


class Scope(Protocol):
    """What `branch` returns (a `jax.named_scope`): a context manager, or a decorator that
    opens it around every call of the function it wraps."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc_info: object) -> Any: ...

    def __call__(self, fn: _F) -> _F: ...


def branch(label: str, *, every: int | None = None, first: int | None = None) -> Scope:
    """Names a conditional's branch, and when it runs, for `measure` and `analyze_hlo`.

    Open it around the whole body of each branch function of a `lax.cond` or `lax.switch`
    whose choice follows the step count (`with wire.branch(...):` inside the function,
    or `wire.branch(...)(fn)` as a decorator), and only there: the name is read off the
    operations traced within it. The report then names the branches and charges `steady`
    and `average` by their schedule (see the module docstring). It is a
    `jax.named_scope`, so the program and its numerics stay the same.

    Args:
      label: the branch's name in reports: non-empty printable text without
        `/ [ ] | " \\`.
      every: the branch runs on one step in `every` (a switch over P phases gives each
        phase `every=P`).
      first: the branch runs during the first `first` steps only (a warm-up).
        With neither, the branch runs on the steps the others leave.

    Returns:
      The named scope, a context manager that also works as a decorator.

    Raises:
      ValueError: for a bad label, a schedule that is not a positive int, or both.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> def averaged(x):
      ...     with gradcomm.wire.branch("average", every=20):
      ...         return jax.lax.pmean(x, "data")
      >>> step = lambda x, count: jax.lax.cond(count % 20 == 19, averaged, lambda x: x, x)
      >>> jax.vmap(step, axis_name="data", in_axes=(0, None))(jnp.arange(4.0), 19)
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
    """
    if (
        not isinstance(label, str)
        or not label.strip()
        or not label.isprintable()
        or _hlo.LABEL_FORBIDDEN & set(label)
    ):
        raise ValueError(
            f'branch label must be non-empty printable text without / [ ] | " \\, got {label!r}'
        )
    for name, value in (("every", every), ("first", first)):
        _checks.check_int(value, f"branch {name}", minimum=1, optional=True)
    if every is not None and first is not None:
        raise ValueError("a branch runs either periodically (every) or in a warm-up (first)")
    return jax.named_scope(_hlo.scope_name(label, every, first))


def analyze_hlo(text: str, mesh: MeshLike | None = None) -> WireReport:
    """Costs every collective in an HLO module's text (`compiled.as_text()`).

    What `measure` does once it has compiled: use it on a program compiled elsewhere, or
    on a dump of one.

    Args:
      text: the optimized HLO, with its metadata (where `branch` names live).
      mesh: the mesh the program runs on, for each collective's `axes` and `by_axes`: a
        `jax.sharding.Mesh`, an `AbstractMesh` or a dict of axis sizes in mesh order. The
        device ids of the replica groups are taken as row-major positions in it
        (`mesh.devices.flat`), as jit compiles for a mesh. None: the axes are unknown.

    Returns:
      A `WireReport`.

    Raises:
      ValueError: if the text has no ENTRY computation, or `mesh` has not as many devices
        as the program.

    Example:
      >>> from gradcomm import wire
      >>> text = '''HloModule m, num_partitions=4
      ...
      ... %add (a: f32[], b: f32[]) -> f32[] {
      ...   %a = f32[] parameter(0)
      ...   %b = f32[] parameter(1)
      ...   ROOT %s = f32[] add(%a, %b)
      ... }
      ...
      ... ENTRY %main (p: f32[1000]) -> f32[1000] {
      ...   %p = f32[1000]{0} parameter(0)
      ...   ROOT %r = f32[1000]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add
      ... }'''
      >>> report = wire.analyze_hlo(text)  # two pairs of devices each sum 4000 bytes
      >>> [(c.kind, c.group_size, c.sent) for c in report.collectives], report.devices
      ([('all-reduce', 2, 4000.0)], 4)
      >>> wire.analyze_hlo(text, mesh={"data": 2, "model": 2}).by_axes()  # {0,1}: "model"
      {('model',): 4000.0}
    """
    layout = None if mesh is None else _cost.Layout.of(_axis_sizes(mesh))
    return _cost.analyze(text, layout)


def measure(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> WireReport:
    """Compiles `fn(*args, **kwargs)` and reports the bytes each device sends per call.

    The mesh that names each collective's `axes` is the one of the compiled program's
    input and output `NamedSharding`s, else of the arguments' shardings, else the context
    mesh (`jax.sharding.set_mesh`), of those with as many devices as the program: the one
    with the most axes of size > 1 where they differ. Where none is found, the axes are
    unknown (None); `analyze_hlo` on `lower(...).compile().as_text()` takes a mesh.

    Args:
      fn: a jitted function, a function with a `.lower` method (such as the step from
        `gradcomm.parallel.train_step`), or a plain function (it is jitted).
      *args: example arguments (arrays or `jax.ShapeDtypeStruct`s).
      **kwargs: example keyword arguments.

    Returns:
      A `WireReport`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from gradcomm import parallel, wire
      >>> mesh = parallel.make_mesh(devices=jax.devices()[:4])
      >>> psum = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
      ...                      in_specs=P("data"), out_specs=P())
      >>> x = jax.ShapeDtypeStruct((4, 1000), jnp.float32, sharding=NamedSharding(mesh, P("data")))
      >>> report = wire.measure(psum, x)
      >>> report.total  # a ring all-reduce of 4000 bytes: 2 (n - 1) / n of it
      6000.0
      >>> report.by_axes()
      {('data',): 6000.0}
    """
    lower = getattr(fn, "lower", None) or jax.jit(fn).lower
    compiled = lower(*args, **kwargs).compile()
    text = compiled.as_text()
    return _cost.analyze(text, _program_layout(compiled, (args, kwargs), text))


def _axis_sizes(mesh: MeshLike) -> dict[str, int]:
    """A mesh's axis sizes by name, in mesh order."""
    return dict(mesh.shape if isinstance(mesh, Mesh | AbstractMesh) else mesh)


def _program_layout(compiled: Any, args: Any, text: str) -> _cost.Layout | None:
    """The layout of the mesh a compiled program runs on, found as `measure` says (None
    where none fits)."""
    devices = _hlo.device_count(text)
    try:  # the program's device assignment, whose positions the replica groups name
        assignment = [d.id for d in compiled.runtime_executable().local_devices()]
    except Exception:  # a runtime without one: the mesh's row-major order is assumed
        assignment = []
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    shardings += [getattr(x, "sharding", None) for x in jax.tree.leaves(args)]
    meshes = [s.mesh for s in shardings if isinstance(s, NamedSharding)]
    meshes += [jax.sharding.get_mesh(), jax.sharding.get_abstract_mesh()]
    found = []
    for mesh in meshes:
        sizes = _axis_sizes(mesh)
        if not sizes or math.prod(sizes.values()) != devices:
            continue
        positions = None
        if isinstance(mesh, Mesh) and len(assignment) == devices:
            where = {d.id: i for i, d in enumerate(mesh.devices.flat)}
            if not set(assignment) <= where.keys():
                continue  # another mesh's devices
            positions = [where[d] for d in assignment]
        found.append((sum(size > 1 for size in sizes.values()), sizes, positions))
    if not found:
        return None
    _, sizes, positions = max(found, key=lambda f: f[0])  # the first of the finest
    return _cost.Layout.of(sizes, positions)
