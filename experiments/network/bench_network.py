#!/usr/bin/env python
"""Step time on an emulated network: every method against allreduce, on shaped links.

    sudo python experiments/network/bench_network.py                   # the default grid: ~45 min
    python experiments/network/bench_network.py --nodes 2,4 --rates 100mbit,unshaped --steps 10
    python experiments/network/bench_network.py --nodes 2 --methods allreduce --peer --threads 1
    python experiments/network/bench_network.py --mesh tp,fsdp --nodes 2 --rates 100mbit,unshaped
    # How long a run takes depends on its grid: it grows with the node counts, rates,
    # methods, --steps and --runs, and the 100mbit cells take longest. The ~45 min of the
    # default grid (N = 2, 4; unshaped, 1gbit, 100mbit; every method; 20 steps) is an
    # estimate from the runs of docs/bench/network.md, which timed 15 methods (the registry
    # has more now): 19.4 min for the 100mbit and unshaped cells at --steps 10, 8.8 min for
    # the 1gbit cells at 20 steps. Each run's network.md records its own time.

For each node count N and link rate, the script builds a cluster of N hosts (network
namespaces joined by a bridge, each link shaped with tc's token bucket filter; see
`gradcomm_experiments.network.cluster`), proves the shaping with plain TCP sockets, then
starts one JAX process per host (gloo collectives over the shaped links, one CPU device
each; `network.worker`) that trains a ~4M-parameter MLP with Adam under
`gradcomm.parallel.train_step` with every method of the registry
(`gradcomm_experiments.methods`). `network.report` writes the records and tables.

The mesh is the default one, one axis across the hosts, and the methods their defaults:
each step's first call times its `exchange="auto"` swaps (Adasum's, SGP's, D-PSGD's)
both ways, as `ppermute`s and as two-member reduce-scatters (gloo runs a swapping
`ppermute` at half speed), and keeps the faster (`parallel.TrainStep.probe`); the
`-permute` and `-pairwise` rows force one. Each record keeps its step's probe.
`--patterns` times the raw collectives instead of the methods. `--utilization` times
training alone (no communication) and Streaming DiLoCo's, DiLoCo's and local SGD's variants
(`network.utilization`: H = 20 and 100, delays 0 and 1) and writes utilization.json and
utilization.md: each variant's step against training alone's, the compute utilization of
issue 30.

Timing: after an untimed warm-up (past 1-bit Adam's warm-up phase too, which the benchmark
shortens to `network.worker.ONEBIT_WARMUP` steps; their median step after the compiling one
is kept apart as `warmup_step_s`), each method runs `--steps` timed steps per run, the
methods taking turns (interleaved, in a rotated order each run); a cell is the median over
runs of each run's median step. Where a method's cost repeats in a cycle (an averaging
period, gossip phases) whole cycles are timed and the run's figure is the mean step, so
the expensive step is counted. Each cell's ratio is taken against allreduce's time in the same run.
Unshaped cells, bound by compute and noisy, take `--runs` runs; shaped cells, bound by the
link and repeatable, `--shaped-runs`. Bytes per step are the steady state's, read from
the compiled program (`gradcomm.wire`): on average over the method's period, and in its
most expensive step after the warm-ups (`peak_bytes_per_step`: DiLoCo's outer step,
Streaming DiLoCo's largest fragment).

Meshes (`--mesh`, default flat): `tp` runs two CPU devices per host, the data axis across
the hosts and a model axis of 2 inside each, and trains the same MLP tensor-parallel (the
first layer split by columns, the second by rows with a psum over the model axis); `fsdp`
also splits every kernel over the data axis (ZeRO-3), so each method must reduce-scatter
(allreduce's is a plain psum_scatter; the methods that can are `network.mesh.FSDP`'s). Each
ratio is against allreduce on the same mesh in the same run; see `network.mesh`.

Allocator: by default (`--allocator retain`) the workers run with glibc's malloc told to
keep and reuse freed memory (`RETAIN_TUNABLES`). XLA:CPU allocates each step's
temporaries afresh; glibc hands allocations of over 32 MiB, and any that land in a
thread's arena, back to the kernel when freed, so the next step faults every page in
again. On the Firecracker VMs this was written on those page faults cost more than the
kernels: they doubled the step of the methods with large temporaries (LAGS, Adasum,
dropping) and left allreduce's nearly alone. `--allocator default` measures glibc's
defaults; each record says which ran.

Peer rows (`--peer`, off by default; needs PyTorch, `pip install -e ".[peer]"`): after
the JAX workers of a cell, on the same cluster and links, one PyTorch process per host
(`network.peer`) trains the same MLP (same widths, initial params and fixed batch,
`network.worker.mlp_init`) with Adam under DistributedDataParallel on gloo: without a
communication hook (`torch-allreduce`, the peers' baseline), with `fp16_compress_hook`
(`torch-fp16`) and with `powerSGD_hook` at rank 2 (`torch-powersgd`), the hooks of
PyTorch's "DDP Communication Hooks" documentation. They are timed as the JAX rows are
(warm-up untimed, the variants interleaved in a rotated order, a run's median step, the
median over runs); each ratio is against torch-allreduce of the same run. Their records
say `"framework": "torch"` (the JAX rows, "jax"), and their provenance gives torch's
version. They measure what a PyTorch user would get from DDP's stock hooks on the same
links, next to gradcomm's methods; the absolute seconds of the two frameworks' allreduce
rows compare their steps, compute included.

Threads (`--threads K`): every worker process, JAX's and torch's, computes with K threads:
XLA:CPU's intra-op pool is sized to K by the CPU affinity mask while the backend starts
(`network.worker.compute_threads`; the mask is restored afterwards), and torch takes
`set_num_threads(K)` and `set_num_interop_threads(K)`. By default nothing is pinned: XLA
uses a thread per CPU and torch its own default. On a machine with fewer cores than
processes times threads, the processes still share the cores. Each record says which ran.

netem is not available on the machines this was written on: no delay or loss is added,
so links differ only in bandwidth. The script needs root, and removes every namespace it
made, on success, on error and on Ctrl-C.

Needs the experiments extra (`pip install -e ".[experiments]"`) for network.png
(matplotlib): without it the script exits before any cell runs. `--patterns` draws no plot.

Writes network.json (a list of records), network.md and network.png to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from gradcomm import perfmodel
from gradcomm_experiments import cli, methods, provenance
from gradcomm_experiments.network import cluster as netcluster
from gradcomm_experiments.network import mesh as netmesh
from gradcomm_experiments.network import report as netreport
from gradcomm_experiments.network import utilization as netutil

# The worker processes, one per host: modules of the installed package, run with -m.
WORKER = "gradcomm_experiments.network.worker"  # JAX: the methods, or raw collectives
PEER_WORKER = "gradcomm_experiments.network.peer"  # PyTorch DDP (`--peer`)

SEEDS = [0]  # the MLP's initial params and its fixed batch (`network.worker.mlp_task`)

# glibc malloc tunables (glibc >= 2.26) that keep freed memory mapped for reuse: one arena
# (thread arenas return large blocks to the kernel), no mmap for large blocks, no trimming.
RETAIN_TUNABLES = (
    "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
    "glibc.malloc.trim_threshold=4611686018427387904:glibc.malloc.top_pad=268435456"
)


PEER_INSTALL = (
    'pip install -e ".[peer]" (on a CPU-only machine, first `pip install torch '
    "--index-url https://download.pytorch.org/whl/cpu`: the CPU wheel, without the CUDA "
    "downloads)"
)


def worker_env(allocator: str) -> dict[str, str]:
    """The environment of a worker process: CPU JAX, and the allocator asked for."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    if allocator == "retain":
        env["GLIBC_TUNABLES"] = RETAIN_TUNABLES
    return env


def peer_env(allocator: str, master: str, port: int) -> dict[str, str]:
    """The environment of a PyTorch peer worker: the JAX workers' (allocator included),
    gloo bound to the host's interface, and host 0 as the rendezvous."""
    return {
        **worker_env(allocator),
        "GLOO_SOCKET_IFNAME": "veth0",
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
    }


EXPERIMENTS_INSTALL = 'pip install -e ".[experiments]"'
# What network.png needs beyond gradcomm's own dependencies (`report.save_figure`).
PLOT_MODULES = ("matplotlib", "cycler")


def plot_problem() -> str | None:
    """Why network.png cannot be drawn here (one line), or None when matplotlib is there.

    Checked before any cell runs, as the grid takes many minutes and the plot comes last.
    The modules are found, not imported: matplotlib's import writes its config directory,
    and the refusal without root stays one line.
    """
    for name in PLOT_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return (
                f"network.png needs matplotlib, which is not installed here (no module "
                f"{name!r}); install the experiments extra: {EXPERIMENTS_INSTALL} "
                "(--patterns draws no plot)"
            )
    return None


def parameter_count(text: str) -> float:
    """An argparse type: a parameter count, plain (4000000, 4e6) or with a k or M suffix
    (`gradcomm.perfmodel.parse_params`)."""
    try:
        return float(perfmodel.parse_params(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def torch_problem() -> str | None:
    """Why the peer rows cannot run here (one line), or None when torch imports."""
    try:
        import torch  # noqa: F401
    except (ImportError, OSError) as e:
        return f"--peer needs PyTorch, which does not import here ({e}); install it with " + (
            PEER_INSTALL
        )
    return None


def _results(procs: list[subprocess.Popen], timeout: float, what: str) -> dict[str, Any]:
    """Waits for the workers; the payload of process 0's `RESULT` line (RuntimeError, with
    `what`, if any failed). Kills the ones still running on the way out."""
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [i for i, p in enumerate(procs) if p.returncode]
    if failed:
        raise RuntimeError(f"{what}: worker(s) {failed} failed")
    result = next(line for line in outputs[0].splitlines() if line.startswith("RESULT "))
    return json.loads(result[len("RESULT ") :])


def run_cell(
    nodes: int, rate: str, args: argparse.Namespace, *, peer: bool = False, **extra: Any
) -> tuple[dict[str, Any], list[float], dict[str, Any] | None]:
    """One cluster, one worker process per host: process 0's payload (`"results"`, the
    `"devices"` the workers ran on as `provenance.devices_info` gives them, and on a 2-D
    mesh the `"mesh"`), the links, and with `peer` the PyTorch peer workers' payload
    (`network.peer`, run on the same cluster afterwards; else None).

    `extra` goes into the workers' config (`mode="patterns"` times raw collectives,
    `mesh="tp"` or `"fsdp"` runs `network.mesh.worker`).
    """
    shaped = rate != netcluster.UNSHAPED
    runs = args.shaped_runs if shaped else args.runs
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
                "runs": runs,
                "pattern_mib": args.pattern_mib,
                "pattern_repeats": args.pattern_repeats,
                "threads": args.threads,
                **extra,
            }
            argv = [sys.executable, "-m", WORKER, json.dumps(config)]
            env = worker_env(args.allocator)
            procs.append(
                cluster.popen(
                    i, argv, env=env, stdout=subprocess.PIPE,
                    stderr=None if (i == 0 and not args.quiet) else subprocess.DEVNULL, text=True,
                )
            )  # fmt: skip
        payload = _results(procs, args.timeout, f"N={nodes}, {rate}")
        peers = None
        if peer:  # the same links; a port of its own, apart from the JAX coordinator's
            procs = []
            env = peer_env(args.allocator, cluster.addresses[0], port + 1)
            for i in range(nodes):
                config = {"nodes": nodes, "process": i, "rate": rate, "params": args.params,
                          "steps": args.steps, "runs": runs, "threads": args.threads,
                          "timeout": args.timeout}  # fmt: skip
                argv = [sys.executable, "-m", PEER_WORKER, json.dumps(config)]
                procs.append(
                    cluster.popen(
                        i, argv, env=env, stdout=subprocess.PIPE,
                        stderr=None if (i == 0 and not args.quiet) else subprocess.DEVNULL,
                        text=True,
                    )
                )  # fmt: skip
            peers = _results(procs, args.timeout, f"PyTorch peers at N={nodes}, {rate}")
        return payload, links, peers


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = cli.make_parser(__doc__)
    parser.add_argument("--nodes", default="2,4", help="comma-separated host counts")
    parser.add_argument(
        "--rates", default="unshaped,1gbit,100mbit", help="comma-separated tc rates or unshaped"
    )
    parser.add_argument(
        "--methods",
        default=",".join(methods.NETWORK),
        help="comma-separated rows (allreduce always runs as the baseline)",
    )
    parser.add_argument("--mesh", default="flat", help=netmesh.HELP)
    parser.add_argument(
        "--params",
        type=parameter_count,
        default="4M",
        help="MLP parameters, about: a count such as 4M, 250k or 2e4",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per method per run")
    parser.add_argument("--runs", type=int, default=3, help="interleaved runs, unshaped cells")
    parser.add_argument("--shaped-runs", type=int, default=1, help="runs for shaped cells")
    parser.add_argument(
        "--allocator",
        choices=("retain", "default"),
        default="retain",
        help="workers' glibc malloc: keep freed memory for reuse, or glibc's defaults",
    )
    parser.add_argument(
        "--peer",
        action="store_true",
        help="also time PyTorch DDP on the same cluster (off by default): no hook, "
        'fp16_compress_hook, powerSGD_hook; needs torch: pip install -e ".[peer]"',
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads per worker process, JAX (XLA:CPU's intra-op pool) and torch "
        "alike (default: not pinned, each framework's own default)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per cell")
    parser.add_argument("--out", default="runs/bench_network", help="output directory")
    parser.add_argument("--quiet", action="store_true", help="no per-method progress")
    parser.add_argument(
        "--patterns", action="store_true", help="time raw collectives instead of methods"
    )
    parser.add_argument(
        "--utilization", action="store_true",
        help="time training alone and Streaming DiLoCo's variants (network.utilization) "
        "instead of the methods; writes utilization.json and utilization.md",
    )  # fmt: skip
    parser.add_argument(
        "--variants", type=lambda text: [v.strip() for v in text.split(",") if v.strip()],
        default=None, help="with --utilization: comma-separated variants to time beside the "
        f"baselines (default: all of {', '.join(netutil.VARIANTS)})",
    )  # fmt: skip
    parser.add_argument("--pattern-mib", type=float, default=16, help="MiB per device")
    parser.add_argument("--pattern-repeats", type=int, default=5, help="calls per pattern")
    args = parser.parse_args(argv)
    try:
        args.node_list = [int(n) for n in args.nodes.split(",")]
        args.rate_list = [r.strip() for r in args.rates.split(",")]
        for rate in args.rate_list:
            netcluster.parse_rate(rate)
    except ValueError as e:
        parser.error(str(e))
    if min(args.node_list) < 2:
        parser.error("--nodes: every node count must be at least 2")
    try:
        args.mesh_list = netmesh.parse(args.mesh, args.node_list, args.patterns, args.peer)
    except ValueError as e:
        parser.error(str(e))
    try:
        labels = methods.parse(args.methods)
    except ValueError as e:
        parser.error(str(e))
    args.labels = ["allreduce", *[m for m in labels if m != "allreduce"]]
    if args.steps < 1 or args.runs < 1 or args.shaped_runs < 1:
        parser.error("--steps, --runs and --shaped-runs must be at least 1")
    cpus = len(os.sched_getaffinity(0))
    if args.threads is not None and not 1 <= args.threads <= cpus:
        parser.error(f"--threads must be between 1 and the {cpus} CPUs this process may use")
    if args.peer and args.patterns:
        parser.error("--peer times training steps: it does not go with --patterns")
    if args.utilization and (args.patterns or args.peer or args.mesh_list != ["flat"]):
        parser.error("--utilization runs its own rows on the flat mesh: no --patterns, --peer "
                     "or --mesh with it")  # fmt: skip
    unknown = sorted(set(args.variants or ()) - set(netutil.VARIANTS))
    if args.variants is not None and (unknown or not args.variants or not args.utilization):
        known, bad = ", ".join(netutil.VARIANTS), ", ".join(unknown) or "none"
        parser.error(f"--variants goes with --utilization, some of {known}; unknown: {bad}")
    if args.peer:
        problem = torch_problem()
        if problem:
            parser.exit(2, f"bench_network: {problem}\n")
    if not (args.patterns or args.utilization):
        problem = plot_problem()
        if problem:
            parser.exit(2, f"bench_network: {problem}\n")
    return args


def stamped(records: list[dict[str, Any]], stamp: provenance.Stamp) -> list[dict[str, Any]]:
    """The records, each with its provenance: its cell's devices, the run's wall time now;
    a peer row's also torch's version."""
    for r in records:
        torch = r["provenance"].get("torch")
        r["provenance"] = stamp.record(r["provenance"], seeds=SEEDS)
        if torch:
            r["provenance"]["torch"] = torch
    return records


def measure_patterns(
    args: argparse.Namespace, out: pathlib.Path, stamp: provenance.Stamp
) -> list[dict[str, Any]]:
    """Times raw collectives per node count and rate; writes patterns.json and patterns.md."""
    records = []
    for nodes in args.node_list:
        for rate in args.rate_list:
            payload, links, _ = run_cell(nodes, rate, args, mode="patterns")
            link = sum(links) / len(links) if links else None
            devices = payload["devices"]
            for name, seconds in payload["results"].items():
                records.append(
                    {"pattern": name, "nodes": nodes, "rate": rate, "seconds": seconds,
                     "mib": args.pattern_mib, "link_mbit_measured": link, "provenance": devices}
                )  # fmt: skip
    (out / "patterns.json").write_text(json.dumps(stamped(records, stamp), indent=1))
    text = netreport.pattern_table(records, args.pattern_mib, args.pattern_repeats)
    (out / "patterns.md").write_text(text + "\n")
    print(text)
    return records


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    stamp = provenance.start(argv)
    args = parse_args(argv)
    problem = netcluster.root_problem()
    if problem:
        raise SystemExit(f"bench_network: {problem}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.patterns:
        return measure_patterns(args, out, stamp)
    if args.utilization:
        return [netutil.measure(args, out, stamp, run_cell, SEEDS)]
    plan = netmesh.plan(args.mesh_list, args.labels)
    records: list[dict[str, Any]] = []
    bytes_known: dict[tuple[str, int, str], dict[str, Any]] = {}
    start = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="bench_network_cache_")
    for nodes in args.node_list:
        for rate in args.rate_list:
            for mesh, group, is_local in plan:
                todo = [m for m in group if (mesh, nodes, m) not in bytes_known]
                extra = {} if mesh == "flat" else {"mesh": mesh, "tag": f" {mesh}"}
                payload, links, peers = run_cell(
                    nodes, rate, args, labels=group, local=is_local, measure_bytes=bool(todo),
                    cache=cache, peer=args.peer and mesh == "flat" and not is_local, **extra,
                )  # fmt: skip
                cell = netreport.records_of(
                    payload["results"], nodes, rate, links, is_local, bytes_known,
                    args.allocator, args.threads, mesh=payload.get("mesh"),
                )  # fmt: skip
                records += [{**r, "provenance": payload["devices"]} for r in cell]
                if peers is not None:
                    cell = netreport.peer_records_of(
                        peers, nodes, rate, links, args.allocator, args.threads
                    )
                    device = {**peers["devices"], "torch": peers["torch"]}
                    records += [{**r, "provenance": device} for r in cell]
                (out / "network.json").write_text(json.dumps(stamped(records, stamp), indent=1))
    shutil.rmtree(cache, ignore_errors=True)
    for r in records:  # bytes were measured in the first cell of each mesh and node count
        if r["framework"] == "jax":
            r.update(bytes_known.get((r["mesh"], r["nodes"], r["label"]), {}))
    (out / "network.json").write_text(json.dumps(stamped(records, stamp), indent=1))
    text = netreport.table(records, args.rate_list)
    elapsed = time.perf_counter() - start
    flags = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python experiments/network/bench_network.py {flags}".strip()
    (out / "network.md").write_text(f"`{command}` ({elapsed / 60:.1f} min)\n\n{text}\n")
    netreport.plot(records, out / "network.png")
    print(f"\n{text}\nwrote {out}/network.json, network.md, network.png")
    return records


if __name__ == "__main__":
    main()
