"""Compute utilization on a slow link (`bench_network.py --utilization`; issue 30).

Utilization is the step time of training alone, unshaped, over a method's average step
time on a shaped link (100 Mbit/s), at the same node count, over whole cycles of the
method's period. Training alone (`ALONE`) is the benchmark's step with no communication at
all: each host's own MLP, its forward and backward pass and Adam's update on its own
gradient, in one jitted `shard_map` that holds no collective (`alone_step`; the worker
checks from the compiled program, `gradcomm.wire`, that it sends nothing). `LOCAL` is the
step every method's runs (`parallel.train_step`, per-device params, no sync), keeping each
host's own loss and accuracy (`metrics="per_device"`), as every variant does: no collective
between syncs. `LOCAL_MEAN` is the same with `train_step`'s default metrics, their mean
over the hosts, a small all-reduce each step that makes every host wait for the slowest.

The variants (`VARIANTS`) are Streaming DiLoCo at the benchmark's H = 20 and its default
H = 100, with 2 (and 4) fragments, 4-bit (e3m0) or float32 outer gradients, and a delay of
1 (the exchange runs in the step after the sending one, from the sync state alone, so it
may overlap that step's compute) or 0 (inside the sending step); DiLoCo and local SGD
beside them. Each is timed as the network benchmark times a periodic method
(`network.worker.time_runs`: interleaved runs, whole cycles, the mean step), and each
step's time is kept by its phase in the cycle (`phase_s`), which shows what the syncing
steps cost.

A cell (a node count and rate) runs the `BASELINES`; a shaped cell also the variants.
`figures` reads the records: utilization against the unshaped cell's `ALONE` (the
definition) and against the same cell's (the same run and link), and, per pair of delays,
how much of the sync's cost the deferred exchange hides. Each row also records every
host's mean step, and a periodic row what waiting for the slowest host at its syncs costs
per step (`straggling`): between syncs the hosts step on their own and drift apart.
"""

from __future__ import annotations

import itertools
import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from gradcomm_experiments import methods
from gradcomm_experiments.network import cluster as netcluster
from gradcomm_experiments.network import worker as networker

ALONE = "training-alone"
LOCAL = "local-steps"
LOCAL_MEAN = "local-steps-mean"
BASELINES = (ALONE, LOCAL, LOCAL_MEAN)
TARGET = 0.9  # issue 30: Streaming DiLoCo with 4-bit outer gradients at 100 Mbit, N = 4


def _streaming(label: str, **options: Any) -> methods.Spec:
    return methods.Spec(label, "streaming_diloco", options)


VARIANTS: dict[str, methods.Spec] = {
    s.label: s
    for s in (
        _streaming("streaming-diloco", every=20),
        _streaming("streaming-diloco-d0", every=20, delay=0),
        _streaming("streaming-diloco-f32", every=20, outer_dtype="float32"),
        _streaming("streaming-diloco-f32-d0", every=20, outer_dtype="float32", delay=0),
        _streaming("streaming-diloco-h100", every=100),
        _streaming("streaming-diloco-h100-d0", every=100, delay=0),
        _streaming("streaming-diloco-h100-p4", every=100, fragments=4),
        methods.Spec("diloco", "diloco", {"every": 20}),
        methods.Spec("diloco-h100", "diloco", {"every": 100}),
        methods.Spec("local-sgd", "local_sgd", {"every": 20}),
        methods.Spec("local-sgd-h100", "local_sgd", {"every": 100}),
    )
}
# (delay 0, delay 1) of the same streaming configuration: the overlap's measure.
PAIRS = (
    ("streaming-diloco-d0", "streaming-diloco"),
    ("streaming-diloco-f32-d0", "streaming-diloco-f32"),
    ("streaming-diloco-h100-d0", "streaming-diloco-h100"),
)


def alone_step(loss_fn: Callable[..., Any], opt: Any, mesh: Any) -> tuple[Any, Any]:
    """(init, step) of training alone: per-device params and Adam state (a leading device
    axis), `step(params, state, batch) -> (params, state, {"loss": per device})`, jitted,
    donating params and state, with no collective."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    spec = P(mesh.axis_names)

    def own(tree: Any) -> Any:
        return jax.tree.map(lambda x: x[0], tree)

    def stacked(tree: Any) -> Any:
        return jax.tree.map(lambda x: x[None], tree)

    def body(params: Any, state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        params, state = own(params), own(state)
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        return stacked(params), stacked(state), {"loss": loss[None]}

    def init(params: Any) -> Any:
        return stacked(opt.init(own(params)))

    def mapped(fn: Callable[..., Any]) -> Any:
        return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)

    return jax.jit(mapped(init)), jax.jit(mapped(body), donate_argnums=(0, 1))


def worker(config: dict[str, Any]) -> None:
    """One host's process: times `config["labels"]` (of `BASELINES` and `VARIANTS`), one
    CPU device per host; process 0 prints `RESULT {"results": ..., "devices": ...}`."""
    from gradcomm_experiments import provenance

    devices, log = networker.start(config, 1)
    import jax
    import numpy as np
    import optax

    from gradcomm import parallel, wire

    mesh = parallel.make_mesh({"data": config["nodes"]}, devices=devices)
    widths = networker.mlp_widths(config["params"])
    host_params, loss_fn, data = networker.mlp_task(widths, 32 * len(devices))
    batch = parallel.shard_batch(data, mesh)
    runs: dict[str, Any] = {}
    for label in config["labels"]:
        opt, spec = optax.adam(1e-4), VARIANTS.get(label)
        if label == ALONE:
            params = parallel.per_device(host_params, mesh)
            init, step = alone_step(loss_fn, opt, mesh)
            state = init(params)
        else:  # each device's own metrics: no collective between syncs (but LOCAL_MEAN's)
            method = methods.build(spec, opt) if spec else methods.Method(label, opt, True)
            kind = "mean" if label == LOCAL_MEAN else "per_device"
            params, state, step = method.start(
                loss_fn, mesh, host_params, donate=True, metrics=kind
            )
        sent = wire.measure(step, params, state, batch)
        if label == ALONE and sent.total:
            raise RuntimeError(f"training alone sends {sent.total} bytes a step; it must not")
        every = spec.every if spec else 1
        runs[label] = networker.warm_up(label, step, params, state, batch, every, log)
        runs[label].update(bytes=sent.average, peak=networker.peak_after_warmup(sent))
    networker.time_runs(runs, config["labels"], batch, config, log)
    from jax.experimental import multihost_utils

    out = {}
    for label, run in runs.items():  # every process: each host's step times, (hosts, steps)
        hosts = np.asarray(multihost_utils.process_allgather(np.asarray(run["steps_s"])))
        every, warm = run["cycle"], max(3, run["cycle"] + 1)  # `warm_up`'s steps
        steps = [t for times in run["steps_s"] for t in times]
        phases = [
            float(np.median(steps[(p - warm) % every :: every])) for p in range(every)
        ]  # phase p: the steps whose 0-based index is p mod the cycle
        spec = VARIANTS.get(label)
        syncs = np.argsort(phases)[::-1][: _exchanges(spec.describe())] if spec else []
        wait = [straggling(h, warm % every, every, syncs) for h in np.moveaxis(hosts, 1, 0)]
        out[label] = {"runs": run["times"], "cycle": every, "bytes": run["bytes"],
                      "peak_bytes": run["peak"], "phase_s": phases,
                      "host_step_s": hosts.mean(axis=(1, 2)).tolist(),
                      "straggling_s": float(np.mean(wait))}  # fmt: skip
    if jax.process_index() == 0:
        result = {"results": out, "devices": provenance.devices_info(devices)}
        print("RESULT " + json.dumps(result), flush=True)


def straggling(hosts: Any, first_phase: int, every: int, syncs: Sequence[int]) -> float:
    """What waiting for the slowest host costs a periodic row, per step.

    Between two syncs the hosts step on their own and drift apart; at the sync the others
    wait for the slowest. Over each window of steps between two syncing steps (complete
    within the run), the slowest host's time less the hosts' mean, summed, over the steps
    from the run's first syncing step to its last (0 with fewer than two).

    Args:
      hosts: one run's step times, `(hosts, steps)`.
      first_phase: the phase in the cycle of the run's first step.
      every: the cycle's length.
      syncs: the phases of the steps that sync.
    """
    import numpy as np

    hosts = np.asarray(hosts)
    at = np.flatnonzero(np.isin((np.arange(hosts.shape[1]) + first_phase) % every, syncs))
    if len(at) < 2:
        return 0.0
    lost = 0.0
    for a, b in itertools.pairwise(at):
        window = hosts[:, a + 1 : b].sum(axis=1)
        lost += float(window.max() - window.mean())
    return lost / (at[-1] - at[0])


def labels_for(rate: str, variants: Sequence[str] | None = None) -> list[str]:
    """The rows a cell times: the baselines, and on a shaped link the variants too (those
    of `variants`, default all)."""
    chosen = [v for v in VARIANTS if variants is None or v in variants]
    return [*BASELINES, *(chosen if rate != netcluster.UNSHAPED else ())]


def records_of(
    payload: dict[str, Any], nodes: int, rate: str, links: Sequence[float]
) -> list[dict[str, Any]]:
    """utilization.json's records of one cell: per row its method (`Spec.describe()`; the
    baselines' own names), the median over runs of each run's mean step, the bytes a
    device sends per step (on average, and in the most expensive step), and its phases."""
    import numpy as np

    out = []
    for label, res in payload["results"].items():
        spec = VARIANTS.get(label)
        described = spec.describe() if spec else {"method": None, "options": {}, "label": label}
        out.append({**described, "nodes": nodes, "rate": rate,
                    "link_mbit_measured": float(np.mean(links)) if links else None,
                    "step_s": float(np.median(res["runs"])), "step_s_runs": res["runs"],
                    "cycle": res["cycle"], "timing": "cycle-mean" if res["cycle"] > 1 else "median",
                    "bytes_per_step": res["bytes"], "peak_bytes_per_step": res["peak_bytes"],
                    "phase_s": res["phase_s"], "host_step_s": res.get("host_step_s"),
                    "straggling_s": res.get("straggling_s"),
                    "backend": "gloo", "netem": False})  # fmt: skip
    return out


def figures(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per shaped cell and variant: its step, its utilization against the unshaped cell's
    training alone (None without that cell) and against the same cell's, its sync's cost
    per step (step less the same cell's training alone) and its syncing steps' extra time
    (its `fragments` slowest phases, or one, less its median phase); per `PAIRS` in a cell,
    the share of the delay-0 sync cost that delay 1 removes."""
    import numpy as np

    def find(label: str, nodes: int, rate: str) -> dict[str, Any] | None:
        got = [r for r in records if (r["label"], r["nodes"], r["rate"]) == (label, nodes, rate)]
        return got[-1] if got else None

    util, overlap = [], []
    for r in records:
        if r["label"] not in VARIANTS or r["rate"] == netcluster.UNSHAPED:
            continue
        here = find(ALONE, r["nodes"], r["rate"])
        base = find(ALONE, r["nodes"], netcluster.UNSHAPED)
        phases = np.sort(r["phase_s"])[::-1]
        syncs = _exchanges(r)
        util.append({
            "label": r["label"], "nodes": r["nodes"], "rate": r["rate"], "step_s": r["step_s"],
            "alone_unshaped_s": base and base["step_s"], "alone_same_cell_s": here["step_s"],
            "utilization": base and base["step_s"] / r["step_s"],
            "utilization_same_cell": here["step_s"] / r["step_s"],
            "sync_cost_s_per_step": r["step_s"] - here["step_s"],
            "sync_step_extra_s": float(np.mean(phases[:syncs]) - np.median(phases)),
            "straggling_s_per_step": r.get("straggling_s"),
        })  # fmt: skip
    for d0, d1 in PAIRS:
        for a in [r for r in records if r["label"] == d0]:
            b, here = find(d1, a["nodes"], a["rate"]), find(ALONE, a["nodes"], a["rate"])
            if b is None:
                continue
            cost = a["step_s"] - here["step_s"]
            overlap.append({
                "delay0": d0, "delay1": d1, "nodes": a["nodes"], "rate": a["rate"],
                "step_s_delay0": a["step_s"], "step_s_delay1": b["step_s"],
                "alone_s": here["step_s"], "sync_cost_delay0_s": cost,
                "hidden_share": (a["step_s"] - b["step_s"]) / cost if cost > 0 else None,
            })  # fmt: skip
    return {"utilization": util, "overlap": overlap}


def markdown(figs: dict[str, list[dict[str, Any]]], command: str, minutes: float) -> str:
    """utilization.md's tables: the command, each variant's utilization, the overlap, and
    every row's runs and phases."""
    import numpy as np

    def pct(x: float | None) -> str:
        return "—" if x is None else f"{100 * x:.1f}%"

    def sec(x: float | None) -> str:
        return "—" if x is None else f"{x:.4f}"

    lines = [
        f"`{command}` ({minutes:.1f} min)",
        "",
        "| N | rate | variant | step (s) | utilization | same cell | sync cost (s/step) "
        "| syncing step's extra (s) | waiting for the slowest host (s/step) |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for u in figs["utilization"]:
        cells = [u["nodes"], u["rate"], u["label"], f"{u['step_s']:.4f}", pct(u["utilization"]),
                 pct(u["utilization_same_cell"]), f"{u['sync_cost_s_per_step']:.4f}",
                 f"{u['sync_step_extra_s']:.4f}", sec(u.get("straggling_s_per_step"))]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += [
        "",
        "| N | rate | delay 0 | delay 1 | step, delay 0 (s) | step, delay 1 (s) "
        "| training alone (s) | share of the sync hidden |",
        "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for o in figs["overlap"]:
        steps = [f"{o[k]:.4f}" for k in ("step_s_delay0", "step_s_delay1", "alone_s")]
        cells = [o["nodes"], o["rate"], o["delay0"], o["delay1"], *steps, pct(o["hidden_share"])]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += [
        "",
        "Each row's step by run (each run's mean step over its timed steps), and by phase of "
        "its cycle (the median over the timed cycles): its ordinary step, and its slowest "
        "steps, one per exchange.",
        "",
        "| N | rate | row | step (s) | runs (s) | ordinary step (s) | slowest steps (s) "
        "| each host's mean step (s) |",
        "| ---: | --- | --- | ---: | --- | ---: | --- | --- |",
    ]
    for r in figs.get("records", []):
        phases = np.asarray(r["phase_s"])
        slowest = np.argsort(phases)[::-1][: _exchanges(r)]
        shown = ", ".join(f"{phases[i]:.3f} (step {i})" for i in slowest) if len(phases) > 1 else ""
        runs = ", ".join(f"{t:.4f}" for t in r["step_s_runs"])
        hosts = ", ".join(f"{t:.4f}" for t in r.get("host_step_s") or [])
        cells = [r["nodes"], r["rate"], r["label"], f"{r['step_s']:.4f}", runs,
                 f"{np.median(phases):.4f}", shown, hosts or "—"]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _exchanges(record: dict[str, Any]) -> int:
    """How many steps of a record's cycle exchange: a fragment's each, else one."""
    streaming = record["method"] == "streaming_diloco"
    return record["options"].get("fragments", 2) if streaming else 1


def measure(
    args: Any, out: pathlib.Path, stamp: Any, run_cell: Callable[..., Any], seeds: Sequence[int]
) -> dict[str, Any]:
    """Runs each cell of `args.node_list` x `args.rate_list` (`run_cell(nodes, rate, args,
    **config)`, bench_network's), writes utilization.json (records with provenance, and
    `figures`) and utilization.md to `out`; returns what utilization.json holds."""
    import time

    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    for nodes in args.node_list:
        for rate in args.rate_list:
            labels = labels_for(rate, args.variants)
            payload, links, _ = run_cell(nodes, rate, args, mode="utilization", labels=labels)
            cell = records_of(payload, nodes, rate, links)
            records += [{**r, "provenance": payload["devices"]} for r in cell]
            for r in records:  # each cell's devices, the run's wall time so far
                devices = r["provenance"].get("devices", r["provenance"])
                r["provenance"] = {**stamp.record(devices, seeds=seeds), "devices": devices}
            done = {"records": records, **figures(records)}
            (out / "utilization.json").write_text(json.dumps(done, indent=1))
    command = " ".join(["python", "experiments/network/bench_network.py", *stamp.command[1:]])
    minutes = (time.perf_counter() - start) / 60
    text = markdown(done, command, minutes)
    (out / "utilization.md").write_text(text + "\n")
    print(text)
    return done
