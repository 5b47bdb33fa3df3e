"""train_step on 1-device meshes, with Explicit and with Auto axes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import gradcomm
from gradcomm import parallel

METHODS = {  # name: (transformation, params per device, sync)
    "allreduce": (lambda: optax.chain(gradcomm.allreduce("data"), optax.adam(1e-2)), False, None),
    "adasum": (lambda: optax.chain(optax.adam(1e-2), gradcomm.adasum("data")), False, None),
    "lags": (
        lambda: optax.chain(optax.adam(1e-2), gradcomm.lags("data", density=0.5)),
        False,
        None,
    ),
    "sgp": (lambda: optax.chain(optax.sgd(0.1), gradcomm.sgp("data")), True, None),
    "local_sgd": (lambda: optax.sgd(0.1), True, lambda: gradcomm.local_sgd("data", every=2)),
    # The 4-bit outer gradients' exchange over one device (an all_to_all and all_gather).
    "streaming_diloco": (
        lambda: optax.sgd(0.1),
        True,
        lambda: gradcomm.streaming_diloco("data", every=2, fragments=1),
    ),
    # Per-device anchor and outer state; outer SGD(1): plain local SGD up to rounding.
    "diloco_eager": (
        lambda: optax.sgd(0.1),
        True,
        lambda: gradcomm.diloco("data", optax.sgd(1.0), every=2, eager=True),
    ),
}
# Each on one axis type (what differs between the two is train_step's, checked above).
ONE_TYPE = {"streaming_diloco": AxisType.Explicit, "diloco_eager": AxisType.Auto}
# Not plain local training on one device: name -> why.
NOT_PLAIN = {
    "lags": "it sends only half the entries per step",
    "streaming_diloco": "its outer gradients go as 4-bit codes, and outer Nesterov steps them",
}


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)


@pytest.mark.parametrize(
    ("name", "axis_type"),
    [
        (name, axis_type)
        for name in METHODS
        for axis_type in (AxisType.Explicit, AxisType.Auto)
        if ONE_TYPE.get(name, axis_type) == axis_type
    ],
    ids=str,
)
def test_one_device_mesh(name, axis_type):
    make, per_device, make_sync = METHODS[name]
    tx, sync = make(), make_sync() if make_sync else None
    mesh = parallel.make_mesh({"data": 1}, devices=jax.devices()[:1], axis_types=axis_type)
    params = (parallel.per_device if per_device else parallel.replicate)(jnp.zeros(3), mesh)
    state = parallel.init_state(tx, params, mesh, params_per_device=per_device, sync=sync)
    step = parallel.train_step(_loss, tx, mesh, params_per_device=per_device, sync=sync)
    x = np.array([[1.0, 2.0, 0.5], [0.0, 1.0, -1.0]], np.float32)
    batch = {"x": x, "y": x @ np.array([1.0, -1.0, 2.0], np.float32)}
    losses = []
    for _ in range(3):
        params, state, metrics = step(params, state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    # On one device every method is plain local training: compare with the optimizer alone.
    inner = optax.adam(1e-2) if name in ("allreduce", "adasum", "lags") else optax.sgd(0.1)
    if name not in NOT_PLAIN:
        p, s = jnp.zeros(3), inner.init(jnp.zeros(3))
        for _ in range(3):
            g = jax.grad(_loss)(p, batch)
            u, s = inner.update(g, s, p)
            p = optax.apply_updates(p, u)
        np.testing.assert_allclose(np.asarray(params).reshape(-1), p, rtol=1e-5, atol=1e-6)
