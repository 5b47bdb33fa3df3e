#!/usr/bin/env python
"""Step time on an emulated network: every method against allreduce, on shaped links.

    sudo python experiments/bench_network.py                   # the default grid, ~30 min
    python experiments/bench_network.py --nodes 2,4 --rates 100mbit,unshaped --steps 10

For each node count N and link rate, the script builds a cluster of N hosts (network
namespaces joined by a bridge, each link shaped with tc's token bucket filter; see
`_netcluster.py`), proves the shaping with plain TCP sockets, then starts one JAX process
per host (gloo collectives over the shaped links, one CPU device each) that trains a
~4M-parameter MLP with Adam under `gradcomm.parallel.train_step` with every method.

For a power-of-two N the hosts' axis is factored into size-2 axes
(`parallel.pairwise_axes`), so that the pairwise swaps of Adasum, SGP and D-PSGD run as
two-member collectives, which gloo runs at full speed both ways (a swapping `ppermute`
runs at half speed). `--patterns` times the raw collectives instead of the methods.

Timing: after warm-up, each method runs `--steps` timed steps per run, the methods taking
turns (interleaved, in a rotated order each run); a cell is the median over runs of each
run's median step. Where a method's cost repeats in a cycle (an averaging period, gossip
phases) whole cycles are timed and the run's figure is the mean step, so the expensive
step is counted. Each cell's ratio is taken against allreduce's time in the same run.
Unshaped cells, bound by compute and noisy, take `--runs` runs; shaped cells, bound by the
link and repeatable, `--shaped-runs`. Bytes per step are the steady state's, read from
the compiled program (`gradcomm.wire`).

Allocator: by default (`--allocator retain`) the workers run with glibc's malloc told to
keep and reuse freed memory (`RETAIN_TUNABLES`). XLA:CPU allocates each step's
temporaries afresh; glibc hands allocations of over 32 MiB, and any that land in a
thread's arena, back to the kernel when freed, so the next step faults every page in
again. On the Firecracker VMs this was written on those page faults cost more than the
kernels: they doubled the step of the methods with large temporaries (LAGS, Adasum,
dropping) and left allreduce's nearly alone. `--allocator default` measures glibc's
defaults; each record says which ran.

netem is not available on the machines this was written on: no delay or loss is added,
so links differ only in bandwidth. The script needs root, and removes every namespace it
made, on success, on error and on Ctrl-C.

Writes network.json (a list of records), network.md and network.png to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _netcluster as netcluster  # noqa: E402

# ----------------------------------------------------------------------------- methods


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row: a gradcomm factory with the options that differ from its defaults.

    `name` is the compare.py display name that `_common.make_method` builds; `local`
    marks the hierarchical row, which runs 2 devices per process (its local axis inside
    a host).
    """

    label: str
    method: str
    options: dict[str, Any]
    name: str
    local: bool = False


ENTRIES = (
    Entry("allreduce", "allreduce", {}, "allreduce"),
    Entry("adasum", "adasum", {}, "adasum"),
    Entry("adasum-hierarchical", "adasum", {"local_axis": "local"}, "adasum", local=True),
    # gloo's swaps as ppermutes: half speed on a slow link, less CPU than the exchanges.
    Entry("adasum-permute", "adasum", {"exchange": "permute"}, "adasum"),
    Entry(
        "adasum-hierarchical-permute",
        "adasum",
        {"local_axis": "local", "exchange": "permute"},
        "adasum",
        local=True,
    ),
    Entry("terngrad", "terngrad", {}, "terngrad"),
    Entry("lags-0.01", "lags", {"density": 0.01}, "lags"),
    Entry("lags-0.001", "lags", {"density": 0.001}, "lags"),
    Entry("slgs", "slgs", {"density": 0.01}, "slgs"),
    Entry("dropping", "gradient_dropping", {"warmup_steps": 0}, "dropping"),
    Entry(
        "dropping-local",
        "gradient_dropping",
        {"local": "compensated", "average_every": 50, "warmup_steps": 0},
        "dropping-local",
    ),
    Entry("local-sgd", "local_sgd", {}, "local-sgd"),
    Entry("sgp", "sgp", {}, "sgp"),
    Entry("osgp", "sgp", {"overlap": 1}, "osgp"),
    Entry("dpsgd", "dpsgd", {}, "dpsgd"),
)
BY_LABEL = {e.label: e for e in ENTRIES}


def build(entry: Entry, opt: Any, axis: Any = "data") -> Any:
    """The `_common.Method` of an entry, chained with the inner optimizer."""
    import _common
    import optax

    import gradcomm

    if entry.method == "adasum":
        return _common.Method(entry.label, optax.chain(opt, gradcomm.adasum(axis, **entry.options)))
    o = entry.options
    method = _common.make_method(
        entry.name,
        opt,
        axis=axis,
        float_leaves=None,
        density=o.get("density", 0.01),
        warmup_steps=o.get("warmup_steps", 0),
        average_every=o.get("average_every", 50),
    )
    return dataclasses.replace(method, name=entry.label)


def cycle(entry: Entry, nodes: int) -> int:
    """Steps after which the method's communication repeats (1: every step is alike)."""
    from gradcomm import topology

    if entry.method == "local_sgd":
        return 20  # local_sgd's default period
    if "average_every" in entry.options:
        return entry.options["average_every"]
    if entry.method in ("sgp", "dpsgd"):
        name = "exponential" if entry.method == "sgp" else "exponential-bidirectional"
        return topology.resolve(name, nodes).num_phases
    return 1


# ----------------------------------------------------------------------------- worker


def mlp_widths(params: float, d_in: int = 256, classes: int = 10) -> tuple[int, ...]:
    """Layer widths of a 2-hidden-layer MLP with about `params` parameters."""
    # h^2 + (d_in + classes + 2) h + classes = params
    b = d_in + classes + 2
    h = int((-b + math.sqrt(b * b + 4 * (params - classes))) / 2)
    return (d_in, max(h, 1), max(h, 1), classes)


def mlp_task(widths: Sequence[int], batch: int, seed: int = 0) -> tuple[Any, Any, Any]:
    """(init params, loss_fn with accuracy, one fixed global batch) for a ReLU MLP."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        params[f"w{i}"] = (rng.standard_normal((a, b)) * np.sqrt(2 / a)).astype(np.float32)
        params[f"b{i}"] = np.zeros(b, np.float32)
    layers = len(widths) - 1

    def loss_fn(p: Any, data: Any) -> tuple[jax.Array, dict]:
        x = data["x"]
        for i in range(layers):
            x = x @ p[f"w{i}"] + p[f"b{i}"]
            x = jax.nn.relu(x) if i + 1 < layers else x
        loss = optax.softmax_cross_entropy_with_integer_labels(x, data["y"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(x, -1) == data["y"])}

    data = {
        "x": rng.standard_normal((batch, widths[0])).astype(np.float32),
        "y": rng.integers(0, widths[-1], batch).astype(np.int32),
    }
    return params, loss_fn, data


def pairwise_mesh_axes(name: str, nodes: int) -> dict[str, int]:
    """Size-2 axes for a power-of-two host count (`parallel.pairwise_axes`), else one axis."""
    from gradcomm import parallel

    return parallel.pairwise_axes(name, nodes) if nodes & (nodes - 1) == 0 else {name: nodes}


def worker(config: dict[str, Any]) -> None:
    """One host's process: trains with every method, prints records (process 0) as JSON."""
    import _common

    local = config["local"]
    args = argparse.Namespace(
        devices=2 if local else 1,
        coordinator_address=config["coordinator"],
        num_processes=config["nodes"],
        process_id=config["process"],
    )
    devices = _common.setup(args)
    import jax
    import numpy as np
    import optax

    if config.get("cache"):  # later cells of the same node count reuse the compiled steps
        jax.config.update("jax_compilation_cache_dir", config["cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    from gradcomm import parallel

    nodes = config["nodes"]
    # The hosts' axis factored into size-2 axes, so that pairwise swaps (Adasum, SGP,
    # D-PSGD) run as full-duplex two-member collectives (`parallel.pairwise_axes`).
    host_axes = pairwise_mesh_axes("node" if local else "data", nodes)
    mesh = parallel.make_mesh({**host_axes, **({"local": 2} if local else {})}, devices=devices)
    axis: Any = tuple(host_axes)
    widths = mlp_widths(config["params"])
    host_params, loss_fn, data = mlp_task(widths, 32 * len(devices))
    num_params = sum(int(np.prod(v.shape)) for v in host_params.values())
    batch = parallel.shard_batch(data, mesh)
    labels = config["labels"]
    main = jax.process_index() == 0

    def log(text: str) -> None:
        if main:
            print(f"[{config['rate']} N={nodes}] {text}", file=sys.stderr, flush=True)

    runs: dict[str, Any] = {}
    for label in labels:
        entry = BY_LABEL[label]
        if local and label == "allreduce":  # the baseline averages over every device
            method = _common.make_method("allreduce", optax.adam(1e-4), axis=mesh.axis_names)
        else:
            method = build(entry, optax.adam(1e-4), axis)
        place = parallel.per_device if method.per_device else parallel.replicate
        params = place(host_params, mesh)
        state = parallel.init_state(method.tx, params, mesh, params_per_device=method.per_device)
        step = parallel.train_step(
            loss_fn, method.tx, mesh, has_aux=True, donate=True, params_per_device=method.per_device
        )
        sent = None
        if config["measure_bytes"]:
            sent = _common.bytes_per_step(method, loss_fn, mesh, params, data)
        every = cycle(entry, nodes)
        warm = max(3, every + 1)
        t0 = time.perf_counter()
        for _ in range(warm):
            params, state, metrics = step(params, state, batch)
            jax.block_until_ready(metrics)
        log(f"{label}: compiled and warmed up ({warm} steps) in {time.perf_counter() - t0:.1f}s")
        runs[label] = {"step": step, "params": params, "state": state, "cycle": every,
                       "bytes": sent, "times": []}  # fmt: skip

    steps = config["steps"]
    for r in range(config["runs"]):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in order:
            run = runs[label]
            count = math.ceil(steps / run["cycle"]) * run["cycle"]
            times = []
            params, state = run["params"], run["state"]
            for _ in range(count):
                t0 = time.perf_counter()
                params, state, metrics = run["step"](params, state, batch)
                jax.block_until_ready((params, metrics))
                times.append(time.perf_counter() - t0)
            run["params"], run["state"] = params, state
            stat = float(np.mean(times)) if run["cycle"] > 1 else float(np.median(times))
            run["times"].append(stat)
            log(f"run {r + 1}: {label} {stat:.4f} s/step")
    if main:
        out = {
            label: {
                "runs": run["times"],
                "bytes": run["bytes"],
                "cycle": run["cycle"],
                "params": num_params,
            }
            for label, run in runs.items()
        }
        print("RESULT " + json.dumps(out), flush=True)


PATTERNS = (
    "psum",
    "psum_scatter",
    "all_gather",
    "ppermute_ring",
    "ppermute_one_way",
    "ppermute_swap",
    "all_to_all",
    "pair_reduce_scatter",
    "pair_psum",
)


def pattern_worker(config: dict[str, Any]) -> None:
    """One host's process: times each raw collective on a buffer of `--pattern-mib` MiB.

    The buffer is each device's; `all_gather` gathers N pieces of 1/N of it. The two
    `pair_*` patterns run over one size-2 axis of a mesh whose devices are factored into
    size-2 axes (power-of-two N): a 2-member reduce-scatter of a 2-slot buffer (each
    device sends one buffer, as in a swap) and a 2-member psum of the buffer, which is
    what gradcomm's pairwise exchange runs (on the bits, as unsigned integers).
    """
    import _common

    args = argparse.Namespace(
        devices=1, coordinator_address=config["coordinator"],
        num_processes=config["nodes"], process_id=config["process"],
    )  # fmt: skip
    devices = _common.setup(args)
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    size = int(config["pattern_mib"] * 2**20 // 4)
    size -= size % (2 * n)
    flat = jax.make_mesh((n,), ("data",), devices=devices)
    bits = n.bit_length() - 1
    pair_names = tuple(f"b{i}" for i in range(bits)) if n == 1 << bits else ()
    pairs = jax.make_mesh((2,) * bits, pair_names, devices=devices) if pair_names else None

    def shift(pairs_: list[tuple[int, int]]) -> Any:
        return lambda x: lax.ppermute(x, "data", pairs_)

    bodies: dict[str, tuple[Any, Any, int]] = {
        "psum": (flat, lambda x: lax.psum(x, "data"), size),
        "psum_scatter": (flat, lambda x: lax.psum_scatter(x, "data", tiled=True), size),
        "all_gather": (flat, lambda x: lax.all_gather(x, "data", tiled=True), size // n),
        "ppermute_ring": (flat, shift([(i, (i + 1) % n) for i in range(n)]), size),
        "ppermute_one_way": (flat, shift([(i, i + 1) for i in range(0, n - 1, 2)]), size),
        "ppermute_swap": (flat, shift([(i, i ^ 1) for i in range(n - n % 2)]), size),
        "all_to_all": (flat, lambda x: lax.all_to_all(x, "data", 0, 0, tiled=True), size),
    }
    if pairs is not None:
        last = pair_names[-1]
        bodies["pair_reduce_scatter"] = (
            pairs, lambda x: lax.psum_scatter(x, last, tiled=True), 2 * size,
        )  # fmt: skip
        bodies["pair_psum"] = (pairs, lambda x: lax.psum(x, last), size)
    results: dict[str, float] = {}
    for name in PATTERNS:
        if name not in bodies:
            continue
        mesh, body, count = bodies[name]
        spec = P(mesh.axis_names)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                   check_vma=False))  # fmt: skip
        local = np.ones((count,), np.float32)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)
        times = []
        for k in range(config["pattern_repeats"] + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            if k:  # the first call sets up gloo's connections
                times.append(time.perf_counter() - t0)
        results[name] = float(np.median(times))
        if jax.process_index() == 0:
            print(f"[{config['rate']} N={n}] {name}: {results[name]:.3f} s", file=sys.stderr)
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(results), flush=True)


# ----------------------------------------------------------------------------- driver

# glibc malloc tunables (glibc >= 2.26) that keep freed memory mapped for reuse: one arena
# (thread arenas return large blocks to the kernel), no mmap for large blocks, no trimming.
RETAIN_TUNABLES = (
    "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
    "glibc.malloc.trim_threshold=4611686018427387904:glibc.malloc.top_pad=268435456"
)


def worker_env(allocator: str) -> dict[str, str]:
    """The environment of a worker process: CPU JAX, and the allocator asked for."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    if allocator == "retain":
        env["GLIBC_TUNABLES"] = RETAIN_TUNABLES
    return env


def run_cell(
    nodes: int, rate: str, args: argparse.Namespace, **extra: Any
) -> tuple[dict[str, Any], list[float]]:
    """One cluster, one worker process per host: the worker's result, and the links.

    `extra` goes into the workers' config (`mode="patterns"` times raw collectives).
    """
    shaped = rate != netcluster.UNSHAPED
    with netcluster.Cluster(nodes, rate) as cluster:
        links = cluster.measure_links()
        if links:
            shown = ", ".join(f"{m:.1f}" for m in links)
            print(f"[{rate} N={nodes}] links measured (Mbit/s): {shown}", flush=True)
        port = 20000 + os.getpid() % 20000
        procs = []
        for i in range(nodes):
            config = {
                "coordinator": f"{cluster.addresses[0]}:{port}",
                "nodes": nodes,
                "process": i,
                "rate": rate,
                "params": args.params,
                "steps": args.steps,
                "runs": args.shaped_runs if shaped else args.runs,
                "pattern_mib": args.pattern_mib,
                "pattern_repeats": args.pattern_repeats,
                **extra,
            }
            argv = [sys.executable, __file__, "--worker", json.dumps(config)]
            env = worker_env(args.allocator)
            procs.append(
                cluster.popen(
                    i, argv, env=env, stdout=subprocess.PIPE,
                    stderr=None if (i == 0 and not args.quiet) else subprocess.DEVNULL, text=True,
                )
            )  # fmt: skip
        try:
            outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failed = [i for i, p in enumerate(procs) if p.returncode]
        if failed:
            raise RuntimeError(f"worker(s) {failed} failed at N={nodes}, {rate}")
        result = next(line for line in outputs[0].splitlines() if line.startswith("RESULT "))
        return json.loads(result[len("RESULT ") :]), links


def records_of(
    results: dict[str, Any], nodes: int, rate: str, links: list[float], local: bool,
    bytes_known: dict[tuple[int, str], float], allocator: str = "retain",
) -> list[dict[str, Any]]:  # fmt: skip
    """network.json records for one cell, with ratios to this cell's allreduce, run by run."""
    import numpy as np

    base = results["allreduce"]["runs"]
    out = []
    for label, res in results.items():
        if local and label == "allreduce":
            continue
        entry = BY_LABEL[label]
        ratios = [t / b for t, b in zip(res["runs"], base, strict=True)]
        key = (nodes, label)
        if res["bytes"] is not None:
            bytes_known[key] = res["bytes"]
        out.append(
            {
                "method": entry.method,
                "options": entry.options,
                "label": label,
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


def table(records: Sequence[dict[str, Any]], rates: Sequence[str]) -> str:
    """Markdown: per node count, a row per method and a column per rate (ratio, seconds)."""
    lines = [
        "Step time relative to allreduce in the same run (seconds per step in brackets); "
        "measured link rate under each column. netem unavailable: no added delay.",
        "",
    ]
    for nodes in sorted({r["nodes"] for r in records}):
        cells = {(r["label"], r["rate"]): r for r in records if r["nodes"] == nodes}
        link = {
            rate: next((r["link_mbit_measured"] for (_, q), r in cells.items() if q == rate), None)
            for rate in rates
        }
        head = [f"{rate} ({link[rate]:.0f} Mbit/s)" if link[rate] else rate for rate in rates]
        lines += [f"**N = {nodes}**", "", "| method | " + " | ".join(head) + " | bytes/step |"]
        lines.append("| --- |" + " ---: |" * (len(rates) + 1))
        for entry in ENTRIES:
            row = [cells.get((entry.label, rate)) for rate in rates]
            if not any(row):
                continue
            sent = next((c["bytes_per_step"] for c in row if c and c["bytes_per_step"]), None)
            text = [f"{c['ratio_vs_allreduce']:.2f} ({c['step_s']:.3f})" if c else "—" for c in row]
            shown = f"{sent:,.0f}" if sent else "—"
            lines.append(f"| {entry.label} | " + " | ".join(text) + f" | {shown} |")
        lines.append("")
    return "\n".join(lines)


def plot(records: Sequence[dict[str, Any]], path: pathlib.Path) -> None:
    """Step time against link bandwidth, one line per method, a panel per node count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    node_counts = sorted({r["nodes"] for r in records})
    fig, axes = plt.subplots(1, len(node_counts), figsize=(6 * len(node_counts), 4.5))
    axes = list(axes) if len(node_counts) > 1 else [axes]
    cmap = plt.get_cmap("tab20")
    markers = "osD^vP*Xhp<>d"
    for ax, nodes in zip(axes, node_counts, strict=True):
        for k, entry in enumerate(ENTRIES):
            rows = [r for r in records if r["nodes"] == nodes and r["label"] == entry.label]
            rows = [r for r in rows if r["link_mbit_measured"]]
            if not rows:
                continue
            rows.sort(key=lambda r: r["link_mbit_measured"])
            ax.plot(
                [r["link_mbit_measured"] for r in rows], [r["step_s"] for r in rows],
                marker=markers[k % len(markers)], color=cmap(k), label=entry.label,
            )  # fmt: skip
        ax.set(
            xscale="log", yscale="log", xlabel="measured link bandwidth (Mbit/s)",
            ylabel="step time (s)", title=f"{nodes} hosts, 4M-parameter MLP, Adam",
        )  # fmt: skip
        ax.grid(alpha=0.3, which="both")
    axes[-1].legend(fontsize=7, ncol=2)
    fig.suptitle("Step time on an emulated network (tc tbf, gloo); rightmost point: unshaped")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--nodes", default="2,4", help="comma-separated host counts")
    parser.add_argument(
        "--rates", default="unshaped,1gbit,100mbit", help="comma-separated tc rates or unshaped"
    )
    parser.add_argument(
        "--methods",
        default=",".join(e.label for e in ENTRIES),
        help="comma-separated rows (allreduce always runs as the baseline)",
    )
    parser.add_argument("--params", type=float, default=4e6, help="MLP parameters (about)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per method per run")
    parser.add_argument("--runs", type=int, default=3, help="interleaved runs, unshaped cells")
    parser.add_argument("--shaped-runs", type=int, default=1, help="runs for shaped cells")
    parser.add_argument(
        "--allocator",
        choices=("retain", "default"),
        default="retain",
        help="workers' glibc malloc: keep freed memory for reuse, or glibc's defaults",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per cell")
    parser.add_argument("--out", default="runs/bench_network", help="output directory")
    parser.add_argument("--quiet", action="store_true", help="no per-method progress")
    parser.add_argument(
        "--patterns", action="store_true", help="time raw collectives instead of methods"
    )
    parser.add_argument("--pattern-mib", type=float, default=16, help="MiB per device")
    parser.add_argument("--pattern-repeats", type=int, default=5, help="calls per pattern")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    try:
        args.node_list = [int(n) for n in args.nodes.split(",")]
        args.rate_list = [r.strip() for r in args.rates.split(",")]
        for rate in args.rate_list:
            netcluster.parse_rate(rate)
    except ValueError as e:
        parser.error(str(e))
    if min(args.node_list) < 2:
        parser.error("--nodes: every node count must be at least 2")
    labels = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in labels if m not in BY_LABEL]
    if unknown:
        parser.error(f"unknown method(s) {unknown}: choose from {', '.join(BY_LABEL)}")
    args.labels = ["allreduce", *[m for m in labels if m != "allreduce"]]
    if args.steps < 1 or args.runs < 1 or args.shaped_runs < 1:
        parser.error("--steps, --runs and --shaped-runs must be at least 1")
    return args


def measure_patterns(args: argparse.Namespace, out: pathlib.Path) -> list[dict[str, Any]]:
    """Times raw collectives per node count and rate; writes patterns.json and patterns.md."""
    records = []
    for nodes in args.node_list:
        for rate in args.rate_list:
            results, links = run_cell(nodes, rate, args, mode="patterns")
            link = sum(links) / len(links) if links else None
            for name, seconds in results.items():
                records.append(
                    {"pattern": name, "nodes": nodes, "rate": rate, "seconds": seconds,
                     "mib": args.pattern_mib, "link_mbit_measured": link}
                )  # fmt: skip
    (out / "patterns.json").write_text(json.dumps(records, indent=1))
    cells = sorted({(r["nodes"], r["rate"]) for r in records})
    lines = [
        f"Median seconds per call, {args.pattern_mib:g} MiB per device "
        f"({args.pattern_repeats} calls after one warm-up call).",
        "",
        "| pattern | " + " | ".join(f"N = {n}, {rate}" for n, rate in cells) + " |",
        "| --- |" + " ---: |" * len(cells),
    ]
    for name in PATTERNS:
        row = {(r["nodes"], r["rate"]): r["seconds"] for r in records if r["pattern"] == name}
        if row:
            shown = [f"{row[c]:.3f}" if c in row else "—" for c in cells]
            lines.append(f"| {name} | " + " | ".join(shown) + " |")
    (out / "patterns.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return records


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.worker:
        config = json.loads(args.worker)
        (pattern_worker if config.get("mode") == "patterns" else worker)(config)
        return []
    problem = netcluster.root_problem()
    if problem:
        raise SystemExit(f"bench_network: {problem}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.patterns:
        return measure_patterns(args, out)
    flat = [m for m in args.labels if not BY_LABEL[m].local]
    local = [m for m in args.labels if BY_LABEL[m].local]
    records: list[dict[str, Any]] = []
    bytes_known: dict[tuple[int, str], float] = {}
    start = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="bench_network_cache_")
    for nodes in args.node_list:
        for rate in args.rate_list:
            for group, is_local in ((flat, False), (["allreduce", *local], True)):
                if is_local and len(group) == 1:
                    continue
                todo = [m for m in group if (nodes, m) not in bytes_known]
                results, links = run_cell(
                    nodes, rate, args, labels=group, local=is_local,
                    measure_bytes=bool(todo), cache=cache,
                )  # fmt: skip
                records += records_of(
                    results, nodes, rate, links, is_local, bytes_known, args.allocator
                )
                (out / "network.json").write_text(json.dumps(records, indent=1))
    shutil.rmtree(cache, ignore_errors=True)
    for r in records:  # bytes were measured in the first cell of each node count
        r["bytes_per_step"] = bytes_known.get((r["nodes"], r["label"]), r["bytes_per_step"])
    (out / "network.json").write_text(json.dumps(records, indent=1))
    text = table(records, args.rate_list)
    elapsed = time.perf_counter() - start
    flags = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python experiments/bench_network.py {flags}".strip()
    (out / "network.md").write_text(f"`{command}` ({elapsed / 60:.1f} min)\n\n{text}\n")
    plot(records, out / "network.png")
    print(f"\n{text}\nwrote {out}/network.json, network.md, network.png")
    return records


if __name__ == "__main__":
    main()
