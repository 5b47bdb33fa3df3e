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

A conditional whose branches name nothing (a user's `lax.cond`) costs its largest branch
in all three, so it is never under-counted; in one that is named, a branch that names
nothing runs on the other steps. Nested conditionals compose, and a conditional in a
while loop counts as often as the loop runs. gradcomm's own schedules are named:
gradient dropping's warm-up, SGP's all-reduce steps and gossip phases, and the periodic
parameter averaging of `local_sgd`, `gradient_dropping(average_every=k)` and
`gradcomm.parallel.train_step`.

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

import collections
import dataclasses
import functools
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any, NamedTuple, Protocol, TypeVar

import jax

from gradcomm import _checks

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "f8e3m4": 1,
    "bf16": 2,
    "f16": 2,
    "f32": 4,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

# How many times the payload S each kind sends per device, given group size n.
_MODEL: dict[str, Callable[[int], float]] = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
    "collective-broadcast": lambda n: 1.0,
}

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<opcode>[a-z][a-z0-9\-]*)\((?P<operands>[^)]*)\)(?P<attrs>.*)$"
)
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)?\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_COMMENT = re.compile(r"/\*.*?\*/")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
# The scope `branch` opens: gradcomm.wire.branch[label], [label|every=k] or [label|first=w].
_TAG_PREFIX = "gradcomm.wire.branch"
_TAG = re.compile(re.escape(_TAG_PREFIX) + r"\[([^\[\]|/\"\\]+)(?:\|(every|first)=(\d+))?\]")
_LABEL_FORBIDDEN = set('[]|/"\\')


_F = TypeVar("_F", bound=Callable[..., Any])


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
        or _LABEL_FORBIDDEN & set(label)
    ):
        raise ValueError(
            f'branch label must be non-empty printable text without / [ ] | " \\, got {label!r}'
        )
    for name, value in (("every", every), ("first", first)):
        _checks.check_int(value, f"branch {name}", minimum=1, optional=True)
    if every is not None and first is not None:
        raise ValueError("a branch runs either periodically (every) or in a warm-up (first)")
    schedule = f"|every={every}" if every else f"|first={first}" if first else ""
    return jax.named_scope(f"{_TAG_PREFIX}[{label}{schedule}]")


def _shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string, summed over tuple elements."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * _DTYPE_BYTES[dtype]
    return total


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program and its modelled cost.

    Attributes:
      kind: the HLO opcode without an async suffix, e.g. "all-reduce".
      name: the instruction's name in the HLO.
      computation: the HLO computation that holds it.
      payload: S in the model, in bytes (operands; the output for all-gather).
      group_size: n, the size of its replica group.
      count: how many times it runs per call (while-loop trip counts multiplied).
      sent: modelled bytes sent per device per call, count included.
    """

    kind: str
    name: str
    computation: str
    payload: float
    group_size: int
    count: int
    sent: float


@dataclasses.dataclass(frozen=True)
class Branch:
    """One branch of a conditional and what it sends when it runs.

    Attributes:
      label: the `branch` label it names; "otherwise" for an unnamed branch of a named
        conditional; the branch computation's name in an unnamed conditional.
      computation: the HLO computation of the branch.
      every: it runs on one step in `every` (None if not periodic).
      first: it runs during the first `first` steps only (None if not a warm-up).
      sent: modelled bytes one device sends per run of the branch (its own conditionals'
        largest branches, its loops' trip counts included).
    """

    label: str
    computation: str
    every: int | None
    first: int | None
    sent: float


@dataclasses.dataclass(frozen=True)
class Conditional:
    """One conditional of a compiled program, with its branches.

    Attributes:
      name: the conditional instruction's name in the HLO.
      computation: the HLO computation that holds it.
      count: how many times it runs per call (while-loop trip counts multiplied).
      named: whether any branch names itself with `branch`; if not, every figure of the
        report charges its largest branch.
      branches: its branches, in the HLO's order.
    """

    name: str
    computation: str
    count: int
    named: bool
    branches: tuple[Branch, ...]

    def runs(self, b: Branch) -> str:
        """When branch `b` runs, in words."""
        if b.every is not None:
            return f"1 step in {b.every}"
        if b.first is not None:
            return f"first {b.first} steps"
        return "other steps" if self.named else "unnamed: charged in full"


@dataclasses.dataclass(frozen=True)
class WireReport:
    """Bytes sent per device by a compiled function, with a per-collective breakdown.

    Attributes:
      collectives: every collective counted in `total` (the largest branch of each
        conditional), in program order.
      exact: False if a while loop with an unknown trip count was counted once.
      devices: the devices the program runs on (its partitions or replicas); on one,
        nothing crosses a wire, and `table` says so.
      steady: modelled bytes one device sends in a typical step after the warm-ups (see
        the module docstring).
      average: modelled bytes one device sends per step, averaged over `period` steps
        after the warm-ups.
      period: the least common multiple of the named branches' `every` (1 if none).
      conditionals: every conditional with a collective in a branch, outer ones before
        the ones nested in their branches.
    """

    collectives: tuple[Collective, ...]
    exact: bool = True
    devices: int = 0
    _: dataclasses.KW_ONLY
    steady: float
    average: float
    period: int = 1
    conditionals: tuple[Conditional, ...] = ()

    @property
    def total(self) -> float:
        """Modelled bytes one device sends per call in the worst case: every conditional's
        largest branch (what `measure` reported before conditionals were named)."""
        return sum(c.sent for c in self.collectives)

    def by_kind(self) -> dict[str, float]:
        """Bytes sent per device, per collective kind (those counted in `total`)."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.sent
        return out

    def table(self) -> str:
        """A Markdown table of the collectives with a total row; where the program has
        conditionals, the `steady` and `average` rows and a table of their branches."""
        rows = ["| collective | payload (B) | group | count | sent per device (B) |"]
        rows.append("| --- | ---: | ---: | ---: | ---: |")
        for c in self.collectives:
            rows.append(
                f"| {c.kind} | {c.payload:,.0f} | {c.group_size} | {c.count} | {c.sent:,.0f} |"
            )
        rows.append(f"| **total** | | | | **{self.total:,.0f}** |")
        if self.conditionals:
            rows.append(f"| **steady** | | | | **{self.steady:,.0f}** |")
            steps = f"{self.period} steps" if self.period > 1 else "1 step"
            rows.append(f"| **average** over {steps} | | | | **{self.average:,.0f}** |")
            rows += ["", "| conditional | count | branch | runs | sent per run (B) |"]
            rows.append("| --- | ---: | --- | --- | ---: |")
            for cond in self.conditionals:
                for b in cond.branches:
                    rows.append(
                        f"| {cond.name} | {cond.count} | {b.label} | {cond.runs(b)} "
                        f"| {b.sent:,.0f} |"
                    )
        if self.devices == 1:
            rows += ["", "One device: nothing crosses a wire (every collective is local)."]
        return "\n".join(rows)

    def to_json(self) -> str:
        return json.dumps(
            {
                "total": self.total,
                "steady": self.steady,
                "average": self.average,
                "period": self.period,
                "exact": self.exact,
                "devices": self.devices,
                "by_kind": self.by_kind(),
                "collectives": [dataclasses.asdict(c) for c in self.collectives],
                "conditionals": [dataclasses.asdict(c) for c in self.conditionals],
            }
        )


def _group_size(attrs: str, num_devices: int) -> int:
    if m := _GROUPS_IOTA.search(attrs):
        dims = [int(d) for d in m.group(1).split(",")]
        return dims[-1]
    if m := _GROUPS_LIST.search(attrs):
        if m.group(1):
            first = m.group(1).split("}")[0].strip("{,")
            return len([d for d in first.split(",") if d])
    return num_devices


def _parse(text: str) -> tuple[dict[str, list[dict[str, str]]], str, int]:
    """Computations (name -> instructions), the entry's name, and the device count."""
    computations: dict[str, list[dict[str, str]]] = {}
    entry, current = "", None
    header = text.split("\n", 1)[0]
    num = re.search(r"num_partitions=(\d+)", header)
    rep = re.search(r"replica_count=(\d+)", header)
    devices = max(int(num.group(1)) if num else 1, int(rep.group(1)) if rep else 1)
    for line in text.splitlines():
        if current is None:
            if m := _COMPUTATION.match(line):
                current = m.group("name")
                computations[current] = []
                if line.lstrip().startswith("ENTRY"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        if m := _INSTRUCTION.match(line):
            computations[current].append(m.groupdict())
    if not entry:
        raise ValueError("no ENTRY computation found in the HLO text")
    return computations, entry, devices


# A collective and how often it runs per step (its `sent` has its loops' trip counts).
_Weighted = tuple[tuple[Collective, Fraction], ...]
_Tag = tuple[str, int | None, int | None]  # label, every, first


class _Cost(NamedTuple):
    """What a computation sends per run, for each figure of `WireReport`."""

    collectives: tuple[Collective, ...]  # the worst case: largest branches
    steady: _Weighted
    average: _Weighted
    period: int
    conditionals: tuple[Conditional, ...]


def _figure(items: _Weighted) -> float:
    """Bytes per step: collectives that run on every step add up in order, as `total` does;
    those that run on a fraction of the steps are weighted exactly and rounded once."""
    whole = sum(c.sent for c, w in items if w == 1)
    part = sum((Fraction(c.sent) * w for c, w in items if w != 1), Fraction(0))
    return whole + float(part)


def _weigh(items: _Weighted, weight: Fraction) -> _Weighted:
    return tuple((c, w * weight) for c, w in items)


def _concat(parts: Iterable[_Weighted]) -> _Weighted:
    return tuple(itertools.chain.from_iterable(parts))


def _times(c: _Cost, times: int) -> _Cost:
    """What `c` sends when it runs `times` times per run (a while loop's body)."""

    def scaled(x: Collective) -> Collective:
        return dataclasses.replace(x, count=x.count * times, sent=x.sent * times)

    return _Cost(
        tuple(map(scaled, c.collectives)),
        tuple((scaled(x), w) for x, w in c.steady),
        tuple((scaled(x), w) for x, w in c.average),
        c.period,
        tuple(dataclasses.replace(x, count=x.count * times) for x in c.conditionals),
    )


def _tags(attrs: str) -> list[_Tag]:
    """The `branch` scopes in an instruction's op_name, outermost first."""
    m = _OP_NAME.search(attrs)
    found = _TAG.findall(m.group(1)) if m else []
    return [(label, int(n) if kind == "every" else None, int(n) if kind == "first" else None)
            for label, kind, n in found]  # fmt: skip


def _schedule(branches: list[_Cost], tags: list[_Tag | None]) -> tuple[_Weighted, _Weighted, int]:
    """A conditional's `steady` and `average` items and its period, from its branches.

    Warm-ups drop out; the default branches (named without a schedule, or not named) run
    on the steps the periodic ones leave, and where several could, the largest counts. A
    conditional that names no branch, or only warm-ups, charges its largest branch in
    every figure.
    """
    periodic = [(b, t[1]) for b, t in zip(branches, tags, strict=True) if t and t[1]]
    default = [b for b, t in zip(branches, tags, strict=True) if not (t and (t[1] or t[2]))]
    if not any(tags) or not (periodic or default):
        return (
            max((b.steady for b in branches), key=_figure),
            max((b.average for b in branches), key=_figure),
            math.lcm(*(b.period for b in branches)),
        )
    period = math.lcm(*(k * b.period for b, k in periodic), *(b.period for b in default))
    shares = [(b, Fraction(1, k)) for b, k in periodic]
    if default:
        steady = max((b.steady for b in default), key=_figure)
        rest = 1 - sum(f for _, f in shares)
        if rest > 0:
            shares.append((max(default, key=lambda b: _figure(b.average)), rest))
    else:  # the periodic branches take turns
        norm = sum(f for _, f in shares)
        shares = [(b, f / norm) for b, f in shares]
        steady = _concat(_weigh(b.steady, f) for b, f in shares)
    return steady, _concat(_weigh(b.average, f) for b, f in shares), period


def analyze_hlo(text: str) -> WireReport:
    """Costs every collective in an HLO module's text (`compiled.as_text()`).

    Args:
      text: the optimized HLO, with its metadata (where `branch` names live).

    Returns:
      A `WireReport`.
    """
    computations, entry, devices = _parse(text)
    exact = True

    def branch_tag(name: str, depth: int) -> _Tag | None:
        """The schedule a branch computation names: the `branch` scope just inside the
        conditional's own (`depth` of them), the most common over its instructions."""
        votes = collections.Counter(
            tags[depth]
            for inst in computations.get(name, [])
            if len(tags := _tags(inst["attrs"])) > depth
        )
        return votes.most_common(1)[0][0] if votes else None

    @functools.cache
    def cost(name: str) -> _Cost:
        nonlocal exact
        shapes = {i["name"]: i["shape"] for i in computations.get(name, [])}
        found: list[Collective] = []
        steady: list[_Weighted] = []
        average: list[_Weighted] = []
        periods = [1]
        conditionals: list[Conditional] = []

        def add(c: _Cost, times: int = 1) -> None:
            if times != 1:
                c = _times(c, times)
            found.extend(c.collectives)
            steady.append(c.steady)
            average.append(c.average)
            periods.append(c.period)
            conditionals.extend(c.conditionals)

        for inst in computations.get(name, []):
            opcode, attrs = inst["opcode"], inst["attrs"]
            kind = opcode.removesuffix("-start")
            if kind in _MODEL and not opcode.endswith("-done"):
                operands = [
                    o.split()[-1].lstrip("%")
                    for o in _COMMENT.sub("", inst["operands"]).split(",")
                    if o.strip()
                ]
                payload = sum(_shape_bytes(shapes.get(o, "")) for o in operands)
                n = _group_size(attrs, devices)
                if kind == "all-gather":
                    payload *= n
                if kind == "collective-permute" and "source_target_pairs={}" in attrs:
                    payload = 0.0
                c = Collective(kind, inst["name"], name, payload, n, 1, payload * _MODEL[kind](n))
                add(_Cost((c,), ((c, Fraction(1)),), ((c, Fraction(1)),), 1, ()))
                continue
            if opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", attrs)
                trips = _TRIP_COUNT.search(attrs)
                if trips is None:
                    exact = False
                if body:
                    add(cost(body.group(1)), int(trips.group(1)) if trips else 1)
                continue
            if opcode == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", attrs)
                names = (
                    [b.strip().lstrip("%") for b in m.group(1).split(",")]
                    if m
                    else re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", attrs)
                )
                if names:
                    add(conditional(inst["name"], name, names, len(_tags(attrs))))
                continue
            for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", attrs):
                add(cost(callee))
        return _Cost(
            tuple(found), _concat(steady), _concat(average), math.lcm(*periods), tuple(conditionals)
        )

    def conditional(name: str, holder: str, names: list[str], depth: int) -> _Cost:
        branches = [cost(b) for b in names]
        tags = [branch_tag(b, depth) for b in names]
        sent = [sum(c.sent for c in b.collectives) for b in branches]
        largest = max(range(len(names)), key=sent.__getitem__)
        steady, average, period = _schedule(branches, tags)
        named = any(tags)
        record = Conditional(
            name,
            holder,
            1,
            named,
            tuple(
                Branch(
                    t[0] if t else "otherwise" if named else b,
                    b,
                    t[1] if t else None,
                    t[2] if t else None,
                    s,
                )
                for b, t, s in zip(names, tags, sent, strict=True)
            ),
        )
        nested = [c for b in branches for c in b.conditionals]
        shown = any(b.collectives for b in branches) or bool(nested)
        return _Cost(
            branches[largest].collectives,
            steady,
            average,
            period,
            ((record,) if shown else ()) + tuple(nested),
        )

    top = cost(entry)
    return WireReport(
        top.collectives,
        exact,
        devices,
        steady=_figure(top.steady),
        average=_figure(top.average),
        period=top.period,
        conditionals=top.conditionals,
    )


def measure(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> WireReport:
    """Compiles `fn(*args, **kwargs)` and reports the bytes each device sends per call.

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
      >>> wire.measure(psum, x).total  # a ring all-reduce of 4000 bytes: 2 (n - 1) / n of it
      6000.0
    """
    lower = getattr(fn, "lower", None) or jax.jit(fn).lower
    return analyze_hlo(lower(*args, **kwargs).compile().as_text())
