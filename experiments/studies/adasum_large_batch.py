#!/usr/bin/env python
"""Adasum at large batch: accuracy against the number of devices, and gradient orthogonality.

    python experiments/studies/adasum_large_batch.py               # N = 1..32, 32 simulated devices
    python experiments/studies/adasum_large_batch.py --sizes 1,2,4,8 --epochs 4

The claim (Maleki et al., MLSys 2021, 5.2.3 and Fig. 4): with a fixed batch per device,
an all-reduce needs its learning rate scaled with N (Goyal et al.'s linear rule) and loses
accuracy as N grows, while Adasum, with the small-batch learning rate, keeps it. Both use
momentum SGD for the same number of epochs. Section 5.1.3 and Fig. 2: the per-layer
orthogonality |AS(g)|^2 / sum_i |g_i|^2 of the devices' gradients grows during training,
measured here at the largest N. Writes adasum_large_batch.{json,png,md} to --out.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

import gradcomm
from gradcomm import parallel
from gradcomm_experiments import cli, loop, methods, provenance, report, runtime, tasks


def main(argv: list[str] | None = None) -> None:
    stamp = provenance.start(argv)
    parser = cli.make_parser(__doc__)
    parser.add_argument("--sizes", default="1,2,4,8,16,32", help="numbers of devices N")
    parser.add_argument("--lr", type=float, default=0.02, help="the small-batch learning rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    runtime.add_schedule_args(parser, epochs=8, batch_size=4, probe_every=2, seeds=True)
    runtime.add_common_args(parser)
    args = runtime.parse_args(parser, argv, cli.device_counts)
    sizes, devices = runtime.setup_sizes(args)
    task = tasks.cnn_task(args)
    main_process = runtime.is_main_process()

    def orthogonality(params: object, batch: object) -> object:
        grads = jax.grad(lambda p: task.loss_fn(p, batch)[0])(params)
        return gradcomm.orthogonality(grads, "data")

    def named(tree: object) -> dict[str, float]:
        paths = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(p, simple=True, separator="/"): float(v) for p, v in paths}

    seeds = runtime.seed_list(args)
    results, rows = [], []
    for seed in seeds:
        for n in sizes:
            mesh = parallel.make_mesh(devices=devices[:n])
            probe_fn = loop.on_devices(mesh, orthogonality)
            for name, tx in (
                (
                    "allreduce",
                    optax.chain(gradcomm.allreduce("data"), optax.sgd(args.lr * n, args.momentum)),
                ),
                ("adasum", optax.chain(optax.sgd(args.lr, args.momentum), gradcomm.adasum("data"))),
            ):
                probe = None
                if name == "adasum" and n == max(sizes) and seed == seeds[0]:
                    probe = lambda p, s, b, f=probe_fn: {"orthogonality": named(f(p, b))}  # noqa: E731
                method = methods.Method(f"{name} N={n} seed={seed}", tx)
                result = loop.train_as_flagged(args, method, task, mesh, seed=seed, probe=probe)
                results.append(result)
                rows.append((seed, n, name, result.test_accuracy, len(result.losses)))
                if main_process:
                    print(
                        f"seed {seed} N={n:>2} {name:>9}: test accuracy "
                        f"{100 * result.test_accuracy:.2f}% ({len(result.losses)} steps)"
                    )

    if main_process:
        over = f"mean (min-max) over {len(seeds)} seeds"
        table = [
            f"| N | global batch | steps | allreduce (lr x N), {over} | adasum (lr), {over} |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for n in sizes:
            cells = []
            for name in ("allreduce", "adasum"):
                acc = 100 * np.array([a for _, m, k, a, _ in rows if m == n and k == name])
                cells.append(report.mean_range(acc.mean(), acc.min(), acc.max(), 2, "%"))
            steps = next(s for _, m, _, _, s in rows if m == n)
            table.append(f"| {n} | {n * args.batch_size} | {steps} | {cells[0]} | {cells[1]} |")
        table = "\n".join(table)
        probed = next(r for r in results if r.probes)
        path = report.write_study(
            args.out,
            "adasum_large_batch",
            vars(args),
            results,
            table,
            lambda fig: plot(fig, sizes, rows, probed),
            provenance=stamp.record(devices, seeds=seeds),
            title=f"Adasum at large batch: {task.name}, momentum SGD, "
            f"{args.batch_size} examples per device, {args.epochs} epochs",
        )
        print(f"\n{table}\n\nwrote {path}")


def plot(fig: object, sizes: list[int], rows: list[tuple], probed: loop.RunResult) -> None:
    left, right = fig.subplots(1, 2)
    for name in ("allreduce", "adasum"):
        acc = np.array([[100 * a for _, m, k, a, _ in rows if m == n and k == name] for n in sizes])
        label = name + (" (lr x N)" if name == "allreduce" else " (lr)")
        kw = report.style(name)
        left.plot(sizes, acc.mean(1), label=label, **kw)
        left.fill_between(sizes, acc.min(1), acc.max(1), color=kw["color"], alpha=0.15)
    left.set(
        xscale="log",
        xlabel="devices N (fixed batch per device)",
        ylabel="test accuracy (%)",
        title="accuracy against N (mean, min-max over seeds)",
    )
    left.set_xticks(sizes, [str(n) for n in sizes])
    values = probed.probes["orthogonality"]
    for leaf in values[0]:
        right.plot(probed.probe_steps, [v[leaf] for v in values], lw=1, label=leaf)
    mean = [np.mean(list(v.values())) for v in values]
    right.plot(probed.probe_steps, mean, "k-", lw=3, label="mean over layers")
    right.set(
        xlabel="step",
        ylabel="|AS(g)|^2 / sum |g_i|^2 (1/N: parallel, 1: orthogonal)",
        ylim=(0, 1.05),
        title=f"gradient orthogonality, {probed.method}",
    )
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


if __name__ == "__main__":
    main()
