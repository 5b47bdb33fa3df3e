"""What `gradcomm.wire` reports: the collectives, the conditionals and their branches, and
the bytes one device sends per call in the worst case, a steady step and on average.

The classes are re-exported by `gradcomm.wire`, whose docstring says how the figures are
counted.
"""

from __future__ import annotations

import dataclasses
import json


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
      axes: the mesh axes its groups span, in mesh order: those along which the mesh
        coordinates of a group's members (a collective-permute's source and target)
        differ; () where no group spans two devices; None where the mesh is unknown.
    """

    kind: str
    name: str
    computation: str
    payload: float
    group_size: int
    count: int
    sent: float
    axes: tuple[str, ...] | None = None


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
        `gradcomm.wire`).
      average: modelled bytes one device sends per step, averaged over `period` steps
        after the warm-ups.
      period: the least common multiple of the named branches' `every` (1 if none).
      conditionals: every conditional with a collective in a branch, outer ones before
        the ones nested in their branches.
      mesh: the mesh the collectives' `axes` name, as (axis name, size) pairs in mesh
        order; None where it is unknown.
    """

    collectives: tuple[Collective, ...]
    exact: bool = True
    devices: int = 0
    _: dataclasses.KW_ONLY
    steady: float
    average: float
    period: int = 1
    conditionals: tuple[Conditional, ...] = ()
    mesh: tuple[tuple[str, int], ...] | None = None

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

    def by_axes(self) -> dict[tuple[str, ...] | None, float]:
        """Bytes sent per device, per set of mesh axes spanned (those counted in `total`).

        A collective over one axis counts under that axis alone, one over several (a psum
        over `("data", "model")`) under all of them together: the keys are the
        collectives' `axes`, tuples of axis names in mesh order; `()` holds those whose
        groups are single devices, and `None` all of them where the mesh is unknown. The
        values add up to `total`.

        Returns:
          A dict from a tuple of axis names (or None) to bytes, in order of first use.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from gradcomm import parallel, wire
          >>> mesh = parallel.make_mesh({"data": 2, "model": 2}, devices=jax.devices()[:4])
          >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
          ...                   in_specs=P(), out_specs=P())
          >>> wire.measure(f, jnp.zeros(1000, jnp.float32)).by_axes()  # 2 (n - 1) / n of 4000
          {('data',): 4000.0}
        """
        out: dict[tuple[str, ...] | None, float] = {}
        for c in self.collectives:
            out[c.axes] = out.get(c.axes, 0.0) + c.sent
        return out

    def table(self) -> str:
        """A Markdown table of the collectives with a total row; where the program has
        conditionals, the `steady` and `average` rows and a table of their branches; where
        the mesh is known, an axes column and a table of the bytes per set of mesh axes
        (`by_axes`)."""
        mesh = self.mesh is not None
        axes_head, axes_rule, gap = ("axes | ", "--- | ", " |") if mesh else ("", "", "")
        rows = [f"| collective | payload (B) | group | {axes_head}count | sent per device (B) |"]
        rows.append(f"| --- | ---: | ---: | {axes_rule}---: | ---: |")
        for c in self.collectives:
            axes = f" {_axes_label(c.axes)} |" if mesh else ""
            rows.append(
                f"| {c.kind} | {c.payload:,.0f} | {c.group_size} |{axes} {c.count} "
                f"| {c.sent:,.0f} |"
            )
        rows.append(f"| **total** | | |{gap} | **{self.total:,.0f}** |")
        if self.conditionals:
            rows.append(f"| **steady** | | |{gap} | **{self.steady:,.0f}** |")
            steps = f"{self.period} steps" if self.period > 1 else "1 step"
            rows.append(f"| **average** over {steps} | | |{gap} | **{self.average:,.0f}** |")
            rows += ["", "| conditional | count | branch | runs | sent per run (B) |"]
            rows.append("| --- | ---: | --- | --- | ---: |")
            for cond in self.conditionals:
                for b in cond.branches:
                    rows.append(
                        f"| {cond.name} | {cond.count} | {b.label} | {cond.runs(b)} "
                        f"| {b.sent:,.0f} |"
                    )
        if mesh:
            shape = ", ".join(f"{name}={size}" for name, size in self.mesh or ())
            rows += ["", f"| mesh axes ({shape}) | sent per device (B) |", "| --- | ---: |"]
            rows += [f"| {_axes_label(a)} | {b:,.0f} |" for a, b in self.by_axes().items()]
        if self.devices == 1:
            rows += ["", "One device: nothing crosses a wire (every collective is local)."]
        return "\n".join(rows)

    def to_json(self) -> str:
        """The report as JSON: the figures, `by_kind`, the mesh (a list of [name, size],
        or null), `by_axes` (a list of {"axes": [names] or null, "sent": bytes}), and every
        collective and conditional with their fields."""
        return json.dumps(
            {
                "total": self.total,
                "steady": self.steady,
                "average": self.average,
                "period": self.period,
                "exact": self.exact,
                "devices": self.devices,
                "by_kind": self.by_kind(),
                "mesh": self.mesh,
                "by_axes": [{"axes": a, "sent": b} for a, b in self.by_axes().items()],
                "collectives": [dataclasses.asdict(c) for c in self.collectives],
                "conditionals": [dataclasses.asdict(c) for c in self.conditionals],
            }
        )


def _axes_label(axes: tuple[str, ...] | None) -> str:
    """A set of mesh axes in a table: names joined by "+", "-" for none, "?" if unknown."""
    return "?" if axes is None else "+".join(axes) or "-"
