"""Where each method beats allreduce: the crossover bandwidth, and a table of them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gradcomm.perfmodel._fit import Calibration, Record, key
from gradcomm.perfmodel._model import NCCL, Backend, predict

# `predict`'s keyword arguments that belong to the method, not to the machine: allreduce,
# the baseline, runs without them.
_OWN = ("options", "sync", "cost_per_byte")


def _baseline(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings allreduce runs under beside a method: the machine's, not the method's."""
    return {k: v for k, v in settings.items() if k not in _OWN}


def crossover_bandwidth(
    method: str,
    params: int,
    nodes: int,
    latency: float = 0.0,
    *,
    lo: float = 1e-4,
    hi: float = 1e4,
    **settings: Any,
) -> float | None:
    """The link bandwidth (Gbit/s) below which `method` beats allreduce.

    Args:
      method: as for `predict`.
      params: as for `predict`.
      nodes: as for `predict`.
      latency: as for `predict`.
      lo: the slowest link searched, in Gbit/s.
      hi: the fastest link searched, in Gbit/s.
      **settings: `predict`'s keyword arguments (options, sync, backend, compute_s,
        cost_per_byte, itemsize); allreduce gets the same without the method's own
        (options, sync, cost_per_byte).

    Returns:
      The bandwidth; `math.inf` if the method wins on every link in the range; None ("no
      crossover") if it loses even on the slowest.

    Example:
      >>> from gradcomm import perfmodel
      >>> b = perfmodel.crossover_bandwidth("lags", 25_000_000, 16, compute_s=0.1,
      ...                                   cost_per_byte=1e-9)  # 0.1 s of top-k
      >>> round(b, 2)  # below 9 Gbit/s the all-reduce's exposed time exceeds 0.1 s
      9.0
    """
    base = _baseline(settings)

    def gap(bandwidth: float) -> float:  # negative where the method wins (ties do not)
        mine = predict(method, params, nodes, bandwidth, latency, **settings).step_s
        theirs = predict("allreduce", params, nodes, bandwidth, latency, **base).step_s
        return mine - theirs * (1 - 1e-9)

    grid = np.geomspace(lo, hi, 81)
    wins = [gap(b) < 0 for b in grid]
    if not wins[0]:
        return None
    if all(wins):
        return math.inf
    first_loss = wins.index(False)  # bisect between the last win and it, on a log scale
    a, b = math.log(grid[first_loss - 1]), math.log(grid[first_loss])
    for _ in range(60):
        mid = (a + b) / 2
        a, b = (mid, b) if gap(math.exp(mid)) < 0 else (a, mid)
    return math.exp((a + b) / 2)


def crossover_table(
    params: int,
    nodes: int,
    compute_s: float = 0.0,
    *,
    methods: Sequence[Record],
    latency: float = 0.0,
    backend: Backend = NCCL,
    rates: Sequence[float] = (1.0, 10.0, 100.0),
    calibration: Calibration | None = None,
) -> str:
    """Markdown: per method, where it beats allreduce, and its speed-up at each link rate.

    The model knows gradcomm's factories, not the names a study gives them: the caller
    hands the rows (gradcomm_experiments.methods's `rows()`, or network.json records).

    Args:
      params: as for `predict`.
      nodes: as for `predict`.
      compute_s: as for `predict`.
      latency: as for `predict`.
      backend: as for `predict`.
      methods: a row each: a mapping with "method" (a gradcomm factory) and optionally
        "options", "sync" (as for `predict`) and "label" (the row's name).
      rates: link rates in Gbit/s, a column each.
      calibration: if given, its backend, compute and per-method costs are used instead.

    Returns:
      The table; the speed-up is allreduce's step time over the method's.

    Example:
      >>> from gradcomm import perfmodel
      >>> rows = [{"method": "allreduce"},
      ...         {"label": "lags-0.001", "method": "lags", "options": {"density": 0.001}}]
      >>> print(perfmodel.crossover_table(25_000_000, 16, 0.2, methods=rows).splitlines()[3])
      | lags-0.001 | 11.2 Gbit/s | 7.83x | 1.08x | 1.00x |
    """
    head = " | ".join(f"{r:g} Gbit/s" for r in rates)
    lines = [
        f"| method | beats allreduce below | {head} |",
        "| --- | --- |" + " ---: |" * len(rates),
    ]
    for row in methods:
        method, options, sync = row["method"], row.get("options") or {}, row.get("sync")
        kw: dict[str, Any] = {"backend": backend, "compute_s": compute_s}
        if calibration is not None:
            kw = calibration.settings(method, options, nodes, sync=sync)
        kw |= {"options": options, "sync": sync}
        speed = [
            predict("allreduce", params, nodes, r, latency, **_baseline(kw)).step_s
            / predict(method, params, nodes, r, latency, **kw).step_s
            for r in rates
        ]
        where = "-"
        if method != "allreduce":
            b = crossover_bandwidth(method, params, nodes, latency, **kw)
            where = (
                "no crossover" if b is None else "always" if b == math.inf else f"{b:.3g} Gbit/s"
            )
        label = row.get("label") or key(method, options, sync)
        lines.append(f"| {label} | {where} | " + " | ".join(f"{s:.2f}x" for s in speed) + " |")
    return "\n".join(lines) + "\n"
