"""`parallel.train_step(..., overlap=True)`: each layer's exchange in the backward pass."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_of

import gradcomm
from gradcomm import parallel
from gradcomm.parallel._overlap import layerwise


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["l0"]["w"] + params["l0"]["b"])
    h = jnp.tanh(h @ params["l1"]["w"] + params["l1"]["b"])
    return jnp.mean((h @ params["l2"]["w"] - batch["y"]) ** 2)


def problem(seed=0, rows=32):
    rng = np.random.default_rng(seed)
    params = {
        f"l{i}": {
            "w": (rng.standard_normal((8, 8)) * 0.4).astype(np.float32),
            "b": (rng.standard_normal(8) * 0.1).astype(np.float32),
        }
        for i in range(2)
    }
    params["l2"] = {"w": (rng.standard_normal((8, 3)) * 0.4).astype(np.float32)}
    batches = [
        {
            "x": rng.standard_normal((rows, 8)).astype(np.float32),
            "y": rng.standard_normal((rows, 3)).astype(np.float32),
        }
        for _ in range(3)
    ]
    return params, batches


def train(tx, n, overlap, init_tx=None):
    """Three steps on n devices; the params and losses as NumPy."""
    mesh = mesh_of(n)
    params, batches = problem()
    params = parallel.replicate(params, mesh)
    state = parallel.init_state(init_tx or tx, params, mesh, overlap=overlap)
    step = parallel.train_step(loss_fn, init_tx or tx, mesh, overlap=overlap)
    losses = []
    for batch in batches:
        params, state, metrics = step(params, state, batch)
        losses.append(float(metrics["loss"]))
    return parallel.host_copy(params), losses, state


def assert_bits(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# Layer-wise methods whose per-layer step XLA:CPU compiles to the same bits as the
# whole-tree step.
SAME_BITS = {
    "allreduce, sgd": lambda: optax.chain(gradcomm.allreduce(), optax.sgd(0.1)),
    "sgd, allreduce": lambda: optax.chain(optax.sgd(0.1), gradcomm.allreduce()),
    "sgd, lags": lambda: optax.chain(optax.sgd(0.1), gradcomm.lags(density=0.25)),
    "gradient_dropping, sgd": lambda: optax.chain(
        gradcomm.gradient_dropping(drop_ratio=0.5, warmup_steps=0), optax.sgd(0.1)
    ),
}


# One device takes train_step's one-device path, 2 and 4 the same multi-device one: each
# method runs on 1 and on 2 or 4, the methods taking turns, so each count is in every test.
SAME_BITS_DEVICES = {
    "allreduce, sgd": (1, 2),
    "gradient_dropping, sgd": (1, 4),
    "sgd, allreduce": (1, 2),
    "sgd, lags": (1, 4),
}


@pytest.mark.parametrize(
    ("name", "n"), [(name, n) for name in sorted(SAME_BITS) for n in SAME_BITS_DEVICES[name]]
)
def test_overlap_gives_the_same_bits(name, n):
    want, want_losses, _ = train(SAME_BITS[name](), n, overlap=False)
    got, got_losses, state = train(SAME_BITS[name](), n, overlap=True)
    assert_bits(got, want)
    assert got_losses == want_losses
    assert isinstance(state, tuple) and len(state) == 3  # one state per layer


# With Adam (and in Adasum's reductions), XLA:CPU's code for the same arithmetic differs
# by an ulp or so between a program that updates every leaf at once and one that updates
# a layer at a time, with or without overlap; the ulps can flip LAGS's top-k on ties.
CLOSE = {
    "allreduce, adam": lambda: optax.chain(gradcomm.allreduce(), optax.adam(0.05)),
    "adam, allreduce": lambda: optax.chain(optax.adam(0.05), gradcomm.allreduce()),
    "adam, adasum": lambda: optax.chain(optax.adam(0.05), gradcomm.adasum()),
    "adam, lags": lambda: optax.chain(optax.adam(0.05), gradcomm.lags(density=0.25)),
}


# Likewise (Adasum on one device is the identity; on 4, its second level is test_adasum's).
CLOSE_DEVICES = {
    "adam, adasum": (2,),
    "adam, allreduce": (1, 4),
    "adam, lags": (1, 4),
    "allreduce, adam": (1, 2),
}


@functools.cache
def overlapped(name, n):
    """`train` of CLOSE[name] on n devices with overlap=True (two tests compare it)."""
    return train(CLOSE[name](), n, overlap=True)


@pytest.mark.parametrize(
    ("name", "n"), [(name, n) for name in sorted(CLOSE) for n in CLOSE_DEVICES[name]]
)
def test_overlap_matches_the_per_layer_step(name, n):
    """Against the same per-layer transformation run after the whole backward."""
    want, _, want_state = train(layerwise(CLOSE[name]()), n, overlap=False)
    got, _, got_state = overlapped(name, n)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True):
        if not jnp.issubdtype(a.dtype, jnp.floating):  # counts travel bit for bit
            np.testing.assert_array_equal(a, b)


def test_layerwise_adam_is_close_to_the_whole_tree_step():
    want, _, _ = train(CLOSE["allreduce, adam"](), 2, overlap=False)
    got, _, _ = overlapped("allreduce, adam", 2)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


NOT_LAYERWISE = {
    "slgs": (lambda: optax.chain(optax.sgd(0.1), gradcomm.slgs()), "gradcomm.slgs"),
    "low_precision": (lambda: gradcomm.low_precision(), "gradcomm.low_precision"),
    "powersgd": (lambda: gradcomm.powersgd(), "gradcomm.powersgd"),
    "terngrad": (lambda: gradcomm.terngrad(), "random key"),
    "global norm": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), gradcomm.allreduce()),
        "clip_by_global_norm",
    ),
    "apply_if_finite": (
        lambda: gradcomm.apply_if_finite(gradcomm.allreduce(), 3, "data"),
        "apply_if_finite",
    ),
}


@pytest.mark.parametrize("name", sorted(NOT_LAYERWISE))
def test_whole_tree_transformations_raise(name):
    make, match = NOT_LAYERWISE[name]
    mesh = mesh_of(2)
    params = parallel.replicate(problem()[0], mesh)
    with pytest.raises(ValueError, match=match):
        parallel.init_state(make(), params, mesh, overlap=True)
    step = parallel.train_step(loss_fn, make(), mesh, overlap=True)
    state = parallel.init_state(layerwise(make()), params, mesh)
    with pytest.raises(ValueError, match=match):
        step(params, state, problem()[1][0])


def test_a_whole_tree_state_is_refused():
    mesh = mesh_of(2)
    tx = optax.chain(gradcomm.allreduce(), optax.sgd(0.1))
    params, batches = problem()
    params = parallel.replicate(params, mesh)
    step = parallel.train_step(loss_fn, tx, mesh, overlap=True)
    with pytest.raises(ValueError, match="overlap=True"):
        step(params, parallel.init_state(tx, params, mesh), batches[0])


def _schedule(step, params, state, batch):
    """The entry computation's instructions in their scheduled order."""
    text = step.lower(params, state, batch).compile().as_text()
    entry = text[text.index("\nENTRY") :]
    return [line.strip() for line in entry.splitlines() if " = " in line]


def _positions(lines):
    collectives = [i for i, x in enumerate(lines) if re.search(r"\ball-reduce(-start)?\(", x)]
    # The backward's weight-gradient matmuls: dots (or the matmul fusions XLA:CPU makes)
    # under the transpose of the forward's dot.
    dots = [
        i
        for i, x in enumerate(lines)
        if "transpose(" in x and "dot_general" in x and ("dot(" in x or "kind=kCustom" in x)
    ]
    return collectives, dots


def test_the_exchanges_sit_between_the_layers_backward():
    mesh = mesh_of(2)
    tx = optax.chain(gradcomm.allreduce(), optax.sgd(0.1))
    params, batches = problem()
    params = parallel.replicate(params, mesh)
    plain = parallel.train_step(loss_fn, tx, mesh)
    collectives, dots = _positions(
        _schedule(plain, params, parallel.init_state(tx, params, mesh), batches[0])
    )
    assert dots and min(collectives) > max(dots)  # without overlap: all after the backward
    step = parallel.train_step(loss_fn, tx, mesh, overlap=True)
    state = parallel.init_state(tx, params, mesh, overlap=True)
    collectives, dots = _positions(_schedule(step, params, state, batches[0]))
    assert len(collectives) >= 3  # one per layer: XLA did not merge them
    # The last layer's exchange runs after its weight gradient and before the first
    # layer's weight gradient is computed.
    assert min(dots) < min(collectives) < max(dots)
