"""A run saved mid-way with orbax and restored continues bit for bit: Adam's per-device
moments, a sync's step count, SGP's messages in flight, DiLoCo's eager per-device anchors,
and onto another device count.

Every method of the README's table (SGD beside it) continues bit for bit from a checkpoint
in test_contract.py's test_checkpoint_round_trip_continues_bit_for_bit; the runs here are
the state that test has not: Adam's moments kept per device, local SGD's sync state, SGP
with and without a message in flight, and eager DiLoCo's per-device sync state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import mesh_of, restore, save
from jax.sharding import NamedSharding

import gradcomm
from gradcomm import parallel

N = 4  # devices of the saved run


def loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


# Three steps: the checkpoint is taken after two, and the third runs on the restored state.
METHODS = {
    # All-reduce before Adam: every leaf replicated (test_state_restored_onto_another_device_count).
    "allreduce": lambda: optax.chain(gradcomm.allreduce("data"), optax.adam(1e-2)),
    # Adasum after Adam: per-device Adam moments.
    "adasum": lambda: optax.chain(optax.adam(1e-2), gradcomm.adasum("data")),
    # Per-device params. Local SGD (SGD and its sync, below) averages at the third step,
    # after the restore: the sync's step count is in the checkpoint.
    "local_sgd": lambda: optax.sgd(0.05),
    # SGP: push-sum weights, and with overlap a message in flight; without, no in-flight
    # arrays at all (zero-size ones would not save).
    "sgp0": lambda: optax.chain(optax.sgd(0.05), gradcomm.sgp("data", overlap=0)),
    "sgp1": lambda: optax.chain(optax.sgd(0.05), gradcomm.sgp("data", overlap=1)),
    # DiLoCo's eager updates (SGD and its sync, Streaming DiLoCo with one fragment): each
    # device's own anchor, outer state and last outer gradient, and their mean in flight.
    "diloco_eager": lambda: optax.sgd(0.05),
}
PER_DEVICE = {"local_sgd", "sgp0", "sgp1", "diloco_eager"}
# Their state is test_contract's: the methods' own keys, counts and residuals (TernGrad, LAGS,
# SLGS, gradient dropping), replicated state (allreduce), and D-PSGD's per-device params.
ROUND_TRIPS = ["adasum", "local_sgd", "sgp0", "sgp1", "diloco_eager"]
SYNCS = {
    "local_sgd": lambda: gradcomm.local_sgd("data", every=3),
    "diloco_eager": lambda: gradcomm.diloco("data", every=2, eager=True),
}


def _data(steps=3):
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.standard_normal((6, 8)).astype(np.float32) * 0.3,
        "w2": rng.standard_normal(8).astype(np.float32) * 0.3,
    }
    batches = [
        {
            "x": rng.standard_normal((4 * N, 6)).astype(np.float32),
            "y": rng.standard_normal(4 * N).astype(np.float32),
        }
        for _ in range(steps)
    ]
    return params, batches


def _start(method, mesh, params):
    tx = METHODS[method]()
    sync = SYNCS[method]() if method in SYNCS else None
    per_device = method in PER_DEVICE
    step = parallel.train_step(loss, tx, mesh, params_per_device=per_device, sync=sync)
    p = (parallel.per_device if per_device else parallel.replicate)(params, mesh)
    return tx, step, p, parallel.init_state(tx, p, mesh, params_per_device=per_device, sync=sync)


def _on(mesh, tree):
    """The restore target of `tree` with its shardings moved to `mesh` (same specs)."""

    def struct(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec))

    return jax.tree.map(struct, tree)


@pytest.mark.parametrize("method", ROUND_TRIPS)
def test_state_checkpoints_and_restores_bit_identically(tmp_path, method):
    mesh = mesh_of(N)
    params, batches = _data()
    _, step, p, state = _start(method, mesh, params)
    for batch in batches[:2]:
        p, state, _ = step(p, state, batch)
    save(tmp_path / "ckpt", {"params": p, "state": state})

    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": p, "state": state})
    restored = restore(tmp_path / "ckpt", target)
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)

    saved = (p, state)
    p, state, metrics = step(p, state, batches[2])
    p2, state2, metrics2 = step(restored["params"], restored["state"], batches[2])
    jax.tree.map(np.testing.assert_array_equal, (p2, state2, metrics2), (p, state, metrics))

    # The checkpoint held what makes each method's state its own.
    if method == "adasum":  # each device ran its own Adam on its own gradients
        mu = np.asarray(saved[1][0][0].mu["w1"])
        assert not np.array_equal(mu[0], mu[1])
    if method in PER_DEVICE:  # the devices held different params
        w1 = np.asarray(saved[0]["w1"])
        assert not np.array_equal(w1[0], w1[1])
    if method == "local_sgd":  # and the restored count made the third step average them
        w1 = np.asarray(p["w1"])
        assert all(np.array_equal(w1[0], w1[i]) for i in range(N))
    if method == "sgp1":  # a message in flight (packed: one flat buffer per dtype)
        assert np.abs(np.asarray(saved[1][1].in_flight[0][0])).sum() > 0
    if method == "diloco_eager":  # each device's own anchor and outer gradient, after
        for leaf in (saved[1].sync.anchor["w1"], saved[1].sync.own["w1"]):  # its outer step
            leaf = np.asarray(leaf)
            assert not np.array_equal(leaf[0], leaf[1])
    if method == "sgp0":  # nothing in flight, and no arrays for it
        assert saved[1][1].in_flight == () and restored["state"][1].in_flight == ()


def test_state_restored_onto_another_device_count(tmp_path):
    params, batches = _data()
    half = mesh_of(N // 2)

    # Replicated state (an all-reduce, then Adam) restores onto any mesh and runs.
    _, step, p, state = _start("allreduce", mesh_of(N), params)
    p, state, _ = step(p, state, batches[0])
    save(tmp_path / "replicated", {"params": p, "state": state})
    restored = restore(tmp_path / "replicated", _on(half, {"params": p, "state": state}))
    tx = METHODS["allreduce"]()
    p2, _, _ = parallel.train_step(loss, tx, half)(
        restored["params"], restored["state"], batches[1]
    )
    p4, _, _ = step(p, state, batches[1])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), p2, p4)

    # Per-device state (and params) belong to the devices that made them.
    tx, step, p, state = _start("sgp1", mesh_of(N), params)
    p, state, _ = step(p, state, batches[0])
    save(tmp_path / "per_device", {"params": p, "state": state})
    restored = restore(tmp_path / "per_device", _on(half, {"params": p, "state": state}))
    step2 = parallel.train_step(loss, tx, half, params_per_device=True)
    with pytest.raises(ValueError, match=r"holds 4 per-device copies .* has 2 data-parallel"):
        step2(restored["params"], restored["state"], batches[1])
    fresh = parallel.init_state(tx, parallel.per_device(params, half), half, params_per_device=True)
    with pytest.raises(ValueError, match=r"param \['w1'\] .* 2 on this mesh"):
        step2(restored["params"], fresh, batches[1])
    with pytest.raises(ValueError, match=r"param \['w1'\] .* 2 on this mesh"):
        parallel.init_state(tx, restored["params"], half, params_per_device=True)

    # Per-device state restored without its shardings (as host arrays) is an error too.
    host = jax.tree.map(np.asarray, state)
    with pytest.raises(ValueError, match="not sharded over the data axes"):
        step(p, host, batches[1])
