"""Shared test helpers: meshes over the first n of the 8 simulated devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
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


def _varying(aval):
    manual = getattr(aval, "manual_axis_type", None)  # as gradcomm._axes.varying_axes reads it
    return frozenset(manual.varying) if manual is not None else frozenset()


def _typed_like(x, aval):
    """`x` typed varying over the axes `aval` varies over (a scan's carry keeps its type)."""
    missing = tuple(sorted(_varying(aval) - _varying(jax.typeof(x))))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def scan_steps(step, carry, xs):
    """`lax.scan(step, carry, xs)`, its body compiled once instead of once per step (as a
    Python loop would), after typing `carry` as `step` returns it: an update may make
    state that starts replicated vary over the mesh's axes (a scan wants its carry's type
    unchanged), and a `pcast` changes no value. Returns `(carry, ys)`, as `lax.scan` does."""
    first = jax.tree.map(lambda x: x[0], xs)
    leaves, treedef = jax.tree.flatten(carry)
    for _ in range(3):  # until the types stop changing (an update or two)
        avals = jax.make_jaxpr(lambda c: jax.tree.leaves(step(c, first)[0]))(carry).out_avals
        typed = [_typed_like(x, a) for x, a in zip(leaves, avals, strict=True)]
        if all(t is x for t, x in zip(typed, leaves, strict=True)):
            break
        leaves = typed
        carry = jax.tree.unflatten(treedef, leaves)
    return jax.lax.scan(step, carry, xs)


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

    Returns the stacked outputs and the stacked `state.residual` of every step (a
    `lax.scan` over the steps).
    """

    def f(updates):
        assert len(jax.tree.leaves(updates)[0]) == steps
        state = tx.init(jax.tree.map(lambda u: u[0], updates))

        def step(state, u):
            out, state = tx.update(u, state)
            return state, (out, state.residual)

        return scan_steps(step, state, updates)[1]

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


def save(path, tree):
    """Writes `tree` (sharded arrays included) as an orbax checkpoint at `path`."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()


def restore(path, target):
    """The checkpoint at `path`, restored like `target` (shapes, dtypes and shardings)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, target)


# The sharded (TP and FSDP) checks that sparse, lags and dropping share.
@functools.cache
def explicit_mesh(shape, names):
    """A mesh of Explicit axes over the first prod(shape) devices."""
    devices = jax.devices()[: int(np.prod(shape))]
    return jax.make_mesh(
        shape, names, devices=devices, axis_types=(AxisType.Explicit,) * len(shape)
    )


def run_on_mesh(tx, grads, mesh, specs, check_vma=True):
    """Per device, the outputs of `tx.update` on grads `(steps, data, *leaf)`, stacked
    `(steps, data, *leaf)`, each leaf split over the mesh by its spec (beyond 'data'). The
    steps run in one `lax.scan` (`scan_steps`)."""
    in_specs = {k: P(None, "data", *specs[k]) for k in grads}

    def body(g):
        g = jax.tree.map(lambda x: x[:, 0], g)
        params = jax.tree.map(lambda x: x[0] * 0, g)  # typed like the grads

        def step(state, gt):
            out, state = tx.update(gt, state, params)
            return state, out

        outs = scan_steps(step, tx.init(params), g)[1]
        return jax.tree.map(lambda x: x[:, None], outs)

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(in_specs,), out_specs=in_specs, check_vma=check_vma
    )
    placed = {k: jax.device_put(v, NamedSharding(mesh, in_specs[k])) for k, v in grads.items()}
    return jax.tree.map(np.asarray, jax.jit(mapped)(placed))


def sharded_against_whole(make, grads, specs, shape=(2, 2), names=("data", "model")):
    """`make()`'s outputs on leaves split by `specs` over a `shape` mesh of `names`, and on
    the whole leaves over 'data' alone (the first axis): `(got, want)`."""
    whole = explicit_mesh(shape[:1], names[:1])
    want = run_on_mesh(make(), grads, whole, {k: P() for k in grads})
    got = run_on_mesh(make(), grads, explicit_mesh(shape, names), specs)
    return got, want


def assert_same_bits(got, want):
    for k in want:
        assert got[k].dtype == want[k].dtype
        np.testing.assert_array_equal(
            got[k].view(np.uint8), want[k].view(np.uint8), err_msg=f"leaf {k!r}"
        )


def tied(shape, rng, scale=0.25):
    """Values in {-2, -1, 1, 2} * scale, mostly +-1: exact ties at any top-k threshold."""
    return (rng.choice([-1, 1], shape) * rng.choice([1, 1, 1, 2], shape) * scale).astype(np.float32)


def run_fsdp(tx, grads, split, n):
    """`tx.update` on whole per-device grads `(steps, n, *leaf)` over a 1-D 'data' mesh of
    n, `init` given each device's shard of an FSDP leaf (`split`), the whole of the rest.

    Returns the outputs `(steps, n, *out)` and each step's residuals flat, `(steps, n,
    size)`: an FSDP leaf's shard, and its whole-sized residual (this device's).
    """
    mesh = explicit_mesh((n,), ("data",))
    spec = {k: P(None, "data") for k in grads}

    def body(g):
        g = jax.tree.map(lambda x: x[:, 0], g)
        params = {k: (x[0, : x.shape[1] // n] if split[k] else x[0]) * 0 for k, x in g.items()}

        def step(state, gt):
            out, state = tx.update(gt, state, params)
            return state, (out, jax.tree.map(lambda r: r.reshape(-1), state.residual))

        outs = scan_steps(step, tx.init(params), g)[1]
        return jax.tree.map(lambda x: x[:, None], outs)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=(spec, spec)))
    placed = {k: jax.device_put(v, NamedSharding(mesh, spec[k])) for k, v in grads.items()}
    return jax.tree.map(np.asarray, f(placed))


def fsdp_against_whole(make, grads, split, n=4):
    """`make(specs)` with the leaves of `split` FSDP-split against `make(None)`: asserts
    that every device's shard is its slice of the whole result and its residual the same,
    bit for bit; returns the outputs with and without FSDP."""
    specs = {k: P("data") if s else P() for k, s in split.items()}
    got, got_residuals = run_fsdp(make(specs), grads, split, n)
    want, want_residuals = run_fsdp(make(None), grads, dict.fromkeys(split, False), n)
    for k, s in split.items():
        rows = grads[k].shape[2] // n if s else None
        for j in range(n):
            expected = want[k][:, j, j * rows : (j + 1) * rows] if s else want[k][:, j]
            assert got[k][:, j].shape == expected.shape, k
            assert_same_bits({k: got[k][:, j]}, {k: expected})
    assert_same_bits(got_residuals, want_residuals)
    return got, want


# A small MLP for FSDP in parallel.train_step (test_sharded's): leading dims divisible by 4.
def train_fsdp_against_replicated(make, n=4, steps=5):
    """`make(specs)` in `parallel.train_step` on the MLP, FSDP-split (`FSDP_SPECS`) and
    replicated: returns (fsdp params, fsdp state, replicated params, replicated state)."""
    from gradcomm import parallel

    mesh = explicit_mesh((n,), ("data",))
    params, batches = mlp_problem(steps=steps)

    def train(tx, placed):
        state = parallel.init_state(tx, placed, mesh)
        step = parallel.train_step(mlp_loss, tx, mesh)
        for batch in batches:
            placed, state, _ = step(placed, state, batch)
        return jax.tree.map(np.asarray, placed), state

    want, want_state = train(make(None), parallel.replicate(params, mesh))
    got, got_state = train(make(FSDP_SPECS), parallel.shard_params(params, mesh, FSDP_SPECS))
    for k in params:
        scale = np.abs(want[k]).max()
        assert np.abs(got[k] - want[k]).max() <= 1e-6 * scale, k
        assert not np.allclose(got[k], params[k]), k  # it trained
    return got, got_state, want, want_state


def spec_of(x):
    """An array's PartitionSpec without trailing Nones."""
    entries = list(x.sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


PER_SHARD_SHAPES = {"w": (16, 6), "v": (8, 3), "z": (8, 2), "h": (8, 4)}


def per_shard_grads(n, dtype, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    grads = {
        k: np.clip(rng.standard_normal((steps, n, *s)), -3, 3) for k, s in PER_SHARD_SHAPES.items()
    }
    grads["z"][:] = 0
    grads["h"] *= float(jnp.finfo(dtype).max) / 64
    return {k: v.astype(dtype) for k, v in grads.items()}


def assert_shards_match(got, want, dtype, n):
    """Each device's shard within n roundings of the dtype of the largest entry (the sum of
    n terms runs in float32, the reference's in float64), zeros exactly."""
    got = np.asarray(got, np.float64).reshape(want.shape)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, rtol=eps, atol=n * eps * np.abs(want).max())
    assert not got[want == 0].any()


def hand_written_sync_loop(tx, sync, loss_fn, params, batch, mesh, steps):
    """`steps` steps of a hand-written `shard_map` loop (a `lax.scan`) over per-device
    `params`, with the one line a `ParamsSync` asks for after `apply_updates`; the
    per-device params."""
    import optax

    spec = P("data")

    def loop(p, batch):
        p = jax.tree.map(lambda x: x[0], p)

        def step(carry, _):
            p, opt_state, sync_state = carry
            grads = jax.grad(loss_fn)(p, batch)
            updates, opt_state = tx.update(grads, opt_state, p)
            p = optax.apply_updates(p, updates)
            p, sync_state = sync.update(p, sync_state)  # the one line
            return (p, opt_state, sync_state), None

        (p, _, _), _ = scan_steps(step, (p, tx.init(p), sync.init(p)), jnp.arange(steps))
        return jax.tree.map(lambda x: x[None], p)

    fn = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    placed = jax.device_put(parallel.per_device(params, mesh), NamedSharding(mesh, spec))
    return jax.tree.map(np.asarray, fn(placed, parallel.shard_batch(batch, mesh)))


def result_records(data):
    """The records of a committed result JSON that carry provenance: a list's items, or a
    dict itself, or (a dict of `"records"` and figures made from them) its records."""
    if isinstance(data, list):
        return data
    if "provenance" not in data and "records" in data:
        return data["records"]
    return [data]
