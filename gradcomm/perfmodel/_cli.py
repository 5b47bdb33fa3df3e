"""`python -m gradcomm.perfmodel [network.json]`: the fit, the crossovers and the papers;
`python -m gradcomm.perfmodel recommend ...`: the methods ranked for a cluster."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any, Literal

from gradcomm.perfmodel._crossover import crossover_table
from gradcomm.perfmodel._fit import Calibration, fit_file, fit_markdown, fit_report, key
from gradcomm.perfmodel._kernels import kernel_record
from gradcomm.perfmodel._papers import paper_checks, paper_table
from gradcomm.perfmodel._recommend import (
    GPU_FLOPS,
    GPU_TOKENS,
    Choice,
    default_network,
    parse_params,
    recommend,
)


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
    records, cal, backend = fit_file(network, backend)

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


def _call(c: Choice) -> str:
    """The factory call a row stands for (its sync as `train_step`'s)."""
    args = "".join(f", {k}={v!r}" for k, v in c.options.items())
    text = f'`gradcomm.{c.method}("data"{args})`'
    if c.sync:
        rest = "".join(f", {k}={v!r}" for k, v in c.sync.items() if k != "name")
        text += f' + `sync=gradcomm.{c.sync["name"]}("data"{rest})`'
    return text


def _recommend_markdown(choices: Sequence[Choice], head: str) -> str:
    lines = [
        head,
        "",
        "| rank | method | call | step s | / allreduce | extra compute s | docs "
        "| accuracy evidence |",
        "| ---: | --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for i, c in enumerate(choices, 1):
        lines.append(
            f"| {i} | {c.label} | {_call(c)} | {c.step_s:.4g} | {c.ratio:.3g} "
            f"| {c.extra_s:.3g} | {c.page} | {c.evidence} |"
        )
    return "\n".join(lines) + "\n"


def _params(text: str) -> int:
    try:
        return parse_params(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _recommend_cli(argv: Sequence[str]) -> int:
    """`python -m gradcomm.perfmodel recommend`: see `gradcomm.perfmodel.recommend`."""
    parser = argparse.ArgumentParser(
        prog="python -m gradcomm.perfmodel recommend",
        description="Ranks gradcomm's methods by the step time the model predicts for a "
        "model on N hosts (one device each) on a link, and links each method's docs and "
        "accuracy evidence. gpu: NCCL, extra compute from the measured H200 kernel record; "
        "cpu: gloo, the model calibrated to network.json's records.",
    )
    parser.add_argument("--params", type=_params, required=True,
                        help="parameters: 124M, 1.5B, 350k or a plain int")  # fmt: skip
    parser.add_argument("--nodes", type=int, required=True, help="hosts, one device each")
    parser.add_argument("--link", type=str, required=True,
                        help="each host's link: 100mbit, 1gbit, 10gbit, 100gbit or a number "
                        "of Gbit/s; unshaped (cpu only): the benchmark's own")  # fmt: skip
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="default gpu")
    parser.add_argument("--compute-s", type=float,
                        help="an all-reduce step's compute in seconds (default gpu: "
                        f"6 params x {GPU_TOKENS} tokens / {GPU_FLOPS / 1e12:g} TFLOP/s, an "
                        "estimate; cpu: the calibrated compute scaled by --params)")  # fmt: skip
    parser.add_argument("--network", help="cpu: network.json (default: the checkout's)")
    parser.add_argument("--kernels", help="gpu: bench_kernels.json (default: the H200 record)")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per message")
    parser.add_argument("--every-exchange", action="store_true",
                        help="list rows that differ only in `exchange` separately")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = parser.parse_args(argv)
    try:
        choices = recommend(
            args.params, args.nodes, args.link, device=args.device, compute_s=args.compute_s,
            network=args.network, kernels=args.kernels, latency=args.latency,
            every_exchange=args.every_exchange,
        )  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    base = next(c for c in choices if c.method == "allreduce" and not c.options)
    if args.device == "gpu":
        source = "given" if args.compute_s is not None else (
            f"estimated: 6 FLOPs per parameter per token, {GPU_TOKENS} tokens per device, "
            f"{GPU_FLOPS / 1e12:g} TFLOP/s; pass --compute-s"
        )  # fmt: skip
        record = kernel_record(args.kernels)
        setting = (f"NCCL; the all-reduce step's compute {base.compute_s:.4g} s "
                   f"({source}); extra compute from {record.path} ({record.device})")  # fmt: skip
    else:
        source = "given" if args.compute_s is not None else "calibrated, scaled by --params"
        setting = (f"gloo, calibrated to {args.network or default_network()}; the all-reduce "
                   f"step's compute {base.compute_s:.4g} s ({source}); "
                   'exchange "auto" as the records ran it')  # fmt: skip
    setting += "; PowerSGD's factors as of one square matrix of --params, its best case"
    head = (f"## Methods by predicted step: {args.params:,} parameters, {args.nodes} hosts, "
            f"link {args.link}, {args.device}\n\n{setting}.")  # fmt: skip
    if args.json:
        given = {k: getattr(args, k) for k in ("params", "nodes", "link", "device")}
        report = given | {"setting": setting, "choices": [c._asdict() for c in choices]}
        print(json.dumps(report, indent=1))
    else:
        print(_recommend_markdown(choices, head))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gradcomm.perfmodel [network.json]`: the fit, the crossovers, the papers;
    `python -m gradcomm.perfmodel recommend --params 124M --nodes 32 --link 10gbit`: the
    methods ranked by predicted step time (`recommend`; `recommend --help`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["recommend"]:
        return _recommend_cli(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m gradcomm.perfmodel",
        description="Fits the alpha-beta step-time model to network.json (from "
        "experiments/network/bench_network.py) and prints its fit error, the crossover "
        "bandwidths and the papers' figures beside the model's.",
    )
    parser.add_argument("network", nargs="?", help="network.json; without it, the papers only "
                        "(`recommend --help`: the methods ranked for a cluster)")  # fmt: skip
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
