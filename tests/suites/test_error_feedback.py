"""Error feedback (lags, slgs, gradient_dropping): the residual keeps its own dtype.

A bf16 or fp16 residual that met float32 updates used to come back as float32, which
changed the state's type and made a jitted step retrace.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradcomm

METHODS = {
    "lags": lambda: gradcomm.lags("d", density=0.25),
    "slgs": lambda: gradcomm.slgs("d", density=0.25),
    "gradient_dropping": lambda: gradcomm.gradient_dropping("d", drop_ratio=0.75),
    "gradient_dropping warm-up": lambda: gradcomm.gradient_dropping(
        "d", drop_ratio=0.75, warmup_steps=2
    ),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_residual_keeps_its_dtype_without_retracing(name, dtype):
    tx = METHODS[name]()
    params = {"w": jnp.zeros((2, 16), dtype), "b": jnp.zeros((2, 4), dtype)}
    traces = []

    def step(grads, state, params):
        traces.append(1)
        return jax.vmap(tx.update, axis_name="d")(grads, state, params)

    step = jax.jit(step)
    state = jax.vmap(tx.init)(params)
    rng = np.random.default_rng(0)
    for _ in range(4):  # float32 updates (an optimizer's) on low-precision params
        grads = jax.tree.map(
            lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params
        )
        updates, state = step(grads, state, params)
        jax.block_until_ready(updates)
        assert all(r.dtype == dtype for r in jax.tree.leaves(state.residual))
    assert len(traces) == 1
