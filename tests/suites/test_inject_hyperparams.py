"""optax.inject_hyperparams: float hyperparameters inject as traced values; structural
ones raise a ValueError that names `static_args`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_of
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel

STRUCTURAL = [  # factory, the structural argument, its value
    (gradcomm.lags, "density", 0.5),
    (gradcomm.slgs, "density", 0.5),
    (gradcomm.gradient_dropping, "drop_ratio", 0.5),
    (gradcomm.gradient_dropping, "warmup_steps", 3),
    (gradcomm.local_sgd, "every", 4),
    (gradcomm.sgp, "overlap", 1),
    (gradcomm.sgp, "allreduce_steps", 2),
    (gradcomm.terngrad, "seed", 3),
    (gradcomm.powersgd, "rank", 2),
    (gradcomm.powersgd, "min_compression_rate", 2.0),
    (gradcomm.powersgd, "seed", 3),
]


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)


def _sharded(x):
    return jax.device_put(x, jax.NamedSharding(mesh_of(4), P("data")))


def _batch(n):
    x = np.random.default_rng(0).normal(size=(4 * n, 3)).astype(np.float32)
    return {"x": x, "y": x @ np.array([1.0, -1.0, 2.0], np.float32)}


def test_terngrad_clip_injected_and_changed_between_steps():
    mesh = mesh_of(4)
    inner = optax.inject_hyperparams(gradcomm.terngrad, static_args=("seed",))
    tx = optax.chain(inner(axis_name="data", clip=2.5), optax.sgd(0.1))
    params = parallel.replicate(jnp.zeros(3), mesh)
    state = parallel.init_state(tx, params, mesh)
    step = parallel.train_step(_loss, tx, mesh)
    losses = []
    for clip in (2.5, 1.0, 0.5):  # a new value reuses the compiled step
        state[0].hyperparams["clip"] = jnp.asarray(clip, jnp.float32)
        params, state, metrics = step(params, state, _batch(4))
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert len(step._compiled) == 1


def test_injected_clip_matches_the_static_one():
    g = _sharded(np.random.default_rng(1).normal(size=(4, 50)).astype(np.float32))

    def run(tx):
        def body(x):
            x = x[0]
            return tx.update(x, tx.init(x))[0][None]

        mapped = jax.shard_map(body, mesh=mesh_of(4), in_specs=P("data"), out_specs=P("data"))
        return np.asarray(jax.jit(mapped)(g))

    static = run(gradcomm.terngrad("data", clip=1.5))
    inner = optax.inject_hyperparams(gradcomm.terngrad, static_args=("seed",))
    np.testing.assert_array_equal(run(inner(axis_name="data", clip=1.5)), static)


@pytest.mark.parametrize(
    ("factory", "arg", "value"), STRUCTURAL, ids=lambda v: getattr(v, "__name__", str(v))
)
def test_structural_arguments_name_static_args(factory, arg, value):
    others = tuple(a for f, a, _ in STRUCTURAL if f is factory and a != arg)
    tx = optax.inject_hyperparams(factory, static_args=others)(axis_name="data", **{arg: value})
    x = _sharded(np.zeros((4, 3), np.float32))

    def body(p):
        p = p[0]
        return tx.update(p, tx.init(p), p)[0][None]

    mapped = jax.shard_map(body, mesh=mesh_of(4), in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(ValueError, match=rf"static_args=\('{arg}',\)"):
        jax.jit(mapped)(x)


def test_a_default_seed_injected_outside_jit_names_static_args():
    """inject_hyperparams makes the default seed an array already in an eager `init`."""
    tx = optax.inject_hyperparams(gradcomm.terngrad)(axis_name="data", clip=2.5)
    with pytest.raises(ValueError, match=r"static_args=\('seed',\)"):
        tx.init({"w": jnp.ones(3)})
