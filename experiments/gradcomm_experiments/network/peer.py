"""The network benchmark's peer worker: one host's PyTorch process, timing DDP and its hooks.

`bench_network.py --peer` starts one per host of the emulated cluster (`network.cluster`),
on the links its JAX workers (`network.worker`) have just used, as

    python -m gradcomm_experiments.network.peer '{"nodes": 2, "process": 0, ...}'

with `MASTER_ADDR` (host 0's address), `MASTER_PORT` and `GLOO_SOCKET_IFNAME=veth0` in its
environment, so that gloo's pairs bind to the host's interface. Each process trains the
benchmark's MLP (`network.worker.mlp_init`: the JAX worker's widths, initial params and fixed
global batch, of which rank r takes the r-th 32 rows) with Adam (lr 1e-4) under PyTorch's
DistributedDataParallel on gloo, in three variants (`VARIANTS`), each its own model, DDP
and optimizer from the same params:

- `torch-allreduce`: DDP with no communication hook, PyTorch's baseline: the gradient
  bucket all-reduced in float32;
- `torch-fp16`: `default_hooks.fp16_compress_hook`, the bucket cast to float16, divided
  by the world size and all-reduced;
- `torch-powersgd`: `powerSGD_hook.powerSGD_hook` with rank 2 (`POWERSGD`): the vectors
  (biases) all-reduced as they are, each weight matrix as its rank-2 factors P and Q,
  with error feedback and warm start, PowerSGD's defaults.

The hooks are those of PyTorch's "DDP Communication Hooks" documentation
(`torch.distributed.algorithms.ddp_comm_hooks`). DDP is built with `bucket_cap_mb=64`
(`BUCKET_CAP_MB`), so all gradients sit in one bucket and each hook sees the whole
gradient once per step: with DDP's default of two buckets the PowerSGD hook failed with a
gloo collective mismatch in 4 of 4 runs on the machines this was written on.

Timing follows the JAX worker: warm-up steps first (`warmup_steps`; PowerSGD's include its
`start_powerSGD_iter` plain all-reduce steps, which are never timed), then in each run the
variants take turns, in an order rotated each run, `steps` timed steps each; a run's
figure for a variant is its median step. A step is zero_grad, forward, loss, backward
(DDP's all-reduce, waited for before backward returns) and the optimizer's step; torch's
CPU kernels return when they are done, so the clock needs no barrier. Process 0 prints
`RESULT {"results": ..., "devices": ..., "torch": <version>, "threads": [intra, interop]}`.

Bytes per step are those the JAX rows use (`gradcomm.wire`'s bandwidth-optimal model: an
all-reduce of S bytes sends 2 (n-1)/n S per process), applied to the all-reduces' payloads:
for the hooks, the tensors they hand to `torch.distributed.all_reduce`, counted in the last
warm-up step; for the baseline, which DDP all-reduces in C++, its buckets' bytes.

With `threads` in the config, `torch.set_num_threads` and `torch.set_num_interop_threads`
take it before any work, as `--threads` gives the JAX workers their intra-op pool. The
worker never imports JAX.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gradcomm_experiments.network.worker import mlp_init, mlp_widths

VARIANTS = ("torch-allreduce", "torch-fp16", "torch-powersgd")
BASELINE = "torch-allreduce"
BUCKET_CAP_MB = 64
# PowerSGDState's options; start_powerSGD_iter = 2 is the smallest PowerSGDState allows with
# error feedback or warm start (DDP's first two steps run plain all-reduce).
POWERSGD = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}
HOOKS: dict[str, dict[str, Any]] = {
    "torch-allreduce": {"hook": None, "hook_options": {}},
    "torch-fp16": {"hook": "default_hooks.fp16_compress_hook", "hook_options": {}},
    "torch-powersgd": {"hook": "powerSGD_hook.powerSGD_hook", "hook_options": dict(POWERSGD)},
}
BATCH_PER_PROCESS = 32  # the JAX worker's, one device per process


def warmup_steps(label: str) -> int:
    """Untimed steps before a variant's first timed one: 3, as the JAX worker's least;
    PowerSGD's plain all-reduce steps and 3 compressed ones."""
    return POWERSGD["start_powerSGD_iter"] + 3 if label == "torch-powersgd" else 3


def build_model(params: dict[str, Any]) -> Any:
    """The MLP as `torch.nn.Sequential`, from `mlp_init`'s NumPy params.

    `Linear(a, b)` computes `x @ weight.T + bias`, so its weight is `w{i}.T` and the model
    computes what the JAX worker's `loss_fn` does with `x @ w + b`.
    """
    import torch

    layers = len(params) // 2
    modules: list[Any] = []
    for i in range(layers):
        w, b = params[f"w{i}"], params[f"b{i}"]
        linear = torch.nn.Linear(*w.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
            linear.bias.copy_(torch.from_numpy(b))
        modules.append(linear)
        if i + 1 < layers:
            modules.append(torch.nn.ReLU())
    return torch.nn.Sequential(*modules)


def local_batch(data: dict[str, Any], rank: int, world: int) -> tuple[Any, Any]:
    """Rank `rank`'s share of the fixed global batch, as the JAX worker's process holds it:
    the `rank`-th of `world` equal slices of the rows, as (inputs, int64 labels)."""
    import torch

    rows = len(data["x"]) // world
    part = slice(rank * rows, (rank + 1) * rows)
    x = torch.from_numpy(np.ascontiguousarray(data["x"][part]))
    y = torch.from_numpy(data["y"][part].astype(np.int64))
    return x, y


def loss_of(model: Any, x: Any, y: Any) -> Any:
    """The mean softmax cross-entropy of the model's logits: the JAX `loss_fn`'s loss."""
    import torch

    return torch.nn.functional.cross_entropy(model(x), y)


def wire_bytes(payload: float, world: int) -> float:
    """Bytes one process sends to all-reduce `payload` bytes (`gradcomm.wire`'s model)."""
    return 2 * (world - 1) / world * payload


def make_variant(label: str, params: dict[str, Any], world: int) -> dict[str, Any]:
    """A variant's DDP model (with its hook), Adam and state, from the initial params."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    model = build_model(params)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    if label == "torch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif label == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, **POWERSGD)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif label != BASELINE:
        raise ValueError(f"unknown peer variant {label!r}: one of {', '.join(VARIANTS)}")
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    return {"ddp": ddp, "optimizer": optimizer, "times": [], "bytes": None, "buckets": None}


def train_step(variant: dict[str, Any], x: Any, y: Any) -> float:
    """One DDP step (its all-reduce included); the loss before it."""
    optimizer = variant["optimizer"]
    optimizer.zero_grad(set_to_none=True)
    loss = loss_of(variant["ddp"], x, y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def counted_step(variant: dict[str, Any], label: str, x: Any, y: Any, world: int) -> None:
    """A step that records the variant's bytes per step and its bucket count."""
    import torch.distributed as dist

    payloads: list[int] = []
    original: Callable[..., Any] = dist.all_reduce

    def counting(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        payloads.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting  # what the hooks call, by the module's attribute
    try:
        train_step(variant, x, y)
    finally:
        dist.all_reduce = original
    buckets = _buckets(variant["ddp"])
    variant["buckets"] = len(buckets) if buckets is not None else None
    if label == BASELINE:  # DDP's own all-reduce of its float32 buckets, from C++
        grads = [p for p in variant["ddp"].parameters() if p.requires_grad]
        payloads = [p.numel() * p.element_size() for p in grads]
    variant["bytes"] = wire_bytes(sum(payloads), world)


def _buckets(ddp: Any) -> list[Any] | None:
    """DDP's gradient buckets after its rebuild (a private reducer method; None without)."""
    try:
        return list(ddp.reducer._get_zeros_like_grad_buckets())
    except (AttributeError, RuntimeError):
        return None


def set_threads(threads: int | None) -> None:
    """`threads` intra-op and inter-op threads for torch (None: torch's defaults)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
        torch.set_num_interop_threads(threads)


def worker(config: dict[str, Any]) -> None:
    """One host's process: trains each variant, prints its results (process 0) as JSON."""
    import torch

    set_threads(config.get("threads"))
    import torch.distributed as dist

    nodes, rank = config["nodes"], config["process"]
    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=nodes,
        timeout=datetime.timedelta(seconds=config.get("timeout", 1800)),
    )  # fmt: skip
    try:
        results = _train(config, nodes, rank)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        devices = {"platform": "cpu", "device_kind": "cpu", "device_count": nodes,
                   "process_count": nodes}  # fmt: skip
        threads = [torch.get_num_threads(), torch.get_num_interop_threads()]
        out = {"results": results, "devices": devices, "torch": torch.__version__,
               "threads": threads}  # fmt: skip
        print("RESULT " + json.dumps(out), flush=True)


def _train(config: dict[str, Any], nodes: int, rank: int) -> dict[str, Any]:
    """Warm-up, then the interleaved timed runs; each variant's results."""
    widths = mlp_widths(config["params"])
    params, data = mlp_init(widths, BATCH_PER_PROCESS * nodes)
    x, y = local_batch(data, rank, nodes)
    num_params = sum(int(v.size) for v in params.values())
    labels: Sequence[str] = config.get("variants", VARIANTS)

    def log(text: str) -> None:
        if rank == 0:
            print(f"[{config['rate']} N={nodes}] {text}", file=sys.stderr, flush=True)

    variants = {}
    for label in labels:
        variant = make_variant(label, params, nodes)
        warm = warmup_steps(label)
        t0 = time.perf_counter()
        for _ in range(warm - 1):
            train_step(variant, x, y)
        counted_step(variant, label, x, y, nodes)
        log(f"{label}: warmed up ({warm} steps) in {time.perf_counter() - t0:.1f}s")
        variant["warm"] = warm
        variants[label] = variant

    steps = config["steps"]
    for r in range(config["runs"]):
        order = [*labels[r % len(labels) :], *labels[: r % len(labels)]]
        for label in order:
            variant = variants[label]
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                train_step(variant, x, y)
                times.append(time.perf_counter() - t0)
            stat = float(np.median(times))
            variant["times"].append(stat)
            log(f"run {r + 1}: {label} {stat:.4f} s/step")
    return {
        label: {"runs": v["times"], "bytes": v["bytes"], "buckets": v["buckets"],
                "warmup_steps": v["warm"], "params": num_params}
        for label, v in variants.items()
    }  # fmt: skip


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
