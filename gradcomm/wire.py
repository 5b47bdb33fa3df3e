"""Bytes on the wire, read from the compiled program.

`measure(fn, *args)` compiles `fn` for `args` and walks the optimized HLO: every collective
it finds is costed by a bandwidth-optimal model of what one device sends per call,

    all-reduce of S bytes           2 (n-1)/n S
    all-gather with output S        (n-1)/n S
    reduce-scatter with input S     (n-1)/n S
    all-to-all of S                 (n-1)/n S
    collective-permute of S         S
    collective-broadcast of S       S

with n the size of its replica group. A conditional costs its most expensive branch (a
time-varying peer is a `lax.switch` of which one `ppermute` runs), a while loop its body
times its known trip count, and a call or fusion what it calls. Asynchronous pairs
(`*-start` / `*-done`) count once.

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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable
from typing import Any

import jax

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
class WireReport:
    """Bytes sent per device by a compiled function, with a per-collective breakdown.

    Attributes:
      collectives: every collective counted, in program order.
      exact: False if a while loop with an unknown trip count was counted once.
      devices: the devices the program runs on (its partitions or replicas); on one,
        nothing crosses a wire, and `table` says so.
    """

    collectives: tuple[Collective, ...]
    exact: bool = True
    devices: int = 0

    @property
    def total(self) -> float:
        """Modelled bytes one device sends per call."""
        return sum(c.sent for c in self.collectives)

    def by_kind(self) -> dict[str, float]:
        """Bytes sent per device, per collective kind."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.sent
        return out

    def table(self) -> str:
        """A Markdown table of the collectives, with a total row."""
        rows = ["| collective | payload (B) | group | count | sent per device (B) |"]
        rows.append("| --- | ---: | ---: | ---: | ---: |")
        for c in self.collectives:
            rows.append(
                f"| {c.kind} | {c.payload:,.0f} | {c.group_size} | {c.count} | {c.sent:,.0f} |"
            )
        rows.append(f"| **total** | | | | **{self.total:,.0f}** |")
        if self.devices == 1:
            rows += ["", "One device: nothing crosses a wire (every collective is local)."]
        return "\n".join(rows)

    def to_json(self) -> str:
        return json.dumps(
            {
                "total": self.total,
                "exact": self.exact,
                "devices": self.devices,
                "by_kind": self.by_kind(),
                "collectives": [dataclasses.asdict(c) for c in self.collectives],
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


def analyze_hlo(text: str) -> WireReport:
    """Costs every collective in an HLO module's text (`compiled.as_text()`)."""
    computations, entry, devices = _parse(text)
    exact = True

    @functools.cache
    def cost(name: str) -> tuple[Collective, ...]:
        nonlocal exact
        shapes = {i["name"]: i["shape"] for i in computations.get(name, [])}
        found: list[Collective] = []
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
                found.append(
                    Collective(kind, inst["name"], name, payload, n, 1, payload * _MODEL[kind](n))
                )
                continue
            if opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", attrs)
                trips = _TRIP_COUNT.search(attrs)
                if trips is None:
                    exact = False
                count = int(trips.group(1)) if trips else 1
                for c in cost(body.group(1)) if body else ():
                    found.append(dataclasses.replace(c, count=c.count * count, sent=c.sent * count))
                continue
            if opcode == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", attrs)
                branches = (
                    [b.strip().lstrip("%") for b in m.group(1).split(",")]
                    if m
                    else re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", attrs)
                )
                costs = [cost(b) for b in branches]
                if costs:
                    found.extend(max(costs, key=lambda cs: sum(c.sent for c in cs)))
                continue
            for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", attrs):
                found.extend(cost(callee))
        return tuple(found)

    collectives = cost(entry)
    return WireReport(collectives, exact, devices)


def measure(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> WireReport:
    """Compiles `fn(*args, **kwargs)` and reports the bytes each device sends per call.

    Args:
      fn: a jitted function, a function with a `.lower` method (such as the step from
        `gradcomm.parallel.train_step`), or a plain function (it is jitted).
      *args: example arguments (arrays or `jax.ShapeDtypeStruct`s).
      **kwargs: example keyword arguments.

    Returns:
      A `WireReport`.
    """
    lower = getattr(fn, "lower", None) or jax.jit(fn).lower
    return analyze_hlo(lower(*args, **kwargs).compile().as_text())
