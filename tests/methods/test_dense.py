"""The all-reduce baseline: the mean over the axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import per_device

import gradcomm


def allreduce_fn(tree):
    tx = gradcomm.allreduce("data")
    return tx.update(tree, tx.init(tree))[0]


@pytest.mark.parametrize("n", [1, 3, 8])
def test_mean_over_devices(n):
    rng = np.random.default_rng(n)
    tree = {
        "w": rng.standard_normal((n, 4, 3)).astype(np.float32),
        "b": rng.standard_normal((n, 2)).astype(np.float16),
    }
    out = per_device(allreduce_fn, n, tree)
    np.testing.assert_allclose(out["w"][0], tree["w"].mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["b"][0], tree["b"].astype(np.float32).mean(0), rtol=2e-3)
    assert out["b"].dtype == np.float16


def test_state_and_errors():
    tx = gradcomm.allreduce()
    state = tx.init(jnp.zeros(2))
    assert state == gradcomm.AllReduceState() and not jax.tree.leaves(state)
    with pytest.raises(ValueError, match="axis_name"):
        gradcomm.allreduce("")
    with pytest.raises(ValueError, match="not bound"):
        jax.vmap(lambda g: tx.update(g, state)[0], axis_name="other")(jnp.ones((2, 2)))
    with pytest.raises(ValueError, match="int32"):
        jax.vmap(lambda g: tx.update(g, state)[0], axis_name="data")(jnp.ones((2, 2), jnp.int32))
