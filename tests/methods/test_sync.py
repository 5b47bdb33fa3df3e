"""Explicit parameter synchronization: `gradcomm.average_params`, `periodic_average`,
`local_sgd`, and `train_step(..., sync=...)`; Streaming DiLoCo (4-bit E3M0 and bfloat16
outer gradients) and DiLoCo's eager updates held to the same contexts where they differ
(their float64 references are in test_streaming_diloco.py).

The sync is applied to the params themselves after the optimizer's step, the same bits on
every device, in `train_step`, a hand-written `shard_map` loop, `pmap` and a named `vmap`
alike. That it gives the same bits as the hidden averaging it replaced
(`gradient_dropping(average_every=...)`, the `local_sgd` transformation) is held by
`test_golden.py`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import hand_written_sync_loop, mesh_of, scan_steps
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel, wire

N, K, STEPS = 4, 3, 7


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def problem():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8 * N, 5)).astype(np.float32)
    batch = {"x": x, "y": (x @ rng.standard_normal(5)).astype(np.float32)}
    params = {"w": np.zeros(5, np.float32), "b": np.zeros((), np.float32)}
    return params, batch


def train(tx, sync=None, steps=STEPS):
    mesh = mesh_of(N)
    params, batch = problem()
    p = parallel.per_device(params, mesh)
    state = parallel.init_state(tx, p, mesh, params_per_device=True, sync=sync)
    step = parallel.train_step(loss_fn, tx, mesh, params_per_device=True, sync=sync)
    history = []
    for _ in range(steps):
        p, state, _ = step(p, state, batch)
        history.append(jax.tree.map(np.asarray, p))
    return history, step, p, state, batch


def test_hand_written_loop_with_the_one_line():
    tx, sync = optax.sgd(0.1), gradcomm.periodic_average("data", every=K)
    mesh = mesh_of(N)
    params, batch = problem()
    got = hand_written_sync_loop(tx, sync, loss_fn, params, batch, mesh, STEPS)
    expected = train(tx, sync)[0][-1]
    jax.tree.map(np.testing.assert_array_equal, got, expected)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16])
def test_average_params_is_the_mean_the_same_bits_on_every_device(n, dtype):
    rng = np.random.default_rng(n)
    rows = (rng.standard_normal((n, 9)) * 10).astype(dtype)
    out = jax.vmap(lambda p: gradcomm.average_params(p, "d"), axis_name="d")(rows)
    out = np.asarray(out).astype(np.float64)
    assert (out == out[:1]).all()
    reference = np.asarray(rows).astype(np.float64).mean(0)
    tol = {np.float32: 1e-6, np.float16: 2e-3}.get(dtype, 1e-2)
    np.testing.assert_allclose(out[0], reference, rtol=tol, atol=tol)


def test_wire_names_the_sync_average():
    _, step, p, state, batch = train(optax.sgd(0.1), gradcomm.periodic_average("data", every=5))
    alone = train(optax.sgd(0.1), steps=1)  # what runs between averages: the loss's mean
    report = wire.measure(step, p, state, batch)
    steady = wire.measure(alone[1], alone[2], alone[3], alone[4]).total
    mean_bytes = 2 * (N - 1) / N * 6 * 4  # one all-reduce of the 6 params
    assert report.steady == steady and report.period == 5
    assert report.average == pytest.approx(steady + mean_bytes / 5, rel=1e-12)


def test_sync_composes_with_multisteps():
    # The sync runs outside the wrapper, on the params, so MultiSteps' skipped steps count.
    tx = optax.MultiSteps(
        optax.chain(
            gradcomm.gradient_dropping("data", drop_ratio=0.5, local="compensated", warmup_steps=0),
            optax.sgd(0.1),
        ),
        every_k_schedule=2,
    )
    history, *_ = train(tx, gradcomm.periodic_average("data", every=4), steps=4)
    equal = [
        all(np.array_equal(x, x[:1].repeat(N, 0)) for x in jax.tree.leaves(p)) for p in history
    ]
    # Step 1 accumulates (params unchanged), step 2 applies each device's own step, step 4
    # applies and averages.
    assert equal == [True, False, False, True]


def test_errors_say_what_to_do():
    mesh = mesh_of(N)
    params, batch = problem()
    sync = gradcomm.periodic_average("data", every=2)
    with pytest.raises(ValueError, match="params_per_device=True"):
        parallel.train_step(loss_fn, optax.sgd(0.1), mesh, sync=sync)
    with pytest.raises(ValueError, match="ParamsSync"):
        parallel.train_step(loss_fn, optax.sgd(0.1), mesh, params_per_device=True, sync=2)
    with pytest.raises(ValueError, match="every must be a positive int"):
        gradcomm.periodic_average("data", every=0)
    p = parallel.per_device(params, mesh)
    plain = parallel.init_state(optax.sgd(0.1), p, mesh, params_per_device=True)
    synced = parallel.init_state(optax.sgd(0.1), p, mesh, params_per_device=True, sync=sync)
    assert isinstance(synced, parallel.TrainState)
    with_sync = parallel.train_step(
        loss_fn, optax.sgd(0.1), mesh, params_per_device=True, sync=sync
    )
    without = parallel.train_step(loss_fn, optax.sgd(0.1), mesh, params_per_device=True)
    with pytest.raises(ValueError, match="TrainState of init_state"):
        with_sync(p, plain, batch)
    with pytest.raises(ValueError, match="build the step with the same sync"):
        without(p, synced, batch)
    with pytest.raises(ValueError, match="floating"):
        jax.vmap(functools.partial(gradcomm.average_params, axis_name="d"), axis_name="d")(
            jnp.ones((2, 3), jnp.int32)
        )


@pytest.mark.parametrize("context", ["pmap", "vmap"])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_local_sgd_in_pmap_and_vmap_matches_a_float64_reference(context, n):
    """Two SGD steps with local_sgd(every=2): own steps, then the exact mean, every row
    the same bits; one device keeps its own params."""
    tx, sync = optax.sgd(0.5), gradcomm.local_sgd("data", every=2)
    rng = np.random.default_rng(n)
    p0 = rng.standard_normal((n, 3)).astype(np.float32)
    grads = rng.standard_normal((2, n, 3)).astype(np.float32)

    def run(p, g):
        opt, state = tx.init(p), sync.init(p)
        for t in range(2):
            updates, opt = tx.update(g[t], opt, p)
            p, state = sync.update(optax.apply_updates(p, updates), state)
        return p

    mapped = (  # the vmap jitted: one compilation instead of one per operation
        jax.pmap(run, axis_name="data")
        if context == "pmap"
        else jax.jit(jax.vmap(run, axis_name="data"))
    )
    got = np.asarray(mapped(p0, np.swapaxes(grads, 0, 1)))
    stepped = p0.astype(np.float64) - 0.5 * grads.astype(np.float64).sum(0)
    np.testing.assert_allclose(got, np.broadcast_to(stepped.mean(0), got.shape), rtol=1e-6)
    assert (got == got[:1]).all()


# `factory(axis, every=...)`: the plain syncs, Streaming DiLoCo (2 fragments, E3M0, a delay)
# and DiLoCo's eager updates (per-device anchor and outer state). The steps' trace count
# skips Streaming DiLoCo: its state's layout is eager's, without the per-device leaves.
FACTORIES = {
    "local_sgd": gradcomm.local_sgd,
    "periodic_average": gradcomm.periodic_average,
    "streaming_diloco": gradcomm.streaming_diloco,
    "diloco_eager": functools.partial(gradcomm.diloco, eager=True),
}


@pytest.mark.parametrize("factory", FACTORIES.values(), ids=FACTORIES)
def test_a_sync_chained_as_a_transformation_says_where_it_goes(factory):
    tx = optax.chain(optax.sgd(0.1), factory("data", every=2))
    params = {"a": jnp.zeros((1, 3)), "b": jnp.zeros((1, 2))}  # two layers: two fragments
    with pytest.raises(ValueError, match=r"not an optax transformation.*sync=\.\.\."):
        jax.vmap(lambda p: tx.update(p, tx.init(p), p), axis_name="data")(params)


@pytest.mark.parametrize(
    "factory",
    [f for k, f in FACTORIES.items() if k != "streaming_diloco"],
    ids=[k for k in FACTORIES if k != "streaming_diloco"],
)
def test_steps_with_a_sync_trace_once(factory):
    traces = []

    def counting_loss(params, batch):
        traces.append(1)  # runs when the step is traced, never when it runs compiled
        return loss_fn(params, batch)

    mesh, (params, batch) = mesh_of(N), problem()
    sync, tx = factory("data", every=2), optax.sgd(0.1)
    p = parallel.per_device(params, mesh)
    state = parallel.init_state(tx, p, mesh, params_per_device=True, sync=sync)
    step = parallel.train_step(counting_loss, tx, mesh, params_per_device=True, sync=sync)
    for _ in range(4):  # averaging and plain steps alike
        p, state, _ = step(p, state, batch)
        jax.block_until_ready(p)
    assert len(traces) == 1


# A tensor-parallel mesh (issue 27): params sharded over 'model' by rows and by columns,
# beside one replicated over it, each data device with its own copy.
TP_SPECS = {"w": P("model", None), "c": P(None, "model"), "b": P()}
TP_SHAPES = {"w": (8, 6), "c": (5, 4), "b": (6,)}


@functools.cache
def tp_meshes():
    """The (data 4, model 2) mesh, and the 1-D mesh of its 4 data devices."""
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    two = jax.make_mesh((4, 2), ("data", "model"), axis_types=explicit)
    one = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=explicit[:1])
    return two, one


def tp_run(sync, mesh, specs, steps=4, seed=0):
    """`steps` of per-device SGD on random gradients, each followed by `sync.update`
    (`sync=None`: `average_params` on every step), in a hand-written `shard_map` loop;
    the params after each step, (steps, data device, ...)."""
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in TP_SHAPES.items()}
    grads = {k: rng.standard_normal((steps, 4, *s)) for k, s in TP_SHAPES.items()}
    grads = {k: g.astype(np.float32) for k, g in grads.items()}
    param_specs = {k: P("data", *specs[k]) for k in params}
    grad_specs = {k: P(None, "data", *specs[k]) for k in params}

    def loop(p, g):
        p = {k: x[0] for k, x in p.items()}

        def step(carry, gt):  # in a lax.scan: the step compiles once
            p, state = carry
            p = {k: p[k] - np.float32(0.1) * gt[k][0] for k in p}
            if sync:
                p, state = sync.update(p, state)
            else:
                p = gradcomm.average_params(p, "data")
            return (p, state), {k: x[None] for k, x in p.items()}

        return scan_steps(step, (p, sync.init(p) if sync else None), g)[1]

    fn = jax.jit(
        jax.shard_map(loop, mesh=mesh, in_specs=(param_specs, grad_specs), out_specs=grad_specs)
    )
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    per_device = {k: np.broadcast_to(v, (4, *v.shape)) for k, v in params.items()}
    placed = jax.tree.map(put, (per_device, grads), (param_specs, grad_specs))
    return jax.tree.map(np.asarray, fn(*placed))


@pytest.mark.parametrize("factory", [None, gradcomm.periodic_average, gradcomm.local_sgd])
def test_params_sharded_over_a_model_axis(factory):
    """On a (data 4, model 2) mesh, params sharded over 'model' beside one replicated over
    it: each leaf keeps its type (the replicated one leaves the map as replicated over
    'model') and the params are the bits of the whole tensors on the 4 data devices."""
    two, one = tp_meshes()
    sync = factory("data", every=2) if factory else None
    got = tp_run(sync, two, TP_SPECS)
    want = tp_run(sync, one, {k: P() for k in TP_SPECS})
    for k in TP_SHAPES:
        np.testing.assert_array_equal(got[k], want[k])
        synced = got[k][1::2] if factory else got[k]
        assert (synced == synced[:, :1]).all()  # averaged: the same on every data device
        if factory:
            assert not (got[k][0] == got[k][0, :1]).all()  # between averages, their own


def test_streaming_diloco_on_params_sharded_over_a_model_axis():
    """Streaming DiLoCo with two fragments (which train_step cannot lay out over 'model',
    test_sharded.py) in bfloat16, whose rounding is entry by entry: each piece of a split
    leaf gets the whole tensor's bits. (Eager updates over 'model': test_sharded.py's
    train_step run.)"""
    two, one = tp_meshes()

    def sync():
        return gradcomm.streaming_diloco(
            "data", every=2, fragments=2, delay=0, outer_dtype="bfloat16"
        )

    got = tp_run(sync(), two, TP_SPECS)
    want = tp_run(sync(), one, {k: P() for k in TP_SPECS})
    for k in TP_SHAPES:
        np.testing.assert_array_equal(got[k], want[k])
    # Fragment 0 ("b", "w") took its outer step after step 1, fragment 1 ("c") after 2:
    # then the same on every data device, before it each device's own.
    assert (got["w"][0] == got["w"][0, :1]).all() and (got["c"][1] == got["c"][1, :1]).all()
    assert not (got["c"][0] == got["c"][0, :1]).all()


def test_e3m0_on_params_sharded_over_a_model_axis_says_what_to_do():
    """E3M0's scales are per slice of the whole flattened leaf, which no device of a split
    leaf holds: a ValueError that names the outer dtypes that work."""
    two, _ = tp_meshes()
    with pytest.raises(ValueError, match=r"split over mesh axes \('model',\).*'bfloat16'"):
        tp_run(gradcomm.streaming_diloco("data", every=2, fragments=1), two, TP_SPECS)


def test_streaming_diloco_composes_with_multisteps():
    """The sync counts its own calls, MultiSteps' accumulating ones too: fragment 0 (the
    leaf "b") syncs after call 2, fragment 1 ("w") after call 4, whatever MultiSteps did."""
    tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    sync = gradcomm.streaming_diloco("data", every=4, fragments=2, delay=0, outer_dtype="float32")
    history, *_ = train(tx, sync, steps=4)
    equal = [
        {k: bool(np.array_equal(x, x[:1].repeat(N, 0))) for k, x in p.items()} for p in history
    ]
    # Call 1 accumulates; call 2 steps each device, then syncs "b"; call 3 accumulates;
    # call 4 steps, then syncs "w".
    assert [e["b"] for e in equal] == [True, True, True, False]
    assert [e["w"] for e in equal] == [True, False, False, True]
