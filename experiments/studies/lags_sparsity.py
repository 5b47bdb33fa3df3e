#!/usr/bin/env python
"""LAGS-SGD: Assumption 1 during training, Dense vs SLGS vs LAGS, and the eq. 18 planner.

    python experiments/studies/lags_sparsity.py                     # 8 simulated devices
    python experiments/studies/lags_sparsity.py --densities 0.01 --epochs 5
    python experiments/studies/lags_sparsity.py --runs lags,plan      # no dense, no SLGS

The claims (Shi et al., ECAI 2020, Fig. 2 and Table 1): delta(l) (eq. 20), the ratio of
the error of the devices' summed top-k to the expected error of a random-k of the sum,
stays below 1 for every layer throughout training (Assumption 1 holds), and LAGS reaches
about the accuracy of dense SGD and of single-layer SLGS at the same density. The planner
(eq. 18) picks each layer's density from its backward time, profiled here on this model,
and an all-gather over a modelled network (--latency, --bandwidth). Plain SGD, so that
the accumulator x = residual - lr * gradient is what LAGS selects from. Writes
lags_sparsity.{json,png,md} to --out.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax

import gradcomm
from gradcomm import parallel
from gradcomm_experiments import cli, loop, methods, provenance, report, runtime, tasks

# The study's runs, as --runs names them: SLGS and LAGS run at each of --densities.
RUNS = ("dense", "slgs", "lags", "plan")


def main(argv: list[str] | None = None) -> None:
    stamp = provenance.start(argv)
    parser = cli.make_parser(__doc__)
    parser.add_argument("--densities", default="0.001,0.01", help="k/d, comma-separated")
    parser.add_argument(
        "--runs",
        default=",".join(RUNS),
        help="comma-separated: dense SGD, SLGS and LAGS at each density, LAGS with the eq. 18 "
        "plan's densities",
    )
    parser.add_argument("--lr", type=float, default=0.3, help="SGD learning rate (constant)")
    runtime.add_schedule_args(parser, epochs=20, batch_size=16, probe_every=5)
    parser.add_argument("--latency", type=float, default=50e-6, help="seconds per message")
    parser.add_argument("--bandwidth", type=float, default=1.25e8, help="bytes per second")
    runtime.add_common_args(parser)
    args = runtime.parse_args(parser, argv, check_densities)
    densities = cli.comma_list(args.densities, float, "--densities")
    chosen = cli.comma_list(args.runs, str, "--runs")

    devices = runtime.setup(args)
    mesh = parallel.make_mesh(devices=devices)
    n = len(devices)
    task = tasks.cnn_task(args)
    main_process = runtime.is_main_process()

    init = task.init(jax.random.key(args.seed))
    local_batch = task.batches(args.batch_size, args.seed, 0)[0]
    backward = gradcomm.lags_profile(lambda p, b: task.loss_fn(p, b)[0], init, local_batch)
    sizes = {name: _leaf_sizes(init)[name] for name in backward}
    plan = gradcomm.lags_plan(
        backward, sizes, num_devices=n, latency=args.latency, bandwidth=args.bandwidth
    )

    def delta_probe(density: object) -> loop.Probe:
        def deltas(params: object, batch: object, residual: object) -> object:
            grads = jax.grad(lambda p: task.loss_fn(p, batch)[0])(params)
            acc = jax.tree.map(lambda r, g: r - args.lr * g, residual, grads)
            return gradcomm.lags_delta(acc, density, "data")

        run = loop.on_devices(mesh, deltas)
        return lambda p, s, b: {"delta": _named(run(p, b, s[1].residual))}

    sgd = optax.sgd(args.lr)
    runs = []
    if "dense" in chosen:
        runs.append(("dense", optax.chain(gradcomm.allreduce("data"), sgd), None))
    for d in densities:
        if "slgs" in chosen:
            runs.append((f"slgs {d}", optax.chain(sgd, gradcomm.slgs("data", density=d)), None))
        if "lags" in chosen:
            runs.append((f"lags {d}", optax.chain(sgd, gradcomm.lags("data", density=d)), d))
    if "plan" in chosen:
        runs.append(("lags plan", optax.chain(sgd, gradcomm.lags("data", density=plan)), plan))

    results = []
    for name, tx, density in runs:
        probe = delta_probe(density) if density is not None else None
        result = loop.train_as_flagged(args, methods.Method(name, tx), task, mesh, probe=probe)
        results.append(result)
        if main_process:
            worst = max((max(v.values()) for v in result.probes.get("delta", [])), default=None)
            note = f", max delta {worst:.3f}" if worst is not None else ""
            print(f"{name:>12}: test accuracy {100 * result.test_accuracy:.2f}%{note}")

    if main_process:
        table = [
            "| run | test accuracy | bytes per device per step | max delta(l) over training |",
            "| --- | ---: | ---: | ---: |",
        ]
        for r in results:
            deltas = r.probes.get("delta")
            worst = f"{max(max(v.values()) for v in deltas):.3f}" if deltas else "-"
            table.append(
                f"| {r.method} | {100 * r.test_accuracy:.2f}% | {r.bytes_per_step:,.0f} | {worst} |"
            )
        table += ["", *_delta_table(results, _leaf_sizes(init)), ""]
        table.append(
            f"The eq. 18 plan for {n} devices, latency {args.latency:g} s, bandwidth "
            f"{args.bandwidth:g} B/s, backward times profiled on this model:"
        )
        table.append("")
        table.append(plan.table())
        table = "\n".join(table)
        probed = [r for r in results if r.probes.get("delta")]
        path = report.write_study(
            args.out,
            "lags_sparsity",
            vars(args),
            results,
            table,
            lambda fig: plot(fig, results, probed, plan),
            extra={
                "plan": {"densities": plan.densities, "backward_seconds": plan.backward_seconds}
            },
            provenance=stamp.record(devices, seeds=[args.seed]),
            title=f"LAGS-SGD: {task.name}, SGD (lr {args.lr:g}), {n} devices, {args.epochs} epochs",
        )
        print(f"\n{table}\n\nwrote {path}")


def check_densities(args: argparse.Namespace) -> None:
    """Every density of `--densities` is in (0, 1]; `--runs` names runs of `RUNS`."""
    densities = cli.comma_list(args.densities, float, "--densities")
    if not all(0 < d <= 1 for d in densities):
        raise ValueError(f"--densities {args.densities}: every k/d must be in (0, 1]")
    unknown = [r for r in cli.comma_list(args.runs, str, "--runs") if r not in RUNS]
    if unknown:
        raise ValueError(f"--runs: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}")


def run_style(name: str) -> dict[str, object]:
    """A run's style: dense as the all-reduce; "slgs d" and "lags d" as the registry's
    methods, hollow at a density other than the registry's; the plan as a variant of LAGS."""
    if name == "dense":
        return report.style("allreduce")
    method, _, density = name.partition(" ")
    registry = methods.METHODS[method].options["density"]
    variant = 2 if density == "plan" else int(float(density) != registry)
    return report.style(method, variant)


def _delta_table(results: list, sizes: dict[str, int]) -> list[str]:
    """Per leaf and LAGS run: mean and max delta(l) over the probes, and how often it passed 1."""
    probed = [r for r in results if r.probes.get("delta")]
    rows = [
        "delta(l) per leaf over training (mean / max / share of probes above 1):",
        "",
        "| leaf | size | " + " | ".join(r.method for r in probed) + " |",
        "| --- | ---: |" + " ---: |" * len(probed),
    ]
    for leaf, size in sizes.items():
        cells = []
        for r in probed:
            v = np.array([float(p[leaf]) for p in r.probes["delta"]])
            cells.append(f"{v.mean():.2f} / {v.max():.2f} / {np.mean(v > 1):.0%}")
        rows.append(f"| {leaf} | {size:,} | " + " | ".join(cells) + " |")
    return rows


def _leaf_sizes(params: object) -> dict[str, int]:
    return {name: int(np.size(v)) for name, v in _named(params).items()}


def _named(tree: object) -> dict[str, object]:
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p, simple=True, separator="/"): v for p, v in paths}


def plot(fig: object, results: list, probed: list, plan: gradcomm.LagsPlan) -> None:
    left, middle, right = fig.subplots(1, 3)
    shown = probed[0] if probed else None
    if shown is not None:
        for leaf in shown.probes["delta"][0]:
            middle.plot(
                shown.probe_steps, [float(v[leaf]) for v in shown.probes["delta"]], lw=1, label=leaf
            )
        middle.axhline(1, color="k", ls="--", lw=1)
        middle.set(
            xlabel="step", ylabel="delta(l) (eq. 20; <= 1: Assumption 1 holds)",
            title=f"Assumption 1, {shown.method}",
        )  # fmt: skip
    for r in results:
        left.plot(
            range(1, len(r.epoch_accuracy) + 1),
            100 * np.array(r.epoch_accuracy),
            label=r.method,
            **run_style(r.method),
        )
    left.set(
        xlabel="epoch", ylabel="test accuracy (%)", title="Dense vs SLGS vs LAGS", ylim=(80, 100)
    )
    names = list(plan.densities)
    right.bar(
        range(len(names)), [plan.densities[k] for k in names], color=run_style("lags plan")["color"]
    )
    right.set_xticks(range(len(names)), names, rotation=60, fontsize=7)
    right.set(yscale="log", ylabel="density k/d", title="eq. 18 plan (backprop order)")
    for ax in (left, middle):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


if __name__ == "__main__":
    main()
