"""What every experiment shares: devices and hosts, data, models, the training loop, outputs.

Scripts call `add_common_args` on their parser and `setup` before anything touches a JAX
device: `setup` simulates CPU devices (`--devices`), or joins a multi-host run
(`--coordinator-address`, `--num-processes`, `--process-id`, gloo collectives on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel

# ----------------------------------------------------------------------------- devices


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Device, host, data, seed and output flags shared by every experiment."""
    group = parser.add_argument_group("devices and hosts")
    group.add_argument(
        "--devices",
        type=int,
        default=None,
        help="devices per process: simulated on a CPU (default 8 there), or the first N "
        "accelerators (default: all of them)",
    )
    group.add_argument("--coordinator-address", default=None, help="host:port of process 0")
    group.add_argument("--num-processes", type=int, default=1, help="processes in the run")
    group.add_argument("--process-id", type=int, default=0, help="this process's index")
    parser.add_argument("--data-dir", default=None, help="directory with real data, if any")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--out",
        default="runs/" + pathlib.Path(sys.argv[0]).stem,
        help="output directory for JSON, PNG and Markdown",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def setup(args: argparse.Namespace) -> list[jax.Device]:
    """Configures JAX for the run and returns the devices to use (all processes')."""
    if args.devices is not None and args.devices < 1:
        raise SystemExit("--devices must be at least 1")
    jax.config.update("jax_num_cpu_devices", args.devices or 8)
    if args.coordinator_address:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    local = jax.local_devices()
    if args.devices is not None and args.devices > len(local):
        raise SystemExit(f"--devices {args.devices}: only {len(local)} local devices")
    if args.devices is not None and local[0].platform != "cpu":
        keep = {
            d.id for p in range(jax.process_count()) for d in _first_of_process(p, args.devices)
        }
        return [d for d in jax.devices() if d.id in keep]
    return jax.devices()


def _first_of_process(process: int, count: int) -> list[jax.Device]:
    return [d for d in jax.devices() if d.process_index == process][:count]


def is_main_process() -> bool:
    return jax.process_index() == 0


def describe(devices: Sequence[jax.Device]) -> str:
    kind = devices[0].device_kind if devices else "none"
    return f"{len(devices)} x {devices[0].platform} ({kind}), {jax.process_count()} process(es)"


# ----------------------------------------------------------------------------- data


@dataclasses.dataclass
class Dataset:
    """Images in NHWC float32 and integer labels, split into train and test."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images), a stratified split, scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    digits = sk_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return Dataset("digits", x_train, y_train, x_test, y_test)


def batches(data: Dataset, global_batch: int, seed: int, epoch: int) -> list[dict[str, Any]]:
    """One epoch of shuffled full batches (the remainder is dropped), the same in every process."""
    order = np.random.default_rng([seed, epoch]).permutation(len(data.x_train))
    count = steps_per_epoch(data, global_batch)
    return [
        {"x": data.x_train[idx], "y": data.y_train[idx]}
        for idx in np.split(order[: count * global_batch], count)
    ]


# ----------------------------------------------------------------------------- models


def small_cnn(num_classes: int = 10) -> Any:
    """Two 3x3 convolutions, average pooling, two dense layers (about 40k parameters)."""
    import flax.linen as nn

    class SmallCNN(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(nn.Conv(16, (3, 3))(x))
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), (2, 2))
            x = x.reshape(x.shape[0], -1)
            x = nn.relu(nn.Dense(64)(x))
            return nn.Dense(num_classes)(x)

    return SmallCNN()


def classification_loss(model: Any) -> Callable[[Any, dict[str, Any]], tuple[jax.Array, dict]]:
    """Mean softmax cross-entropy, with accuracy as an auxiliary metric."""

    def loss_fn(params: Any, batch: dict[str, Any]) -> tuple[jax.Array, dict]:
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

    return loss_fn


def accuracy(model: Any, params: Any, x: np.ndarray, y: np.ndarray) -> float:
    logits = jax.jit(lambda p, v: model.apply({"params": p}, v))(params, x)
    return float(np.mean(np.argmax(np.asarray(logits), -1) == y))


# ----------------------------------------------------------------------------- methods


def optimizer(
    name: str, lr: float, steps: int, schedule: str = "cosine"
) -> optax.GradientTransformation:
    """The inner optimizer: "adam", "sgd" or "momentum" (SGD with momentum 0.9).

    `schedule` is "cosine" (decay to 0 over `steps`) or "constant".
    """
    if schedule == "cosine":
        rate: optax.ScalarOrSchedule = optax.cosine_decay_schedule(lr, max(steps, 1))
    elif schedule == "constant":
        rate = lr
    else:
        raise SystemExit(f"unknown schedule {schedule!r}: choose cosine or constant")
    if name == "adam":
        return optax.adam(rate)
    if name == "sgd":
        return optax.sgd(rate)
    if name == "momentum":
        return optax.sgd(rate, momentum=0.9)
    raise SystemExit(f"unknown optimizer {name!r}: choose adam, sgd or momentum")


def steps_per_epoch(data: Dataset, global_batch: int) -> int:
    return len(data.x_train) // global_batch


# Each method in the place its paper puts it: the all-reduce before the optimizer (it
# averages gradients), Adasum after it (it combines each device's update, paper A.6),
# TernGrad before it (it quantizes gradients, keeping the last layer in float), LAGS and
# SLGS after it (they sparsify learning-rate-scaled updates, LAGS eq. 5), gradient
# dropping before it (Algorithm 1 feeds the optimizer), local SGD and the gossip methods
# (SGP, 1-overlap SGP, D-PSGD) after it.
METHODS = (
    "allreduce",
    "adasum",
    "terngrad",
    "lags",
    "slgs",
    "dropping",
    "dropping-local",
    "local-sgd",
    "sgp",
    "osgp",
    "dpsgd",
)


@dataclasses.dataclass(frozen=True)
class Method:
    """A method as the training loop needs it.

    Attributes:
      name: the method's name.
      tx: the transformation, chained with the inner optimizer.
      per_device: whether devices hold different params (local gradients, local SGD).
      steady_tx: the same without warm-up or parameter averaging, for bytes per step.
      average_every: the parameter averaging period, if any (amortized in bytes per step).
    """

    name: str
    tx: optax.GradientTransformation
    per_device: bool = False
    steady_tx: optax.GradientTransformation | None = None
    average_every: int | None = None


def make_method(
    name: str,
    opt: optax.GradientTransformation,
    *,
    density: float = 0.01,
    drop_ratio: float = 0.99,
    warmup_steps: int = 50,
    average_every: int = 50,
    local_every: int = 20,
) -> Method:
    """The method `name` chained with the inner optimizer."""
    if name == "allreduce":
        return Method(name, optax.chain(gradcomm.allreduce("data"), opt))
    if name == "adasum":
        return Method(name, optax.chain(opt, gradcomm.adasum("data")))
    if name == "terngrad":
        return Method(name, optax.chain(gradcomm.terngrad("data", dense=["Dense_1"]), opt))
    if name == "lags":
        return Method(name, optax.chain(opt, gradcomm.lags("data", density=density)))
    if name == "slgs":
        return Method(name, optax.chain(opt, gradcomm.slgs("data", density=density)))
    if name in ("dropping", "dropping-local"):
        local = "compensated" if name == "dropping-local" else None
        every = average_every if local else None

        def dropping(warmup: int, every: int | None) -> optax.GradientTransformation:
            return gradcomm.gradient_dropping(
                "data",
                drop_ratio=drop_ratio,
                local=local,
                warmup_steps=warmup,
                average_every=every,
            )

        return Method(
            name,
            optax.chain(dropping(warmup_steps, every), opt),
            per_device=local is not None,
            steady_tx=optax.chain(dropping(0, None), opt),
            average_every=every,
        )
    if name == "local-sgd":
        return Method(
            name,
            optax.chain(opt, gradcomm.local_sgd("data", every=local_every)),
            per_device=True,
            steady_tx=opt,
            average_every=local_every,
        )
    if name in ("sgp", "osgp"):
        tx = gradcomm.sgp("data", overlap=1 if name == "osgp" else 0)
        return Method(name, optax.chain(opt, tx), per_device=True)
    if name == "dpsgd":
        return Method(name, optax.chain(opt, gradcomm.dpsgd("data")), per_device=True)
    raise SystemExit(f"unknown method {name!r}: choose from {', '.join(METHODS)}")


def parse_methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise SystemExit(f"unknown method(s) {unknown}: choose from {', '.join(METHODS)}")
    return names


# ----------------------------------------------------------------------------- training


@dataclasses.dataclass
class RunResult:
    """One training run's history and summary."""

    method: str
    losses: list[float]
    epoch_accuracy: list[float]
    test_accuracy: float
    step_seconds: float
    bytes_per_step: float
    wall_seconds: float


def bytes_per_step(
    method: Method, loss_fn: Callable[..., Any], mesh: Any, params: Any, batch: Any
) -> float:
    """Bytes one device sends per step after warm-up, averaging amortized over its period.

    Read from compiled programs: the step without warm-up and averaging (the wire model
    would charge a conditional's largest branch, the dense one, on every step), plus one
    exact parameter average (a psum of the params) divided by its period.
    """
    tx = method.steady_tx or method.tx
    host = parallel.host_copy(params, per_device=method.per_device)
    placed = (parallel.per_device if method.per_device else parallel.replicate)(host, mesh)
    state = parallel.init_state(tx, placed, mesh, params_per_device=method.per_device)
    step = parallel.train_step(loss_fn, tx, mesh, has_aux=True, params_per_device=method.per_device)
    total = gradcomm.wire.measure(step, placed, state, batch).total
    if method.average_every:
        mean = jax.shard_map(
            lambda p: jax.lax.pmean(p, "data"),
            mesh=mesh,
            in_specs=P(),
            out_specs=P(),
            check_vma=False,
        )
        total += gradcomm.wire.measure(jax.jit(mean), parallel.replicate(host, mesh)).total / (
            method.average_every
        )
    return total


def train(
    method: Method,
    model: Any,
    data: Dataset,
    mesh: jax.sharding.Mesh,
    *,
    epochs: int,
    batch_per_device: int,
    seed: int,
    progress: bool = True,
) -> RunResult:
    """Trains `model` data-parallel with the method on `mesh`; tests each epoch.

    For methods whose devices hold different params, the model tested is the mean of the
    devices' params (the federated model).
    """
    from tqdm.auto import tqdm

    n = parallel.num_shards(mesh)
    global_batch = n * batch_per_device
    init = model.init(jax.random.key(seed), data.x_train[:1])["params"]
    place = parallel.per_device if method.per_device else parallel.replicate
    params = place(init, mesh)
    state = parallel.init_state(method.tx, params, mesh, params_per_device=method.per_device)
    loss_fn = classification_loss(model)
    step = parallel.train_step(
        loss_fn, method.tx, mesh, has_aux=True, donate=True, params_per_device=method.per_device
    )
    first = batches(data, global_batch, seed, 0)
    if not first:
        raise SystemExit(f"the global batch {global_batch} is larger than the training set")
    sent = bytes_per_step(method, loss_fn, mesh, params, first[0])

    losses, epoch_accuracy, times = [], [], []
    start = time.perf_counter()
    bar = tqdm(total=epochs * len(first), desc=method.name, disable=not progress, leave=False)
    for epoch in range(epochs):
        for batch in batches(data, global_batch, seed, epoch):
            t0 = time.perf_counter()
            params, state, metrics = step(params, state, batch)
            loss = float(metrics["loss"])  # blocks: async steps can deadlock on a small CPU
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            bar.update()
            bar.set_postfix(loss=f"{loss:.3f}", epoch=epoch)
        epoch_accuracy.append(
            accuracy(
                model, _model_params(params, method.per_device, mesh), data.x_test, data.y_test
            )
        )
    bar.close()
    return RunResult(
        method=method.name,
        losses=losses,
        epoch_accuracy=epoch_accuracy,
        test_accuracy=epoch_accuracy[-1],
        step_seconds=float(np.median(times[1:] or times)),
        bytes_per_step=sent,
        wall_seconds=time.perf_counter() - start,
    )


def _model_params(params: Any, per_device: bool, mesh: Any) -> Any:
    """The params to test: the mean over devices for per-device params."""
    if per_device:
        mean = jax.jit(
            lambda t: jax.tree.map(lambda x: x.mean(0), t), out_shardings=NamedSharding(mesh, P())
        )
        params = mean(params)
    return parallel.host_copy(params)


# ----------------------------------------------------------------------------- outputs


def write_outputs(
    out: str | os.PathLike,
    name: str,
    config: dict[str, Any],
    results: Sequence[RunResult],
    table: str,
) -> pathlib.Path:
    """Writes `name`.json (config and every run), `name`.png and `name`.md under `out`."""
    path = pathlib.Path(out)
    path.mkdir(parents=True, exist_ok=True)
    payload = {"config": config, "runs": [dataclasses.asdict(r) for r in results]}
    (path / f"{name}.json").write_text(json.dumps(payload, indent=1))
    (path / f"{name}.md").write_text(table + "\n")
    plot_runs(results, path / f"{name}.png")
    return path


def plot_runs(results: Sequence[RunResult], file: pathlib.Path) -> None:
    """Training loss per step and test accuracy per epoch, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in results:
        left.plot(r.losses, label=r.method, lw=1)
        right.plot(range(1, len(r.epoch_accuracy) + 1), r.epoch_accuracy, label=r.method)
    left.set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
    right.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(file, dpi=120)
    plt.close(fig)


def results_table(results: Sequence[RunResult], baseline: str = "allreduce") -> str:
    """A Markdown table: accuracy, loss, bytes per step and step time against the baseline."""
    base = next((r for r in results if r.method == baseline), results[0])
    rows = [
        "| method | test accuracy | final loss | bytes sent per device per step "
        f"| step time vs {base.method} |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        final = float(np.mean(r.losses[-10:]))
        rows.append(
            f"| {r.method} | {100 * r.test_accuracy:.2f}% | {final:.4f} "
            f"| {r.bytes_per_step:,.0f} | {r.step_seconds / base.step_seconds:.2f}x |"
        )
    return "\n".join(rows)
