"""Reading the optimized HLO text of a compiled program (`compiled.as_text()`).

What `gradcomm.wire` needs to know of the program, and nothing of what it costs: its
computations and their instructions, the device count, the bytes of a shape, the size of a
collective's replica group and the devices of each group (or of each source-target pair),
the computations a while loop, a conditional or a call runs, and the `gradcomm.wire.branch`
scopes left in an instruction's `op_name`. The format of those scopes is written
(`scope_name`) and read (`tags`) here, in one place.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import numpy as np

DTYPE_BYTES = {
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

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<opcode>[a-z][a-z0-9\-]*)\((?P<operands>[^)]*)\)(?P<attrs>.*)$"
)
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)?\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=")
# The iota form in full: [groups,size]<=[reshape dims] and an optional T(transpose).
_GROUPS_IOTA_FULL = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}")
_SET = re.compile(r"\{([0-9,]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_WHILE_BODY = re.compile(r"body=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"(?:true|false)_computation=%?([\w.\-]+)")
_CALLEES = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_COMMENT = re.compile(r"/\*.*?\*/")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
# The scope `branch` opens: gradcomm.wire.branch[label], [label|every=k] or [label|first=w].
TAG_PREFIX = "gradcomm.wire.branch"
LABEL_FORBIDDEN = frozenset('[]|/"\\')
_TAG = re.compile(re.escape(TAG_PREFIX) + r"\[([^\[\]|/\"\\]+)(?:\|(every|first)=(\d+))?\]")

# A branch's label and schedule, as a scope names them: (label, every, first).
Tag = tuple[str, int | None, int | None]


class Instruction(NamedTuple):
    """One HLO instruction, its parts as the text spells them."""

    name: str
    shape: str
    opcode: str
    operands: str
    attrs: str


class Module(NamedTuple):
    """An HLO module: its computations (name -> instructions), its entry, its devices."""

    computations: dict[str, list[Instruction]]
    entry: str
    devices: int


def parse(text: str) -> Module:
    """The computations of an HLO module's text, its entry's name and its device count
    (partitions or replicas, from the header)."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
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
            computations[current].append(Instruction(**m.groupdict()))
    if not entry:
        raise ValueError("no ENTRY computation found in the HLO text")
    return Module(computations, entry, device_count(text))


def device_count(text: str) -> int:
    """The devices an HLO module runs on: its partitions or replicas, from the header."""
    header = text.split("\n", 1)[0]
    num = re.search(r"num_partitions=(\d+)", header)
    rep = re.search(r"replica_count=(\d+)", header)
    return max(int(num.group(1)) if num else 1, int(rep.group(1)) if rep else 1)


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string, summed over tuple elements."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            continue
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * DTYPE_BYTES[dtype]
    return total


def operand_names(inst: Instruction) -> list[str]:
    """The names of the instructions whose values `inst` takes."""
    return [
        o.split()[-1].lstrip("%") for o in _COMMENT.sub("", inst.operands).split(",") if o.strip()
    ]


def group_size(attrs: str, num_devices: int) -> int:
    """The size of a collective's replica groups (all the devices where it names none)."""
    if m := _GROUPS_IOTA.search(attrs):
        dims = [int(d) for d in m.group(1).split(",")]
        return dims[-1]
    if m := _GROUPS_LIST.search(attrs):
        if m.group(1):
            first = m.group(1).split("}")[0].strip("{,")
            return len([d for d in first.split(",") if d])
    return num_devices


def device_groups(attrs: str, num_devices: int) -> list[tuple[int, ...]]:
    """The device ids of each of a collective's groups, as the text gives them.

    Its replica groups in list form (`{{0,2},{1,3}}`) or iota form (`[2,2]<=[2,2]T(1,0)`:
    the ids 0..N-1 laid out in the reshape dims, transposed, one group per row); a
    collective-permute's source-target pairs, each pair a group; one group of all the
    devices where it names none (`replica_groups={}` or no attribute).
    """
    if m := _PAIRS.search(attrs):
        return [tuple(int(d) for d in p.split(",") if d) for p in _SET.findall(m.group(1))]
    if m := _GROUPS_IOTA_FULL.search(attrs):
        shape, dims = ([int(d) for d in g.split(",") if d] for g in m.groups()[:2])
        perm = [int(d) for d in m.group(3).split(",")] if m.group(3) else range(len(dims))
        ids = np.arange(math.prod(dims)).reshape(dims).transpose(tuple(perm))
        return [tuple(int(d) for d in row) for row in ids.reshape(shape[0], -1)]
    if (m := _GROUPS_LIST.search(attrs)) and m.group(1):
        return [tuple(int(d) for d in g.split(",") if d) for g in _SET.findall(m.group(1))]
    return [tuple(range(num_devices))]


def while_loop(attrs: str) -> tuple[str | None, int | None]:
    """A while loop's body computation and its known trip count (None where unknown)."""
    body = _WHILE_BODY.search(attrs)
    trips = _TRIP_COUNT.search(attrs)
    return (body.group(1) if body else None), (int(trips.group(1)) if trips else None)


def branch_computations(attrs: str) -> list[str]:
    """A conditional's branch computations, in the order the text lists them."""
    if m := _BRANCHES.search(attrs):
        return [b.strip().lstrip("%") for b in m.group(1).split(",")]
    return _TRUE_FALSE.findall(attrs)


def callees(attrs: str) -> list[str]:
    """The computations an instruction calls (a fusion's, a call's, a reduction's)."""
    return _CALLEES.findall(attrs)


def scope_name(label: str, every: int | None, first: int | None) -> str:
    """The `jax.named_scope` name that `tags` reads back as (label, every, first)."""
    schedule = f"|every={every}" if every else f"|first={first}" if first else ""
    return f"{TAG_PREFIX}[{label}{schedule}]"


def tags(attrs: str) -> list[Tag]:
    """The `branch` scopes in an instruction's op_name, outermost first."""
    m = _OP_NAME.search(attrs)
    found = _TAG.findall(m.group(1)) if m else []
    return [(label, int(n) if kind == "every" else None, int(n) if kind == "first" else None)
            for label, kind, n in found]  # fmt: skip
