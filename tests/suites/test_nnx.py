"""flax nnx: `nnx.Optimizer` with a gradcomm method under `nnx.shard_map`, against float64 NumPy.

The model enters the map replicated (`in_specs=P()`), so its params are invariant and JAX
would sum their gradient over the devices itself. The recipe (README, "flax nnx")
differentiates a per-device copy of the model instead: split off the params, type them
as varying with `jax.lax.pcast`, merge them back, take `nnx.value_and_grad` of that copy,
and hand the gradients to `optimizer.update(model, grads)`, which updates the replicated
model. The references below compute each device's gradient of its own batch shard, then
the SGD step, Adasum (tests/reference.py) or the mean, straight from the equations.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import mesh_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from reference import adasum

import gradcomm
from gradcomm import parallel

N = 4  # devices
B = 2  # examples per device and step
STEPS = 3
LR = 0.1
mesh = mesh_of(N)


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


# The README recipe, line for line (only `mesh` differs: 4 of the 8 test devices).
@nnx.jit
@nnx.shard_map(mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=P())
def train_step(model, optimizer, x, y):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    local = nnx.merge(graphdef, jax.lax.pcast(params, "data", to="varying"), rest)
    loss, grads = nnx.value_and_grad(loss_fn)(local, x, y)  # this device's gradient
    optimizer.update(model, grads)  # combined across devices: the same step everywhere
    return jax.lax.pmean(loss, "data")


# What a flax user writes first: the gradient of the replicated model, already summed.
@nnx.jit
@nnx.shard_map(mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=P())
def naive_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return jax.lax.pmean(loss, "data")


def _data():
    """STEPS global batches of N * B examples, float32 as the model sees them."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, N * B, 3)).astype(np.float32)
    y = rng.normal(size=(STEPS, N * B, 2)).astype(np.float32)
    return x, y


def _shard(*batch):
    """A batch split over the devices, as the explicit-axes mesh wants it."""
    return jax.device_put(batch, NamedSharding(mesh, P("data")))


def _grads(w, b, x, y):
    """One device's gradient of mean((x w + b - y)^2) over its shard, in float64."""
    r = x @ w + b - y
    return 2 * x.T @ r / r.size, 2 * r.sum(0) / r.size, np.mean(r**2)


def _mean(values):
    return np.mean(values, axis=0)


def _sgd_reference(w, b, xs, ys, combine):
    """SGD on each device's gradient, then `combine` over the devices, leaf by leaf."""
    w, b = np.float64(w), np.float64(b)
    losses = []
    for x, y in zip(xs, ys, strict=True):
        per_device = [
            _grads(w, b, xi, yi)
            for xi, yi in zip(np.split(np.float64(x), N), np.split(np.float64(y), N), strict=True)
        ]
        losses.append(np.mean([g[2] for g in per_device]))
        w = w + combine([-LR * g[0] for g in per_device])
        b = b + combine([-LR * g[1] for g in per_device])
    return w, b, losses


@pytest.mark.parametrize(
    ("method", "combine"),
    [(gradcomm.adasum, adasum), (gradcomm.allreduce, _mean)],
    ids=["adasum", "allreduce"],
)
def test_recipe_matches_numpy(method, combine):
    model = nnx.Linear(3, 2, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))
    w0, b0 = np.asarray(model.kernel[...]), np.asarray(model.bias[...])
    optimizer = nnx.Optimizer(model, optax.chain(optax.sgd(LR), method("data")), wrt=nnx.Param)
    xs, ys = _data()
    losses = []
    for x, y in zip(xs, ys, strict=True):
        losses.append(float(train_step(model, optimizer, *_shard(x, y))))

    w, b, want_losses = _sgd_reference(w0, b0, xs, ys, combine)
    np.testing.assert_allclose(np.asarray(model.kernel[...]), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.bias[...]), b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert int(optimizer.step[...]) == STEPS
    if method is gradcomm.adasum:  # the data tell Adasum from the mean
        w_mean, _, _ = _sgd_reference(w0, b0, xs, ys, _mean)
        assert np.abs(w - w_mean).max() > 1e-3


@pytest.mark.parametrize(
    "method", [gradcomm.adasum, gradcomm.allreduce], ids=["adasum", "allreduce"]
)
def test_replicated_model_raises(method):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(optax.sgd(LR), method("data")), wrt=nnx.Param)
    xs, ys = _data()
    with pytest.raises(ValueError, match="already identical"):
        naive_step(model, optimizer, *_shard(xs[0], ys[0]))


def test_split_model_with_parallel_train_step():
    """Per-device optimizer state (Adam before Adasum): nnx.split and gradcomm.parallel."""
    model = nnx.Linear(3, 2, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))
    w, b = np.float64(model.kernel[...]), np.float64(model.bias[...])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, batch):
        return loss_fn(nnx.merge(graphdef, params, rest), batch["x"], batch["y"])

    # eps of the gradients' order: with a tiny eps, Adam's first update is lr * sign(g) on
    # every device, and Adasum of (near-)opposite sign vectors cancels catastrophically.
    b1, b2, eps = 0.9, 0.999, 0.1
    tx = optax.chain(optax.adam(LR, b1=b1, b2=b2, eps=eps), gradcomm.adasum("data"))
    params = parallel.replicate(params, mesh)
    state = parallel.init_state(tx, params, mesh)
    step = parallel.train_step(loss, tx, mesh)
    xs, ys = _data()
    for x, y in zip(xs, ys, strict=True):
        params, state, _ = step(params, state, {"x": x, "y": y})
    nnx.update(model, params)

    # Adam on each device's own gradient (its own moments), then Adasum of the updates.
    moments = [[np.zeros_like(w), np.zeros_like(b), np.zeros_like(w), np.zeros_like(b)]] * N
    for t, (x, y) in enumerate(zip(xs, ys, strict=True), start=1):
        updates, new_moments = [], []
        for xi, yi, (mw, mb, vw, vb) in zip(
            np.split(np.float64(x), N), np.split(np.float64(y), N), moments, strict=True
        ):
            gw, gb, _ = _grads(w, b, xi, yi)
            mw, mb = b1 * mw + (1 - b1) * gw, b1 * mb + (1 - b1) * gb
            vw, vb = b2 * vw + (1 - b2) * gw**2, b2 * vb + (1 - b2) * gb**2
            new_moments.append([mw, mb, vw, vb])
            updates.append(
                [
                    -LR * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
                    for m, v in ((mw, vw), (mb, vb))
                ]
            )
        moments = new_moments
        w = w + adasum([u[0] for u in updates])
        b = b + adasum([u[1] for u in updates])
    np.testing.assert_allclose(np.asarray(model.kernel[...]), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.bias[...]), b, rtol=1e-5, atol=1e-6)
