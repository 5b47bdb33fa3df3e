#!/usr/bin/env python
"""Stochastic Gradient Push against AllReduce, D-PSGD, overlap, biased overlap and hybrids.

    python experiments/studies/sgp_gossip.py                        # 8 simulated devices
    python experiments/studies/sgp_gossip.py --devices 16 --epochs 10
    python experiments/studies/sgp_gossip.py --runs sgp,1-osgp --seeds 0   # two of the runs

The claims (Assran et al., ICML 2019, Tables 3-4, Fig. 2): SGP trains about as well as an
all-reduce while each device sends one message per step; 1-overlap SGP (1-OSGP) keeps
that, while the biased 1-OSGP that ignores the push-sum weight does worse; 2 peers mix
faster than 1; all-reducing for the first steps and gossiping afterwards recovers
all-reduce accuracy; and the devices' distance to their average model grows and shrinks
with the learning rate. Nesterov momentum SGD with linear warm-up and staircase decay
(x0.1 at half and three quarters of training), as in the paper. Writes
sgp_gossip.{json,png,md} to --out.
"""

from __future__ import annotations

import argparse

import numpy as np
import optax
from jax import lax

import gradcomm
from gradcomm import parallel
from gradcomm_experiments import cli, loop, methods, provenance, report, runtime, tasks

# The study's runs besides the all-reduce (its baseline, always run), as --runs names them.
RUNS = ("sgp", "sgp-2peer", "d-psgd", "1-osgp", "biased-1-osgp", "hybrid")


def schedule(peak: float, steps: int, warmup: int) -> optax.Schedule:
    """Linear warm-up to `peak`, then x0.1 at half and three quarters of training."""
    return optax.join_schedules(
        [
            optax.linear_schedule(peak / 10, peak, warmup),
            optax.piecewise_constant_schedule(
                peak, {steps // 2 - warmup: 0.1, 3 * steps // 4 - warmup: 0.1}
            ),
        ],
        [warmup],
    )


def main(argv: list[str] | None = None) -> None:
    stamp = provenance.start(argv)
    parser = cli.make_parser(__doc__)
    parser.add_argument("--lr", type=float, default=0.05, help="peak learning rate")
    parser.add_argument(
        "--runs",
        default=",".join(RUNS),
        help="comma-separated runs besides the all-reduce (always run, the baseline); the "
        "hybrid all-reduces for the first quarter of training, then gossips with SGP",
    )
    runtime.add_schedule_args(parser, epochs=30, batch_size=16, probe_every=5, seeds=True)
    runtime.add_common_args(parser)
    args = runtime.parse_args(parser, argv, check_runs)

    devices = runtime.setup(args)
    mesh = parallel.make_mesh(devices=devices)
    n = len(devices)
    task = tasks.cnn_task(args)
    main_process = runtime.is_main_process()
    epoch = len(task.batches(n * args.batch_size, args.seed, 0))
    steps = args.epochs * epoch
    lr = schedule(args.lr, steps, warmup=2 * epoch)

    def inner() -> optax.GradientTransformation:
        return optax.sgd(lr, momentum=0.9, nesterov=True)

    hybrid_steps = steps // 4

    def gossip(name: str, **kwargs: object) -> methods.Method:
        return methods.Method(name, optax.chain(inner(), gradcomm.sgp("data", **kwargs)), True)

    every = {
        "sgp": gossip("sgp"),
        "sgp-2peer": gossip("sgp 2-peer", topology="exponential-2peer"),
        "d-psgd": methods.Method("d-psgd", optax.chain(inner(), gradcomm.dpsgd("data")), True),
        "1-osgp": gossip("1-osgp", overlap=1),
        "biased-1-osgp": gossip("biased 1-osgp", overlap=1, biased=True),
        # Bytes per step are those after the switch, when it gossips (wire's average).
        "hybrid": gossip(f"allreduce {hybrid_steps} steps, then sgp", allreduce_steps=hybrid_steps),
    }
    runs = [
        methods.Method("allreduce", optax.chain(gradcomm.allreduce("data"), inner())),
        *(every[name] for name in cli.comma_list(args.runs, str, "--runs")),
    ]
    deviation = loop.on_devices(
        mesh,
        lambda p, b: lax.pmean(gradcomm.consensus_distance(p, "data"), "data"),
        per_device_params=True,
    )

    seeds = runtime.seed_list(args)
    results = []
    for seed in seeds:
        for method in runs:
            probe = None
            if method.per_device and seed == seeds[0]:
                probe = lambda p, s, b: {"deviation": float(deviation(p, b))}  # noqa: E731
            result = loop.train_as_flagged(args, method, task, mesh, seed=seed, probe=probe)
            results.append(result)
            if main_process:
                print(
                    f"seed {seed} {method.name:>34}: test accuracy "
                    f"{100 * result.test_accuracy:.2f}%"
                )

    if main_process:
        table = _table([m.name for m in runs], results, len(seeds), 3 * steps // 4)
        path = report.write_study(
            args.out,
            "sgp_gossip",
            vars(args),
            results,
            table,
            lambda fig: plot(fig, [m.name for m in runs], results, lr),
            provenance=stamp.record(devices, seeds=seeds),
            title=f"SGP against the all-reduce: {task.name}, Nesterov SGD, {n} devices, "
            f"{args.epochs} epochs",
        )
        print(f"\n{table}\n\nwrote {path}")


def check_runs(args: argparse.Namespace) -> None:
    """`--runs` names runs of `RUNS`."""
    unknown = [r for r in cli.comma_list(args.runs, str, "--runs") if r not in RUNS]
    if unknown:
        raise ValueError(f"--runs: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}")


def _table(names: list[str], results: list, num_seeds: int, last_quarter: int) -> str:
    """Accuracy and loss over seeds, bytes and time against the all-reduce, and deviation."""
    rows = [
        f"| method | test accuracy, mean (min-max) over {num_seeds} seeds | final loss, mean "
        "| bytes sent per device per step | bytes vs allreduce | step time vs allreduce "
        "| mean distance to the average model, last quarter (first seed) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    runs = {name: [r for r in results if r.method == name] for name in names}
    base = runs[names[0]]
    base_time = np.mean([r.step_seconds for r in base])
    base_bytes = base[0].bytes_per_step
    for name, rs in runs.items():
        acc = 100 * np.array([r.test_accuracy for r in rs])
        loss = np.mean([np.mean(r.losses[-10:]) for r in rs])
        time = np.mean([r.step_seconds for r in rs]) / base_time
        d = rs[0].probes.get("deviation")
        last = [v for s, v in zip(rs[0].probe_steps, d or [], strict=False) if s >= last_quarter]
        rows.append(
            f"| {name} | {report.mean_range(acc.mean(), acc.min(), acc.max(), 2, '%')} "
            f"| {loss:.4f} "
            f"| {rs[0].bytes_per_step:,.0f} "
            f"| {f'{rs[0].bytes_per_step / base_bytes:.3f}' if base_bytes else '-'} "
            f"| {time:.2f}x | " + (f"{np.mean(last):.2e} |" if last else "- |")
        )
    if not base_bytes:
        rows += ["", report.ONE_DEVICE]
    return "\n".join(rows)


# Each run drawn as the registry's method it is, the study's own variants hollow.
STYLES = {
    "allreduce": ("allreduce", 0),
    "sgp": ("sgp", 0),
    "sgp 2-peer": ("sgp", 1),
    "d-psgd": ("dpsgd", 0),
    "1-osgp": ("osgp", 0),
    "biased 1-osgp": ("osgp", 1),
}


def run_style(name: str) -> dict[str, object]:
    """The style of a run of this study (the hybrid: a variant of SGP)."""
    return report.style(*STYLES.get(name, ("sgp", 2)))


def plot(fig: object, names: list[str], results: list, lr: optax.Schedule) -> None:
    left, right = fig.subplots(1, 2)
    for name in names:
        runs = [r for r in results if r.method == name]
        acc = 100 * np.mean([r.epoch_accuracy for r in runs], axis=0)
        kw = {**run_style(name), "markevery": max(1, len(acc) // 10), "markersize": 5}
        left.plot(range(1, len(acc) + 1), acc, label=name, **kw)
        if runs[0].probes.get("deviation"):
            deviation = runs[0].probes["deviation"]
            kw["markevery"] = max(1, len(deviation) // 10)
            right.plot(runs[0].probe_steps, deviation, lw=1, label=name, **kw)
    left.set(
        xlabel="epoch",
        ylabel="test accuracy (%)",
        title="test accuracy, mean over seeds",
        ylim=(80, 100),
    )
    right.set(
        xlabel="step",
        ylabel="mean |z_i - average| (log scale)",
        yscale="log",
        title="distance to the average model (Fig. 2)",
    )
    steps = max(len(r.losses) for r in results)
    twin = right.twinx()
    twin.plot(range(steps), [float(lr(s)) for s in range(steps)], "k--", lw=1)
    twin.set_ylabel("learning rate (dashed)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)


if __name__ == "__main__":
    main()
