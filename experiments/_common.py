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


def add_common_args(
    parser: argparse.ArgumentParser, *, data: bool = True, seed: bool = True
) -> None:
    """Device, host, data, seed and output flags shared by every experiment.

    A study that makes its own data leaves out `--dataset` and `--data-dir` (`data=False`);
    one that runs several seeds leaves out `--seed` (`seed=False`).
    """
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
    if data:
        parser.add_argument(
            "--dataset",
            default="digits",
            help="digits (bundled), mnist or cifar10 (from --data-dir)",
        )
        parser.add_argument(
            "--data-dir", default=None, help="directory with MNIST idx files or CIFAR-10 batches"
        )
    if seed:
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


def _read_idx(path: pathlib.Path) -> np.ndarray:
    """An MNIST idx file (optionally gzipped): big-endian magic, dims, then uint8 data."""
    import gzip

    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find(directory: pathlib.Path, names: Sequence[str]) -> pathlib.Path:
    for name in names:
        for candidate in (directory / name, directory / (name + ".gz")):
            if candidate.exists():
                return candidate
    raise SystemExit(f"none of {list(names)} (or .gz) found in {directory}")


def load_mnist(data_dir: str | os.PathLike) -> Dataset:
    """MNIST from the four standard idx files in `data_dir` (or `data_dir/mnist`)."""
    root = pathlib.Path(data_dir)
    root = root / "mnist" if (root / "mnist").is_dir() else root
    parts = {
        "x_train": ["train-images-idx3-ubyte", "train-images.idx3-ubyte"],
        "y_train": ["train-labels-idx1-ubyte", "train-labels.idx1-ubyte"],
        "x_test": ["t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"],
        "y_test": ["t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"],
    }
    arrays = {key: _read_idx(_find(root, names)) for key, names in parts.items()}
    images = {k: (arrays[k] / 255.0).astype(np.float32)[..., None] for k in ("x_train", "x_test")}
    labels = {k: arrays[k].astype(np.int32) for k in ("y_train", "y_test")}
    return Dataset(
        "mnist", images["x_train"], labels["y_train"], images["x_test"], labels["y_test"]
    )


def load_cifar10(data_dir: str | os.PathLike) -> Dataset:
    """CIFAR-10 from the standard python batches (`cifar-10-batches-py`) in `data_dir`."""
    import pickle

    root = pathlib.Path(data_dir)
    root = root / "cifar-10-batches-py" if (root / "cifar-10-batches-py").is_dir() else root

    def read(name: str) -> tuple[np.ndarray, np.ndarray]:
        path = root / name
        if not path.exists():
            raise SystemExit(f"{path} not found: expected the CIFAR-10 python batches")
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        x = batch[b"data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return (x / 255.0).astype(np.float32), np.asarray(batch[b"labels"], np.int32)

    train = [read(f"data_batch_{i}") for i in range(1, 6)]
    x_test, y_test = read("test_batch")
    return Dataset(
        "cifar10",
        np.concatenate([x for x, _ in train]),
        np.concatenate([y for _, y in train]),
        x_test,
        y_test,
    )


DATASETS = ("digits", "mnist", "cifar10")


def load_dataset(name: str, data_dir: str | None, seed: int = 0) -> Dataset:
    """digits (bundled with scikit-learn), or MNIST / CIFAR-10 from --data-dir."""
    if name == "digits":
        return load_digits(seed)
    if name not in DATASETS:
        raise SystemExit(f"unknown dataset {name!r}: choose from {', '.join(DATASETS)}")
    if data_dir is None:
        raise SystemExit(f"--dataset {name} needs --data-dir with its files")
    return load_mnist(data_dir) if name == "mnist" else load_cifar10(data_dir)


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


@dataclasses.dataclass(frozen=True)
class Task:
    """What the training loop needs to know about a problem.

    Attributes:
      name: for outputs.
      init: `init(key) -> params`.
      loss_fn: `loss_fn(params, batch) -> (loss, metrics)`, on one device's batch.
      batches: `batches(global_batch, seed, epoch) -> list of global batches`, the same in
        every process.
      evaluate: `evaluate(host_params) -> test accuracy`.
    """

    name: str
    init: Callable[[jax.Array], Any]
    loss_fn: Callable[[Any, Any], tuple[jax.Array, dict]]
    batches: Callable[[int, int, int], list[Any]]
    evaluate: Callable[[Any], float]


def classification_task(model: Any, data: Dataset) -> Task:
    """Image classification with `model` on `data`, tested on the test split."""
    return Task(
        name=data.name,
        init=lambda key: model.init(key, data.x_train[:1])["params"],
        loss_fn=classification_loss(model),
        batches=lambda global_batch, seed, epoch: batches(data, global_batch, seed, epoch),
        evaluate=lambda params: accuracy(model, params, data.x_test, data.y_test),
    )


def cnn_task(args: argparse.Namespace) -> Task:
    """The small CNN on `--dataset` (from `--data-dir`), split with `--seed`."""
    data = load_dataset(args.dataset, args.data_dir, args.seed)
    return classification_task(small_cnn(data.num_classes), data)


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
    """

    name: str
    tx: optax.GradientTransformation
    per_device: bool = False


def make_method(
    name: str,
    opt: optax.GradientTransformation,
    *,
    axis: str | tuple[str, ...] = "data",
    float_leaves: Sequence[str] | None = ("Dense_1",),
    density: float = 0.01,
    drop_ratio: float = 0.99,
    warmup_steps: int = 50,
    average_every: int = 50,
    local_every: int = 20,
) -> Method:
    """The method `name` chained with the inner optimizer, communicating over `axis`.

    `float_leaves` are the leaves TernGrad keeps in float (the small CNN's last layer).
    """
    if name == "allreduce":
        return Method(name, optax.chain(gradcomm.allreduce(axis), opt))
    if name == "adasum":
        return Method(name, optax.chain(opt, gradcomm.adasum(axis)))
    if name == "terngrad":
        return Method(
            name,
            optax.chain(gradcomm.terngrad(axis, dense=float_leaves and list(float_leaves)), opt),
        )
    if name == "lags":
        return Method(name, optax.chain(opt, gradcomm.lags(axis, density=density)))
    if name == "slgs":
        return Method(name, optax.chain(opt, gradcomm.slgs(axis, density=density)))
    if name in ("dropping", "dropping-local"):
        local = "compensated" if name == "dropping-local" else None
        every = average_every if local else None

        def dropping(warmup: int, every: int | None) -> optax.GradientTransformation:
            return gradcomm.gradient_dropping(
                axis,
                drop_ratio=drop_ratio,
                local=local,
                warmup_steps=warmup,
                average_every=every,
            )

        return Method(
            name,
            optax.chain(dropping(warmup_steps, every), opt),
            per_device=local is not None,
        )
    if name == "local-sgd":
        return Method(
            name,
            optax.chain(opt, gradcomm.local_sgd(axis, every=local_every)),
            per_device=True,
        )
    if name in ("sgp", "osgp"):
        tx = gradcomm.sgp(axis, overlap=1 if name == "osgp" else 0)
        return Method(name, optax.chain(opt, tx), per_device=True)
    if name == "dpsgd":
        return Method(name, optax.chain(opt, gradcomm.dpsgd(axis)), per_device=True)
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
    """One training run's history and summary.

    `probes` holds, per name, the values a probe returned every `probe_every` steps, with
    their step numbers in `probe_steps`; `eval_accuracy` the test accuracy after each of
    `eval_steps` steps (every `eval_every` steps, when asked for).
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

    def run(params: Any, batch: Any, *extras: Any) -> Any:
        def body(params: Any, batch: Any, *extras: Any) -> Any:
            if per_device_params:
                params = jax.tree.map(lambda x: x[0], params)
            else:
                params = jax.tree.map(lambda x: jax.lax.pcast(x, "data", to="varying"), params)
            return fn(params, batch, *jax.tree.map(lambda x: x[0], extras))

        specs = (spec if per_device_params else P(), spec, *([spec] * len(extras)))
        mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P()))
        return jax.tree.map(np.asarray, mapped(params, parallel.shard_batch(batch, mesh), *extras))

    return run


def bytes_per_step(
    method: Method, loss_fn: Callable[..., Any], mesh: Any, params: Any, batch: Any
) -> float:
    """Bytes one device sends per step after warm-up, averaged over the method's period.

    `wire.measure(step).average` of the real step, read from its compiled program: a
    warm-up branch is dropped, a periodic one (parameter averaging, a gossip phase) is
    charged at its frequency.
    """
    host = parallel.host_copy(params, per_device=method.per_device)
    placed = (parallel.per_device if method.per_device else parallel.replicate)(host, mesh)
    state = parallel.init_state(method.tx, placed, mesh, params_per_device=method.per_device)
    step = parallel.train_step(
        loss_fn, method.tx, mesh, has_aux=True, params_per_device=method.per_device
    )
    return gradcomm.wire.measure(step, placed, state, batch).average


def train(
    method: Method,
    task: Task,
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
    record.
    """
    from tqdm.auto import tqdm

    n = parallel.num_shards(mesh)
    global_batch = n * batch_per_device
    place = parallel.per_device if method.per_device else parallel.replicate
    params = place(task.init(jax.random.key(seed)), mesh)
    state = parallel.init_state(method.tx, params, mesh, params_per_device=method.per_device)
    step = parallel.train_step(
        task.loss_fn,
        method.tx,
        mesh,
        has_aux=True,
        donate=probe is None,
        params_per_device=method.per_device,
    )
    first = task.batches(global_batch, seed, 0)
    if not first:
        raise SystemExit(f"the global batch {global_batch} is larger than the training set")
    sent = bytes_per_step(method, task.loss_fn, mesh, params, first[0])

    losses, epoch_accuracy, times = [], [], []
    probe_steps: list[int] = []
    probes: dict[str, list[Any]] = {}
    eval_steps: list[int] = []
    eval_accuracy: list[float] = []
    start = time.perf_counter()
    bar = tqdm(total=epochs * len(first), desc=method.name, disable=not progress, leave=False)
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


def _model_params(params: Any, per_device: bool, mesh: Any) -> Any:
    """The params to test: the mean over devices for per-device params."""
    if per_device:
        mean = jax.jit(
            lambda t: jax.tree.map(lambda x: x.mean(0), t), out_shardings=NamedSharding(mesh, P())
        )
        params = mean(params)
    return parallel.host_copy(params)


def add_training_args(parser: argparse.ArgumentParser, *, methods: str) -> None:
    """The flags of a classification run over several methods (train.py, compare.py)."""
    parser.add_argument(
        "--method", default=methods, help=f"comma-separated methods, from: {', '.join(METHODS)}"
    )
    parser.add_argument("--optimizer", default="adam", help="adam, sgd or momentum")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    parser.add_argument("--schedule", default="cosine", help="cosine (decay to 0) or constant")
    parser.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per device per step")
    parser.add_argument("--density", type=float, default=0.01, help="k/d for lags and slgs")
    add_common_args(parser)


def run_methods(args: argparse.Namespace, name: str) -> list[RunResult]:
    """Trains the small CNN with each of `args.method`, the same data order and optimizer.

    Writes `name`.json, `name`.png and `name`.md to `args.out` (from process 0).
    """
    methods = parse_methods(args.method)
    devices = setup(args)
    mesh = parallel.make_mesh(devices=devices)
    data = load_dataset(args.dataset, args.data_dir, args.seed)
    task = classification_task(small_cnn(data.num_classes), data)
    main = is_main_process()
    if main:
        print(
            f"gradcomm {gradcomm.__version__}: {describe(devices)}; "
            f"{data.name}: {len(data.x_train)} train / {len(data.x_test)} test"
        )
    steps = args.epochs * len(task.batches(len(devices) * args.batch_size, args.seed, 0))
    results = []
    for method in methods:
        inner = optimizer(args.optimizer, args.lr, steps, args.schedule)
        result = train(
            make_method(method, inner, density=args.density),
            task,
            mesh,
            epochs=args.epochs,
            batch_per_device=args.batch_size,
            seed=args.seed,
            progress=main and not args.no_progress,
        )
        results.append(result)
        if main:
            print(
                f"{method:>14}: test accuracy {100 * result.test_accuracy:.2f}% "
                f"in {result.wall_seconds:.1f}s"
            )
    if main:
        table = results_table(results)
        config = {**vars(args), "devices": len(devices), "processes": jax.process_count()}
        path = write_outputs(args.out, name, config, results, table)
        print(f"\n{table}\n\nwrote {path}/{name}.json, {name}.png, {name}.md")
    return results


# ----------------------------------------------------------------------------- outputs


def write_study(
    out: str | os.PathLike,
    name: str,
    config: dict[str, Any],
    results: Sequence[RunResult],
    table: str,
    plot: Callable[[Any], None],
    extra: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Writes `name`.json (config, every run, `extra`), `name`.md and `name`.png under `out`.

    `plot(figure)` draws on a matplotlib figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = pathlib.Path(out)
    path.mkdir(parents=True, exist_ok=True)
    payload = {"config": config, "runs": [dataclasses.asdict(r) for r in results], **(extra or {})}
    (path / f"{name}.json").write_text(json.dumps(_jsonable(payload), indent=1))
    (path / f"{name}.md").write_text(table + "\n")
    fig = plt.figure(figsize=(11, 4))
    plot(fig)
    fig.tight_layout()
    fig.savefig(path / f"{name}.png", dpi=110)
    plt.close(fig)
    return path


def write_outputs(
    out: str | os.PathLike,
    name: str,
    config: dict[str, Any],
    results: Sequence[RunResult],
    table: str,
) -> pathlib.Path:
    """Writes `name`.json, `name`.png (loss and accuracy curves) and `name`.md under `out`."""
    return write_study(out, name, config, results, table, lambda fig: plot_runs(results, fig))


def _jsonable(value: Any) -> Any:
    """NumPy arrays and scalars inside nested containers to plain lists and floats."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    return value


def plot_runs(results: Sequence[RunResult], fig: Any) -> None:
    """Training loss per step and test accuracy per epoch, one line per run."""
    left, right = fig.subplots(1, 2)
    for r in results:
        left.plot(r.losses, label=r.method, lw=1)
        right.plot(range(1, len(r.epoch_accuracy) + 1), r.epoch_accuracy, label=r.method)
    left.set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
    right.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


ONE_DEVICE = (
    "One device: nothing crosses a wire, so every method sends 0 bytes and runs as local "
    "training. Run on several devices (on a CPU, `--devices 8`) to compare what they send."
)


def results_table(results: Sequence[RunResult], baseline: str = "allreduce") -> str:
    """A Markdown table: accuracy, loss, bytes per step and step time against the baseline."""
    base = next((r for r in results if r.method == baseline), results[0])
    rows = [
        f"| method | test accuracy | final loss | bytes sent per device per step "
        f"| bytes vs {base.method} | step time vs {base.method} |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        final = float(np.mean(r.losses[-10:]))
        vs = f"{r.bytes_per_step / base.bytes_per_step:.3f}" if base.bytes_per_step else "-"
        rows.append(
            f"| {r.method} | {100 * r.test_accuracy:.2f}% | {final:.4f} "
            f"| {r.bytes_per_step:,.0f} | {vs} | {r.step_seconds / base.step_seconds:.2f}x |"
        )
    if not any(r.bytes_per_step for r in results):
        rows += ["", ONE_DEVICE]
    return "\n".join(rows)
