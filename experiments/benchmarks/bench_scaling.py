#!/usr/bin/env python
"""Cost against the number of devices N of the sparse exchange and of Adasum's statistics.

    python experiments/benchmarks/bench_scaling.py                  # N = 1 .. 8, about two minutes
    python experiments/benchmarks/bench_scaling.py --sizes 1000000 --density 0.001 --repeats 50
    git worktree add /tmp/before HEAD && cd /tmp/before && \\
        PYTHONPATH=/tmp/before python /path/to/bench_scaling.py --out /tmp/scaling_before

For each N = 1 .. --devices (simulated CPU devices, one mesh axis "data"):

* sparse: `gradcomm.sparse.sum_sparse`, the exchange under `gradcomm.lags` and
  `gradcomm.gradient_dropping`, divided by N (the mean), on fixed (value, index) pairs:
  k = density * size per leaf, a share --overlap of each device's indices common to all
  devices (top-k indices of correlated gradients repeat across devices), the rest drawn
  at random. Reported from the compiled program: its scatter instructions, how many of
  them run per call (a while loop's body counted its trip count times), its while loops
  and sorts; the bytes each device sends (`gradcomm.wire`); the median time of a call;
  and the median time of a whole `gradcomm.lags` update of the same leaves.
* adasum: `gradcomm.adasum_reduce` of a tree of the same leaves: the bytes each device
  sends per level of the tree, split into the exchange of halves and the per-leaf
  statistics (the collectives' named scopes, `exchange` and `combine`, say which is
  which; `gradcomm.wire` says their bytes), and the median time of a call.

The simulated devices share the host's cores, so every time includes N devices' worth
of per-device work: compare times at one N, or before and after a change at each N.

Only gradcomm's public API is used (`gradcomm.sparse`, `gradcomm.lags`,
`gradcomm.adasum_reduce`, `gradcomm.wire`, `gradcomm.parallel`), so the same script
measures another checkout of the library put first on PYTHONPATH (the JSON records
which one, and its git commit). Writes bench_scaling.json, bench_scaling.md and
bench_scaling.png (bytes and time against N) to --out.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomm_experiments import cli, provenance, report
from gradcomm_experiments.timing import device_pairs, median_seconds

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?\s([a-z][a-z0-9-]*)\(")
_CALLEES = re.compile(
    r"\b(?:calls|to_apply|body|condition|branch_computations|true_computation|"
    r"false_computation)=(\{[^}]*\}|%[^\s,]+)"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_ops(text: str) -> dict[str, Any]:
    """Scatter, gather, sort and while instructions of an optimized HLO module.

    `runs` counts each op as often as it runs per call: a computation runs as often as
    its callers, times the trip count for a while loop's body (an unknown trip count
    counts once and sets `exact` to False).
    """
    ops: dict[str, collections.Counter[str]] = {}
    calls: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    entry, current, exact = "", "", True
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            ops[current] = collections.Counter()
            entry = current if line.startswith("ENTRY") else entry
            continue
        instruction = _INSTRUCTION.match(line)
        if not instruction or not current:
            continue
        op = instruction.group(2)
        ops[current][op] += 1
        trips = 1
        if op == "while":
            found = _TRIP_COUNT.search(line)
            exact = exact and found is not None
            trips = int(found.group(1)) if found else 1
        for group in _CALLEES.findall(line):
            for callee in re.findall(r"%([^\s,}]+)", group):
                calls[current].append((callee, trips))
    runs: collections.Counter[str] = collections.Counter()

    def visit(computation: str, times: int) -> None:
        for op, count in ops.get(computation, {}).items():
            runs[op] += count * times
        for callee, trips in calls[computation]:
            visit(callee, times * trips)

    visit(entry, 1)
    static: collections.Counter[str] = sum(ops.values(), collections.Counter())
    kinds = ("scatter", "gather", "sort", "while")
    return {
        **{k: static[k] for k in kinds},
        **{f"{k}_runs": runs[k] for k in kinds},
        "exact": exact,
    }


def phase_of(op_name: str) -> str:
    """The Adasum phase a collective belongs to, from its named scopes."""
    parts = op_name.split("/")
    for phase in ("exchange", "combine", "gather"):
        if phase in parts:
            return phase
    return "fold"


def adasum_levels(analysis: Any, text: str) -> dict[str, Any]:
    """Bytes one device sends per level (exchange and statistics), plus fold and gather.

    `analysis.collectives` are in program order; a level starts at each exchange.
    """
    scopes = {}
    for line in text.splitlines():
        instruction, name = _INSTRUCTION.match(line), _OP_NAME.search(line)
        if instruction and name:
            scopes[instruction.group(1)] = name.group(1)
    levels: list[dict[str, Any]] = []
    other = {"fold": 0.0, "gather": 0.0}
    for c in analysis.collectives:
        phase = phase_of(scopes.get(c.name, ""))
        if phase == "exchange":
            levels.append({"exchange_bytes": 0.0, "stats_bytes": 0.0, "stats": []})
        if phase == "exchange" or (phase == "combine" and levels):
            key = "exchange_bytes" if phase == "exchange" else "stats_bytes"
            levels[-1][key] += c.sent
            if phase == "combine":
                levels[-1]["stats"].append({"kind": c.kind, "group": c.group_size, "sent": c.sent})
        else:
            other["gather" if phase == "gather" else "fold"] += c.sent
    return {"levels": levels, **{f"{k}_bytes": v for k, v in other.items()}}


def measure(n: int, args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    import gradcomm
    from gradcomm import parallel, sparse, wire

    mesh = parallel.make_mesh({"data": n}, devices=jax.devices()[:n])
    sharding = NamedSharding(mesh, P("data"))

    def mapped(fn: Callable[..., Any]) -> Any:
        def body(*trees: Any) -> Any:
            return fn(*jax.tree.map(lambda x: x[0], trees))

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))

    rng = np.random.default_rng(args.seed + n)
    ks = [sparse.num_kept(size, args.density) for size in sizes]
    pairs = [device_pairs(n, size, k, args.overlap, rng) for size, k in zip(sizes, ks, strict=True)]
    placed = jax.device_put(pairs, sharding)

    def exchange(sent: list[tuple[jax.Array, jax.Array]]) -> list[jax.Array]:
        return sparse.sum_sparse(sent, sizes, "data", divide_by=n)

    fn = mapped(exchange)
    text = fn.lower(placed).compile().as_text()
    row: dict[str, Any] = {"n": n, "k": ks, **hlo_ops(text)}
    row["bytes"] = wire.analyze_hlo(text).total
    row["seconds"] = median_seconds(fn, (placed,), args.repeats)
    updates = jax.device_put(
        [rng.standard_normal((n, size)).astype(np.float32) for size in sizes], sharding
    )
    tx = gradcomm.lags("data", density=args.density)
    lags = mapped(lambda u: tx.update(u, tx.init(u))[0])
    row["lags_seconds"] = median_seconds(lags, (updates,), args.repeats)

    combine = mapped(lambda tree: gradcomm.adasum_reduce(tree, "data"))
    text = combine.lower(updates).compile().as_text()
    analysis = wire.analyze_hlo(text)
    adasum = {"n": n, **adasum_levels(analysis, text), "bytes": analysis.total}
    adasum["seconds"] = median_seconds(combine, (updates,), args.repeats)
    return {"sparse": row, "adasum": adasum}


def tables(result: dict[str, Any]) -> str:
    lines = [
        "Sparse exchange (`gradcomm.sparse.sum_sparse`, mean over N devices)",
        "",
        "| N | scatters | scatter runs | gathers | sorts | while loops | bytes/device "
        "| exchange ms | lags update ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["sparse"]:
        lines.append(
            f"| {r['n']} | {r['scatter']} | {r['scatter_runs']} | {r['gather']} | {r['sort']} "
            f"| {r['while']} | {r['bytes']:.0f} | {1e3 * r['seconds']:.3f} "
            f"| {1e3 * r['lags_seconds']:.3f} |"
        )
    lines += [
        "",
        "Adasum (`gradcomm.adasum_reduce`): bytes per device per level, halves + statistics",
        "",
        "| N | level: exchange + statistics bytes (the statistics' collectives) | fold | gather "
        "| total bytes | ms |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["adasum"]:
        levels = "; ".join(
            f"{j}: {lv['exchange_bytes']:.0f} + {lv['stats_bytes']:.0f} ("
            + ", ".join(f"{st['kind']} {st['sent']:.0f}" for st in lv["stats"])
            + ")"
            for j, lv in enumerate(r["levels"])
        )
        lines.append(
            f"| {r['n']} | {levels or '-'} | {r['fold_bytes']:.0f} | {r['gather_bytes']:.0f} "
            f"| {r['bytes']:.0f} | {1e3 * r['seconds']:.3f} |"
        )
    return "\n".join(lines)


def plot(fig: Any, result: dict[str, Any]) -> None:
    """Bytes each device sends and the median time, against N."""
    left, right = fig.subplots(1, 2)
    n = [r["n"] for r in result["sparse"]]
    sparse_kw, update_kw, adasum_kw = (
        report.style("lags"), report.style("lags", 1), report.style("adasum"),
    )  # fmt: skip
    left.plot(n, [r["bytes"] for r in result["sparse"]], label="sparse exchange", **sparse_kw)
    left.plot(n, [r["bytes"] for r in result["adasum"]], label="adasum_reduce", **adasum_kw)
    right.plot(n, [1e3 * r["seconds"] for r in result["sparse"]], label="sparse exchange",
               **sparse_kw)  # fmt: skip
    right.plot(n, [1e3 * r["lags_seconds"] for r in result["sparse"]], label="lags update",
               **update_kw)  # fmt: skip
    right.plot(n, [1e3 * r["seconds"] for r in result["adasum"]], label="adasum_reduce",
               **adasum_kw)  # fmt: skip
    left.set(xlabel="devices N", ylabel="bytes sent per device per call", yscale="symlog",
             title="bytes on the wire (gradcomm.wire)")  # fmt: skip
    right.set(xlabel="devices N", ylabel="median time per call (ms, log scale)", yscale="log",
              title="time (simulated devices share the cores)")  # fmt: skip
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> None:
    stamp = provenance.start(argv)
    parser = cli.make_parser(__doc__)
    parser.add_argument(
        "--devices", type=int, default=8, help="simulated CPU devices: N runs from 1 to this"
    )
    parser.add_argument(
        "--sizes", default="262144,16384,512", help="comma-separated leaf sizes (elements)"
    )
    parser.add_argument("--density", type=float, default=0.01, help="k / size per leaf")
    parser.add_argument(
        "--overlap", type=float, default=0.5, help="share of each device's indices common to all"
    )
    cli.add_outputs(
        parser,
        "runs/bench_scaling",
        repeats=(20, "timed calls per measurement"),
        seed="random seed of the pairs",
    )
    args = parser.parse_args(argv)

    def check(args: argparse.Namespace) -> None:
        args.size_list = cli.comma_list(args.sizes, int, "--sizes")
        if args.devices < 1 or args.repeats < 1 or min(args.size_list) < 1:
            raise ValueError("--devices, --repeats and every size must be at least 1")
        if not 0 < args.density <= 1 or not 0 <= args.overlap <= 1:
            raise ValueError("--density must be in (0, 1] and --overlap in [0, 1]")

    cli.check(parser, args, check)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts
    import gradcomm

    sizes = args.size_list
    steps = cli.progress(range(1, args.devices + 1), desc="N", quiet=args.quiet)
    rows = [measure(n, args, sizes) for n in steps]
    result = {
        "config": vars(args),
        "provenance": stamp.record(jax.devices(), seeds=[args.seed]),
        "gradcomm": str(pathlib.Path(gradcomm.__file__).parent),
        "jax": jax.__version__,
        "sparse": [r["sparse"] for r in rows],
        "adasum": [r["adasum"] for r in rows],
    }
    table = tables(result)
    out = report.write_bench(
        args.out,
        "bench_scaling",
        result,
        table,
        lambda fig: plot(fig, result),
        title=f"Cost against N: leaves of {args.sizes} elements, density {args.density:g}",
    )
    print(
        f"gradcomm from {result['gradcomm']}\n\n{table}\n\n"
        f"wrote {out}/bench_scaling.json, .md, .png"
    )


if __name__ == "__main__":
    main()
