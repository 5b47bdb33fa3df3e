"""Shared test helpers: meshes over the first n of the 8 simulated devices."""

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomm import parallel

assert jax.device_count() == 8, "tests need 8 simulated CPU devices"


@functools.cache
def mesh_of(n: int, axis: str = "data"):
    """A 1-D mesh over the first n devices."""
    return parallel.make_mesh({axis: n}, devices=jax.devices()[:n])


@functools.cache
def _compiled(fn, n: int, axis: str):
    mesh = mesh_of(n, axis)

    def body(*args):
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))


def per_device(fn, n: int, *trees, axis: str = "data"):
    """Runs `fn` under shard_map on the first n devices.

    Inputs and outputs carry a leading device axis; outputs come back as NumPy, one row per
    device, so tests can check every device's result. `fn` must be hashable (a module-level
    function) so that its compilation is cached across tests.
    """
    sharding = NamedSharding(mesh_of(n, axis), P(axis))
    placed = jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), trees)
    return jax.tree.map(np.asarray, _compiled(fn, n, axis)(*placed))


# A 1.2M-parameter pytree of mixed leaves (a scalar, odd sizes, a conv kernel) for wire tests.
MODEL_SHAPES = [(1000, 1000), (1000,), (200, 1000), (7,), (3, 3, 16, 32), ()]


def wire_against_psum(update, n, shapes=MODEL_SHAPES):
    """Bytes per device of a float32 psum and of `update(list_of_leaves)`, both compiled.

    Returns (psum_bytes, report) with `report` the `gradcomm.wire.WireReport` of `update`,
    whose outputs leave the map per device (so any method's output type is accepted).
    """
    from gradcomm import wire

    mesh = mesh_of(n)
    sharding = NamedSharding(mesh, P("data"))
    tree = [jax.ShapeDtypeStruct((n, *s), np.float32, sharding=sharding) for s in shapes]

    def compiled(fn):
        body = lambda t: [x[None] for x in fn([x[0] for x in t])]  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))

    psum = wire.measure(compiled(lambda t: jax.lax.psum(t, "data")), tree).total
    return psum, wire.measure(compiled(update), tree)


def model_bytes(shapes=MODEL_SHAPES):
    return sum(int(np.prod(s)) for s in shapes) * 4


def run_steps(tx, steps):
    """A per-device function running `steps` updates of `tx` on updates shaped (steps, ...).

    Returns the stacked outputs and the stacked `state.residual` of every step.
    """

    def f(updates):
        state = tx.init(jax.tree.map(lambda u: u[0], updates))
        outs, residuals = [], []
        for t in range(steps):
            out, state = tx.update(jax.tree.map(lambda u, t=t: u[t], updates), state)
            outs.append(out)
            residuals.append(state.residual)
        stack = lambda xs: jax.tree.map(lambda *v: jax.numpy.stack(v), *xs)  # noqa: E731
        return stack(outs), stack(residuals)

    return f


def quick_start(mesh):
    """The README's quick start on `mesh`: Adam then Adasum on a 3-parameter least squares.

    Returns (params, state, step): replicated zero params, their state and the jitted
    `parallel.train_step` of `loss(params, batch) = mean((batch["x"] @ params - batch["y"])
    ** 2)`.
    """
    import jax.numpy as jnp
    import optax

    import gradcomm

    tx = optax.chain(optax.adam(1e-2), gradcomm.adasum("data"))

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)

    params = parallel.replicate(jnp.zeros(3), mesh)
    return params, parallel.init_state(tx, params, mesh), parallel.train_step(loss, tx, mesh)


# A small MLP for train_step on sharded meshes: FSDP splits both kernels' leading dimension
# (divisible by 8) over 'data'; under tensor parallelism `model_axis` names the axis over
# which the hidden units are split.
FSDP_SPECS = {"w1": P("data"), "b1": P(), "w2": P("data"), "b2": P()}


def mlp_loss(params, batch, model_axis=None):
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    y = h @ params["w2"]
    if model_axis is not None:  # each device holds a slice of the hidden units
        y = jax.lax.psum(y, model_axis)
    return jax.numpy.mean((y + params["b2"] - batch["y"]) ** 2)


def mlp_problem(seed=0, steps=5):
    """Params `{w1 (8, 16), b1, w2 (16, 5), b2}` and `steps` batches of 16 rows."""
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.standard_normal((8, 16)).astype(np.float32) / 3,
        "b1": rng.standard_normal(16).astype(np.float32) / 10,
        "w2": rng.standard_normal((16, 5)).astype(np.float32) / 4,
        "b2": np.zeros(5, np.float32),
    }
    batches = [
        {
            "x": rng.standard_normal((16, 8)).astype(np.float32),
            "y": rng.standard_normal((16, 5)).astype(np.float32),
        }
        for _ in range(steps)
    ]
    return params, batches
