"""optax.MultiSteps and apply_if_finite around gradcomm methods, in every way a user runs them.

`optax.MultiSteps` needs its accumulator per device (it sums this device's gradients) and
its `lax.cond` branches typed alike; `parallel.init_state` finds that layout. A finiteness
test must give one answer on every device: `gradcomm.apply_if_finite` shares it, and
`init_state` refuses optax's own where the answer would differ between devices.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel

N = 4
LR = 0.1


def loss(params, batch):
    return jnp.sum((batch["x"] @ params["w"] + params["b"]) ** 2)


def numpy_grads(params, x):
    """float64 gradient of `loss` on one device's rows."""
    w, b = (np.asarray(params[k], np.float64) for k in ("w", "b"))
    r = x.astype(np.float64) @ w + b
    return {"w": 2 * x.T.astype(np.float64) @ r, "b": 2 * r.sum(0)}


def data(seed, nan_device=None):
    x = np.random.default_rng(seed).normal(size=(2 * N, 3)).astype(np.float32)
    if nan_device is not None:
        x[2 * nan_device, 0] = np.nan  # one row of one device's shard
    return x


PARAMS = {"w": np.full((3, 2), 0.5, np.float32), "b": np.zeros(2, np.float32)}


def run(tx, batches, per_device=False):
    """Params and state after one train_step per batch (as host arrays)."""
    mesh = mesh_of(N)
    place = parallel.per_device if per_device else parallel.replicate
    params = place(PARAMS, mesh)  # per_device makes one copy per device
    state = parallel.init_state(tx, params, mesh, params_per_device=per_device)
    step = parallel.train_step(loss, tx, mesh, params_per_device=per_device)
    history = []
    for x in batches:
        params, state, metrics = step(params, state, parallel.shard_batch({"x": x}, mesh))
        jax.block_until_ready(metrics)
        history.append(jax.tree.map(np.asarray, params))
    return history, state


def test_multisteps_accumulates_k_steps_then_applies_the_reduced_mean():
    """MultiSteps(allreduce, sgd), k=2: step 1 leaves params; step 2 applies the mean of both."""
    tx = optax.MultiSteps(
        optax.chain(gradcomm.allreduce("data"), optax.sgd(LR)), every_k_schedule=2
    )
    x1, x2 = data(1), data(2)
    (p1, p2), _ = run(tx, [x1, x2])
    np.testing.assert_array_equal(p1["w"], PARAMS["w"])
    grads = [numpy_grads(PARAMS, x[2 * d : 2 * d + 2]) for x in (x1, x2) for d in range(N)]
    for name in ("w", "b"):
        mean = np.mean([g[name] for g in grads], axis=0)
        np.testing.assert_allclose(p2[name], PARAMS[name] - LR * mean, rtol=1e-5, atol=1e-6)


# Every method of the README's table, with SGD, meets MultiSteps and gradcomm.apply_if_finite
# (per-device params included) in test_contract.py's test_wrappers, which also checks the
# per-device accumulator: here, Adam's per-device moments inside them.
def test_multisteps_composes_with_methods_through_init_state_and_train_step():
    """init_state used to fail on MultiSteps' cond; now k=2 holds still, then moves, finite."""
    tx = optax.MultiSteps(optax.chain(optax.adam(LR), gradcomm.adasum("data")), every_k_schedule=2)
    (p1, p2), state = run(tx, [data(1), data(2)])
    start = PARAMS["w"]
    np.testing.assert_array_equal(p1["w"], start)
    assert np.isfinite(p2["w"]).all() and not np.array_equal(p2["w"], start)
    acc = state.acc_grads["w"]
    assert acc.shape == (N, *PARAMS["w"].shape), "the accumulator holds each device's own sum"


def test_optax_apply_if_finite_around_a_method_raises_and_names_the_fix():
    """Its flag reads this device's gradient: a per-device cond around collectives."""
    tx = optax.apply_if_finite(optax.chain(gradcomm.allreduce("data"), optax.sgd(LR)), 3)
    with pytest.raises(ValueError, match=r"gradcomm\.apply_if_finite"):
        run(tx, [data(1)])


def test_optax_apply_if_finite_after_the_reduction_is_fine():
    """After the all-reduce every device tests the same updates, so optax's own works."""
    tx = optax.chain(gradcomm.allreduce("data"), optax.apply_if_finite(optax.sgd(LR), 3))
    (p1, p2), _ = run(tx, [data(1), data(2, nan_device=1)])
    np.testing.assert_array_equal(p2["w"], p1["w"])


def test_multisteps_with_a_per_device_skip_function_raises():
    tx = optax.MultiSteps(
        optax.chain(gradcomm.allreduce("data"), optax.sgd(LR)),
        every_k_schedule=2,
        should_skip_update_fn=optax.skip_not_finite,
    )
    with pytest.raises(ValueError, match="decides per device"):
        run(tx, [data(1)])


def test_apply_if_finite_skips_on_every_device_when_one_device_alone_overflows():
    """Device 2 alone sees a NaN: every device skips; the next finite step applies."""
    tx = gradcomm.apply_if_finite(
        optax.chain(optax.adam(LR), gradcomm.adasum("data")), max_consecutive_errors=3
    )
    (p1, p2, p3), state = run(tx, [data(1), data(2, nan_device=2), data(3)])
    np.testing.assert_array_equal(p2["w"], p1["w"])
    assert np.isfinite(p3["w"]).all() and not np.array_equal(p3["w"], p2["w"])
    assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 1


def test_apply_if_finite_gives_up_after_max_consecutive_errors():
    """With max_consecutive_errors=0 a non-finite step is applied at once, as in optax."""
    tx = gradcomm.apply_if_finite(optax.chain(gradcomm.allreduce("data"), optax.sgd(LR)), 0)
    (p1,), state = run(tx, [data(1, nan_device=0)])
    assert np.isnan(p1["w"]).any()
    assert int(state.notfinite_count) == 1


def test_apply_if_finite_in_a_hand_written_shard_map_loop():
    """The README's own loop, guarded: one device's NaN skips the step on all of them."""
    mesh = mesh_of(N)
    tx = gradcomm.apply_if_finite(optax.chain(optax.sgd(LR), gradcomm.adasum("data")), 3)

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P())
    )
    def step(params, state, batch):
        local = jax.lax.pcast(params, "data", to="varying")
        grads = jax.grad(loss)(local, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = jax.tree.map(jnp.asarray, PARAMS)
    state = tx.init(params)
    sharding = NamedSharding(mesh, P("data"))
    for x in (data(1), data(2, nan_device=3)):
        before = params
        params, state = step(params, state, {"x": jax.device_put(x, sharding)})
        jax.block_until_ready(params)
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(before["w"]))
    assert int(state.total_notfinite) == 1


def test_apply_if_finite_under_pmap():
    tx = gradcomm.apply_if_finite(optax.chain(gradcomm.allreduce("data"), optax.sgd(1.0)), 3)
    grads = jnp.arange(N, dtype=jnp.float32).reshape(N, 1).at[1, 0].set(jnp.inf)
    out = jax.pmap(
        lambda g: tx.update(g, tx.init(g))[0], axis_name="data", devices=jax.devices()[:N]
    )(grads)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((N, 1)))


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_apply_if_finite_rejects_a_bad_count(bad):
    with pytest.raises(ValueError, match="max_consecutive_errors"):
        gradcomm.apply_if_finite(optax.sgd(LR), bad)
