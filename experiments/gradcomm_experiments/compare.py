"""The recipe of compare.py and train.py: the small CNN trained with each named method."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import gradcomm
from gradcomm import parallel
from gradcomm_experiments import cli, loop, provenance, report, runtime, tasks, timing
from gradcomm_experiments import data as datasets
from gradcomm_experiments import methods as registry


def main(
    doc: str | None, argv: Sequence[str] | None, name: str, *, methods: str, seeds: bool = False
) -> None:
    """A script's main: its flags (`--method` defaulting to `methods`; `--seeds` with
    `seeds`, else `--seed`), `--timing-rounds` and `--timing-steps`, then `run_methods`."""
    stamp = provenance.start(argv)
    parser = cli.make_parser(doc)
    add_training_args(parser, methods=methods, seeds=seeds)
    parser.add_argument(
        "--timing-rounds",
        type=int,
        default=5,
        help="after training, time every method's step in this many interleaved rounds "
        "(alternating order) and report the median round; 0: the training loop's median",
    )
    parser.add_argument(
        "--timing-steps", type=int, default=20, help="steps per method per timing round"
    )
    parser.set_defaults(out=f"runs/{name}")
    args = runtime.parse_args(parser, argv, check_timed_training_args)
    run_methods(args, name, stamp)


def check_timed_training_args(args: argparse.Namespace) -> None:
    """`check_training_args`, and timing flags that are not negative (steps at least 1)."""
    check_training_args(args)
    if args.timing_rounds < 0 or args.timing_steps < 1:
        raise ValueError(
            f"--timing-rounds {args.timing_rounds} --timing-steps {args.timing_steps}: "
            "need rounds >= 0 (0: no interleaved timing) and steps >= 1"
        )


def add_training_args(
    parser: argparse.ArgumentParser, *, methods: str, seeds: bool = False
) -> None:
    """The flags of a classification run over several methods (default: `methods`): with
    `seeds`, `--seeds` (each method runs once per seed, as the studies spell it), else one
    `--seed`."""
    parser.add_argument(
        "--method",
        default=methods,
        help=f"comma-separated methods, from: {', '.join(registry.METHODS)}",
    )
    parser.add_argument(
        "--optimizer", default="adam", choices=("adam", "sgd", "momentum"), help="inner optimizer"
    )
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    parser.add_argument(
        "--schedule", default="cosine", choices=("cosine", "constant"), help="cosine decays to 0"
    )
    runtime.add_schedule_args(parser, epochs=30, batch_size=16, seeds=seeds)
    parser.add_argument("--density", type=float, default=0.01, help="k/d for lags and slgs")
    runtime.add_common_args(parser, seed=not seeds)


def check_training_args(args: argparse.Namespace) -> None:
    """`--method` names methods of the registry; `--density` is in (0, 1]."""
    registry.parse(args.method)
    if not 0 < args.density <= 1:
        raise ValueError(f"--density {args.density}: must be in (0, 1]")


def configured(name: str, args: argparse.Namespace) -> registry.Spec:
    """The registry's method `name` with this run's flags: `--density` for lags and slgs,
    and TernGrad keeping the small CNN's last layer in float."""
    spec = registry.METHODS[name]
    if name in ("lags", "slgs"):
        return spec.configured(density=args.density)
    if name == "terngrad":
        return spec.configured(dense=tasks.CNN_FLOAT_LEAVES)
    return spec


def run_methods(
    args: argparse.Namespace, name: str, stamp: provenance.Stamp
) -> list[loop.RunResult]:
    """Trains the small CNN with each of `args.method`, once per seed (`--seeds`, or the one
    `--seed`): in each seed every method gets the same data split (digits is split with the
    seed), initial params, data order and optimizer.

    Writes `name`.json (every run with its seed, each method's summary over the seeds, the
    Pareto front of the means, and the provenance of `stamp`), `name`.png (loss and
    accuracy), `name`_bytes.png (accuracy against bytes, the Pareto front marked) and
    `name`.md to `args.out` (from process 0). Returns the runs, seed by seed.
    """
    names = registry.parse(args.method)
    seeds = runtime.seed_list(args) if hasattr(args, "seeds") else [args.seed]
    devices = runtime.setup(args)
    mesh = parallel.make_mesh(devices=devices)
    main = runtime.is_main_process()
    results, run_seeds = [], []
    # Each method built once (for a number of steps) and its jitted step kept: every seed's
    # run of it reuses the compiled step (each seed's task trains the same model, and so
    # takes the first seed's loss function), and so does its interleaved timing.
    built_methods: dict[tuple[str, int], registry.Method] = {}
    loss_fn = None
    for seed in seeds:
        data = datasets.load_dataset(args.dataset, args.data_dir, seed)
        task = tasks.classification_task(tasks.small_cnn(data.num_classes), data)
        loss_fn = loss_fn or task.loss_fn
        task = dataclasses.replace(task, loss_fn=loss_fn)
        if main and seed == seeds[0]:
            print(
                f"gradcomm {gradcomm.__version__}: {runtime.describe(devices)}; "
                f"{data.name}: {len(data.x_train)} train / {len(data.x_test)} test; "
                f"{report.count(len(seeds), 'seed')}"
            )
        steps = args.epochs * len(task.batches(len(devices) * args.batch_size, seed, 0))
        for method in names:
            if (method, steps) not in built_methods:
                built_methods[method, steps] = build(method, args, steps)
            built = built_methods[method, steps]
            result = loop.train_as_flagged(args, built, task, mesh, seed=seed)
            results.append(result)
            run_seeds.append(seed)
            if main:
                print(
                    f"seed {seed} {method:>14}: test accuracy "
                    f"{100 * result.test_accuracy:.2f}% in {result.wall_seconds:.1f}s"
                )
    timing, timed = "", {}
    if getattr(args, "timing_rounds", 0) > 0:
        timers = [built_methods[method, steps] for method in names]
        timing, timed = interleaved_step_times(args, timers, task, mesh, seeds[-1], results)
    if main:
        summary = report.summarize(results)
        means = [(s["bytes_per_step"], s["test_accuracy"]["mean"]) for s in summary]
        on_front = sorted(report.pareto_front(means), key=means.__getitem__)
        front = [summary[i]["method"] for i in on_front]  # from the fewest bytes
        table = report.results_table(results)
        image = 100 / len(data.x_test)
        if len(seeds) > 1:
            split = "split of digits, " if data.name == "digits" else ""
            table += (
                f"\n\nAccuracy and loss: the mean (min-max) over seeds "
                f"{', '.join(map(str, seeds))}. Each seed draws its own {split}initial model "
                f"and batch order, the same for every method. One test image is {image:.2f} "
                "points of accuracy."
            )
        table += timing
        if any(r.bytes_per_step for r in results):
            table += (
                "\n\nPareto front of the mean accuracies (no other method sends fewer bytes "
                f"with at least its accuracy, or as few with more): {', '.join(front)}."
            )
        setting = (
            f"{data.name}, small CNN, {report.count(len(devices), 'device')}, "
            f"{args.optimizer} (lr {args.lr:g}, {args.schedule}), "
            f"{report.count(args.epochs, 'epoch')}, {report.count(len(seeds), 'seed')}"
        )
        config = {**vars(args), "devices": len(devices), "processes": jax.process_count()}
        path = report.write_study(
            args.out,
            name,
            config,
            results,
            table,
            lambda fig: report.plot_runs(results, fig),
            {"seeds": seeds, "summary": summary, "pareto_front": front, **timed},
            provenance=stamp.record(devices, seeds=seeds),
            title=f"Every method on the same task: {setting}",
            figures={
                f"{name}_bytes": (
                    f"Accuracy against bytes on the wire\n{setting}",
                    lambda fig: report.plot_bytes(results, fig),
                )
            },
            run_seeds=run_seeds,
        )
        print(f"\n{table}\n\nwrote {path}/{name}.json, {name}.png, {name}_bytes.png, {name}.md")
    return results


def build(method: str, args: argparse.Namespace, steps: int) -> registry.Method:
    """The registry's `method` as configured by the flags, with the inner optimizer of
    `--optimizer`, `--lr` and `--schedule` over `steps`; it keeps its jitted train steps
    for another run (`Method.compiled`)."""
    inner = registry.optimizer(args.optimizer, args.lr, steps, args.schedule)
    rate = registry.learning_rate(args.lr, steps, args.schedule)  # 1-bit Adam's, which is Adam
    spec = configured(method, args)
    if spec.method == "onebit_adam":
        # Its variance freezes after the warm-up, and the CNN's dead ReLU units and blank
        # pixels leave entries whose variance is 0 or nearly: each then takes a step of the
        # tensor's scale over sqrt(v) + eps, which at Adam's eps = 1e-8 diverges to NaN
        # within a few steps of the warm-up (docs/site/methods/onebit_adam.md). At 1e-3,
        # about the median sqrt(v), it trains. The warm-up: 15% of the run (the paper warms
        # BERT up for a small part of its steps too).
        spec = spec.configured(eps=1e-3, warmup_steps=max(1, steps * 3 // 20))
    built = registry.build(spec, inner, learning_rate=rate)
    return dataclasses.replace(built, compiled={})


def interleaved_step_times(
    args: argparse.Namespace,
    methods: Sequence[registry.Method],
    task: tasks.Task,
    mesh: jax.sharding.Mesh,
    seed: int,
    results: list[loop.RunResult],
) -> tuple[str, dict[str, Any]]:
    """Replaces every run's `step_seconds` by its method's median of interleaved rounds.

    Each method starts afresh (`seed`'s model; `task` holds that seed's data) and runs
    `--timing-steps` steps per round, in `--timing-rounds` rounds of alternating method
    order (`timing.interleaved_medians`); its step time is the median over rounds of each
    round's median step, the same for every seed's run. The methods are the ones that
    trained, so each times the compiled step of its training runs. Returns the sentence the
    table gets, and the record the study's JSON gets: `step_timing`, each method's rounds
    and each run's training-loop median.
    """
    timers = {}
    for method in methods:
        timers[method.name] = loop.step_timer(
            method, task, mesh, seed=seed, batch_per_device=args.batch_size,
            steps=args.timing_steps,
        )  # fmt: skip
    rounds = timing.interleaved_medians(timers, args.timing_rounds)
    loop_seconds = [r.step_seconds for r in results]
    for r in results:
        r.step_seconds = float(np.median(rounds[r.method]))
    record = {"rounds": rounds, "steps": args.timing_steps, "loop_step_seconds": loop_seconds}
    return (
        f"\n\nStep time: the median of {args.timing_rounds} interleaved rounds (alternating "
        f"method order) of {args.timing_steps} steps each, every method started afresh on "
        f"seed {seed} after training; a round's time is its median step."
    ), {"step_timing": record}
