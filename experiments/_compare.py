"""The recipe of compare.py and train.py: the small CNN trained with each named method."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import _cli
import _data
import _loop
import _methods
import _provenance
import _report
import _runtime
import _tasks
import jax

import gradcomm
from gradcomm import parallel


def main(doc: str | None, argv: Sequence[str] | None, name: str, *, methods: str) -> None:
    """A script's main: its flags (`--method` defaulting to `methods`), then `run_methods`."""
    stamp = _provenance.start(argv)
    parser = _cli.make_parser(doc)
    add_training_args(parser, methods=methods)
    parser.set_defaults(out=f"runs/{name}")
    args = _runtime.parse_args(parser, argv, check_training_args)
    run_methods(args, name, stamp)


def add_training_args(parser: argparse.ArgumentParser, *, methods: str) -> None:
    """The flags of a classification run over several methods (default: `methods`)."""
    parser.add_argument(
        "--method",
        default=methods,
        help=f"comma-separated methods, from: {', '.join(_methods.METHODS)}",
    )
    parser.add_argument(
        "--optimizer", default="adam", choices=("adam", "sgd", "momentum"), help="inner optimizer"
    )
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    parser.add_argument(
        "--schedule", default="cosine", choices=("cosine", "constant"), help="cosine decays to 0"
    )
    _runtime.add_schedule_args(parser, epochs=30, batch_size=16)
    parser.add_argument("--density", type=float, default=0.01, help="k/d for lags and slgs")
    _runtime.add_common_args(parser)


def check_training_args(args: argparse.Namespace) -> None:
    """`--method` names methods of the registry; `--density` is in (0, 1]."""
    _methods.parse(args.method)
    if not 0 < args.density <= 1:
        raise ValueError(f"--density {args.density}: must be in (0, 1]")


def configured(name: str, args: argparse.Namespace) -> _methods.Spec:
    """The registry's method `name` with this run's flags: `--density` for lags and slgs,
    and TernGrad keeping the small CNN's last layer in float."""
    spec = _methods.METHODS[name]
    if name in ("lags", "slgs"):
        return spec.configured(density=args.density)
    if name == "terngrad":
        return spec.configured(dense=_tasks.CNN_FLOAT_LEAVES)
    return spec


def run_methods(
    args: argparse.Namespace, name: str, stamp: _provenance.Stamp
) -> list[_loop.RunResult]:
    """Trains the small CNN with each of `args.method`, the same data order and optimizer.

    Writes `name`.json (with the provenance of `stamp`), `name`.png (loss and accuracy),
    `name`_bytes.png (accuracy against bytes, the Pareto front marked) and `name`.md to
    `args.out` (from process 0).
    """
    names = _methods.parse(args.method)
    devices = _runtime.setup(args)
    mesh = parallel.make_mesh(devices=devices)
    data = _data.load_dataset(args.dataset, args.data_dir, args.seed)
    task = _tasks.classification_task(_tasks.small_cnn(data.num_classes), data)
    main = _runtime.is_main_process()
    if main:
        print(
            f"gradcomm {gradcomm.__version__}: {_runtime.describe(devices)}; "
            f"{data.name}: {len(data.x_train)} train / {len(data.x_test)} test"
        )
    steps = args.epochs * len(task.batches(len(devices) * args.batch_size, args.seed, 0))
    results = []
    for method in names:
        inner = _methods.optimizer(args.optimizer, args.lr, steps, args.schedule)
        spec = configured(method, args)
        result = _loop.train_as_flagged(args, _methods.build(spec, inner), task, mesh)
        results.append(result)
        if main:
            print(
                f"{method:>14}: test accuracy {100 * result.test_accuracy:.2f}% "
                f"in {result.wall_seconds:.1f}s"
            )
    if main:
        on_front = sorted(_report.pareto_front(_points(results)), key=lambda i: _points(results)[i])
        front = [results[i].method for i in on_front]  # from the fewest bytes
        table = _report.results_table(results)
        if any(r.bytes_per_step for r in results):
            table += (
                "\n\nPareto front (no other method sends fewer bytes with at least its "
                f"accuracy, or as few with more): {', '.join(front)}."
            )
        setting = (
            f"{data.name}, small CNN, {_report.count(len(devices), 'device')}, "
            f"{args.optimizer} (lr {args.lr:g}, {args.schedule}), "
            f"{_report.count(args.epochs, 'epoch')}"
        )
        config = {**vars(args), "devices": len(devices), "processes": jax.process_count()}
        path = _report.write_study(
            args.out,
            name,
            config,
            results,
            table,
            lambda fig: _report.plot_runs(results, fig),
            {"pareto_front": front},
            provenance=stamp.record(devices, seeds=[args.seed]),
            title=f"Every method on the same task: {setting}",
            figures={
                f"{name}_bytes": (
                    f"Accuracy against bytes on the wire\n{setting}",
                    lambda fig: _report.plot_bytes(results, fig),
                )
            },
        )
        print(f"\n{table}\n\nwrote {path}/{name}.json, {name}.png, {name}_bytes.png, {name}.md")
    return results


def _points(results: Sequence[_loop.RunResult]) -> list[tuple[float, float]]:
    return [(r.bytes_per_step, r.test_accuracy) for r in results]
