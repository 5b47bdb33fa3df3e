"""Where each method beats allreduce: the crossover bandwidth, and a table of them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gradcomm.perfmodel._fit import Calibration
from gradcomm.perfmodel._model import NCCL, Backend, predict

METHODS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("allreduce", "allreduce", {}),
    ("adasum", "adasum", {}),
    ("terngrad", "terngrad", {}),
    ("lags-0.01", "lags", {"density": 0.01}),
    ("lags-0.001", "lags", {"density": 0.001}),
    ("slgs", "slgs", {"density": 0.01}),
    ("dropping", "gradient_dropping", {}),
    ("dropping-local", "gradient_dropping", {"local": "compensated", "average_every": 50}),
    ("local-sgd", "local_sgd", {}),
    ("sgp", "sgp", {}),
    ("osgp", "sgp", {"overlap": 1}),
    ("dpsgd", "dpsgd", {}),
)


def crossover_bandwidth(
    method: str,
    params: int,
    nodes: int,
    latency: float = 0.0,
    *,
    options: Mapping[str, Any] | None = None,
    backend: Backend = NCCL,
    compute_s: float = 0.0,
    cost_per_byte: float = 0.0,
    itemsize: int = 4,
    lo: float = 1e-4,
    hi: float = 1e4,
) -> float | None:
    """The link bandwidth (Gbit/s) below which `method` beats allreduce.

    Args:
      method, params, nodes, latency, options, backend, compute_s, cost_per_byte,
        itemsize: as for `predict` (allreduce gets the same, without `cost_per_byte`).
      lo, hi: the range of links searched, in Gbit/s.

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
    kw: dict[str, Any] = {"backend": backend, "compute_s": compute_s, "itemsize": itemsize}
    mine = {"options": options, "cost_per_byte": cost_per_byte, **kw}

    def gap(bandwidth: float) -> float:  # negative where the method wins (ties do not)
        t = predict(method, params, nodes, bandwidth, latency, **mine).step_s
        return t - predict("allreduce", params, nodes, bandwidth, latency, **kw).step_s * (1 - 1e-9)

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
    latency: float = 0.0,
    backend: Backend = NCCL,
    rates: Sequence[float] = (1.0, 10.0, 100.0),
    calibration: Calibration | None = None,
    methods: Sequence[tuple[str, str, Mapping[str, Any]]] = METHODS,
) -> str:
    """Markdown: per method, where it beats allreduce, and its speed-up at each link rate.

    Args:
      params, nodes, compute_s, latency, backend: as for `predict`.
      rates: link rates in Gbit/s, a column each.
      calibration: if given, its backend, compute and per-method costs are used instead.
      methods: (label, method, options) rows.

    Returns:
      The table; the speed-up is allreduce's step time over the method's.

    Example:
      >>> from gradcomm import perfmodel
      >>> print(perfmodel.crossover_table(25_000_000, 16, 0.2).splitlines()[6])
      | lags-0.001 | 11.2 Gbit/s | 7.83x | 1.08x | 1.00x |
    """
    head = " | ".join(f"{r:g} Gbit/s" for r in rates)
    lines = [
        f"| method | beats allreduce below | {head} |",
        "| --- | --- |" + " ---: |" * len(rates),
    ]
    for label, method, options in methods:
        kw: dict[str, Any] = {"backend": backend, "compute_s": compute_s}
        if calibration is not None:
            kw = calibration.settings(method, options, nodes)
        base = {k: v for k, v in kw.items() if k != "cost_per_byte"}
        speed = [
            predict("allreduce", params, nodes, r, latency, **base).step_s
            / predict(method, params, nodes, r, latency, options=options, **kw).step_s
            for r in rates
        ]
        where = "-"
        if method != "allreduce":
            b = crossover_bandwidth(method, params, nodes, latency, options=options, **kw)
            where = (
                "no crossover" if b is None else "always" if b == math.inf else f"{b:.3g} Gbit/s"
            )
        lines.append(f"| {label} | {where} | " + " | ".join(f"{s:.2f}x" for s in speed) + " |")
    return "\n".join(lines) + "\n"
