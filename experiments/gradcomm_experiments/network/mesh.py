"""The network benchmark on a 2-D mesh: the data axis across hosts, a model axis inside each.

`bench_network.py --mesh tp` (or `fsdp`) starts one process per host with two CPU devices
each (`MODEL`), on a mesh `{data axes: N, "model": 2}`: the data axes span the processes,
so every data-parallel collective crosses the shaped links, while the model axis stays
inside a process (XLA:CPU's in-process collectives, no network).

The model is the flat rows' MLP (`network.worker.mlp_widths`, the same initial values),
tensor-parallel Megatron-style: the first layer split by columns over `'model'` (each
device computes half the hidden units), the second by rows (each device multiplies its
half of the hidden units, then a `psum` over `'model'` adds the halves), the classifier
whole. The second kernel is stored transposed, `(out, in)`, so that every kernel's
leading dimension is free for FSDP:

- `tp`: params split over `'model'` only (`P(None, "model")`), whole over the data axes;
  each method averages over the data axes, chained with Adam as the registry places it.
  PowerSGD and TernGrad get the params' specs (`TP_SPECS`); the others read the split
  from the leaves' types.
- `fsdp`: the same, and every kernel also split along its leading dimension over the data
  axes (ZeRO-3, `P(data, "model")`): gathered for the forward, and each method must
  return this device's shard of the combined gradient, a reduce-scatter. allreduce with
  `specs=` is a plain `psum_scatter`, the baseline. The methods with a compressed
  reduce-scatter are the entries of `FSDP`: a method joins by one entry there.

Ratios are against allreduce on the same mesh in the same run. Bytes per step are read
from the compiled program (`gradcomm.wire`); `link_bytes` counts only the collectives
over the data axes, which cross the links (the model axis's psums stay in a process).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from gradcomm_experiments import methods
from gradcomm_experiments.network import worker as networker

MESHES = ("flat", "tp", "fsdp")  # `--mesh`'s choices, in the order the tables show them
MODEL = 2  # devices per host: the size of the 'model' axis
BATCH_PER_HOST = 32  # examples per data-parallel shard, as the flat rows' per host
HIDDEN_MULTIPLE = 64  # hidden widths divisible by the model axis times the data axis
D_IN = 256  # the MLP's input width (`network.worker.mlp_widths`' default)

# The FSDP rows: a registry label -> its factory's extra options in its FSDP form (the
# factory also gets `specs=`). A method joins the FSDP rows with one entry here, once its
# `specs=` reduce-scatters a leaf split over the data axes.
FSDP: dict[str, dict[str, Any]] = {
    "allreduce": {},  # lax.psum_scatter: the baseline
    "fp16": {},  # low_precision: a 16-bit reduce-scatter
    "bf16": {},
    "terngrad": {},  # ternary codes of the whole gradient, each device decodes its shard
}

# The factories that must be told how a leaf is split over 'model' (`specs=`): the others
# read it from the leaves' types.
TP_SPECS = ("powersgd", "terngrad")

HELP = (
    "comma-separated meshes: flat (one CPU device per host), tp (2 devices per host: data "
    "across hosts, a model axis inside each, a tensor-parallel MLP), fsdp (the tp mesh with "
    "kernels also split over the data axes: methods reduce-scatter; rows: "
    f"{', '.join(FSDP)}); ratios are against allreduce on the same mesh in the same run"
)


def parse(text: str, nodes: Sequence[int], patterns: bool, peer: bool) -> list[str]:
    """The comma-separated meshes of `--mesh`, checked against the other flags.

    Raises:
      ValueError: for an unknown mesh, a node count that cannot split the FSDP mesh's
        kernels evenly, or a 2-D mesh with `--patterns`, or `--peer` without the flat one.
    """
    names = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in names if m not in MESHES]
    if unknown or not names:
        shown = ", ".join(unknown) if unknown else "none given"
        raise ValueError(f"--mesh: unknown mesh(es) {shown}; choose from {', '.join(MESHES)}")
    bad = [n for n in nodes if HIDDEN_MULTIPLE % n or D_IN % n]
    if "fsdp" in names and bad:
        raise ValueError(
            f"--mesh fsdp splits kernels of {D_IN} and a multiple of {HIDDEN_MULTIPLE} rows "
            f"over the hosts: node counts {bad} do not divide them"
        )
    if patterns and names != ["flat"]:
        raise ValueError("--patterns times raw collectives on the flat mesh, not with --mesh")
    if peer and "flat" not in names:
        raise ValueError("--peer runs beside the flat rows: add flat to --mesh")
    return names


def run_worker(config: dict[str, Any]) -> None:
    """A worker process of `bench_network.py` (`python -m gradcomm_experiments.network.worker
    CONFIG`): raw collectives, the utilization variants, the flat rows or a 2-D mesh's, as
    its config says."""
    if config.get("mode") == "patterns":
        from gradcomm_experiments.network import patterns

        patterns.pattern_worker(config)
    elif config.get("mode") == "utilization":
        from gradcomm_experiments.network import utilization

        utilization.worker(config)
    elif config.get("mesh", "flat") != "flat":
        worker(config)
    else:
        networker.worker(config)


def labels_for(mesh: str, labels: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the rows that run on `mesh`, allreduce first; those skipped). The flat mesh runs
    them all; the 2-D meshes leave out the hierarchical methods (whose local axis is the
    model axis's devices), and FSDP runs the methods of `FSDP` only."""
    if mesh == "flat":
        return list(labels), []
    ok = [m for m in labels if not methods.METHODS[m].local and (mesh != "fsdp" or m in FSDP)]
    return ok, [m for m in labels if m not in ok]


def plan(meshes: Sequence[str], labels: Sequence[str]) -> list[tuple[str, list[str], bool]]:
    """The worker runs in each cluster (a node count and rate): (mesh, labels, local). On
    the flat mesh the one-device methods, then allreduce and the hierarchical ones (2
    devices per host, `local`); on a 2-D mesh the rows `labels_for` keeps (and a line says
    which it leaves out)."""
    out = []
    for mesh in meshes:
        if mesh == "flat":
            flat = [m for m in labels if not methods.METHODS[m].local]
            local = [m for m in labels if methods.METHODS[m].local]
            out.append((mesh, flat, False))
            if local:
                out.append((mesh, ["allreduce", *local], True))
        else:
            kept, skipped = labels_for(mesh, labels)
            if skipped:
                shown = ", ".join(skipped)
                print(f"--mesh {mesh}: no rows for {shown} (see gradcomm_experiments.network.mesh)")
            out.append((mesh, kept, False))
    return out


def widths(params: float) -> tuple[int, ...]:
    """The flat rows' MLP widths, hidden widths rounded down to a multiple of 64."""
    d_in, h, _, classes = networker.mlp_widths(params, D_IN)
    h = max(HIDDEN_MULTIPLE, h - h % HIDDEN_MULTIPLE)
    return (d_in, h, h, classes)


def param_specs(data_axes: Sequence[str], fsdp: bool) -> dict[str, Any]:
    """The params' `PartitionSpec`s: kernels split over 'model' (and with `fsdp` along
    their leading dimension over the data axes), the first bias like its columns."""
    from jax.sharding import PartitionSpec as P

    lead = (tuple(data_axes) if len(data_axes) > 1 else data_axes[0]) if fsdp else None
    return {
        "w0": P(lead, "model"),  # (in, hidden): split by columns
        "b0": P("model"),
        "w1": P(lead, "model"),  # (out, in), used transposed: split by rows of the product
        "b1": P(),
        "w2": P(lead) if fsdp else P(),  # the classifier, whole over 'model'
        "b2": P(),
    }


def task(width: Sequence[int], batch: int, seed: int = 0) -> tuple[Any, Any, Any]:
    """(init params, loss_fn with accuracy, fixed batch) of the tensor-parallel MLP.

    The flat rows' arrays (`network.worker.mlp_init`), the middle kernel transposed; inside the
    map each device holds its slice over 'model' and the loss adds the row-split layer's
    partial products with a `psum` over 'model'.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from jax import lax

    params, data = networker.mlp_init(width, batch, seed)
    params["w1"] = params["w1"].T.copy()

    def loss_fn(p: Any, data: Any) -> tuple[jax.Array, dict]:
        h = jax.nn.relu(data["x"] @ p["w0"] + p["b0"])  # this device's hidden units
        h = jax.nn.relu(lax.psum(h @ p["w1"].T, "model") + p["b1"])
        x = h @ p["w2"] + p["b2"]
        loss = optax.softmax_cross_entropy_with_integer_labels(x, data["y"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(x, -1) == data["y"])}

    return params, loss_fn, data


def build(label: str, mesh: str, specs: Any, data_axes: Sequence[str]) -> methods.Method:
    """The registry's method (as the benchmark times it, `network.worker.spec_of`) with Adam,
    over the data axes; its factory gets `specs=` on the FSDP mesh (with its `FSDP`
    options), and on the tp mesh where it is one of `TP_SPECS`."""
    import optax

    spec = networker.spec_of(label)
    extra = dict(FSDP[label]) if mesh == "fsdp" else {}
    if mesh == "fsdp" or spec.method in TP_SPECS:
        extra["specs"] = specs
    return methods.build(spec.configured(**extra), optax.adam(1e-4), tuple(data_axes))


def start(
    method: methods.Method, loss_fn: Any, mesh: Any, host_params: Any, specs: Any,
    data_axes: Sequence[str],
) -> tuple[Any, Any, Any]:  # fmt: skip
    """`(params, state, step)` as `Method.start` makes them from one copy of the params,
    split as `specs` say (one copy per data-parallel device for per-device methods)."""
    from gradcomm import parallel

    axes = tuple(data_axes)
    params = parallel.shard_params(host_params, mesh, specs, per_device=method.per_device)
    kw: dict[str, Any] = {"axes": axes, "params_per_device": method.per_device,
                          "sync": method.sync}  # fmt: skip
    state = parallel.init_state(method.tx, params, mesh, **kw)
    step = parallel.train_step(loss_fn, method.tx, mesh, has_aux=True, donate=True, **kw)
    return params, state, step


def wire_bytes(step: Any, params: Any, state: Any, batch: Any, data_axes: Sequence[str]) -> dict:
    """Bytes one device sends per step, read from the compiled program: `bytes` all
    collectives (the steady state's average), `link_bytes` those over a data axis,
    `bytes_by_axes` the worst case per set of axes."""
    from gradcomm import wire

    report = wire.measure(step, params, state, batch)
    by_axes = report.by_axes()
    local = sum(v for k, v in by_axes.items() if k is not None and not set(k) & set(data_axes))
    return {
        "bytes": report.average,
        "link_bytes": report.average - local,
        "bytes_by_axes": {"+".join(k) if k else "none": v for k, v in by_axes.items() if k},
    }


def worker(config: dict[str, Any]) -> None:
    """One host's process on the 2-D mesh: trains with each method, prints (process 0) the
    results and the mesh as one `RESULT` line."""
    from gradcomm_experiments import provenance

    devices, log = networker.start(config, MODEL)
    import jax
    import numpy as np

    from gradcomm import parallel

    nodes, kind = config["nodes"], config["mesh"]
    data_axes = ("data",)
    mesh = parallel.make_mesh({"data": nodes, "model": MODEL}, devices=devices)
    specs = param_specs(data_axes, fsdp=kind == "fsdp")
    host_params, loss_fn, data = task(widths(config["params"]), BATCH_PER_HOST * nodes)
    num_params = sum(int(np.prod(v.shape)) for v in host_params.values())
    batch = parallel.shard_batch(data, mesh, data_axes)
    labels = config["labels"]
    runs: dict[str, Any] = {}
    for label in labels:
        t0 = time.perf_counter()
        method = build(label, kind, specs, data_axes)
        params, state, step = start(method, loss_fn, mesh, host_params, specs, data_axes)
        sent = wire_bytes(step, params, state, batch, data_axes) if config["measure_bytes"] else {}
        log(f"{label}: built and compiled in {time.perf_counter() - t0:.1f}s")
        spec = networker.spec_of(label)
        every, warmup = networker.cycle(spec, nodes), networker.warmup_of(spec)
        runs[label] = networker.warm_up(label, step, params, state, batch, every, log, warmup)
        runs[label]["sent"] = sent

    networker.time_runs(runs, labels, batch, config, log)
    if jax.process_index() == 0:
        keys = ("bytes", "link_bytes", "bytes_by_axes")
        out = {
            label: {
                "runs": run["times"],
                "cycle": run["cycle"],
                "params": num_params,
                "probe": networker.probe_of(run["step"]),
                **{k: run["sent"].get(k) for k in keys},
            }
            for label, run in runs.items()
        }
        described = {
            "name": kind,
            "axes": {str(k): int(v) for k, v in mesh.shape.items()},
            "data_axes": list(data_axes),
            "param_specs": {k: str(v) for k, v in specs.items()},
            "batch": int(data["x"].shape[0]),
        }
        info = provenance.devices_info(devices)
        result = {"results": out, "devices": info, "mesh": described}
        print("RESULT " + json.dumps(result), flush=True)
