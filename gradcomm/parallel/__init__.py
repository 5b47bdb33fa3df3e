"""Data-parallel plumbing: meshes, placement, per-device state and the sharded train step.

gradcomm transformations run inside `jax.shard_map`, one program per device. Some of their
state differs per device (each device runs its own optimizer under Adasum; residuals, keys
and push-sum weights are per device): outside the map such a leaf carries a leading device
axis sharded over the data axes. State that the transformation keeps identical everywhere
(Adam's moments after an all-reduce, step counters) stays replicated. `init_state` finds
which is which from JAX's types (a value "varies" over an axis unless a collective made it
identical), and `train_step` reads the layout back from the state's shardings. A user places
params, initialises state and builds a jitted step without writing a `PartitionSpec`.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np, optax, gradcomm
  >>> from gradcomm import parallel
  >>> mesh = parallel.make_mesh()                     # every device on one "data" axis
  >>> tx = optax.chain(optax.adam(1e-2), gradcomm.adasum("data"))
  >>> loss = lambda p, b: jnp.mean((b["x"] @ p - b["y"]) ** 2)
  >>> params = parallel.replicate(jnp.zeros(3), mesh)
  >>> state = parallel.init_state(tx, params, mesh)
  >>> step = parallel.train_step(loss, tx, mesh)
  >>> n = parallel.num_shards(mesh)
  >>> batch = {"x": np.ones((4 * n, 3), np.float32), "y": np.ones(4 * n, np.float32)}
  >>> params, state, metrics = step(params, state, batch)
  >>> float(metrics["loss"])
  1.0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax
from jax.sharding import Mesh

from gradcomm import _axes
from gradcomm.parallel._calibrate import LinkProbe, StepProbe, calibrate
from gradcomm.parallel._placement import (
    data_axes,
    device_spec,
    host_copy,
    make_mesh,
    num_shards,
    pairwise_axes,
    per_device,
    replicate,
    shard_batch,
    shard_params,
)
from gradcomm.parallel._state import TrainState, init_state
from gradcomm.parallel._step import Metrics, TrainStep
from gradcomm.sync import ParamsSync

__all__ = [
    "LinkProbe",
    "StepProbe",
    "TrainState",
    "TrainStep",
    "calibrate",
    "device_spec",
    "host_copy",
    "init_state",
    "make_mesh",
    "num_shards",
    "pairwise_axes",
    "per_device",
    "replicate",
    "shard_batch",
    "shard_params",
    "train_step",
]


def train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axes: _axes.AxisName | None = None,
    params_per_device: bool = False,
    has_aux: bool = False,
    donate: bool = False,
    sync: ParamsSync | None = None,
    overlap: bool = False,
    metrics: Metrics = "mean",
) -> TrainStep:
    """Builds the jitted data-parallel step `(params, state, batch) -> (params, state, metrics)`.

    On each device: the loss and gradient of `loss_fn(params, local_batch)`, then
    `tx.update(grads, state, params)` (the transformation's collectives run here), then
    `optax.apply_updates`. Metrics are averaged over devices (or, with
    `metrics="per_device"`, kept per device, with no collective). Where the mesh spans
    processes and the step swaps with `exchange="auto"`, its first call times it both
    ways (`TrainStep.probe`: a collective, a few steps) and keeps the faster.

    With `overlap`, each layer (a top-level entry of the params tree) gets its own
    `tx.update`, run inside the backward pass as soon as that layer's gradient exists, so
    its collectives can run while the layers below are differentiated (as PyTorch DDP's
    buckets do). The result is the same, bit for bit, for a transformation that acts layer
    by layer (`gradcomm.registry`: the methods whose communication hides in the backward,
    chained with elementwise optax transformations); for one that is known not to (SLGS's
    global top-k, `optax.clip_by_global_norm`) the step raises. See
    `docs/site/guide/overlap.md` for what XLA:CPU makes of it.

    Then, with `sync` (a `gradcomm.ParamsSync` such as `gradcomm.local_sgd(axes, every=k)`
    or `gradcomm.periodic_average(axes, every=k)`), the rule runs on the per-device params,
    as a hand-written loop would run it: it can set them to one value, the same bits on
    every device, which no additive update could guarantee.

    Args:
      loss_fn: `loss_fn(params, batch) -> loss`, or `(loss, metrics_dict)` with `has_aux`.
      tx: the transformation, usually a chain holding a gradcomm method.
      mesh: the mesh; the step shards batches over `axes`.
      axes: the data-parallel axes (default: all mesh axes).
      params_per_device: keep one copy of params per device (leading device axis), for
        methods after which devices hold different params (gossip, local SGD). Otherwise
        params are replicated, and a transformation that leaves them different across
        devices is an error at trace time.
      has_aux: whether `loss_fn` returns `(loss, metrics)`.
      donate: donate params and state buffers to the step.
      sync: a `gradcomm.ParamsSync` applied to the params after each step (needs
        `params_per_device`); the state is then the `TrainState` that
        `init_state(..., sync=sync)` returns.
      overlap: run each layer's update in the backward pass; the state is then the
        per-layer state of `init_state(..., overlap=True)`.
      metrics: "mean", the metrics averaged over the devices (a small all-reduce each
        step, which also makes every device wait for the slowest); or "per_device",
        each device's own, along a leading axis of the devices (`jnp.mean` them when you
        log them). A method that talks only every H steps (`sync=gradcomm.diloco(...)`,
        `local_sgd`, `streaming_diloco`) is then free of collectives between its syncs.

    Returns:
      A `TrainStep`: `step(params, state, batch)` returns the new params, the new state and
      a dict of metrics (`"loss"` and any auxiliary ones).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, gradcomm
      >>> from gradcomm import parallel
      >>> mesh = parallel.make_mesh(devices=jax.devices()[:2])
      >>> tx = optax.chain(gradcomm.allreduce(), optax.sgd(0.1))
      >>> params = parallel.replicate({"w": np.zeros(2, np.float32)}, mesh)
      >>> state = parallel.init_state(tx, params, mesh)
      >>> loss_fn = lambda p, batch: jnp.mean((batch @ p["w"] - 1.0) ** 2)
      >>> step = parallel.train_step(loss_fn, tx, mesh)
      >>> params, state, metrics = step(params, state, np.ones((4, 2), np.float32))
      >>> parallel.host_copy(params)["w"], float(metrics["loss"])
      (array([0.2, 0.2], dtype=float32), 1.0)
    """
    names = data_axes(mesh, axes)
    return TrainStep(
        loss_fn, tx, mesh, names, params_per_device, has_aux, donate, sync, overlap, metrics
    )
