"""The network benchmark's outputs: network.json records, the Markdown tables and the plot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import _netcluster as netcluster
import _report
import numpy as np
from _methods import NETWORK
from _networker import PATTERNS, spec_of


def records_of(
    results: dict[str, Any], nodes: int, rate: str, links: list[float], local: bool,
    bytes_known: dict[tuple[int, str], float], allocator: str = "retain",
) -> list[dict[str, Any]]:  # fmt: skip
    """network.json records for one cell, with ratios to this cell's allreduce, run by run.

    Each record names its method as the registry describes it (`Spec.describe()`: method,
    options, sync, label), which is what `gradcomm.perfmodel` reads.
    """
    base = results["allreduce"]["runs"]
    out = []
    for label, res in results.items():
        if local and label == "allreduce":
            continue
        ratios = [t / b for t, b in zip(res["runs"], base, strict=True)]
        key = (nodes, label)
        if res["bytes"] is not None:
            bytes_known[key] = res["bytes"]
        out.append(
            {
                **spec_of(label).describe(),
                "nodes": nodes,
                "devices_per_process": 2 if local else 1,
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
                "bytes_per_step": bytes_known.get(key),
                "cycle": res["cycle"],
                "timing": "cycle-mean" if res["cycle"] > 1 else "median",
                "backend": "gloo",
                "exchange": "pairwise" if nodes & (nodes - 1) == 0 else "permute",
                "netem": False,
                "allocator": allocator,
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
    """Markdown: per node count, a row per method and a column per rate (ratio, seconds)."""
    lines = [
        "Step time relative to allreduce in the same run (seconds per step in brackets); "
        "measured link rate under each column. netem unavailable: no added delay.",
        "",
    ]
    for nodes in sorted({r["nodes"] for r in records}):
        cells = {(label_of(r), r["rate"]): r for r in records if r["nodes"] == nodes}
        link = {
            rate: next((r["link_mbit_measured"] for (_, q), r in cells.items() if q == rate), None)
            for rate in rates
        }
        head = [f"{rate} ({link[rate]:.0f} Mbit/s)" if link[rate] else rate for rate in rates]
        lines += [f"**N = {nodes}**", "", "| method | " + " | ".join(head) + " | bytes/step |"]
        lines.append("| --- |" + " ---: |" * (len(rates) + 1))
        for label in NETWORK:
            row = [cells.get((label, rate)) for rate in rates]
            if not any(row):
                continue
            sent = next((c["bytes_per_step"] for c in row if c and c["bytes_per_step"]), None)
            text = [f"{c['ratio_vs_allreduce']:.2f} ({c['step_s']:.3f})" if c else "—" for c in row]
            shown = f"{sent:,.0f}" if sent else "—"
            lines.append(f"| {label} | " + " | ".join(text) + f" | {shown} |")
        lines.append("")
    return "\n".join(lines)


def plot(records: Sequence[dict[str, Any]], path: Any) -> None:
    """Step time against link bandwidth, one line per method, a panel per node count."""
    node_counts = sorted({r["nodes"] for r in records})
    params = max(r["params"] for r in records)

    def draw(fig: Any) -> None:
        axes = np.atleast_1d(fig.subplots(1, len(node_counts)))
        for ax, nodes in zip(axes, node_counts, strict=True):
            for label in NETWORK:
                rows = [r for r in records if r["nodes"] == nodes and label_of(r) == label]
                rows = sorted(
                    (r for r in rows if r["link_mbit_measured"]),
                    key=lambda r: r["link_mbit_measured"],
                )
                if rows:
                    ax.plot(
                        [r["link_mbit_measured"] for r in rows], [r["step_s"] for r in rows],
                        label=label, **_report.style(label),
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
