"""Calibration from `experiments/network/bench_network.py`'s records, and the fit, cell by cell."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from gradcomm.perfmodel._model import GLOO, GLOO_PAIRWISE, Backend, Prediction, predict

Group = tuple[int, int]  # (nodes, devices per process)
Record = Mapping[str, Any]  # one network.json record


def key(
    method: str, options: Mapping[str, Any] | None = None, sync: Mapping[str, Any] | None = None
) -> str:
    """A method's identity for calibration: its name, options and sync, warm-up left out.

    Example:
      >>> from gradcomm import perfmodel
      >>> perfmodel.key("gradient_dropping", {"local": "compensated", "warmup_steps": 0},
      ...               {"name": "periodic_average", "every": 50})
      'gradient_dropping{"local": "compensated"} + periodic_average{"every": 50}'
    """
    kept = {k: v for k, v in sorted((options or {}).items()) if k != "warmup_steps"}
    text = method + (json.dumps(kept) if kept else "")
    if sync:
        rest = {k: v for k, v in sorted(sync.items()) if k != "name"}
        text += f" + {sync.get('name')}" + (json.dumps(rest) if rest else "")
    return text


def _options_and_sync(r: Record) -> dict[str, Any]:
    """A record's method as `predict` and `key` take it: its options and sync."""
    return {"options": r.get("options"), "sync": r.get("sync")}


def _group(r: Record) -> Group:
    return r["nodes"], r.get("devices_per_process", 1)


def _ring(r: Record) -> int:
    """The allreduce baseline's ring: every device of the cell. With L devices per host the
    ring crosses each host's link once, carrying 2 (nL - 1) / (nL) of the model."""
    return r["nodes"] * r.get("devices_per_process", 1)


def _itemsize(r: Record) -> int:
    return r["param_bytes"] // r["params"]


def _gbps(r: Record) -> float | None:
    """A record's link in Gbit/s (the measured rate where there is one); None if unshaped."""
    if r.get("rate_mbit") is None:
        return None
    return (r.get("link_mbit_measured") or r["rate_mbit"]) / 1000


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What `calibrate` fitted.

    Attributes:
      backend: the backend, with allreduce's factors refitted to the shaped cells.
      base_s: (nodes, devices per process) -> the allreduce step's compute, in seconds.
      cost_per_byte: `key(method, options, sync)` -> extra compute per model byte, in seconds,
        on the reference group (fewest devices per process, then fewest nodes); in another
        group it scales with that group's allreduce compute (`settings`).
      unshaped_gbps: nodes -> an unshaped link's effective bandwidth (inf: no cost seen).
      params: the benchmark model's parameter count.
      itemsize: the benchmark model's bytes per parameter.
      rate_factors: (ring size, shaped rate in Mbit/s) -> allreduce's factor at that rate,
        which a record at that rate is predicted with (gloo's ring ran at 1.02x of the
        ideal at 100 Mbit and 0.82x at 1 Gbit); `backend` holds the median over rates.
    """

    backend: Backend
    base_s: Mapping[Group, float]
    cost_per_byte: Mapping[str, float]
    unshaped_gbps: Mapping[int, float]
    params: int
    itemsize: int = 4
    rate_factors: Mapping[tuple[int, float], float] = dataclasses.field(default_factory=dict)

    def settings(
        self,
        method: str,
        options: Mapping[str, Any] | None,
        nodes: int,
        per_process: int = 1,
        *,
        sync: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """`predict` keyword arguments for a method on the calibrated machine.

        The compute is the calibrated one of the nearest node count measured, and the
        method's extra compute (that of `key(method, options, sync)`) scales with it.
        """
        near = min(self.base_s, key=lambda g: (g[1] != per_process, abs(g[0] - nodes)))
        ref = self.base_s[_reference(self.base_s)]
        slower = self.base_s[near] / ref if ref > 0 else 1.0
        return {
            "backend": self.backend,
            "compute_s": self.base_s[near],
            "cost_per_byte": self.cost_per_byte.get(key(method, options, sync), 0.0) * slower,
            "itemsize": self.itemsize,
        }

    def backend_at(self, rate_mbit: float | None) -> Backend:
        """The backend with allreduce's factors fitted at a shaped rate (`rate_factors`),
        where the records have that rate; else `backend`."""
        at_rate = {
            ("allreduce", n): f for (n, rate), f in self.rate_factors.items() if rate == rate_mbit
        }
        if not at_rate:
            return self.backend
        return dataclasses.replace(self.backend, factors={**self.backend.factors, **at_rate})

    def predict_record(self, r: Record, method: str | None = None) -> Prediction:
        """The model's step for a network.json record, or its allreduce's (`"allreduce"`)."""
        m, own = (method, {}) if method else (r["method"], _options_and_sync(r))
        gbps = _gbps(r) or self.unshaped_gbps.get(r["nodes"], math.inf)
        kw = self.settings(m, own.get("options"), *_group(r), sync=own.get("sync"))
        kw["compute_s"] = self.base_s[_group(r)]
        kw["backend"] = self.backend_at(r.get("rate_mbit"))
        amortize = r.get("timing") != "median"
        nodes = _ring(r) if m == "allreduce" else r["nodes"]
        return predict(m, r["params"], nodes, gbps, amortize=amortize, **own, **kw)


def _reference(groups: Iterable[Group]) -> Group:
    """The group whose compute the extra costs are quoted at: fewest devices per process,
    then fewest nodes."""
    return min(groups, key=lambda g: (g[1], g[0]))


def _fit_unshaped(
    rec: Sequence[Record], backend: Backend
) -> tuple[dict[Group, float], dict[int, float], dict[str, float]]:
    """Least squares over unshaped cells: compute per group, 1 / bandwidth per N, extras.

    A method's extra compute is quoted at the reference group and scales with each
    group's compute (N processes sharing a machine's cores run everything slower): the
    extras' column holds base_g / base_ref, refitted until the bases settle.
    """
    rows: list[tuple[Group, str | None, float, float]] = []  # group, key, step, comm at 1 Gbit/s
    for r in (r for r in rec if _gbps(r) is None):
        kw = {"backend": backend, "itemsize": _itemsize(r)}
        ar = predict("allreduce", r["params"], _ring(r), 1.0, **kw)
        rows.append((_group(r), None, r["allreduce_step_s"], ar.comm_s))
        if r["method"] != "allreduce":
            own = _options_and_sync(r)
            kw |= {**own, "amortize": r.get("timing") != "median"}
            p = predict(r["method"], r["params"], r["nodes"], 1.0, **kw)
            rows.append((_group(r), key(r["method"], **own), r["step_s"], p.comm_s))
    if not rows:
        return {}, {}, {}
    groups = sorted({g for g, *_ in rows})
    keys = sorted({k for _, k, _, _ in rows if k})
    links = sorted({n for n, _ in groups})
    inverse = dict.fromkeys(links, 0.0)
    y = np.array([t for _, _, t, _ in rows])
    scale = dict.fromkeys(groups, 1.0)
    for _ in range(50):
        a = np.zeros((len(rows), len(groups) + len(links) + len(keys)))
        for i, (g, k, _, c) in enumerate(rows):
            a[i, groups.index(g)] = 1.0
            if g[0] in links:
                a[i, len(groups) + links.index(g[0])] = c
            if k:
                a[i, len(groups) + len(links) + keys.index(k)] = scale[g]
        x = np.linalg.lstsq(a / y[:, None], np.ones(len(rows)), rcond=None)[0]
        base, x = x[: len(groups)], x[len(groups) :]
        fitted = {n: float(v) for n, v in zip(links, x, strict=False)}
        if any(v < 0 for v in fitted.values()):  # drop negative link terms, and refit
            links = [n for n in links if fitted[n] >= 0]
            continue
        extra = {k: float(v) for k, v in zip(keys, x[len(links) :], strict=True)}
        base_s = {g: max(float(v), 0.0) for g, v in zip(groups, base, strict=True)}
        ref = base_s[_reference(groups)]
        new = {g: base_s[g] / ref if ref > 0 else 1.0 for g in groups}
        if max(abs(new[g] - scale[g]) for g in groups) < 1e-9:
            break
        scale = new
    return base_s, inverse | fitted, extra


def calibrate(records: Sequence[Record], *, backend: Backend = GLOO) -> Calibration:
    """Fits the model's free numbers to network.json records.

    From the unshaped cells, by least squares on relative error: the allreduce step's
    compute per (nodes, devices per process), an unshaped link's effective bandwidth per
    node count (a link term that comes out negative is dropped), and one extra compute
    cost per method and options, quoted at the reference group and scaled by each
    group's compute (processes that share cores slow down alike). From the shaped cells:
    allreduce's pattern factor per node count, the median of (allreduce step - compute) /
    ideal ring time, over all rates (the backend's) and per rate (`rate_factors`); where
    a group has no unshaped cell, its compute is the intercept of a line through its
    shaped allreduce steps (or, at a single rate, what the pattern table leaves). Every
    other pattern factor is the backend's (for gloo, `GLOO_MEASURED`). Nothing is fitted
    per cell.

    Args:
      records: network.json records (see docs/bench/model.md for the fields used).
      backend: the backend the benchmark ran, `GLOO` or `GLOO_PAIRWISE`.

    Returns:
      A `Calibration`.

    Example:
      >>> from gradcomm import perfmodel
      >>> cell = {"method": "allreduce", "nodes": 2, "params": 4_194_304,
      ...         "param_bytes": 16_777_216, "rate_mbit": 100.0, "link_mbit_measured": 95.8}
      >>> cal = perfmodel.calibrate([cell | {"step_s": 1.51, "allreduce_step_s": 1.51}])
      >>> round(cal.backend.factor("allreduce", 2), 2)  # all compute taken as 0
      1.08
    """
    rec = [r for r in records if r.get("step_s") is not None]
    shaped: dict[Group, list[tuple[float, float, float]]] = {}  # group: (step, ideal, rate)
    for r in rec:
        if (gbps := _gbps(r)) is not None:
            ideal = predict("allreduce", r["params"], _ring(r), gbps, itemsize=_itemsize(r))
            shaped.setdefault(_group(r), []).append(
                (r["allreduce_step_s"], ideal.comm_s, r["rate_mbit"])
            )
    fitted = backend
    for _ in range(3):  # the unshaped fit uses allreduce's refitted factors: iterate
        base, inverse, extra = _fit_unshaped(rec, fitted)
        for g, obs in shaped.items():
            if g in base:
                continue
            steps, ideal, _ = np.array(obs).T
            if len(set(ideal)) > 1:  # no unshaped cell: a line through the shaped allreduce
                base[g] = max(float(np.polyfit(ideal, steps, 1)[1]), 0.0)
            else:  # one rate: what the pattern table's factor leaves
                f = backend.factor("allreduce", g[0] * g[1])
                base[g] = max(statistics.median(t - f * c for t, c, _ in obs), 0.0)
        factors = dict(backend.factors)
        by_rate: dict[tuple[int, float], list[float]] = {}  # per ring size and rate
        for g, obs in shaped.items():
            for t, c, rate in obs:
                by_rate.setdefault((g[0] * g[1], rate), []).append((t - base[g]) / c)
        for n in sorted({n for n, _ in by_rate}):
            ratios = [x for (m, _), xs in by_rate.items() if m == n for x in xs if x]
            factors[("allreduce", n)] = statistics.median(ratios)
        rate_factors = {k: statistics.median(x for x in xs if x) for k, xs in by_rate.items()}
        fitted = dataclasses.replace(backend, factors=factors)
    first = rec[0] if rec else {"params": 1, "param_bytes": 4}
    return Calibration(
        fitted,
        base,
        {k: v / first["param_bytes"] for k, v in extra.items()},
        {n: 1 / v if v > 0 else math.inf for n, v in inverse.items()},
        first["params"],
        _itemsize(first),
        rate_factors if shaped else {},
    )


def fit_file(
    network: str | os.PathLike[str], backend: Literal["auto", "gloo", "gloo-pairwise"] = "auto"
) -> tuple[list[Record], Calibration, str]:
    """`calibrate` on a network.json file's gradcomm records (PyTorch DDP's peer rows
    model nothing and are left out).

    Returns:
      The records, the calibration, and the backend's name: "auto" reads the records'
      `exchange` ("gloo-pairwise" where the benchmark's swaps ran pairwise, else "gloo").
    """
    with open(network) as f:
        records = [r for r in json.load(f) if r.get("framework", "jax") == "jax"]
    if backend == "auto":
        pairwise = any(r.get("exchange") == "pairwise" for r in records)
        backend = "gloo-pairwise" if pairwise else "gloo"
    cal = calibrate(records, backend=GLOO if backend == "gloo" else GLOO_PAIRWISE)
    return records, cal, backend


class FitRow(NamedTuple):
    """One cell beside the model: the error is on the ratio to allreduce (allreduce: seconds)."""

    label: str
    nodes: int
    rate: str
    measured_s: float
    predicted_s: float
    measured_ratio: float
    predicted_ratio: float
    comm_share: float
    bound: Literal["bandwidth", "compute"]
    error: float
    tolerance: float
    ok: bool


def _spread(runs: Sequence[float | None] | None) -> float:
    """(max - min) / median over runs; 0 for fewer than two."""
    v = [x for x in runs or [] if x is not None]
    return (max(v) - min(v)) / statistics.median(v) if len(v) > 1 else 0.0


def fit_report(records: Sequence[Record], calibration: Calibration) -> list[FitRow]:
    """Every cell against the model: the model's fit error, cell by cell.

    A shaped cell whose predicted exposed communication is at least half its step is
    "bandwidth" bound and must be within 15%; every other cell within the larger of 15%
    and the spread between its runs, (max - min) / median of `ratio_runs` (allreduce:
    `step_s_runs`).

    Args:
      records: network.json records.
      calibration: from `calibrate`.

    Returns:
      A `FitRow` per record; `fit_markdown` prints them.
    """
    out = []
    for r in (r for r in records if r.get("step_s") is not None):
        p, ar = calibration.predict_record(r), calibration.predict_record(r, "allreduce")
        exposed = p.comm_s - p.hidden_s
        bound = "bandwidth" if _gbps(r) and exposed >= p.step_s / 2 else "compute"
        measured = r.get("ratio_vs_allreduce") or r["step_s"] / r["allreduce_step_s"]
        if r["method"] == "allreduce":
            error, runs = p.step_s / r["step_s"] - 1, r.get("step_s_runs")
        else:
            error, runs = p.step_s / ar.step_s / measured - 1, r.get("ratio_runs")
        tolerance = 0.15 if bound == "bandwidth" else max(0.15, _spread(runs))
        label = r.get("label") or key(r["method"], **_options_and_sync(r))
        out.append(
            FitRow(
                label,
                r["nodes"],
                r.get("rate", "?"),
                r["step_s"],
                p.step_s,
                measured,
                p.step_s / ar.step_s,
                exposed / p.step_s,
                bound,
                error,
                tolerance,
                abs(error) <= tolerance,
            )
        )
    return out


OVERLAP_NOTE = (
    "Overlap is 0 on this CPU path: every collective runs after the backward pass, so osgp "
    "shows no gain over sgp here; on a GPU its message would hide behind the next step's "
    "compute. netem is unavailable: links add no delay, so latency is 0."
)


def fit_markdown(rows: Sequence[FitRow]) -> str:
    """The fit as a Markdown table, with the largest error of each kind of cell."""
    lines = [
        "| method | nodes | link | measured s | model s | measured / allreduce "
        "| model / allreduce | error | bound | within |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for f in rows:
        ok = "yes" if f.ok else f"no (tolerance {f.tolerance:.0%})"
        lines.append(
            f"| {f.label} | {f.nodes} | {f.rate} | {f.measured_s:.3f} | {f.predicted_s:.3f} "
            f"| {f.measured_ratio:.2f} | {f.predicted_ratio:.2f} | {f.error:+.0%} | {f.bound} "
            f"| {ok} |"
        )
    lines.append("")
    for bound in ("bandwidth", "compute"):
        errors = [abs(f.error) for f in rows if f.bound == bound]
        if errors:
            ok = sum(f.ok for f in rows if f.bound == bound)
            lines.append(
                f"{bound}-bound cells: {len(errors)}, largest error {max(errors):.0%}, "
                f"{ok} within tolerance."
            )
    return "\n".join([*lines, "", OVERLAP_NOTE, ""])
