"""The training loop: one method on one task, data-parallel, with probes and its bytes."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel
from gradcomm_experiments import cli, runtime, tasks
from gradcomm_experiments.methods import Method


@dataclasses.dataclass
class RunResult:
    """One training run's history and summary.

    `probes` holds, per name, the values a probe returned every `probe_every` steps, with
    their step numbers in `probe_steps`; `eval_accuracy` the test accuracy after each of
    `eval_steps` steps (every `eval_every` steps, when asked for). `step_seconds` is the
    median step of the training loop, unless a study replaced it by interleaved timing
    (`compare.py`'s `--timing-rounds`).
    """

    method: str
    losses: list[float]
    epoch_accuracy: list[float]
    test_accuracy: float
    step_seconds: float
    bytes_per_step: float
    wall_seconds: float
    probe_steps: list[int] = dataclasses.field(default_factory=list)
    probes: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    eval_steps: list[int] = dataclasses.field(default_factory=list)
    eval_accuracy: list[float] = dataclasses.field(default_factory=list)


Probe = Callable[[Any, Any, Any], dict[str, Any]]


def on_devices(
    mesh: Any, fn: Callable[..., Any], *, per_device_params: bool = False
) -> Callable[..., Any]:
    """`fn(params, batch, *extras)` on every device, for probes; returns host NumPy.

    `params` are replicated (typed per device inside, so gradients are each device's own)
    or carry a device axis; `batch` and `extras` are split over devices. `fn` must return
    values that are the same on every device (reduce with a collective).
    """
    spec = P("data")

    def body(params: Any, batch: Any, *extras: Any) -> Any:
        if per_device_params:
            params = jax.tree.map(lambda x: x[0], params)
        else:
            params = jax.tree.map(lambda x: jax.lax.pcast(x, "data", to="varying"), params)
        return fn(params, batch, *jax.tree.map(lambda x: x[0], extras))

    @functools.cache
    def mapped(extras: int) -> Callable[..., Any]:  # one jit per call site (and extras count)
        specs = (spec if per_device_params else P(), spec, *([spec] * extras))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P()))

    def run(params: Any, batch: Any, *extras: Any) -> Any:
        out = mapped(len(extras))(params, parallel.shard_batch(batch, mesh), *extras)
        return jax.tree.map(np.asarray, out)

    return run


def bytes_per_step(
    method: Method,
    loss_fn: Callable[..., Any],
    mesh: Any,
    params: Any,
    batch: Any,
    *,
    state: Any = None,
    step: Any = None,
) -> float:
    """Bytes one device sends per step after warm-up, averaged over the method's period.

    `wire.measure(step).average` of the real step, read from its compiled program: a
    warm-up branch is dropped, a periodic one (parameter averaging, a gossip phase) is
    charged at its frequency. Given the `state` and jitted `step` that `method.start` made
    for `params`, it reads that step, whose compiled program the training then reuses (one
    compilation instead of two); otherwise it starts the method afresh.
    """
    if step is None:
        host = parallel.host_copy(params, per_device=method.per_device)
        params, state, step = method.start(loss_fn, mesh, host)
    return gradcomm.wire.measure(step, params, state, batch).average


def train(
    method: Method,
    task: tasks.Task,
    mesh: jax.sharding.Mesh,
    *,
    epochs: int,
    batch_per_device: int,
    seed: int,
    progress: bool = True,
    probe: Probe | None = None,
    probe_every: int = 10,
    eval_every: int | None = None,
) -> RunResult:
    """Trains on `task` data-parallel with the method on `mesh`; tests after each epoch.

    With `eval_every`, it also tests after every `eval_every`-th step (a learning curve).

    For methods whose devices hold different params, the model tested is the mean of the
    devices' params (the federated model). `probe(params, state, batch)`, if given, runs
    before every `probe_every`-th step and returns a dict of values (NumPy or floats) to
    record. A progress bar shows on a terminal, with `progress`.
    """
    global_batch = parallel.num_shards(mesh) * batch_per_device
    host = task.init(jax.random.key(seed))
    params, state, step = method.start(task.loss_fn, mesh, host, donate=probe is None)
    first = task.batches(global_batch, seed, 0)
    if not first:
        raise SystemExit(f"the global batch {global_batch} is larger than the training set")
    sent = bytes_per_step(method, task.loss_fn, mesh, params, first[0], state=state, step=step)

    losses, epoch_accuracy, times = [], [], []
    probe_steps: list[int] = []
    probes: dict[str, list[Any]] = {}
    eval_steps: list[int] = []
    eval_accuracy: list[float] = []
    start = time.perf_counter()
    bar = cli.progress(total=epochs * len(first), desc=method.name, quiet=not progress, leave=False)
    for epoch in range(epochs):
        for batch in task.batches(global_batch, seed, epoch):
            if probe is not None and len(losses) % probe_every == 0:
                probe_steps.append(len(losses))
                for key, value in probe(params, state, batch).items():
                    probes.setdefault(key, []).append(value)
            t0 = time.perf_counter()
            params, state, metrics = step(params, state, batch)
            loss = float(metrics["loss"])  # blocks: async steps can deadlock on a small CPU
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            bar.update()
            bar.set_postfix(loss=f"{loss:.3f}", epoch=epoch)
            if eval_every and len(losses) % eval_every == 0:
                eval_steps.append(len(losses))
                eval_accuracy.append(task.evaluate(_model_params(params, method.per_device, mesh)))
        epoch_accuracy.append(task.evaluate(_model_params(params, method.per_device, mesh)))
    bar.close()
    return RunResult(
        method=method.name,
        losses=losses,
        epoch_accuracy=epoch_accuracy,
        test_accuracy=epoch_accuracy[-1],
        step_seconds=float(np.median(times[1:] or times)),
        bytes_per_step=sent,
        wall_seconds=time.perf_counter() - start,
        probe_steps=probe_steps,
        probes=probes,
        eval_steps=eval_steps,
        eval_accuracy=eval_accuracy,
    )


def step_timer(
    method: Method,
    task: tasks.Task,
    mesh: jax.sharding.Mesh,
    *,
    seed: int,
    batch_per_device: int,
    steps: int,
) -> Callable[[], float]:
    """A function that runs `steps` training steps and returns their median seconds.

    The method starts afresh from `task.init` with `seed` (its step compiled, unless the
    method kept the one `train` ran (`Method.compiled`), and run once here, untimed); each
    call goes on from where the last one stopped, over the batches of epoch 0 in turn,
    with the inputs donated and blocking on every step as `train` does, whose step times
    it measures the same way. Interleave several methods' timers with
    `timing.interleaved_medians`.
    """
    global_batch = parallel.num_shards(mesh) * batch_per_device
    host = task.init(jax.random.key(seed))
    params, state, step = method.start(task.loss_fn, mesh, host, donate=True)
    batches = task.batches(global_batch, seed, 0)
    held = {"params": params, "state": state, "count": 0}

    def one() -> float:
        batch = batches[held["count"] % len(batches)]
        held["count"] += 1
        start = time.perf_counter()
        held["params"], held["state"], metrics = step(held["params"], held["state"], batch)
        float(metrics["loss"])  # blocks
        return time.perf_counter() - start

    one()  # compiles
    return lambda: float(np.median([one() for _ in range(steps)]))


def _model_params(params: Any, per_device: bool, mesh: Any) -> Any:
    """The params to test: the mean over devices for per-device params."""
    if per_device:
        params = _device_mean(mesh)(params)
    return parallel.host_copy(params)


@functools.cache
def _device_mean(mesh: Any) -> Callable[[Any], Any]:
    """Per-device params' mean over the device axis, replicated on `mesh` (one jit a mesh)."""
    return jax.jit(
        lambda t: jax.tree.map(lambda x: x.mean(0), t), out_shardings=NamedSharding(mesh, P())
    )


# train's settings and the flags that set them, where a study declares the flag.
_FLAGS = {
    "epochs": "epochs",
    "batch_per_device": "batch_size",
    "seed": "seed",
    "probe_every": "probe_every",
    "eval_every": "eval_every",
}


def train_as_flagged(
    args: argparse.Namespace,
    method: Method,
    task: tasks.Task,
    mesh: jax.sharding.Mesh,
    **settings: Any,
) -> RunResult:
    """`train` with the study's flags: `--epochs`, `--batch-size`, `--seed`, `--probe-every`
    and `--eval-every` where it has them, and a progress bar in process 0 unless
    `--quiet`; `settings` (`train`'s keyword arguments) add to them or override them.
    """
    flagged = {key: getattr(args, flag) for key, flag in _FLAGS.items() if hasattr(args, flag)}
    flagged["progress"] = runtime.is_main_process() and not args.quiet
    return train(method, task, mesh, **(flagged | settings))
