#!/usr/bin/env python
"""TernGrad against the number of workers, with a fixed total batch; float as the baseline.

    python experiments/studies/terngrad_workers.py               # N = 1..16, 16 simulated devices
    python experiments/studies/terngrad_workers.py --sizes 1,4 --epochs 5
    python experiments/studies/terngrad_workers.py --optimizers momentum --variants terngrad

The claims (Wen et al., NeurIPS 2017, Fig. 3 and Tables 1-2): ternary gradients with
layer-wise scalars, scalar sharing and clipping at 2.5 standard deviations reach about the
float accuracy, with momentum SGD and with vanilla SGD, as the workers grow; without
clipping accuracy drops. Every layer is ternarized here (the paper's small networks).
The last panel is Fig. 2: one layer's gradient on one device before clipping, after it,
ternarized, and averaged over the devices, after --histogram-epochs of float momentum
SGD. Writes terngrad_workers.{json,png,md}.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import gradcomm
from gradcomm import parallel
from gradcomm_experiments import cli, loop, methods, provenance, report, runtime, tasks

OPTIMIZERS = {"momentum": 0.02, "sgd": 0.3}  # learning rates chosen on the float runs alone
VARIANTS = ("float", "terngrad", "terngrad-noclip")
LAYER = ("Dense_0", "kernel")


def transformation(variant: str, opt: optax.GradientTransformation) -> optax.GradientTransformation:
    if variant == "float":
        return optax.chain(gradcomm.allreduce("data"), opt)
    clip = None if variant == "terngrad-noclip" else 2.5
    return optax.chain(gradcomm.terngrad("data", clip=clip), opt)


def main(argv: list[str] | None = None) -> None:
    stamp = provenance.start(argv)
    parser = cli.make_parser(__doc__)
    parser.add_argument("--sizes", default="1,2,4,8,16", help="numbers of devices N")
    parser.add_argument(
        "--total-batch", type=int, default=128, help="examples per step, all devices"
    )
    parser.add_argument(
        "--optimizers", default=",".join(OPTIMIZERS), help="momentum and/or sgd (vanilla)"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument(
        "--histogram-epochs",
        type=int,
        default=2,
        help="epochs of float momentum SGD before Fig. 2's snapshot (0: the initial model)",
    )
    runtime.add_schedule_args(parser, epochs=20)
    runtime.add_common_args(parser)
    args = runtime.parse_args(parser, argv, check_sizes, check_choices)
    optimizers = cli.comma_list(args.optimizers, str, "--optimizers")
    variants = cli.comma_list(args.variants, str, "--variants")
    sizes, devices = runtime.setup_sizes(args)
    task = tasks.cnn_task(args)
    main_process = runtime.is_main_process()

    results, rows = [], []
    for n in sizes:
        mesh = parallel.make_mesh(devices=devices[:n])
        for opt_name in optimizers:
            opt = optax.sgd(OPTIMIZERS[opt_name], momentum=0.9 if opt_name == "momentum" else None)
            for variant in variants:
                tx = transformation(variant, opt)
                method = methods.Method(f"{variant} {opt_name} N={n}", tx)
                result = loop.train_as_flagged(
                    args, method, task, mesh, batch_per_device=args.total_batch // n
                )
                results.append(result)
                rows.append((n, opt_name, variant, result.test_accuracy))
                if main_process:
                    print(
                        f"N={n:>2} {opt_name:>8} {variant:>16}: {100 * result.test_accuracy:.2f}%"
                    )

    histogram = layer_histogram(task, devices[: max(sizes)], args)
    if main_process:
        columns = [(o, v) for o in optimizers for v in variants]
        head = " | ".join(f"{o} {v}" for o, v in columns)
        table = [f"| N | per device | {head} |", "| ---: | ---: |" + " ---: |" * len(columns)]
        for n in sizes:
            acc = {(o, v): a for m, o, v, a in rows if m == n}
            cells = " | ".join(f"{100 * acc[column]:.2f}%" for column in columns)
            table.append(f"| {n} | {args.total_batch // n} | {cells} |")
        table = "\n".join(table)
        path = report.write_study(
            args.out,
            "terngrad_workers",
            vars(args),
            results,
            table,
            lambda fig: plot(fig, sizes, rows, histogram, optimizers, variants),
            extra={"histogram": histogram},
            provenance=stamp.record(devices, seeds=[args.seed]),
            title=f"TernGrad against float: {task.name}, a total batch of {args.total_batch} "
            f"over N workers, {args.epochs} epochs",
        )
        print(f"\n{table}\n\nwrote {path}")


def check_sizes(args: argparse.Namespace) -> None:
    """`cli.device_counts`, each N also dividing `--total-batch`."""
    sizes = cli.device_counts(args)
    if any(args.total_batch % n for n in sizes):
        raise ValueError(f"--total-batch {args.total_batch} must divide by every N in {sizes}")


def check_choices(args: argparse.Namespace) -> None:
    """`--optimizers` and `--variants` name known ones; `--histogram-epochs` is not negative."""
    for flag, known in (("optimizers", OPTIMIZERS), ("variants", VARIANTS)):
        unknown = set(cli.comma_list(getattr(args, flag), str, f"--{flag}")) - set(known)
        if unknown:
            raise ValueError(
                f"--{flag}: unknown {', '.join(sorted(unknown))}; choose from {', '.join(known)}"
            )
    if args.histogram_epochs < 0:
        raise ValueError(f"--histogram-epochs {args.histogram_epochs}: must be 0 or more")


# Each variant drawn as the registry's method it is.
STYLES = {
    "float": ("allreduce", 0),
    "terngrad": ("terngrad", 0),
    "terngrad-noclip": ("terngrad", 1),
}


def layer_histogram(task: tasks.Task, devices: list, args: argparse.Namespace) -> dict:
    """Fig. 2: one layer's gradient on device 0 before and after clipping, ternarized, averaged.

    Taken after `--histogram-epochs` of float training with momentum SGD on all the
    devices (an epoch more runs: the snapshot is taken before a step), or of the initial
    model (0: no training).
    """
    n = len(devices)
    mesh = parallel.make_mesh(devices=devices)
    terngrad = gradcomm.terngrad("data")

    def views(params: object, batch: object) -> dict[str, jax.Array]:
        grads = jax.grad(lambda p: task.loss_fn(p, batch)[0])(params)
        g = grads[LAYER[0]][LAYER[1]]
        first = lax.axis_index("data") == 0
        codes, scale = gradcomm.ternarize(g, jax.random.key(0))
        clipped = jnp.clip(g, -2.5 * jnp.std(g), 2.5 * jnp.std(g))
        mean = terngrad.update(grads, terngrad.init(grads))[0][LAYER[0]][LAYER[1]]
        on_first = lambda x: lax.psum(jnp.where(first, x, 0), "data")  # noqa: E731
        return {
            "float": on_first(g),
            "clipped": on_first(clipped),
            "ternary": on_first(scale * codes),
            "averaged": mean,
        }

    snapshot = loop.on_devices(mesh, views)
    batches = task.batches(args.total_batch, args.seed, 0)
    if args.histogram_epochs == 0:
        arrays, step = snapshot(task.init(jax.random.key(args.seed)), batches[0]), 0
    else:
        run = loop.train(
            methods.Method(
                "float momentum", transformation("float", optax.sgd(0.02, momentum=0.9))
            ),
            task,
            mesh,
            epochs=args.histogram_epochs + 1,
            batch_per_device=args.total_batch // n,
            seed=args.seed,
            progress=False,
            probe=lambda p, s, b: snapshot(p, b),
            probe_every=args.histogram_epochs * len(batches),
        )
        # At the start of the last epoch.
        arrays, step = {k: v[-1] for k, v in run.probes.items()}, run.probe_steps[-1]
    edges = np.linspace(-np.abs(arrays["float"]).max(), np.abs(arrays["float"]).max(), 61)
    return {
        "layer": "/".join(LAYER),
        "devices": n,
        "step": step,
        "edges": edges,
        **{k: np.histogram(np.ravel(v), bins=edges)[0] for k, v in arrays.items()},
    }


def plot(
    fig: object,
    sizes: list[int],
    rows: list[tuple],
    histogram: dict,
    optimizers: list[str],
    variants: list[str],
) -> None:
    axes = fig.subplots(1, len(optimizers) + 1)
    for ax, opt_name in zip(axes[:-1], optimizers, strict=True):
        for variant in variants:
            acc = [100 * a for m, o, v, a in rows if o == opt_name and v == variant]
            ax.plot(sizes, acc, label=variant, **report.style(*STYLES[variant]))
        ax.set(
            xscale="log",
            xlabel="workers N (fixed total batch)",
            ylabel="test accuracy (%)",
            title="momentum SGD" if opt_name == "momentum" else "vanilla SGD",
        )
        ax.set_xticks(sizes, [str(n) for n in sizes])
    centers = (histogram["edges"][1:] + histogram["edges"][:-1]) / 2
    for key in ("float", "clipped", "ternary", "averaged"):
        axes[-1].plot(centers, histogram[key], label=key, lw=1)
    axes[-1].set(
        yscale="log",
        xlabel=f"gradient value, {histogram['layer']}",
        ylabel="count (log scale)",
        title=f"one layer, step {histogram['step']}, {histogram['devices']} devices",
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


if __name__ == "__main__":
    main()
