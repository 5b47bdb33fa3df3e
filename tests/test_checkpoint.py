"""A run saved mid-way with orbax and restored continues bit for bit, for every method."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import mesh_of

import gradcomm
from gradcomm import parallel


def loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


METHODS = {
    # Adasum after Adam: per-device Adam moments; TernGrad: a key and a step count.
    "adasum": lambda: optax.chain(optax.adam(1e-2), gradcomm.adasum("data")),
    "terngrad": lambda: optax.chain(gradcomm.terngrad("data", seed=3), optax.adam(1e-2)),
    # LAGS after SGD, gradient dropping before Adam (its warm-up ends mid-run): residuals.
    "lags": lambda: optax.chain(optax.sgd(0.05), gradcomm.lags("data", density=0.1)),
    "dropping": lambda: optax.chain(
        gradcomm.gradient_dropping("data", drop_ratio=0.9, warmup_steps=4), optax.adam(1e-2)
    ),
    # SGP with overlap: per-device params, push-sum weights and a message in flight.
    "sgp": lambda: optax.chain(optax.sgd(0.05), gradcomm.sgp("data", overlap=1)),
}
PER_DEVICE = {"sgp"}


@pytest.mark.parametrize("method", METHODS)
def test_state_checkpoints_and_restores_bit_identically(tmp_path, method):
    mesh = mesh_of(8)
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.standard_normal((6, 8)).astype(np.float32) * 0.3,
        "w2": rng.standard_normal(8).astype(np.float32) * 0.3,
    }
    batches = [
        {
            "x": rng.standard_normal((32, 6)).astype(np.float32),
            "y": rng.standard_normal(32).astype(np.float32),
        }
        for _ in range(6)
    ]
    tx = METHODS[method]()
    per_device = method in PER_DEVICE
    step = parallel.train_step(loss, tx, mesh, params_per_device=per_device)
    p = (parallel.per_device if per_device else parallel.replicate)(params, mesh)
    state = parallel.init_state(tx, p, mesh, params_per_device=per_device)
    for batch in batches[:3]:
        p, state, _ = step(p, state, batch)

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": p, "state": state})
    checkpointer.wait_until_finished()

    for batch in batches[3:]:
        p, state, _ = step(p, state, batch)

    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": p, "state": state})
    restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert jax.tree.structure(restored["state"]) == jax.tree.structure(state)
    p2, state2 = restored["params"], restored["state"]
    for batch in batches[3:]:
        p2, state2, _ = step(p2, state2, batch)
    jax.tree.map(np.testing.assert_array_equal, (p2, state2), (p, state))
    if method == "adasum":  # each device ran its own Adam on its own gradients
        mu = np.asarray(state[0][0].mu["w1"])
        assert not np.array_equal(mu[0], mu[1])
    if method == "sgp":  # the devices hold different params and a message in flight
        w1 = np.asarray(p["w1"])
        assert not np.array_equal(w1[0], w1[1])
        assert np.abs(np.asarray(state[1].in_flight["w1"])).sum() > 0
    if method in ("lags", "dropping"):  # each device kept its own residual
        residual = np.asarray(state[1 if method == "lags" else 0].residual["w1"])
        assert not np.array_equal(residual[0], residual[1])
