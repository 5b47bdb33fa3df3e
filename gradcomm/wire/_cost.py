"""The cost of a compiled program's collectives, and the weighting of its conditionals'
branches by their `gradcomm.wire.branch` schedules: what `gradcomm.wire.analyze_hlo` does
with the program `_hlo` reads.

Each computation costs a `_Cost`: the collectives it runs in the worst case (every
conditional's largest branch), and for `steady` and `average` the collectives with how
often each runs per step, as exact fractions. A while loop multiplies its body's cost by
its trip count; a conditional weighs its branches by their schedules (`_schedule`).

Given the program's `Layout` (its devices' coordinates on a mesh), each collective names
the mesh axes its groups span.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import NamedTuple

from gradcomm.wire import _hlo
from gradcomm.wire._report import Branch, Collective, Conditional, WireReport

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

# A collective and how often it runs per step (its `sent` has its loops' trip counts).
_Weighted = tuple[tuple[Collective, Fraction], ...]


class Layout(NamedTuple):
    """Where a program's devices sit on a mesh.

    Attributes:
      axes: the mesh's (axis name, size) pairs, in mesh order.
      coords: each device's mesh coordinates, indexed by its id in the program's replica
        groups (its position in the program's device assignment).
    """

    axes: tuple[tuple[str, int], ...]
    coords: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, shape: Mapping[str, int], positions: Sequence[int] | None = None) -> Layout:
        """The layout of a mesh of `shape` (axis name -> size, in mesh order) whose device
        with id i is the mesh's `positions[i]`-th in row-major order (default: the i-th)."""
        axes = tuple((str(name), int(size)) for name, size in shape.items())
        grid = list(itertools.product(*(range(size) for _, size in axes)))
        order = range(len(grid)) if positions is None else positions
        return cls(axes, tuple(grid[p] for p in order))

    def spanned(self, groups: Iterable[Sequence[int]]) -> tuple[str, ...] | None:
        """The axes, in mesh order, along which some group's members' coordinates differ
        (None if a group names a device the layout does not hold)."""
        differ: set[int] = set()
        for group in groups:
            if any(not 0 <= d < len(self.coords) for d in group):
                return None
            points = [self.coords[d] for d in group]
            differ.update(i for i in range(len(self.axes)) if len({p[i] for p in points}) > 1)
        return tuple(name for i, (name, _) in enumerate(self.axes) if i in differ)


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


def _schedule(
    branches: list[_Cost], tags: list[_hlo.Tag | None]
) -> tuple[_Weighted, _Weighted, int]:
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


def _collective(
    inst: _hlo.Instruction,
    kind: str,
    holder: str,
    shapes: dict[str, str],
    devices: int,
    layout: Layout | None,
) -> _Cost:
    """The cost of one collective instruction of computation `holder`, and the mesh axes
    it spans where the `layout` is known."""
    payload = sum(_hlo.shape_bytes(shapes.get(o, "")) for o in _hlo.operand_names(inst))
    n = _hlo.group_size(inst.attrs, devices)
    if kind == "all-gather":
        payload *= n
    if kind == "collective-permute" and "source_target_pairs={}" in inst.attrs:
        payload = 0.0
    axes = layout.spanned(_hlo.device_groups(inst.attrs, devices)) if layout else None
    c = Collective(kind, inst.name, holder, payload, n, 1, payload * _MODEL[kind](n), axes)
    return _Cost((c,), ((c, Fraction(1)),), ((c, Fraction(1)),), 1, ())


def analyze(text: str, layout: Layout | None = None) -> WireReport:
    """The `WireReport` of an HLO module's text (see `gradcomm.wire.analyze_hlo`), its
    collectives' axes read off `layout` (which must hold as many devices as the module)."""
    module = _hlo.parse(text)
    if layout is not None and len(layout.coords) != module.devices:
        raise ValueError(f"the mesh has {len(layout.coords)} devices, the program {module.devices}")
    computations = module.computations
    exact = True

    def branch_tag(name: str, depth: int) -> _hlo.Tag | None:
        """The schedule a branch computation names: the `branch` scope just inside the
        conditional's own (`depth` of them), the most common over its instructions."""
        votes = collections.Counter(
            tags[depth]
            for inst in computations.get(name, [])
            if len(tags := _hlo.tags(inst.attrs)) > depth
        )
        return votes.most_common(1)[0][0] if votes else None

    @functools.cache
    def cost(name: str) -> _Cost:
        nonlocal exact
        shapes = {i.name: i.shape for i in computations.get(name, [])}
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
            kind = inst.opcode.removesuffix("-start")
            if kind in _MODEL and not inst.opcode.endswith("-done"):
                add(_collective(inst, kind, name, shapes, module.devices, layout))
            elif inst.opcode == "while":
                body, trips = _hlo.while_loop(inst.attrs)
                if trips is None:
                    exact = False
                if body:
                    add(cost(body), 1 if trips is None else trips)
            elif inst.opcode == "conditional":
                if names := _hlo.branch_computations(inst.attrs):
                    add(conditional(inst.name, name, names, len(_hlo.tags(inst.attrs))))
            else:
                for callee in _hlo.callees(inst.attrs):
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

    top = cost(module.entry)
    return WireReport(
        top.collectives,
        exact,
        module.devices,
        steady=_figure(top.steady),
        average=_figure(top.average),
        period=top.period,
        conditionals=top.conditionals,
        mesh=None if layout is None else layout.axes,
    )
