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
}


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=str)
@pytest.mark.parametrize("name", METHODS)
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
    if name != "lags":  # lags sends only half the entries per step
        p, s = jnp.zeros(3), inner.init(jnp.zeros(3))
        for _ in range(3):
            g = jax.grad(_loss)(p, batch)
            u, s = inner.update(g, s, p)
            p = optax.apply_updates(p, u)
        np.testing.assert_allclose(np.asarray(params).reshape(-1), p, rtol=1e-5, atol=1e-6)
