#!/usr/bin/env python
"""Does communication overlap compute on XLA:CPU with gloo? Primitives, then a train step.

    sudo python experiments/benchmarks/bench_overlap.py                # loopback + 1gbit, N=2,4
    python experiments/benchmarks/bench_overlap.py --nodes 2 --rates loopback --repeats 3
    sudo python experiments/benchmarks/bench_overlap.py --mode train --nodes 4 --rates 1gbit

One JAX process per host, one CPU device each, gloo collectives (`loopback`: processes on
127.0.0.1; a tc rate such as `1gbit`: hosts in network namespaces with shaped links,
`gradcomm_experiments.network.cluster`, as root). Every figure is the median of
`--repeats` timed calls after a warm-up, each call blocked on.

`--mode primitives` times three jitted `shard_map` programs: (a) a `psum` of `--mib` MiB,
(b) an independent chain of `--matmuls` `--dim`-square matmuls, (c) both in one program
with no dependency between them. (c) near max(a, b) means XLA:CPU ran the collective
while it computed; near a + b, one after the other. Each `--flags` entry (XLA_FLAGS, `;`
between entries, `default` for none) is a cell of its own.

`--mode train` times the network benchmark's MLP (`--params`, Adam) under
`gradcomm.parallel.train_step` with `overlap=False` and `overlap=True`: allreduce, and
LAGS (`--density`) against SLGS; beside them the step's compute alone (the same step on
one process), its forward alone, and the all-reduce of the model alone. It reports
allreduce's overlapped step against max(compute, comm) and compute + comm, and LAGS's
speed-up from overlap against eq. 19's bound (`gradcomm.lags_speedup_bound`) for the
measured forward, backward and LAGS communication times. Writes bench_overlap.json and
bench_overlap.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from gradcomm_experiments import cli, provenance
from gradcomm_experiments.network import cluster as netcluster

LOOPBACK = "loopback"


def _median_time(fn: Any, args: Sequence[Any], repeats: int) -> float:
    """`timing.median_seconds` after one more warm-up call (the first compiles)."""
    import jax

    from gradcomm_experiments import timing

    jax.block_until_ready(fn(*args))  # compile
    return timing.median_seconds(fn, tuple(args), repeats)


def primitives(config: dict[str, Any], mesh: Any) -> dict[str, float]:
    """(a) psum alone, (b) compute alone, (c) both in one program: seconds each."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n, dim, k = mesh.size, config["dim"], config["matmuls"]
    words = int(config["mib"] * 2**20 / 4)
    spec = P("data")

    def chain(y: Any) -> Any:
        for _ in range(k):
            y = jnp.tanh(y @ y) * 0.5
        return y

    def alone_psum(x: Any, y: Any) -> Any:
        return jax.lax.psum(x, "data")

    def alone_chain(x: Any, y: Any) -> Any:
        return chain(y)

    def both(x: Any, y: Any) -> Any:
        return jax.lax.psum(x, "data"), chain(y)

    sharding = NamedSharding(mesh, spec)
    x = jax.make_array_from_callback((n * words,), sharding, lambda i: jnp.ones(words))
    y = jax.make_array_from_callback(
        (n * dim, dim), sharding, lambda i: jnp.eye(dim, dtype=jnp.float32) * 0.9
    )
    out = {}
    for name, body in (("psum", alone_psum), ("compute", alone_chain), ("both", both)):
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
        out[name] = _median_time(fn, (x, y), config["repeats"])
    return out


def train(config: dict[str, Any], mesh: Any) -> dict[str, float]:
    """The train-step cells of `--mode train`: seconds per step each."""
    import jax
    import numpy as np
    import optax

    import gradcomm
    from gradcomm import parallel
    from gradcomm_experiments.network import worker

    host_params, loss_fn, data = worker.mlp_task(worker.mlp_widths(config["params"]), 64)
    batch = parallel.shard_batch(data, mesh)
    adam = optax.adam(1e-4)
    density = config["density"]
    txs = {
        "allreduce": optax.chain(gradcomm.allreduce(), adam),
        "lags": optax.chain(adam, gradcomm.lags(density=density)),
        "slgs": optax.chain(adam, gradcomm.slgs(density=density)),
    }
    out: dict[str, float] = {}
    for name, tx in txs.items():
        for overlap in (False, True) if name != "slgs" else (False,):
            params = parallel.replicate(host_params, mesh)
            state = parallel.init_state(tx, params, mesh, overlap=overlap)
            step = parallel.train_step(loss_fn, tx, mesh, has_aux=True, overlap=overlap)
            carry = [params, state]

            def run(step: Any = step, carry: list[Any] = carry) -> Any:
                carry[0], carry[1], metrics = step(carry[0], carry[1], batch)
                return metrics["loss"]

            out[f"{name}{' overlap' if overlap else ''}"] = _median_time(run, (), config["repeats"])
    # Compute alone: the loss, the gradient and Adam on this process's rows, no collective.
    local = jax.tree.map(lambda x: np.asarray(x)[: len(x) // mesh.size], data)
    grad = jax.grad(lambda p, b: loss_fn(p, b)[0])

    @jax.jit
    def compute(p: Any, s: Any) -> Any:
        u, s = adam.update(grad(p, local), s, p)
        return optax.apply_updates(p, u), s

    params = jax.tree.map(jax.numpy.asarray, host_params)
    out["compute"] = _median_time(compute, (params, adam.init(params)), config["repeats"])
    out["forward"] = _median_time(jax.jit(loss_fn), (params, local), config["repeats"])
    flat = np.concatenate([np.ravel(v) for v in jax.tree.leaves(host_params)])
    out["comm"] = primitives_psum(flat.size, mesh, config["repeats"])
    out["params"] = float(flat.size)
    return out


def primitives_psum(words: int, mesh: Any, repeats: int) -> float:
    """Seconds for one psum of `words` float32 per device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("data"))
    x = jax.make_array_from_callback((mesh.size * words,), sharding, lambda i: jnp.ones(words))
    fn = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )
    )
    return _median_time(fn, (x,), repeats)


def worker_main(config: dict[str, Any]) -> None:
    """One host's process: join, run the mode's cells, print the result (process 0)."""
    from gradcomm_experiments.network import worker

    devices, _ = worker.start(config, 1)
    import jax

    from gradcomm import parallel

    mesh = parallel.make_mesh({"data": config["nodes"]}, devices=devices)
    result = primitives(config, mesh) if config["mode"] == "primitives" else train(config, mesh)
    if jax.process_index() == 0:
        result["devices"] = provenance.devices_info(devices)
        print("RESULT " + json.dumps(result), flush=True)


def run_cell(nodes: int, rate: str, flags: str, args: argparse.Namespace) -> dict[str, Any]:
    """One cluster (or loopback processes), one worker per host; process 0's result."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    if flags != "default":
        env["XLA_FLAGS"] = flags
    port = 21000 + (os.getpid() + nodes) % 20000
    keys = ("mode", "mib", "dim", "matmuls", "repeats", "params", "density")
    base = {k: getattr(args, k) for k in keys} | {"nodes": nodes, "rate": rate}
    argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker"]

    def launch(popen: Any, address: str) -> dict[str, Any]:
        procs = []
        for i in range(nodes):
            config = base | {"coordinator": f"{address}:{port}", "process": i}
            procs.append(popen(i, [*argv, json.dumps(config)]))
        try:
            outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"N={nodes} {rate} {flags}: a worker failed")
        line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
        return json.loads(line[len("RESULT ") :])

    def options(i: int) -> dict[str, Any]:
        err = None if (i == 0 and not args.quiet) else subprocess.DEVNULL
        return {"env": env, "stdout": subprocess.PIPE, "stderr": err, "text": True}

    if rate == LOOPBACK:
        return launch(lambda i, cmd: subprocess.Popen(cmd, **options(i)), "127.0.0.1")
    with netcluster.Cluster(nodes, rate) as cluster:
        return launch(lambda i, cmd: cluster.popen(i, cmd, **options(i)), cluster.addresses[0])


def verdicts(record: dict[str, Any]) -> dict[str, Any]:
    """The ratios each record is read by."""
    from gradcomm import lags_speedup_bound

    r = record["result"]
    if record["mode"] == "primitives":
        low, high = max(r["psum"], r["compute"]), r["psum"] + r["compute"]
        return {"max": low, "sum": high, "both/max": r["both"] / low, "both/sum": r["both"] / high}
    comm_lags = max(r["lags"] - r["compute"], 0.0)
    backward = max(r["compute"] - r["forward"], 1e-9)
    return {
        "max(compute, comm)": max(r["compute"], r["comm"]),
        "compute + comm": r["compute"] + r["comm"],
        "allreduce overlap / max": r["allreduce overlap"] / max(r["compute"], r["comm"]),
        "allreduce / allreduce overlap": r["allreduce"] / r["allreduce overlap"],
        "lags speed-up from overlap": r["lags"] / r["lags overlap"],
        "lags over slgs, overlapped": r["slgs"] / r["lags overlap"],
        "eq. 19 S_max": lags_speedup_bound(r["forward"], backward, comm_lags),
    }


def table(records: Sequence[dict[str, Any]]) -> str:
    lines = ["| N | link | XLA_FLAGS | times (ms) | ratios |", "| --- | --- | --- | --- | --- |"]
    for rec in records:
        times = ", ".join(
            f"{k} {v * 1e3:.1f}" for k, v in rec["result"].items() if isinstance(v, float)
            and k != "params"
        )  # fmt: skip
        ratios = ", ".join(f"{k} {v:.3g}" for k, v in rec["verdict"].items())
        lines.append(f"| {rec['nodes']} | {rec['rate']} | `{rec['flags']}` | {times} | {ratios} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = cli.make_parser(__doc__)
    parser.add_argument("--mode", choices=("primitives", "train"), default="primitives")
    parser.add_argument("--nodes", default="2,4", help="comma-separated process counts")
    parser.add_argument("--rates", default=f"{LOOPBACK},1gbit", help="loopback or tc rates")
    parser.add_argument(
        "--flags",
        default="default;--xla_cpu_enable_concurrency_optimized_scheduler=false",
        help="XLA_FLAGS per cell, ';'-separated ('default': none)",
    )
    parser.add_argument("--mib", type=float, default=32, help="psum size per device (MiB)")
    parser.add_argument("--dim", type=int, default=1024, help="matmul size")
    parser.add_argument("--matmuls", type=int, default=16, help="chained matmuls")
    parser.add_argument("--params", type=float, default=4.2e6, help="MLP parameters (train)")
    parser.add_argument("--density", type=float, default=0.01, help="LAGS/SLGS density")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per cell")
    cli.add_outputs(parser, "runs/bench_overlap", repeats=(5, "timed calls per cell"))
    args = parser.parse_args(argv)
    args.node_list = cli.comma_list(args.nodes, int, "--nodes")
    args.rate_list = [r for r in args.rates.split(",") if r]
    for rate in args.rate_list:
        if rate != LOOPBACK:
            netcluster.parse_rate(rate)
    args.flag_list = [f.strip() for f in args.flags.split(";") if f.strip()]
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        worker_main(json.loads(sys.argv[2]))
        return {}
    stamp = provenance.start(argv)
    args = parse_args(argv)
    if any(r != LOOPBACK for r in args.rate_list):
        problem = netcluster.root_problem(probe=True)
        if problem:
            raise SystemExit(f"shaped links need network namespaces: {problem}")
    records = []
    for nodes in args.node_list:
        for rate in args.rate_list:
            for flags in args.flag_list:
                result = run_cell(nodes, rate, flags, args)
                devices = result.pop("devices", None)
                rec = {"mode": args.mode, "nodes": nodes, "rate": rate, "flags": flags}
                rec["result"] = result
                rec["verdict"] = verdicts(rec)
                records.append(rec)
                if not args.quiet:
                    print(json.dumps(rec), flush=True)
    out = {"records": records, "provenance": stamp.record(devices, seeds=[0])}
    folder = pathlib.Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench_overlap.json").write_text(json.dumps(out, indent=1))
    (folder / "bench_overlap.md").write_text(table(records) + "\n")
    return out


if __name__ == "__main__":
    main()
