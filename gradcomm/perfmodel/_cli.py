"""`python -m gradcomm.perfmodel [network.json]`: the fit, the crossovers and the papers."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from typing import Any, Literal

from gradcomm.perfmodel._crossover import crossover_table
from gradcomm.perfmodel._fit import (
    Calibration,
    calibrate,
    fit_markdown,
    fit_report,
    key,
)
from gradcomm.perfmodel._model import GLOO, GLOO_PAIRWISE
from gradcomm.perfmodel._papers import paper_checks, paper_table


def _calibration_json(cal: Calibration) -> dict[str, Any]:
    return {
        "base_s": {f"{n}x{d}": v for (n, d), v in cal.base_s.items()},
        "cost_per_byte": dict(cal.cost_per_byte),
        "factors": {f"{k}@{n}": v for (k, n), v in cal.backend.factors.items()},
        "unshaped_gbps": {
            str(n): v if v < math.inf else None for n, v in cal.unshaped_gbps.items()
        },
    }


def _fit(
    network: str, backend: Literal["auto", "gloo", "gloo-pairwise"], nodes: int | None
) -> dict[str, Any]:
    """Prints the fit to `network` and the crossover table; returns them for --json."""
    with open(network) as f:  # gradcomm's records; the peer rows (PyTorch DDP) model nothing
        records = [r for r in json.load(f) if r.get("framework", "jax") == "jax"]
    if backend == "auto":  # the records say how the benchmark's swaps ran
        pairwise = any(r.get("exchange") == "pairwise" for r in records)
        backend = "gloo-pairwise" if pairwise else "gloo"
    cal = calibrate(records, backend=GLOO if backend == "gloo" else GLOO_PAIRWISE)

    rows = fit_report(records, cal)
    nodes = nodes or max(r["nodes"] for r in records)
    methods: dict[str, Any] = {"allreduce": {"label": "allreduce", "method": "allreduce"}}
    for r in records:  # the rows are the benchmark's methods, as its records name them
        if r.get("devices_per_process", 1) == 1:
            methods[key(r["method"], r.get("options"), r.get("sync"))] = r
    compute = ", ".join(f"{n} x {d}: {v:.3f} s" for (n, d), v in sorted(cal.base_s.items()))
    link = ", ".join(f"{n}: {v:.3g} Gbit/s" for n, v in sorted(cal.unshaped_gbps.items()))
    print(f"## The model's fit to {network}\n")
    swaps = "2-member collectives" if backend == "gloo-pairwise" else "permutes"
    print(f"Backend: {backend} (swaps run as {swaps}).")
    print(f"Compute per allreduce step (nodes x devices per process): {compute}.")
    print(f"Unshaped link, effective (nodes: bandwidth): {link or 'none fitted'}.\n")
    print(fit_markdown(rows))
    print(f"## Where each method beats allreduce ({nodes} hosts, this machine's compute)\n")
    print(crossover_table(cal.params, nodes, calibration=cal, methods=list(methods.values())))
    return {"fit": [r._asdict() for r in rows], "calibration": _calibration_json(cal)}


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gradcomm.perfmodel [network.json]`: the fit, the crossovers, the papers."""
    parser = argparse.ArgumentParser(
        prog="python -m gradcomm.perfmodel",
        description="Fits the alpha-beta step-time model to network.json (from "
        "experiments/network/bench_network.py) and prints its fit error, the crossover "
        "bandwidths and the papers' figures beside the model's.",
    )
    parser.add_argument("network", nargs="?", help="network.json; without it, the papers only")
    parser.add_argument(
        "--backend",
        choices=["auto", "gloo", "gloo-pairwise"],
        default="auto",
        help="how the benchmark's swaps ran: as permutes, or as 2-member reduce-scatters; "
        "auto reads each record's `exchange`",
    )
    parser.add_argument("--nodes", type=int, help="hosts in the crossover table (default: most)")
    parser.add_argument("--json", help="also write the fit, calibration and checks to this file")
    args = parser.parse_args(argv)
    report = _fit(args.network, args.backend, args.nodes) if args.network else {}
    checks = paper_checks()
    print("## The papers' figures beside the model\n")
    print(paper_table(checks))
    report["papers"] = [c._asdict() for c in checks]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0
