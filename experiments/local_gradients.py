#!/usr/bin/env python
"""Gradient dropping with local gradients on a Transformer and an LSTM (synthetic seq2seq).

    python experiments/local_gradients.py                   # 8 simulated devices
    python experiments/local_gradients.py --models lstm --epochs 2

The claims (Aji, Heafield and Bogoychev, EMNLP 2019, Table 1 and Fig. 1): dropping 99% of
each gradient (with error feedback) damages the Transformer far more than the RNN, and so
does federated averaging; adding the node's dense local gradient back (C = G - S + L, with
periodic parameter averaging) repairs it. The task is made in code: reverse a random
sequence of tokens, which a model can only solve by routing information across positions.
Both models are small flax models trained with Adam; accuracy is per token on held-out
sequences. Writes local_gradients.{json,png,md} to --out.
"""

from __future__ import annotations

import argparse

import _common
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradcomm import parallel

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
        forward = nn.RNN(nn.OptimizedLSTMCell(self.width))(x)
        backward = nn.RNN(nn.OptimizedLSTMCell(self.width), reverse=True, keep_order=True)(x)
        return nn.Dense(self.vocab)(jnp.concatenate([forward, backward], -1))


def reversal_task(
    model: nn.Module, vocab: int, length: int, train: int, test: int, seed: int
) -> _common.Task:
    """Reverse a random token sequence; token accuracy on held-out sequences."""
    rng = np.random.default_rng(seed)
    x_train = rng.integers(0, vocab, (train, length)).astype(np.int32)
    x_test = rng.integers(0, vocab, (test, length)).astype(np.int32)

    def loss_fn(params: object, batch: dict) -> tuple[jax.Array, dict]:
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

    def batches(global_batch: int, seed: int, epoch: int) -> list[dict]:
        order = np.random.default_rng([seed, epoch]).permutation(train)
        count = train // global_batch
        return [
            {"x": x_train[idx], "y": x_train[idx, ::-1].copy()}
            for idx in np.split(order[: count * global_batch], count)
        ]

    apply = jax.jit(lambda p, x: model.apply({"params": p}, x))

    def evaluate(params: object) -> float:
        return float(np.mean(np.argmax(np.asarray(apply(params, x_test)), -1) == x_test[:, ::-1]))

    return _common.Task(
        name=f"reverse {length} tokens of {vocab}",
        init=lambda key: model.init(key, x_train[:1])["params"],
        loss_fn=loss_fn,
        batches=batches,
        evaluate=evaluate,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", default="transformer,lstm", help="transformer and/or lstm")
    parser.add_argument("--vocab", type=int, default=16, help="tokens in the vocabulary")
    parser.add_argument("--length", type=int, default=12, help="tokens per sequence")
    parser.add_argument("--train-size", type=int, default=16384, help="training sequences")
    parser.add_argument("--epochs", type=int, default=6, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per device per step")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak Adam learning rate")
    parser.add_argument("--drop-ratio", type=float, default=0.99, help="gradient dropping")
    parser.add_argument("--warmup-steps", type=int, default=100, help="drop-ratio warm-up")
    parser.add_argument("--average-every", type=int, default=100, help="parameter averaging")
    parser.add_argument("--local-every", type=int, default=20, help="federated averaging")
    _common.add_common_args(parser)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if set(models) - {"transformer", "lstm"}:
        raise SystemExit(f"unknown model(s) in {models}: choose transformer, lstm")

    devices = _common.setup(args)
    mesh = parallel.make_mesh(devices=devices)
    n = len(devices)
    main_process = _common.is_main_process()
    steps = args.epochs * (args.train_size // (n * args.batch_size))

    results, rows = [], []
    for model_name in models:
        model = (
            Transformer(args.vocab, args.length)
            if model_name == "transformer"
            else LSTM(args.vocab)
        )
        task = reversal_task(model, args.vocab, args.length, args.train_size, 2048, args.seed)
        for method in METHODS:
            adam = optax.adam(optax.warmup_cosine_decay_schedule(0, args.lr, steps // 10, steps))
            spec = _common.make_method(
                method,
                adam,
                drop_ratio=args.drop_ratio,
                warmup_steps=args.warmup_steps,
                average_every=args.average_every,
                local_every=args.local_every,
            )
            spec = _common.Method(
                f"{model_name} {method}",
                spec.tx,
                spec.per_device,
                spec.steady_tx,
                spec.average_every,
            )
            result = _common.train(
                spec,
                task,
                mesh,
                epochs=args.epochs,
                batch_per_device=args.batch_size,
                seed=args.seed,
                progress=main_process and not args.no_progress,
            )
            results.append(result)
            rows.append((model_name, method, result))
            if main_process:
                print(f"{spec.name:>28}: token accuracy {100 * result.test_accuracy:.2f}%")

    if main_process:
        table = ["| model | " + " | ".join(METHODS) + " |", "| --- |" + " ---: |" * len(METHODS)]
        for model_name in models:
            acc = {m: r.test_accuracy for name, m, r in rows if name == model_name}
            table.append(
                f"| {model_name} | " + " | ".join(f"{100 * acc[m]:.2f}%" for m in METHODS) + " |"
            )
        table.append("")
        table.append(
            _common.results_table([r for _, _, r in rows], baseline=f"{models[0]} allreduce")
        )
        table = "\n".join(table)
        path = _common.write_study(
            args.out,
            "local_gradients",
            vars(args),
            results,
            table,
            lambda fig: plot(fig, models, rows),
        )
        print(f"\n{table}\n\nwrote {path}")


def plot(fig: object, models: list[str], rows: list) -> None:
    axes = np.atleast_1d(fig.subplots(1, len(models)))
    for ax, model_name in zip(axes, models, strict=True):
        for name, method, r in rows:
            if name == model_name:
                ax.plot(
                    range(1, len(r.epoch_accuracy) + 1),
                    100 * np.array(r.epoch_accuracy),
                    "o-",
                    label=method,
                )
        ax.set(
            xlabel="epoch",
            ylabel="token accuracy (%)",
            title=f"{model_name}: reverse a sequence",
            ylim=(0, 101),
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


if __name__ == "__main__":
    main()
