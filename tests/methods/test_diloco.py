"""gradcomm.diloco: DiLoCo's outer step (Douillard et al. 2023, Algorithm 1) as a ParamsSync.

Held against a float64 NumPy transcription of Algorithm 1 (inner SGD on each worker's own
data for H steps; the outer gradient, the mean change since the last outer step, through
Nesterov momentum), run through `parallel.train_step(..., sync=...)` and a hand-written
`shard_map` loop.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import hand_written_sync_loop, mesh_of, restore, save, scan_steps
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel, wire
from gradcomm.diloco import DilocoState, diloco

H, ROUNDS, INNER_LR = 3, 2, 0.1
OUTER_LR, MOMENTUM = 0.7, 0.9  # the paper's outer Nesterov momentum


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def problem(n, seed=0):
    """Params, and a batch of 4 rows per device: each device's own least squares."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4 * n, 5)).astype(np.float32)
    batch = {"x": x, "y": (x @ rng.standard_normal(5) + 0.5).astype(np.float32)}
    params = {
        "w": (rng.standard_normal(5) * 0.1).astype(np.float32),
        "b": np.zeros((), np.float32),
    }
    return params, batch


def reference(params, batch, n, steps, every=H, inner_lr=INNER_LR):
    """Algorithm 1 in float64: the per-device params after each step, (steps, n, ...)."""
    theta = np.concatenate([params["w"], params["b"][None]]).astype(np.float64)
    x = batch["x"].astype(np.float64).reshape(n, -1, 5)
    y = batch["y"].astype(np.float64).reshape(n, -1)
    anchor, momentum = theta.copy(), np.zeros_like(theta)
    local = np.repeat(theta[None], n, 0)  # theta_i <- theta(t - 1)
    history = []
    for step in range(1, steps + 1):
        for i in range(n):  # InnerOpt: plain SGD on worker i's gradient
            r = x[i] @ local[i, :5] + local[i, 5] - y[i]
            grad = np.concatenate([2 * x[i].T @ r, [2 * r.sum()]]) / len(r)
            local[i] -= inner_lr * grad
        if step % every == 0:
            delta = (anchor[None] - local).mean(0)  # the outer gradient, averaged
            momentum = MOMENTUM * momentum + delta  # OuterOpt: Nesterov momentum
            anchor = anchor - OUTER_LR * (delta + MOMENTUM * momentum)
            local = np.repeat(anchor[None], n, 0)
        history.append(local.copy())
    return np.stack(history)


def run(n, sync, steps=H * ROUNDS, tx=None, seed=0):
    """Per-device params (numpy, (n, ...)) after each step of train_step with `sync`."""
    mesh = mesh_of(n)
    params, batch = problem(n, seed)
    tx = tx or optax.sgd(INNER_LR)
    p = parallel.per_device(params, mesh)
    state = parallel.init_state(tx, p, mesh, params_per_device=True, sync=sync)
    step = parallel.train_step(loss_fn, tx, mesh, params_per_device=True, sync=sync)
    history = []
    for _ in range(steps):
        p, state, _ = step(p, state, batch)
        history.append(jax.tree.map(np.asarray, p))
    return history, state, (step, p, batch)


def flat(p):
    return np.concatenate([p["w"], p["b"][:, None]], axis=1)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_matches_the_float64_algorithm(n):
    history, state, _ = run(n, diloco("data", every=H))
    params, batch = problem(n)
    expected = reference(params, batch, n, H * ROUNDS)
    for step, p in enumerate(history, start=1):
        np.testing.assert_allclose(flat(p), expected[step - 1], rtol=2e-5, atol=2e-6)
        same = all(np.array_equal(x, x[:1].repeat(n, 0)) for x in p.values())
        assert same == (step % H == 0 or n == 1), step  # identical bits after outer steps
    # The state: the last outer step's params as the anchor, Nesterov's momentum, the count.
    assert isinstance(state.sync, DilocoState) and int(state.sync.count) == H * ROUNDS
    jax.tree.map(
        lambda a, p: np.testing.assert_array_equal(np.asarray(a), p[0]),
        state.sync.anchor,
        history[-1],
    )
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state.sync))


def test_params_are_untouched_between_outer_steps():
    n = 4
    synced, *_ = run(n, diloco("data", every=H), steps=H - 1)
    plain, *_ = run(n, None, steps=H - 1)  # local steps, no sync
    jax.tree.map(np.testing.assert_array_equal, synced, plain)
    # And the sync alone, off its outer step, returns its input's bits.
    sync = diloco("data", every=2)
    p = jnp.asarray(np.random.default_rng(0).standard_normal((n, 3)), jnp.float32)
    out = jax.jit(jax.vmap(lambda q: sync.update(q, sync.init(q))[0], axis_name="data"))(p)
    np.testing.assert_array_equal(out, p)


def test_outer_sgd_of_rate_one_is_periodic_averaging():
    """With outer=optax.sgd(1.0) the outer step is theta_anchor - (theta_anchor - mean):
    the mean up to the rounding of the difference, not always local SGD's bits (measured:
    up to 8 float32 ulps on a component much smaller than the anchor's others), so within
    a float32 rounding of the params' magnitude."""
    n = 4
    ours, *_ = run(n, diloco("data", outer=optax.sgd(1.0), every=H))
    local, *_ = run(n, gradcomm.local_sgd("data", every=H))
    for a, b in zip(ours, local, strict=True):
        scale = max(np.abs(x).max() for x in b.values())
        for key in a:
            np.testing.assert_allclose(a[key], b[key], rtol=0, atol=4 * 2.0**-24 * scale)


def test_hand_written_loop_with_the_one_line():
    """`params, sync_state = sync.update(params, sync_state)` after apply_updates, with the
    state initialised inside the map from per-device params: the train_step's bits."""
    n = 4
    tx, sync = optax.sgd(INNER_LR), diloco("data", every=H)
    mesh = mesh_of(n)
    params, batch = problem(n)
    got = hand_written_sync_loop(tx, sync, loss_fn, params, batch, mesh, H * ROUNDS)
    jax.tree.map(np.testing.assert_array_equal, got, run(n, sync)[0][-1])


def ocp_struct(x):
    """An orbax restore target: the array's shape, dtype and sharding."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def test_adamw_inner_and_outer_checkpoint_and_restore_bit_identically(tmp_path):
    """AdamW inside (per-device moments), Adam outside (its state replicated in the sync's);
    saved after two steps, the third (an outer step) continues bit for bit."""
    n = 4
    sync = diloco("data", outer=optax.adam(0.5), every=H)
    mesh = mesh_of(n)
    params, batch = problem(n)
    tx = optax.adamw(1e-2)
    p = parallel.per_device(params, mesh)
    state = parallel.init_state(tx, p, mesh, params_per_device=True, sync=sync)
    step = parallel.train_step(loss_fn, tx, mesh, params_per_device=True, sync=sync)
    for _ in range(2):
        p, state, _ = step(p, state, batch)
    leaves, treedef = jax.tree.flatten(state.sync)  # a pytree of arrays, all replicated
    assert all(isinstance(x, jax.Array) and x.sharding.is_fully_replicated for x in leaves)
    assert jax.tree.structure(jax.tree.unflatten(treedef, leaves)) == treedef
    save(tmp_path / "ckpt", {"params": p, "state": state})
    target = jax.tree.map(ocp_struct, {"params": p, "state": state})
    restored = restore(tmp_path / "ckpt", target)
    expected = step(p, state, batch)
    got = step(restored["params"], restored["state"], batch)
    jax.tree.map(np.testing.assert_array_equal, got, expected)
    w = np.asarray(expected[0]["w"])
    assert all(np.array_equal(w[0], w[i]) for i in range(n))  # the outer step ran
    assert int(expected[1].sync.outer_state[0].count) == 1


def test_wire_names_the_outer_step():
    n = 4
    _, state, (step, p, batch) = run(n, diloco("data", every=5), steps=1)
    report = wire.measure(step, p, state, batch)
    mean_bytes = 2 * (n - 1) / n * 6 * 4  # one all-reduce of the 6 params
    assert report.period == 5
    assert report.average == pytest.approx(report.steady + mean_bytes / 5, rel=1e-12)


def test_chained_as_a_transformation_it_says_where_it_goes():
    tx = optax.chain(optax.sgd(0.1), diloco("data", every=2))
    with pytest.raises(ValueError, match=r"diloco returns a gradcomm\.ParamsSync.*sync=\.\.\."):
        jax.vmap(lambda p: tx.update(p, tx.init(p), p), axis_name="data")(jnp.zeros((2, 3)))


def test_bad_arguments_raise():
    for every in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every must be a positive int"):
            diloco("data", every=every)
    for outer in (0.7, gradcomm.local_sgd("data"), "sgd"):
        with pytest.raises(ValueError, match=r"outer must be an optax\.GradientTransformation"):
            diloco("data", outer=outer)
    with pytest.raises(ValueError, match="axis_name"):
        diloco("")
    sync = diloco("data", every=1)
    with pytest.raises(ValueError, match="floating"):
        sync.init(jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="not bound"):
        jax.vmap(lambda q: sync.update(q, sync.init(q)), axis_name="other")(jnp.ones((2, 3)))


# A tensor-parallel mesh (issue 27): params sharded over 'model' by rows and by columns,
# beside one replicated over it.
TP_SPECS = {"w": P("model", None), "c": P(None, "model"), "b": P()}
TP_SHAPES = {"w": (8, 6), "c": (5, 4), "b": (6,)}


def tp_meshes():
    """The (data 4, model 2) mesh, and the 1-D mesh of its 4 data devices."""
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    two = jax.make_mesh((4, 2), ("data", "model"), axis_types=explicit)
    one = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=explicit[:1])
    return two, one


def tp_run(sync, mesh, specs, replicated_state, steps=4):
    """`steps` of per-device SGD on random gradients from the same params, each followed
    by `sync.update`, in a hand-written `shard_map` loop: the params after each step,
    (steps, data device, ...), and the final sync state. The state is initialised inside
    the map from the per-device params, or (`replicated_state`) outside it and passed in
    and out replicated over the data devices, as `train_step` keeps it."""
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in TP_SHAPES.items()}
    grads = {k: rng.standard_normal((steps, 4, *s)) for k, s in TP_SHAPES.items()}
    grads = {k: g.astype(np.float32) for k, g in grads.items()}
    param_specs = {k: P("data", *specs[k]) for k in params}
    grad_specs = {k: P(None, "data", *specs[k]) for k in params}
    state = sync.init(params)
    by_shape = {s: specs[k] for k, s in TP_SHAPES.items()}  # the shapes are distinct
    state_specs = jax.tree.map(lambda x: by_shape.get(x.shape, P()), state)

    def loop(p, g, state):
        p = {k: x[0] for k, x in p.items()}
        if not replicated_state:
            state = sync.init(p)

        def step(carry, gt):  # in a lax.scan: the step compiles once
            p, state = carry
            p = {k: p[k] - np.float32(0.1) * gt[k][0] for k in p}
            p, state = sync.update(p, state)
            return (p, state), {k: x[None] for k, x in p.items()}

        (_, state), history = scan_steps(step, (p, state), g)
        return history, (state if replicated_state else None)

    fn = jax.shard_map(
        loop,
        mesh=mesh,
        in_specs=(param_specs, grad_specs, state_specs),
        out_specs=(grad_specs, state_specs if replicated_state else None),
    )
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    per_device = {k: np.broadcast_to(v, (4, *v.shape)) for k, v in params.items()}
    placed = jax.tree.map(put, (per_device, grads, state), (param_specs, grad_specs, state_specs))
    return jax.tree.map(np.asarray, jax.jit(fn)(*placed))


@pytest.mark.parametrize("replicated_state", [False, True], ids=["in-map", "replicated"])
@pytest.mark.parametrize("outer", ["nesterov", "adam"])
def test_params_sharded_over_a_model_axis(outer, replicated_state):
    """On a (data 4, model 2) mesh, params sharded over 'model' beside one replicated over
    it: each param and state leaf keeps its type (the replicated ones leave the map as
    replicated over 'model', the state as replicated over every axis it is) and the
    params and the state are the bits of the whole tensors on the 4 data devices: the
    outer optimizers, elementwise, give each piece the whole tensor's piece of the step."""
    two, one = tp_meshes()
    outer = None if outer == "nesterov" else optax.adam(0.5)
    sync = diloco("data", outer=outer, every=2)
    got, got_state = tp_run(sync, two, TP_SPECS, replicated_state)
    want, want_state = tp_run(sync, one, {k: P() for k in TP_SPECS}, replicated_state)
    jax.tree.map(np.testing.assert_array_equal, (got, got_state), (want, want_state))
    for k in TP_SHAPES:
        assert (got[k][1::2] == got[k][1::2, :1]).all()  # outer steps: every device's
        assert not (got[k][0] == got[k][0, :1]).all()  # inner steps: each its own
