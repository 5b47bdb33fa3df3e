"""Tasks: what the training loop needs to know about a problem, and the small CNN's."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradcomm_experiments import data as datasets


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


def classification_loss(model: Any) -> Callable[[Any, dict[str, Any]], tuple[jax.Array, dict]]:
    """Mean softmax cross-entropy over every label, with accuracy as an auxiliary metric."""

    def loss_fn(params: Any, batch: dict[str, Any]) -> tuple[jax.Array, dict]:
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

    return loss_fn


def supervised_task(
    name: str,
    model: Any,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
) -> Task:
    """A flax `model` that predicts integer labels (one per example, or one per token).

    Trained on shuffled batches of the training split with `classification_loss`, tested
    on the test split: the share of labels the model's arg-max gets right.
    """
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x))

    def evaluate(params: Any) -> float:
        return float(np.mean(np.argmax(np.asarray(apply(params, x_test)), -1) == y_test))

    return Task(
        name=name,
        init=lambda key: model.init(key, x_train[:1])["params"],
        loss_fn=classification_loss(model),
        batches=lambda global_batch, seed, epoch: datasets.batches(
            x_train, y_train, global_batch, seed, epoch
        ),
        evaluate=evaluate,
    )


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


# The small CNN's last layer, which TernGrad keeps in float (as its paper does).
CNN_FLOAT_LEAVES = ["Dense_1"]


def classification_task(model: Any, data: datasets.Dataset) -> Task:
    """Image classification with `model` on `data`, tested on the test split."""
    return supervised_task(data.name, model, data.x_train, data.y_train, data.x_test, data.y_test)


def cnn_task(args: argparse.Namespace) -> Task:
    """The small CNN on `--dataset` (from `--data-dir`), split with `--seed`."""
    data = datasets.load_dataset(args.dataset, args.data_dir, args.seed)
    return classification_task(small_cnn(data.num_classes), data)
