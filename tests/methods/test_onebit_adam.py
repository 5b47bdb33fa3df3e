"""gradcomm.onebit_adam: 1-bit Adam (Tang et al., ICML 2021, Algorithm 1).

Held against a float64 NumPy transcription of Algorithm 1 with DeepSpeed's compressed
all-reduce: Adam on the averaged gradient during the warm-up; then, with the variance
frozen, each worker's momentum plus its error goes as signs with one scale per tensor (its
L2 norm over the square root of its size), each server averages its slice, adds its own
error and sends that as signs with one scale per slice.
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
from gradcomm import parallel, wire
from gradcomm.onebit_adam import OnebitAdamState, onebit_adam

LR, B1, B2, EPS = 0.01, 0.9, 0.999, 1e-8
SHAPES = {"b": (3,), "w": (4, 5), "z": (13,)}


def grads_of(steps, n, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((steps, n, *s)).astype(dtype) for k, s in sorted(SHAPES.items())}


# ---- the float64 reference, from the paper ----


def compress(c):
    """C(c) = scale sign(c), scale = |c|_2 / sqrt(size); sign(0) = +1 (DeepSpeed's)."""
    scale = np.sqrt(np.sum(c * c) / c.size)
    return scale * np.where(c >= 0, 1.0, -1.0)


def reference(grads, n, warmup, bias_correction=True, weight_decay=0.0, params=None):
    """Algorithm 1 in float64: each step's update (the same on every device), per leaf."""
    steps = next(iter(grads.values())).shape[0]
    out = []
    state = {}
    for k, g in grads.items():
        g = g.astype(np.float64).reshape(steps, n, -1)
        size = g.shape[-1]
        w = -(-size // (8 * n)) * 8  # each server's slice
        slices = [slice(j * w, min((j + 1) * w, size)) for j in range(n)]
        mu, nu = np.zeros(size), np.zeros(size)
        worker_error, server_error = np.zeros((n, size)), np.zeros((n, size))
        updates = []
        for t in range(1, steps + 1):
            if t <= warmup:  # Adam on the all-reduced gradient
                mean = g[t - 1].mean(0)
                mu = B1 * mu + (1 - B1) * mean
                nu = B2 * nu + (1 - B2) * mean**2
            else:  # the variance frozen; the momentum compressed both ways
                c = B1 * mu + (1 - B1) * g[t - 1] + worker_error  # (n, size)
                sent = np.stack([compress(ci) for ci in c])
                worker_error = c - sent
                for j, s in enumerate(slices):
                    cs = sent[:, s].mean(0) + server_error[j, s]
                    if cs.size:
                        mu[s] = compress(cs)
                        server_error[j, s] = cs - mu[s]
            m_hat, v_hat = mu, nu
            if bias_correction:
                m_hat = mu / (1 - B1**t)
                v_hat = nu / (1 - B2 ** min(t, warmup))
            step = m_hat / (np.sqrt(v_hat) + EPS)
            if weight_decay:
                step = step + weight_decay * params[k].reshape(-1)
            updates.append(-LR * step)
        out.append(np.stack(updates))
        state[k] = (mu, worker_error, server_error)
    return out, state


# ---- the library, in a hand-written shard_map loop ----


@functools.cache
def looped(n, warmup, **options):
    tx = onebit_adam("data", LR, B1, B2, EPS, warmup_steps=warmup, **options)

    def loop(params, g):
        def one(state, g):
            updates, state = tx.update(g, state, params)
            return state, updates

        g = jax.tree.map(lambda x: x[:, 0], g)
        state, history = jax.lax.scan(one, tx.init(params), g)
        state = jax.tree.map(lambda x: x[None], state)
        return jax.tree.map(lambda x: x[:, None], history), state

    spec = P(None, "data")
    fn = jax.shard_map(loop, mesh=mesh_of(n), in_specs=(P(), spec), out_specs=(spec, P("data")))
    return jax.jit(fn)


def run(n, grads, warmup, params=None, **options):
    mesh = mesh_of(n)
    params = params or {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    g = jax.device_put(grads, NamedSharding(mesh, P(None, "data")))
    history, state = looped(n, warmup, **options)(params, g)
    return jax.tree.map(np.asarray, (history, state))


@pytest.mark.parametrize(("n", "dtype"), [(1, np.float32), (3, jnp.bfloat16), (8, np.float32),
                                          (5, np.float16)])  # fmt: skip
def test_matches_the_float64_algorithm(n, dtype):
    steps, warmup = 7, 3
    grads = grads_of(steps, n, dtype)
    history, state = run(n, grads, warmup)
    want, want_state = reference(grads, n, warmup)
    tol = {np.float32: 1e-5, jnp.bfloat16: 1e-2, np.float16: 2e-3}[dtype]
    for (k, got), expected in zip(sorted(history.items()), want, strict=True):
        assert got.dtype == np.dtype(dtype)
        got = got.astype(np.float64).reshape(steps, n, -1)
        assert (got == got[:, :1]).all()  # the same update on every device
        np.testing.assert_allclose(got[:, 0], expected, rtol=tol, atol=tol * LR, err_msg=k)
    for k, (mu, worker_error, server_error) in want_state.items():
        np.testing.assert_allclose(state.mu[k][0].reshape(-1), mu, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(state.errors.worker[k].reshape(n, -1), worker_error,
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
        np.testing.assert_allclose(state.errors.server[k].reshape(n, -1), server_error,
                                   rtol=1e-5, atol=1e-6)  # fmt: skip


def test_warm_up_is_optax_adam_on_the_mean_gradient():
    n, steps = 4, 3
    grads = grads_of(steps, n)
    history, _ = run(n, grads, warmup=steps)
    adam = optax.adam(LR, B1, B2, EPS)
    mean = jax.tree.map(lambda g: jnp.asarray(g.mean(1)), grads)
    state = adam.init(jax.tree.map(lambda g: g[0], mean))
    for t in range(steps):
        updates, state = adam.update(jax.tree.map(lambda g, t=t: g[t], mean), state)
        for k in SHAPES:
            np.testing.assert_allclose(history[k][t, 0], updates[k], rtol=2e-6, atol=1e-9)


def test_without_bias_correction_and_with_weight_decay():
    n, steps, warmup = 2, 4, 2
    grads = grads_of(steps, n)
    params = {k: np.random.default_rng(1).standard_normal(s).astype(np.float32)
              for k, s in SHAPES.items()}  # fmt: skip
    history, _ = run(n, grads, warmup, params=params, bias_correction=False, weight_decay=0.1)
    want, _ = reference(grads, n, warmup, bias_correction=False, weight_decay=0.1, params=params)
    for got, expected in zip([history[k] for k in sorted(history)], want, strict=True):
        np.testing.assert_allclose(got[:, 0].reshape(steps, -1), expected, rtol=1e-5, atol=1e-8)


def test_train_step_keeps_the_errors_per_device_and_the_rest_replicated():
    n = 4
    mesh = mesh_of(n)
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    tx = onebit_adam("data", LR, warmup_steps=1)
    state = parallel.init_state(tx, params, mesh)
    grads = grads_of(3, n)

    def loss(p, g):
        return sum(jnp.sum(p[k] * g[k][0]) for k in p)

    step = parallel.train_step(loss, tx, mesh)
    for t in range(3):
        params, state, _ = step(params, state, jax.tree.map(lambda g, t=t: g[t], grads))
    assert isinstance(state, OnebitAdamState)
    for x in jax.tree.leaves(state.errors):
        assert x.shape[0] == n and not x.sharding.is_fully_replicated  # one per device
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves((state.mu, state.nu)))
    history, _ = run(n, grads, 1)  # the loss is linear: the params are the updates' sum
    for k in SHAPES:
        np.testing.assert_allclose(params[k], history[k][:, 0].sum(0), rtol=1e-5, atol=1e-7)


def test_wire_warm_up_all_reduce_then_a_thirty_second():
    n = 4
    mesh = mesh_of(n)
    size = sum(int(np.prod(s)) for s in SHAPES.values())
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    tx = onebit_adam("data", LR, warmup_steps=5)
    state = parallel.init_state(tx, params, mesh)

    def loss(p, g):
        return sum(jnp.sum(p[k] * g[k][0]) for k in p)

    step = parallel.train_step(loss, tx, mesh)
    batch = jax.tree.map(lambda g: g[0], grads_of(1, n))
    report = wire.measure(step, params, state, batch)
    loss_bytes = 2 * (n - 1) / n * 4
    assert report.total - loss_bytes == pytest.approx(2 * (n - 1) / n * 4 * size)  # warm-up
    # Steady: one bit an entry (each leaf padded to 8n) and a float32 scale per leaf and
    # device, each way.
    padded = sum(-(-int(np.prod(s)) // (8 * n)) * 8 * n for s in SHAPES.values())
    one_way = (n - 1) / n * (padded / 8 + 4 * n * len(SHAPES))
    assert report.steady - loss_bytes == pytest.approx(2 * one_way)


def test_bad_arguments_raise():
    for kwargs, message in [
        ({"warmup_steps": 0}, "warmup_steps must be a positive int"),
        ({"b1": 1.0}, r"b1 must be a float in \[0, 1\)"),
        ({"b2": -0.1}, r"b2 must be a float in \[0, 1\)"),
        ({"eps": -1.0}, "eps must be a float >= 0"),
        ({"learning_rate": "fast"}, "learning_rate must be a float or an optax schedule"),
    ]:
        with pytest.raises(ValueError, match=message):
            onebit_adam("data", **kwargs)
    tx = onebit_adam("data", weight_decay=0.1)
    with pytest.raises(ValueError, match="weight_decay needs the params"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="floating"):
        tx.init(jnp.ones(3, jnp.int32))
    assert gradcomm.onebit_adam is onebit_adam


def test_fsdp_params_say_what_to_do():
    """With params split over the data axis (FSDP), train_step hands each device the whole
    gradient and wants its shard of the update back; 1-bit Adam's exchange returns whole
    updates (its momentum is whole on every device, as in DeepSpeed, which refuses ZeRO
    with it): a ValueError names the methods that reduce-scatter."""
    from helpers import FSDP_SPECS, explicit_mesh, mlp_loss, mlp_problem

    mesh = explicit_mesh((4,), ("data",))
    params, batches = mlp_problem(steps=1)
    placed = parallel.shard_params(params, mesh, FSDP_SPECS)
    tx = onebit_adam("data", LR, warmup_steps=1)
    with pytest.raises(ValueError, match=r"FSDP.*allreduce\(specs=\.\.\.\)"):
        state = parallel.init_state(tx, placed, mesh)
        parallel.train_step(mlp_loss, tx, mesh)(placed, state, batches[0])
