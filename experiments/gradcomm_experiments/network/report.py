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

import numpy as np

from gradcomm_experiments import report
from gradcomm_experiments.methods import NETWORK
from gradcomm_experiments.network import cluster as netcluster
from gradcomm_experiments.network.mesh import MESHES
from gradcomm_experiments.network.patterns import PATTERNS
from gradcomm_experiments.network.peer import BASELINE, BUCKET_CAP_MB, HOOKS, VARIANTS
from gradcomm_experiments.network.worker import spec_of

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
    bytes_known: dict[tuple[str, int, str], dict[str, Any]], allocator: str = "retain",
    threads: int | None = None, mesh: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """network.json records for one cell, with ratios to this cell's allreduce, run by run.

    Each record names its method as the registry describes it (`Spec.describe()`: method,
    options, sync, label), which is what `gradcomm.perfmodel` reads. `threads` is the
    workers' compute threads (`--threads`; None: not pinned). `mesh` is a 2-D mesh's
    description (`network.mesh.worker`: name, axes, data axes, param specs, batch); None for
    the flat rows. `bytes_known` keeps each (mesh, nodes, label)'s bytes from the cell that
    measured them. Each record's `exchange` is its method's own option, else what its
    step's probe chose for "auto" (`probe`: a `parallel.StepProbe` as a dict), else None
    (no swap to choose).
    """
    base = results["allreduce"]["runs"]
    name = mesh["name"] if mesh else "flat"
    out = []
    for label, res in results.items():
        if local and label == "allreduce":
            continue
        key = (name, nodes, label)
        if res["bytes"] is not None:
            bytes_known[key] = {
                "bytes_per_step": res["bytes"],
                "peak_bytes_per_step": res.get("peak_bytes"),
            }
            if mesh:
                bytes_known[key].update(
                    link_bytes_per_step=res["link_bytes"], bytes_by_axes=res["bytes_by_axes"]
                )
        known = bytes_known.get(key, {})
        where: dict[str, Any] = {"mesh": name}
        if mesh:
            where.update(
                mesh_axes=mesh["axes"], data_axes=mesh["data_axes"],
                param_specs=mesh["param_specs"], batch=mesh["batch"],
                baseline="allreduce (psum_scatter)" if name == "fsdp" else "allreduce",
                link_bytes_per_step=known.get("link_bytes_per_step"),
                bytes_by_axes=known.get("bytes_by_axes"),
            )  # fmt: skip
        out.append(
            {
                **spec_of(label).describe(),
                **_timed(res, base, nodes, rate, links),
                **where,
                "devices_per_process": 2 if local or mesh else 1,
                "bytes_per_step": known.get("bytes_per_step"),
                "peak_bytes_per_step": known.get("peak_bytes_per_step"),
                "warmup_step_s": res.get("warmup_step_s"),
                "cycle": res["cycle"],
                "timing": "cycle-mean" if res["cycle"] > 1 else "median",
                "backend": "gloo",
                "exchange": spec_of(label).options.get("exchange")
                or (res["probe"]["exchange"] if res.get("probe") else None),
                "probe": res.get("probe"),
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
    """network.json records of one cell's PyTorch DDP peer rows (`network.peer`).

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


MESH_CAPTION = (
    "Meshes tp and fsdp (`--mesh`, `gradcomm_experiments.network.mesh`): 2 CPU devices per host, "
    "the data axes across the hosts (over the shaped links) and a model axis of 2 inside each host "
    "(in-process collectives, no network); the same MLP, tensor-parallel: the first layer split by "
    "columns, the second by rows with a psum over 'model', the classifier whole. fsdp also splits "
    "each kernel's leading dimension over the data axes (gathered for the forward; each method "
    "reduce-scatters the gradient). Each ratio is against allreduce on the same mesh in the same "
    "run (on fsdp, its plain psum_scatter)."
)


def mesh_of(record: dict[str, Any]) -> str:
    """The mesh a record ran on: "flat" for records from before `--mesh`, and peer rows."""
    return record.get("mesh") or "flat"


def panels(records: Sequence[dict[str, Any]]) -> list[tuple[str, int]]:
    """The (mesh, node count) pairs of the records: the flat mesh first, in `--mesh` order."""
    order = {m: i for i, m in enumerate(MESHES)}
    found = {(mesh_of(r), r["nodes"]) for r in records}
    return sorted(found, key=lambda p: (order.get(p[0], len(order)), p[0], p[1]))


def table(records: Sequence[dict[str, Any]], rates: Sequence[str]) -> str:
    """Markdown: per mesh and node count, a row per method and a column per rate (ratio,
    seconds). The flat rows' bytes are all a device sends (on average per step, and where
    records have it, in the most expensive step after the warm-ups); a 2-D mesh's are split
    into those over the data axes (across the links) and those over the model axis only.

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
    if any(mesh_of(r) != "flat" for r in records):
        lines.append(MESH_CAPTION)
    lines.append("")
    for mesh, nodes in panels(records):
        cells = {
            (label_of(r), r["rate"]): r
            for r in records
            if r["nodes"] == nodes and mesh_of(r) == mesh
        }
        link = {
            rate: next((r["link_mbit_measured"] for (_, q), r in cells.items() if q == rate), None)
            for rate in rates
        }
        head = [f"{rate} ({link[rate]:.0f} Mbit/s)" if link[rate] else rate for rate in rates]
        peaks = mesh == "flat" and any(c.get("peak_bytes_per_step") for c in cells.values())
        if mesh == "flat":
            lines += [f"**N = {nodes}**", "", "| method | " + " | ".join(head) + " | bytes/step |"
                      + (" peak bytes/step |" if peaks else "")]  # fmt: skip
            lines.append("| --- |" + " ---: |" * (len(rates) + 1 + peaks))
        else:
            some = next(iter(cells.values()))
            axes = " x ".join(f"{a} {n}" for a, n in some["mesh_axes"].items())
            specs = ", ".join(f"{k} {v}" for k, v in some["param_specs"].items())
            lines += [f"**N = {nodes}, mesh {mesh}** ({axes}; {specs})", ""]
            lines.append("| method | " + " | ".join(head) + " | bytes/step over the link "
                         "| bytes/step inside a host |")  # fmt: skip
            lines.append("| --- |" + " ---: |" * (len(rates) + 2))
        for label in [*NETWORK, *VARIANTS]:
            row = [cells.get((label, rate)) for rate in rates]
            if not any(row):
                continue
            text = [f"{c['ratio_vs_allreduce']:.2f} ({c['step_s']:.3f})" if c else "—" for c in row]
            sent = next((c["bytes_per_step"] for c in row if c and c["bytes_per_step"]), None)
            if mesh == "flat":
                peak = next((c.get("peak_bytes_per_step") for c in row if c and sent), None)
                shown = [sent, peak] if peaks else [sent]
            else:
                over = next((c["link_bytes_per_step"] for c in row if c and sent), None)
                shown = [over, None if over is None else sent - over]
            shown_text = " | ".join("—" if b is None else f"{b:,.0f}" for b in shown)
            name = PEER_NAMES.get(label, label)
            if mesh == "fsdp" and label == "allreduce":
                name = "allreduce (psum_scatter)"
            lines.append(f"| {name} | " + " | ".join(text) + f" | {shown_text} |")
        lines.append("")
    return "\n".join(lines)


def plot(records: Sequence[dict[str, Any]], path: Any) -> None:
    """Step time against link bandwidth, one line per method, a panel per mesh and node
    count; peer rows in grey, dotted."""
    shown = panels(records)
    params = max(r["params"] for r in records)

    def draw(fig: Any) -> None:
        axes = np.atleast_1d(fig.subplots(1, len(shown)))
        for ax, (mesh, nodes) in zip(axes, shown, strict=True):
            for label in [*NETWORK, *VARIANTS]:
                rows = [
                    r
                    for r in records
                    if r["nodes"] == nodes and mesh_of(r) == mesh and label_of(r) == label
                ]
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
                title=f"{nodes} hosts, {params / 1e6:.1f}M-parameter MLP, Adam"
                + ("" if mesh == "flat" else f", mesh {mesh}"),
            )  # fmt: skip
            ax.grid(alpha=0.3, which="both")
        fullest = max(axes, key=lambda ax: len(ax.get_lines()))
        fullest.legend(fontsize=7, ncol=2)

    report.save_figure(
        path,
        draw,
        title="Step time on an emulated network (tc tbf, gloo); rightmost point: unshaped",
        size=(6 * len(shown), 4.8),
    )


def _style(label: str) -> dict[str, Any]:
    """The registry's style of a method (`report.style`); grey and dotted for a peer row."""
    if label in VARIANTS:
        marker = "osD"[VARIANTS.index(label)]
        return {"color": "0.35", "marker": marker, "linestyle": ":", "markerfacecolor": "white"}
    return report.style(label)


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
