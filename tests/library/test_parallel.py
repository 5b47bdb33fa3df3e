"""gradcomm.parallel: meshes, placement, per-device state and the sharded train step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_of
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel


def linear_loss(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)


def make_problem(seed=0, size=64):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((size, 5)).astype(np.float32)
    batch = {"x": x, "y": (x @ rng.standard_normal(5)).astype(np.float32)}
    params = {"w": np.zeros(5, np.float32), "b": np.zeros((), np.float32)}
    return params, batch


def test_make_mesh_shapes_and_errors():
    mesh = parallel.make_mesh()
    assert mesh.axis_names == ("data",) and mesh.size == 8
    mesh2 = parallel.make_mesh({"node": 4, "local": 2})
    assert dict(mesh2.shape) == {"node": 4, "local": 2}
    assert parallel.device_spec(mesh2) == P(("node", "local"))
    assert parallel.num_shards(mesh2) == 8 and parallel.num_shards(mesh2, "node") == 4
    with pytest.raises(ValueError, match="hold 6 devices"):
        parallel.make_mesh({"data": 6})
    with pytest.raises(ValueError, match="positive integer"):
        parallel.make_mesh({"data": 0}, devices=[])
    with pytest.raises(ValueError, match="not in the mesh"):
        parallel.num_shards(mesh, "model")


def test_placement_helpers():
    mesh = mesh_of(4)
    params, batch = make_problem()
    rep = parallel.replicate(params, mesh)
    assert rep["w"].sharding.spec == P() and rep["w"].shape == (5,)
    copies = parallel.per_device(params, mesh)
    assert copies["w"].shape == (4, 5) and copies["b"].shape == (4,)
    np.testing.assert_array_equal(parallel.host_copy(copies, per_device=True)["w"], params["w"])
    sharded = parallel.shard_batch(batch, mesh)
    assert sharded["x"].shape == (64, 5)
    assert [s.data.shape for s in sharded["x"].addressable_shards] == [(16, 5)] * 4
    with pytest.raises(ValueError, match="divisible by the 4 devices"):
        parallel.shard_batch({"x": np.ones((6, 2))}, mesh)


def test_state_is_per_device_only_where_the_method_makes_it_differ():
    """Adam after Adasum sees each device's gradient: its moments live per device.

    Adam after an all-reduce sees the same gradient everywhere: its state is replicated.
    Step counters never differ.
    """
    mesh = mesh_of(8)
    params = make_problem()[0]
    adasum_after = parallel.init_state(
        optax.chain(optax.adam(1e-3), gradcomm.adasum()), params, mesh
    )
    assert adasum_after[0][0].mu["w"].shape == (8, 5)
    assert adasum_after[0][0].mu["w"].sharding.spec[0] == "data"
    assert adasum_after[0][0].count.shape == () and adasum_after[1] == gradcomm.AdasumState()
    allreduce_first = parallel.init_state(
        optax.chain(gradcomm.allreduce(), optax.adam(1e-3)), params, mesh
    )
    assert allreduce_first[1][0].mu["w"].shape == (5,)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(allreduce_first))


def test_allreduce_step_equals_large_batch_sgd():
    """Equal shards and a mean loss: averaging the devices' gradients is the full-batch one."""
    mesh = mesh_of(8)
    params, batch = make_problem()
    tx = optax.chain(gradcomm.allreduce(), optax.sgd(0.1))
    state = parallel.init_state(tx, params, mesh)
    step = parallel.train_step(linear_loss, tx, mesh)
    p_ref = jax.tree.map(jnp.asarray, params)
    p = parallel.replicate(params, mesh)
    reference_grad = jax.jit(jax.value_and_grad(linear_loss))  # compiled once
    for _ in range(5):
        p, state, metrics = step(p, state, batch)
        loss, grads = reference_grad(p_ref, batch)
        p_ref = jax.tree.map(lambda w, g: w - 0.1 * g, p_ref, grads)
        np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p, p_ref)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_two_d_mesh_hierarchical_adasum_trains(axis_type):
    mesh = parallel.make_mesh({"node": 4, "local": 2}, axis_types=axis_type)
    params, batch = make_problem(1)
    tx = optax.chain(optax.sgd(0.1), gradcomm.adasum("node", local_axis="local"))
    state = parallel.init_state(tx, params, mesh)
    step = parallel.train_step(linear_loss, tx, mesh)
    p = parallel.replicate(params, mesh)
    first = None
    for _ in range(30):
        p, state, metrics = step(p, state, batch)
        first = first if first is not None else float(metrics["loss"])
    assert float(metrics["loss"]) < 0.1 * first


def test_replicated_params_that_diverge_raise_a_clear_error():
    mesh = mesh_of(4)
    params, batch = make_problem()
    tx = optax.sgd(0.1)  # nothing synchronises the devices
    state = parallel.init_state(tx, params, mesh)
    step = parallel.train_step(linear_loss, tx, mesh)
    with pytest.raises(ValueError, match="params_per_device=True"):
        step(parallel.replicate(params, mesh), state, batch)


def test_per_device_params_diverge_and_per_device_metrics_need_no_collective():
    mesh = mesh_of(4)
    params, batch = make_problem()
    tx = optax.sgd(0.1)
    copies = parallel.per_device(params, mesh)
    state = parallel.init_state(tx, copies, mesh, params_per_device=True)
    steps = {
        kind: parallel.train_step(linear_loss, tx, mesh, params_per_device=True, metrics=kind)
        for kind in ("mean", "per_device")
    }
    sent = {k: gradcomm.wire.measure(s, copies, state, batch).total for k, s in steps.items()}
    assert sent["per_device"] == 0 < sent["mean"]
    _, _, mean = steps["mean"](copies, state, batch)
    stepped, _, own = steps["per_device"](copies, state, batch)
    w = np.asarray(stepped["w"])
    assert w.shape == (4, 5) and not np.allclose(w[0], w[1])
    shards = [{k: v[i * 16 : (i + 1) * 16] for k, v in batch.items()} for i in range(4)]
    expected = [linear_loss(params, b) for b in shards]  # each device's own loss
    np.testing.assert_allclose(own["loss"], expected, rtol=1e-6)
    np.testing.assert_allclose(mean["loss"], np.mean(expected), rtol=1e-6)
    with pytest.raises(ValueError, match="metrics must be one of"):
        parallel.train_step(linear_loss, tx, mesh, metrics="sum")


def test_aux_metrics_and_no_retracing():
    mesh = mesh_of(2)
    params, batch = make_problem()
    traces = []

    def loss_with_aux(p, b):
        traces.append(1)
        loss = linear_loss(p, b)
        return loss, {"twice": 2 * loss}

    tx = optax.chain(gradcomm.allreduce(), optax.sgd(0.1))
    step = parallel.train_step(loss_with_aux, tx, mesh, has_aux=True, donate=True)
    p = parallel.replicate(params, mesh)
    state = parallel.init_state(tx, params, mesh)
    for _ in range(3):
        p, state, metrics = step(p, state, batch)
    np.testing.assert_allclose(metrics["twice"], 2 * metrics["loss"], rtol=1e-6)
    assert len(traces) == 1


def test_the_transformation_sees_each_devices_own_gradient():
    """With replicated params, JAX would sum the gradient itself; the step must not."""
    import reference

    mesh = mesh_of(4)
    params, batch = make_problem(2, size=16)
    tx = optax.chain(gradcomm.adasum(), optax.sgd(1.0))
    step = parallel.train_step(linear_loss, tx, mesh)
    state = parallel.init_state(tx, params, mesh)
    new, _, _ = step(parallel.replicate(params, mesh), state, batch)
    shards = [jax.tree.map(lambda x, i=i: x[4 * i : 4 * i + 4], batch) for i in range(4)]
    grads = [jax.grad(linear_loss)(params, b) for b in shards]
    for leaf in ("w", "b"):
        expected = -reference.adasum([np.asarray(g[leaf], np.float64) for g in grads])
        np.testing.assert_allclose(new[leaf], expected, rtol=1e-5, atol=1e-6)


def norm_loss(params, batch):
    """A loss that takes params of any shape: per-device copies read as replicated or FSDP."""
    return sum(jnp.sum(x**2) for x in jax.tree.leaves(params)) * jnp.mean(batch)


def test_state_laid_out_for_the_other_params_per_device_raises():
    """A state built with one params_per_device and stepped with the other names the flag.

    Per-device copies given as host arrays read as replicated params whose leading axis is
    the device axis: without the flag, Adam's moments come out (4, 4, 3), not (4, 3).
    """
    mesh = mesh_of(4)
    tx = optax.chain(optax.adam(0.1), gradcomm.sgp("data"))
    copies = parallel.per_device({"w": np.ones(3, np.float32)}, mesh)
    host = jax.tree.map(np.asarray, copies)
    batch = np.ones(8, np.float32)
    built_without = parallel.init_state(tx, host, mesh)
    assert built_without[0][0].mu["w"].shape == (4, 4, 3)
    step = parallel.train_step(norm_loss, tx, mesh, params_per_device=True)
    fix = r"init_state\(tx, params, mesh, params_per_device=True\)"
    with pytest.raises(ValueError, match=rf"laid out for params_per_device=False.*{fix}"):
        step(copies, built_without, batch)
    built_with = parallel.init_state(tx, copies, mesh, params_per_device=True)
    step(copies, built_with, batch)  # the state the step takes
    fix = r"init_state\(tx, params, mesh, params_per_device=False\)"
    with pytest.raises(ValueError, match=rf"laid out for params_per_device=True.*{fix}"):
        parallel.train_step(norm_loss, tx, mesh)(host, built_with, batch)


def test_per_device_copies_without_the_flag_name_it():
    """Placed per-device copies read as FSDP-split params without params_per_device=True;
    where a method cannot take them so, the error says which flag they need. Replicated
    params given to a per-device init say the flag's other value."""
    mesh = mesh_of(4)
    copies = parallel.per_device({"w": np.ones(3, np.float32)}, mesh)
    tx = optax.chain(optax.adam(0.1), gradcomm.sgp("data"))
    state = parallel.init_state(tx, copies, mesh, params_per_device=True)
    step = parallel.train_step(norm_loss, tx, mesh)
    with pytest.raises(ValueError, match=r"per-device copies .* params_per_device=True"):
        step(copies, state, np.ones(8, np.float32))
    with pytest.raises(ValueError, match=r"per-device copies .* params_per_device=True"):
        parallel.init_state(gradcomm.powersgd("data"), copies, mesh)
    with pytest.raises(ValueError, match="replicated params with params_per_device=False"):
        parallel.init_state(tx, {"w": np.ones(3, np.float32)}, mesh, params_per_device=True)


def test_an_unbound_axis_names_the_bound_ones():
    """A method whose axis name the map does not bind says which axes are bound."""
    mesh = mesh_of(2)
    params = {"w": np.zeros(3, np.float32)}
    tx = gradcomm.allreduce("batch")
    step = parallel.train_step(norm_loss, tx, mesh, axes="data")
    bound = r"axis 'batch' is not bound here; the axes bound here are \('data',\)"
    factory = r"data axis name to the gradcomm method's factory"
    with pytest.raises(ValueError, match=rf"{bound}.*{factory}"):
        step(parallel.replicate(params, mesh), tx.init(params), np.ones(4, np.float32))
    with pytest.raises(ValueError, match=bound):
        parallel.init_state(tx, params, mesh)

    def update(g):
        return tx.update(g, tx.init(g))[0]

    with pytest.raises(ValueError, match=r"the axes bound here are \('v',\)"):
        jax.vmap(update, axis_name="v")(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"the axes bound here are \('p',\)"):
        jax.pmap(update, axis_name="p", devices=jax.devices()[:2])(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="not bound here, and no axis is"):
        update(jnp.ones(3))
    # A shard_map over some mesh axes: the others are named as not mapped.
    model = gradcomm.allreduce("model")
    two = parallel.make_mesh({"data": 2, "model": 2}, devices=jax.devices()[:4])
    mapped = jax.shard_map(
        jax.vmap(lambda g: model.update(g, model.init(g))[0], axis_name="v"), mesh=two,
        in_specs=P("data"), out_specs=P("data"), axis_names={"data"},
    )  # fmt: skip
    x = jax.device_put(jnp.ones((2, 2, 3)), jax.NamedSharding(two, P("data")))
    with pytest.raises(ValueError, match=r"bound here are \('data', 'v'\) .*\['model'\]"):
        jax.jit(mapped)(x)
