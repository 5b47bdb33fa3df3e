"""Gradients that JAX already summed raise; per-device ones, unchecked types and vmap pass.

The case: a hand-written `shard_map` whose params come in replicated (`in_specs=P()`) and
which differentiates inside. JAX then sums the gradient over the axis itself, so every
device holds the total and a method would average N copies of it (N times too large for
allreduce, a no-op for Adasum). Every factory must refuse that, name the fix, and never
raise where the types say nothing.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_of
from jax.sharding import PartitionSpec as P

import gradcomm

N = 4
FACTORIES = {
    "allreduce": lambda: gradcomm.allreduce("data"),
    "adasum": lambda: gradcomm.adasum("data"),
    "terngrad": lambda: gradcomm.terngrad("data"),
    "lags": lambda: gradcomm.lags("data", density=0.5),
    "slgs": lambda: gradcomm.slgs("data", density=0.5),
    "gradient_dropping": lambda: gradcomm.gradient_dropping("data", warmup_steps=0),
    "sgp": lambda: gradcomm.sgp("data"),
    "dpsgd": lambda: gradcomm.dpsgd("data"),
}
PARAMS = jax.device_put(
    {"w": jnp.arange(1.0, 7.0).reshape(2, 3), "b": jnp.array([0.5, -0.5, 1.0])},
    jax.NamedSharding(mesh_of(N), P()),
)


def _loss(params, x):
    return jnp.sum((x @ params["w"] + params["b"]) ** 2)


def _batch():
    x = jnp.arange(N * 2 * 2, dtype=jnp.float32).reshape(N * 2, 2) / 10
    return jax.device_put(x, jax.NamedSharding(mesh_of(N), P("data")))


def _step(tx, *, pcast: bool, check_vma: bool = True):
    """A user's step: replicated params in, gradient inside, `tx.update` on it."""
    mesh = mesh_of(N)

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P("data"),
        check_vma=check_vma,
    )
    def step(params, x):
        state = tx.init(params)
        local = jax.lax.pcast(params, "data", to="varying") if pcast else params
        grads = jax.grad(_loss)(local, x)
        updates, _ = tx.update(grads, state, local)
        return jax.tree.map(lambda u: u[None], updates)

    return step


@pytest.mark.parametrize("name", FACTORIES)
def test_replicated_params_raise_with_the_fix(name):
    with pytest.raises(ValueError, match=r"already identical on every device.*pcast"):
        _step(FACTORIES[name](), pcast=False)(PARAMS, _batch())


@pytest.mark.parametrize("name", ["allreduce", "adasum", "lags", "sgp"])
def test_per_device_gradients_pass(name):
    out = _step(FACTORIES[name](), pcast=True)(PARAMS, _batch())
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(out))


def test_allreduce_of_per_device_gradients_is_the_mean():
    out = _step(FACTORIES["allreduce"](), pcast=True)(PARAMS, _batch())
    x = np.asarray(_batch(), np.float64).reshape(N, 2, 2)
    w, b = np.asarray(PARAMS["w"], np.float64), np.asarray(PARAMS["b"], np.float64)
    r = x @ w + b  # (N, 2, 3): d/dw sum(r^2) = 2 x^T r, d/db = 2 sum over rows of r
    mean = {"b": (2 * r.sum(1)).mean(0), "w": (2 * np.swapaxes(x, 1, 2) @ r).mean(0)}
    for key in ("b", "w"):
        got = np.asarray(out[key])
        np.testing.assert_allclose(got, np.broadcast_to(mean[key], got.shape), rtol=1e-6)


def test_unchecked_types_never_raise():
    # With check_vma=False every value reads as invariant and JAX does not sum the
    # gradient of replicated params: the per-device gradients arrive and are averaged.
    out = _step(FACTORIES["allreduce"](), pcast=False, check_vma=False)(PARAMS, _batch())
    want = _step(FACTORIES["allreduce"](), pcast=True)(PARAMS, _batch())
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_named_vmap_never_raises():
    tx = FACTORIES["adasum"]()
    g = jnp.array([[3.0, 0.0], [0.0, 4.0]])
    # jitted: one compilation instead of one per operation (the vmap is the same)
    out = jax.jit(jax.vmap(lambda x: tx.update(x, tx.init(x))[0], axis_name="data"))(g)
    np.testing.assert_allclose(np.asarray(out[0]), [3.0, 4.0])


def test_one_invariant_leaf_is_not_a_sum():
    # A frozen parameter's zeros are invariant; the other leaves vary: no error.
    tx = optax.chain(
        optax.multi_transform(
            {"train": optax.identity(), "frozen": optax.set_to_zero()},
            {"w": "train", "b": "frozen"},
        ),
        gradcomm.allreduce("data"),
    )
    out = _step(tx, pcast=True)(PARAMS, _batch())
    np.testing.assert_array_equal(np.asarray(out["b"]), 0.0)


def test_adasum_reduce_checks_too():
    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh_of(N), in_specs=P(), out_specs=P())
    def reduce(tree):
        return gradcomm.adasum_reduce(tree, "data")

    with pytest.raises(ValueError, match="already identical"):
        reduce(PARAMS)


def test_readme_loop_without_pcast_raises():
    """The hand-written shard_map loop (once the README's, now on the Training loops page)
    raises without its pcast."""
    import pathlib
    import re

    page = "docs/site/guide/training.md"
    text = (pathlib.Path(__file__).resolve().parents[2] / page).read_text()
    fix = 'local = jax.lax.pcast(params, "data", to="varying")'
    [loop] = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if fix in b]
    with pytest.raises(ValueError, match="already identical"):
        exec(compile(loop.replace(fix, "local = params"), page, "exec"), {})
