"""The network benchmark's outputs: network.json records, the Markdown tables and the plot.

A record is a JAX row (`"framework": "jax"`, `records_of`: a method of the registry,
relative to gradcomm's allreduce) or, with `--peer`, a PyTorch DDP peer row
(`"framework": "torch"`, `peer_records_of`: a DDP communication hook, relative to DDP
without one, in the same run). The tables and the plot show both, the peer rows labelled
as PyTorch DDP; `gradcomm.perfmodel` models the JAX rows only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import _netcluster as netcluster
import _report
import numpy as np
from _methods import NETWORK
from _networker import PATTERNS, spec_of
from _peerworker import BASELINE, BUCKET_CAP_MB, HOOKS, VARIANTS

# The peer rows as the tables and the plot name them.
PEER_NAMES = {
    "torch-allreduce": "PyTorch DDP: allreduce (no hook)",
    "torch-fp16": "PyTorch DDP: fp16_compress_hook",
    "torch-powersgd": "PyTorch DDP: powerSGD_hook, rank 2",
}


def _timed(
    res: dict[str, Any], base: list[float], nodes: int, rate: str, links: list[float]
) -> dict[str, Any]:
    """A record's cell and timing: its link, its steps, and its ratios run by run to the
    baseline's steps `base` in the same runs."""
    ratios = [t / b for t, b in zip(res["runs"], base, strict=True)]
    return {
        "nodes": nodes,
        "rate": rate,
        "rate_mbit": netcluster.parse_rate(rate),
        "link_mbit_measured": float(np.mean(links)) if links else None,
        "link_mbit_hosts": links,
        "params": res["params"],
        "param_bytes": 4 * res["params"],
        "step_s": float(np.median(res["runs"])),
        "step_s_runs": res["runs"],
        "allreduce_step_s": float(np.median(base)),
        "ratio_vs_allreduce": float(np.median(ratios)),
        "ratio_runs": ratios,
    }


def records_of(
    results: dict[str, Any], nodes: int, rate: str, links: list[float], local: bool,
    bytes_known: dict[tuple[int, str], float], allocator: str = "retain",
    threads: int | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """network.json records for one cell, with ratios to this cell's allreduce, run by run.

    Each record names its method as the registry describes it (`Spec.describe()`: method,
    options, sync, label), which is what `gradcomm.perfmodel` reads. `threads` is the
    workers' compute threads (`--threads`; None: not pinned).
    """
    base = results["allreduce"]["runs"]
    out = []
    for label, res in results.items():
        if local and label == "allreduce":
            continue
        key = (nodes, label)
        if res["bytes"] is not None:
            bytes_known[key] = res["bytes"]
        out.append(
            {
                **spec_of(label).describe(),
                **_timed(res, base, nodes, rate, links),
                "devices_per_process": 2 if local else 1,
                "bytes_per_step": bytes_known.get(key),
                "cycle": res["cycle"],
                "timing": "cycle-mean" if res["cycle"] > 1 else "median",
                "backend": "gloo",
                "exchange": "pairwise" if nodes & (nodes - 1) == 0 else "permute",
                "netem": False,
                "allocator": allocator,
                "framework": "jax",
                "threads": threads,
            }
        )
    return out


def peer_records_of(
    payload: dict[str, Any], nodes: int, rate: str, links: list[float], allocator: str,
    threads: int | None,
) -> list[dict[str, Any]]:  # fmt: skip
    """network.json records of one cell's PyTorch DDP peer rows (`_peerworker.py`).

    `payload` is what the peer worker printed: per variant its runs' median steps, bytes
    per step, bucket count and warm-up steps. Each ratio is against DDP without a hook
    (`torch-allreduce`) in the same run, not against gradcomm's allreduce; the record's
    `baseline` says so, and `"framework": "torch"` marks it as a peer row. `threads` is
    `--threads` (None: torch's default thread counts, which `torch_threads` gives).
    """
    results = payload["results"]
    base = results[BASELINE]["runs"]
    out = []
    for label in [v for v in VARIANTS if v in results]:
        res = results[label]
        out.append(
            {
                "label": label,
                "framework": "torch",
                **HOOKS[label],
                "baseline": BASELINE,
                "bucket_cap_mb": BUCKET_CAP_MB,
                "buckets": res["buckets"],
                "warmup_steps": res["warmup_steps"],
                **_timed(res, base, nodes, rate, links),
                "devices_per_process": 1,
                "bytes_per_step": res["bytes"],
                "timing": "median",
                "backend": "gloo",
                "netem": False,
                "allocator": allocator,
                "threads": threads,
                "torch_threads": payload.get("threads"),
            }
        )
    return out


def label_of(record: dict[str, Any]) -> str:
    """The registry's label of the method a record timed, found by what it ran (method,
    options, sync), so that records written under an older label ("lags-0.01") still
    match; the record's own label where no method of the registry ran that."""
    ran = {k: record.get(k) for k in ("method", "options", "sync")}
    for label in NETWORK:
        described = spec_of(label).describe()
        if {k: described[k] for k in ran} == ran:
            return label
    return record["label"]


def table(records: Sequence[dict[str, Any]], rates: Sequence[str]) -> str:
    """Markdown: per node count, a row per method and a column per rate (ratio, seconds).

    Peer rows follow the JAX rows, named "PyTorch DDP: ..." and relative to PyTorch's own
    allreduce; a line under the caption says so, and gives the thread setting.
    """
    lines = [
        "Step time relative to allreduce in the same run (seconds per step in brackets); "
        "measured link rate under each column. netem unavailable: no added delay.",
    ]
    if any(r.get("framework") == "torch" for r in records):
        lines.append(
            "Rows named PyTorch DDP: the same MLP, initial params, batch and links under "
            f"PyTorch's DistributedDataParallel (gloo, Adam, one {BUCKET_CAP_MB} MB bucket), "
            "each relative to PyTorch's own allreduce (DDP without a hook) in the same run."
        )
    threads = {r.get("threads") for r in records}
    if threads != {None}:
        shown = ", ".join(str(t) if t else "not pinned" for t in sorted(threads, key=str))
        lines.append(
            f"Compute threads per process: {shown} (XLA:CPU's intra-op pool; "
            "torch.set_num_threads and set_num_interop_threads)."
        )
    lines.append("")
    for nodes in sorted({r["nodes"] for r in records}):
        cells = {(label_of(r), r["rate"]): r for r in records if r["nodes"] == nodes}
        link = {
            rate: next((r["link_mbit_measured"] for (_, q), r in cells.items() if q == rate), None)
            for rate in rates
        }
        head = [f"{rate} ({link[rate]:.0f} Mbit/s)" if link[rate] else rate for rate in rates]
        lines += [f"**N = {nodes}**", "", "| method | " + " | ".join(head) + " | bytes/step |"]
        lines.append("| --- |" + " ---: |" * (len(rates) + 1))
        for label in [*NETWORK, *VARIANTS]:
            row = [cells.get((label, rate)) for rate in rates]
            if not any(row):
                continue
            sent = next((c["bytes_per_step"] for c in row if c and c["bytes_per_step"]), None)
            text = [f"{c['ratio_vs_allreduce']:.2f} ({c['step_s']:.3f})" if c else "—" for c in row]
            shown = f"{sent:,.0f}" if sent else "—"
            lines.append(
                f"| {PEER_NAMES.get(label, label)} | " + " | ".join(text) + f" | {shown} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(records: Sequence[dict[str, Any]], path: Any) -> None:
    """Step time against link bandwidth, one line per method, a panel per node count;
    peer rows in grey, dotted."""
    node_counts = sorted({r["nodes"] for r in records})
    params = max(r["params"] for r in records)

    def draw(fig: Any) -> None:
        axes = np.atleast_1d(fig.subplots(1, len(node_counts)))
        for ax, nodes in zip(axes, node_counts, strict=True):
            for label in [*NETWORK, *VARIANTS]:
                rows = [r for r in records if r["nodes"] == nodes and label_of(r) == label]
                rows = sorted(
                    (r for r in rows if r["link_mbit_measured"]),
                    key=lambda r: r["link_mbit_measured"],
                )
                if rows:
                    ax.plot(
                        [r["link_mbit_measured"] for r in rows], [r["step_s"] for r in rows],
                        label=PEER_NAMES.get(label, label), **_style(label),
                    )  # fmt: skip
            ax.set(
                xscale="log", yscale="log", xlabel="measured link bandwidth (Mbit/s, log scale)",
                ylabel="step time (s, log scale)",
                title=f"{nodes} hosts, {params / 1e6:.1f}M-parameter MLP, Adam",
            )  # fmt: skip
            ax.grid(alpha=0.3, which="both")
        axes[-1].legend(fontsize=7, ncol=2)

    _report.save_figure(
        path,
        draw,
        title="Step time on an emulated network (tc tbf, gloo); rightmost point: unshaped",
        size=(6 * len(node_counts), 4.8),
    )


def _style(label: str) -> dict[str, Any]:
    """The registry's style of a method (`_report.style`); grey and dotted for a peer row."""
    if label in VARIANTS:
        marker = "osD"[VARIANTS.index(label)]
        return {"color": "0.35", "marker": marker, "linestyle": ":", "markerfacecolor": "white"}
    return _report.style(label)


def pattern_table(records: Sequence[dict[str, Any]], mib: float, repeats: int) -> str:
    """Markdown: per raw collective, its median seconds per call in each cell."""
    cells = sorted({(r["nodes"], r["rate"]) for r in records})
    lines = [
        f"Median seconds per call, {mib:g} MiB per device "
        f"({repeats} calls after one warm-up call).",
        "",
        "| pattern | " + " | ".join(f"N = {n}, {rate}" for n, rate in cells) + " |",
        "| --- |" + " ---: |" * len(cells),
    ]
    for name in PATTERNS:
        row = {(r["nodes"], r["rate"]): r["seconds"] for r in records if r["pattern"] == name}
        if row:
            shown = [f"{row[c]:.3f}" if c in row else "—" for c in cells]
            lines.append(f"| {name} | " + " | ".join(shown) + " |")
    return "\n".join(lines)
