#!/usr/bin/env python
"""Gradient dropping with local gradients on a Transformer and an LSTM (synthetic seq2seq).

    python experiments/studies/local_gradients.py                   # 8 simulated devices, 3 seeds
    python experiments/studies/local_gradients.py --models lstm --seeds 0 --epochs 2
    python experiments/studies/local_gradients.py --task reverse --lr 2e-3

The claims (Aji, Heafield and Bogoychev, EMNLP 2019, Table 1 and Fig. 1): dropping 99% of
each gradient (with error feedback) damages the Transformer far more than the RNN, and so
does federated averaging; adding the node's dense local gradient back (C = G - S + L, with
periodic parameter averaging) repairs it. The task is made in code: map a random token
sequence to y_i = max(x_(i-2), x_(i+2)) (`--task max`, which both models learn in a few
hundred steps) or to its reverse (`--task reverse`, which routes every token across the
sequence). Both models are small flax models trained with Adam under one learning rate,
chosen on the all-reduce alone; accuracy is per token on 2048 held-out sequences, tested
every --eval-every steps. Writes local_gradients.{json,png,md} to --out.
"""

from __future__ import annotations

import argparse
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradcomm import parallel
from gradcomm_experiments import cli, loop, provenance, report, runtime, tasks
from gradcomm_experiments import methods as registry

METHODS = ("allreduce", "dropping", "local-sgd", "dropping-local")


class Transformer(nn.Module):
    """A pre-norm Transformer encoder over the input, predicting each output token."""

    vocab: int
    length: int
    width: int = 64
    layers: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.width)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (self.length, self.width))
        for _ in range(self.layers):
            y = nn.SelfAttention(num_heads=self.heads)(nn.LayerNorm()(x))
            x = x + y
            y = nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x))))
            x = x + y
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class LSTM(nn.Module):
    """A bidirectional LSTM over the input, predicting each output token."""

    vocab: int
    width: int = 64

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.width)(tokens)
        # The zero carry is built from x so that, inside shard_map, it has x's varying type
        # (flax's default carry is replicated, and lax.scan rejects the mismatch).
        zeros = jnp.zeros_like(x[:, 0])
        carry = (zeros, zeros)
        forward = nn.RNN(nn.OptimizedLSTMCell(self.width))(x, initial_carry=carry)
        backward = nn.RNN(nn.OptimizedLSTMCell(self.width), reverse=True, keep_order=True)(
            x, initial_carry=carry
        )
        return nn.Dense(self.vocab)(jnp.concatenate([forward, backward], -1))


def reverse(x: np.ndarray, vocab: int) -> np.ndarray:
    """y_i = x_(L-1-i): every output token comes from the far end of the input."""
    del vocab
    return x[:, ::-1].copy()


def neighbour_max(x: np.ndarray, vocab: int) -> np.ndarray:
    """y_i = max(x_(i-2), x_(i+2)), with x = 0 beyond the ends."""
    del vocab
    padded = np.pad(x, ((0, 0), (2, 2)))
    return np.maximum(padded[:, :-4], padded[:, 4:])


TASKS = {"max": neighbour_max, "reverse": reverse}


def sequence_task(
    model: nn.Module, target: str, vocab: int, length: int, train: int, test: int, seed: int
) -> tasks.Task:
    """Map random token sequences to `TASKS[target]` of them; held-out token accuracy."""
    rng = np.random.default_rng(seed)
    x_train = rng.integers(0, vocab, (train, length)).astype(np.int32)
    x_test = rng.integers(0, vocab, (test, length)).astype(np.int32)
    y_train = TASKS[target](x_train, vocab).astype(np.int32)
    y_test = TASKS[target](x_test, vocab).astype(np.int32)
    name = f"{target}: {length} tokens of {vocab}"
    return tasks.supervised_task(name, model, x_train, y_train, x_test, y_test)


def configured(method: str, args: argparse.Namespace) -> registry.Spec:
    """The registry's `method` with the study's flags: the drop ratio and its warm-up for
    gradient dropping, and the periods of parameter and federated averaging."""
    spec = registry.METHODS[method]
    if spec.method == "gradient_dropping":
        spec = spec.configured(drop_ratio=args.drop_ratio, warmup_steps=args.warmup_steps)
    if spec.method == "local_sgd":
        return spec.configured(every=args.local_every)
    return spec.configured(sync_every=args.average_every) if spec.sync else spec


def main(argv: list[str] | None = None) -> None:
    stamp = provenance.start(argv)
    parser = cli.make_parser(__doc__)
    parser.add_argument("--models", default="transformer,lstm", help="transformer and/or lstm")
    parser.add_argument("--task", default="max", choices=sorted(TASKS), help="target")
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, from {', '.join(registry.METHODS)}",
    )
    parser.add_argument("--vocab", type=int, default=16, help="tokens in the vocabulary")
    parser.add_argument("--length", type=int, default=12, help="tokens per sequence")
    parser.add_argument("--train-size", type=int, default=16384, help="training sequences")
    runtime.add_schedule_args(parser, epochs=3, batch_size=16, seeds=True)
    parser.add_argument("--lr", type=float, default=1e-2, help="peak Adam learning rate")
    parser.add_argument("--drop-ratio", type=float, default=0.99, help="gradient dropping")
    parser.add_argument("--warmup-steps", type=int, default=100, help="drop-ratio warm-up")
    parser.add_argument("--average-every", type=int, default=100, help="parameter averaging")
    parser.add_argument("--local-every", type=int, default=20, help="federated averaging")
    parser.add_argument("--eval-every", type=int, default=16, help="steps between tests")
    parser.add_argument(
        "--target", type=float, default=0.9, help="token accuracy for the steps-to-target column"
    )
    runtime.add_common_args(parser, data=False, seed=False)
    args = runtime.parse_args(parser, argv, check_models_and_methods)
    models = cli.comma_list(args.models, str, "--models")
    methods = registry.parse(args.methods)

    devices = runtime.setup(args)
    mesh = parallel.make_mesh(devices=devices)
    n = len(devices)
    main_process = runtime.is_main_process()
    steps = args.epochs * (args.train_size // (n * args.batch_size))

    seeds = runtime.seed_list(args)
    results, rows = [], []
    for seed in seeds:
        for model_name in models:
            model = (
                Transformer(args.vocab, args.length)
                if model_name == "transformer"
                else LSTM(args.vocab)
            )
            task = sequence_task(
                model, args.task, args.vocab, args.length, args.train_size, 2048, seed
            )
            for method in methods:
                schedule = optax.warmup_cosine_decay_schedule(0, args.lr, steps // 10, steps)
                spec = configured(method, args)
                spec = dataclasses.replace(spec, label=f"{model_name} {method}")
                built = registry.build(spec, optax.adam(schedule))
                result = loop.train_as_flagged(args, built, task, mesh, seed=seed)
                results.append(result)
                rows.append((model_name, method, seed, result))
                if main_process:
                    print(
                        f"seed {seed} {spec.label:>28}: token accuracy "
                        f"{100 * result.test_accuracy:.2f}%"
                    )

    if main_process:
        first = [(name, m, r) for name, m, seed, r in rows if seed == seeds[0]]
        table = "\n\n".join(
            [summary_table(models, methods, rows, args.target, steps, len(seeds))]
            + [
                report.results_table(
                    [r for name, _, r in first if name == model_name], f"{model_name} allreduce"
                )
                for model_name in models
            ]
        )
        path = report.write_study(
            args.out,
            "local_gradients",
            vars(args),
            results,
            table,
            lambda fig: plot(fig, models, methods, rows),
            provenance=stamp.record(devices, seeds=seeds),
            title=f"Gradient dropping with local gradients: {args.task} task, Adam, "
            f"{n} devices, {args.epochs} epochs",
        )
        print(f"\n{table}\n\nwrote {path}")


def check_models_and_methods(args: argparse.Namespace) -> None:
    """`--models` names transformer and/or lstm; `--methods` methods of the registry."""
    unknown = set(cli.comma_list(args.models, str, "--models")) - {"transformer", "lstm"}
    if unknown:
        raise ValueError(
            f"unknown model(s): {', '.join(sorted(unknown))}; choose transformer, lstm"
        )
    registry.parse(args.methods)


def steps_to(result: loop.RunResult, target: float) -> int | None:
    """The first tested step at which token accuracy reached `target` (None: never)."""
    curve = zip(result.eval_steps, result.eval_accuracy, strict=True)
    return next((step for step, accuracy in curve if accuracy >= target), None)


def summary_table(
    models: list[str], methods: list[str], rows: list, target: float, steps: int, seeds: int
) -> str:
    """Final token accuracy and steps to `target` accuracy over seeds, one row per model."""
    lines = [
        "| model | " + " | ".join(methods) + " |",
        "| --- |" + " ---: |" * len(methods),
    ]
    for model_name in models:
        cells = []
        for m in methods:
            runs = [r for name, method, _, r in rows if (name, method) == (model_name, m)]
            acc = 100 * np.array([r.test_accuracy for r in runs])
            reached = [steps_to(r, target) for r in runs]
            when = (
                f"{np.mean(reached):.0f} ({min(reached)}-{max(reached)}) steps"
                if None not in reached
                else f"{reached.count(None)} of {len(runs)} not in {steps} steps"
            )
            cells.append(report.mean_range(acc.mean(), acc.min(), acc.max(), 2, "%") + f"; {when}")
        lines.append(f"| {model_name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"Each cell: final held-out token accuracy, mean (min-max) over {seeds} seed(s); then the "
        f"first tested step with token accuracy >= {100 * target:.0f}%, mean (min-max). Below, "
        "bytes and step time for the first seed."
    )
    return "\n".join(lines)


def plot(fig: object, models: list[str], methods: list[str], rows: list) -> None:
    axes = np.atleast_1d(fig.subplots(1, len(models)))
    for ax, model_name in zip(axes, models, strict=True):
        for m in methods:
            runs = [r for name, method, _, r in rows if (name, method) == (model_name, m)]
            curve = 100 * np.mean([r.eval_accuracy for r in runs], axis=0)
            every = max(1, len(curve) // 10)
            ax.plot(runs[0].eval_steps, curve, label=m, markevery=every, **report.style(m))
        ax.set(
            xlabel="step",
            ylabel="held-out token accuracy (%), mean over seeds",
            title=f"{model_name}",
            ylim=(0, 101),
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


if __name__ == "__main__":
    main()
