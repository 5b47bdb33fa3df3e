"""SGP and D-PSGD: PushSum invariants, exact averaging, overlap, baselines."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import mesh_of, model_bytes, per_device, wire_against_psum
from jax import lax

import gradcomm
from gradcomm import _flat, parallel, topology


@functools.cache
def gossip_fn(steps, **kwargs):
    """`steps` SGP steps with zero updates from this device's params: z, w and x in flight."""

    def f(z):
        tx = gradcomm.sgp("data", **kwargs)
        state = jax.tree.map(lambda v: lax.pcast(v, "data", to="varying"), tx.init(z))

        def body(carry, _):
            z, state = carry
            delta, state = tx.update(jnp.zeros_like(z), state, z)
            z = z + delta
            if kwargs.get("overlap"):  # the slots' flat buffers, summed, as params
                summed = [sum(xs) for xs in zip(*state.in_flight, strict=True)]
                flight = _flat.FlatBuffers.of(z).unpack(summed)
                flight_w = jnp.sum(state.in_flight_weight)
            else:  # nothing in flight: the state holds no in-flight arrays
                flight, flight_w = jnp.zeros_like(z), jnp.zeros([], state.weight.dtype)
            return (z, state), (z, state.weight, flight, flight_w)

        _, history = lax.scan(body, (z, state), None, length=steps)
        return history

    return f


def initial(n, size=5, seed=0):
    return np.random.default_rng(seed).standard_normal((n, size)).astype(np.float32)


@pytest.mark.parametrize("name", ["exponential", "exponential-2peer", "ring"])
@pytest.mark.parametrize("overlap", [0, 1, 2])
def test_push_sum_conserves_mass(name, overlap):
    """Zero updates: sum_i w_i z_i and sum_i w_i never change (counting what is in flight)."""
    n = 6
    z0 = initial(n)
    z, w, flight, flight_w = per_device(gossip_fn(12, topology=name, overlap=overlap), n, z0)
    # per_device returns (n, steps, ...): device-major.
    mass = np.sum(w[..., None] * z + flight, axis=0)  # (steps, size)
    weight = np.sum(w + flight_w, axis=0)
    np.testing.assert_allclose(mass, np.broadcast_to(z0.sum(0), mass.shape), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(weight, n, rtol=1e-6)
    if overlap == 0:  # nothing in flight: the held mass itself is conserved
        np.testing.assert_array_equal(flight, 0)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_one_peer_exponential_averages_exactly_in_log2_n_steps(n):
    z0 = initial(n, seed=n)
    steps = n.bit_length() - 1
    z, w, _, _ = per_device(gossip_fn(steps), n, z0)
    for i in range(n):
        np.testing.assert_allclose(z[i, -1], z0.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(w, 1)  # circulant and regular: doubly stochastic


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_one_peer_exponential_converges_geometrically(n):
    z0 = initial(n, seed=n)
    m = (n - 1).bit_length()
    cycles = 8
    z, _, _, _ = per_device(gossip_fn(m * cycles), n, z0)
    deviation = [np.abs(z[:, m * (c + 1) - 1] - z0.mean(0)).max() for c in range(cycles)]
    start = np.abs(z0 - z0.mean(0)).max()
    ratios = np.array(deviation[1:]) / np.array(deviation[:-1])
    assert np.all(ratios < 0.9), ratios  # at least a constant factor per cycle
    assert deviation[-1] < 1e-2 * start


@pytest.mark.parametrize("overlap", [1, 2])
def test_overlap_converges_to_the_average_and_the_biased_variant_does_not(overlap):
    n = 4
    z0 = initial(n, seed=1) + 3  # a nonzero mean, so losing mass shows
    z, w, _, _ = per_device(gossip_fn(200, overlap=overlap), n, z0)
    for i in range(n):
        np.testing.assert_allclose(z[i, -1], z0.mean(0), rtol=1e-5)
    assert not np.allclose(w[:, -1], 1)  # the weights moved: mass is in flight
    zb, _, _, _ = per_device(gossip_fn(200, overlap=overlap, biased=True), n, z0)
    assert np.abs(zb[:, -1] - z0.mean(0)).max() > 0.1  # ignoring w loses the mass in flight
    np.testing.assert_allclose(zb[:, -1], np.broadcast_to(zb[0, -1], zb[:, -1].shape), rtol=1e-5)


def linear_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def problem(seed, size=48):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((size, 4)).astype(np.float32)
    return {"w": np.zeros(4, np.float32)}, {
        "x": x,
        "y": x @ rng.standard_normal(4).astype(np.float32),
    }


def run(tx, n, steps, per_device_params=True, seed=0):
    mesh = mesh_of(n)
    params, batch = problem(seed)
    place = parallel.per_device if per_device_params else parallel.replicate
    p = place(params, mesh)
    state = parallel.init_state(tx, p, mesh, params_per_device=per_device_params)
    step = parallel.train_step(linear_loss, tx, mesh, params_per_device=per_device_params)
    history = []
    for _ in range(steps):
        p, state, _ = step(p, state, batch)
        history.append(np.asarray(p["w"]))
    return np.stack(history), state


def test_complete_graph_reproduces_allreduce_sgd_over_20_steps():
    n = 4
    gossip, _ = run(optax.chain(optax.sgd(0.05), gradcomm.sgp("data", topology="complete")), n, 20)
    dense, _ = run(optax.chain(gradcomm.allreduce("data"), optax.sgd(0.05)), n, 20, False)
    for i in range(n):
        np.testing.assert_allclose(gossip[:, i], dense, rtol=1e-5, atol=1e-6)


def test_two_devices_match_large_batch_sgd():
    params, batch = problem(0)
    gossip, _ = run(optax.chain(optax.sgd(0.05), gradcomm.sgp("data")), 2, 5)
    w = jnp.asarray(params["w"])
    grad = jax.jit(jax.grad(lambda v: linear_loss({"w": v}, batch)))  # compiled once
    for t in range(5):
        w = w - 0.05 * grad(w)
        np.testing.assert_allclose(gossip[t, 0], w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gossip[t, 1], w, rtol=1e-5, atol=1e-6)


def test_dpsgd_keeps_weights_at_one_and_conserves_the_average():
    n = 6
    tx = optax.chain(optax.sgd(0.05), gradcomm.dpsgd("data"))
    _, state = run(tx, n, 6)
    assert set(state[1]._fields) == {"count"}  # no weight to keep: it is 1 by design
    graph = topology.resolve("exponential-bidirectional", n)
    assert graph.is_doubly_stochastic() and graph.is_symmetric()
    # the same mixing in SGP keeps w = 1 (to rounding)
    _, w, _, _ = per_device(gossip_fn(6, topology="exponential-bidirectional"), n, initial(n))
    np.testing.assert_allclose(w, 1, rtol=1e-6)
    with pytest.raises(ValueError, match="symmetric"):
        bad = gradcomm.dpsgd("data", topology="exponential")
        jax.vmap(lambda p: bad.update(p, bad.init(p), p), axis_name="data")(jnp.ones((4, 2)))


def test_allreduce_steps_average_exactly_first():
    n = 5
    z0 = initial(n, seed=3)
    z, _, _, _ = per_device(gossip_fn(3, allreduce_steps=1), n, z0)
    for i in range(n):
        np.testing.assert_allclose(z[i, 0], z0.mean(0), rtol=1e-6, atol=1e-6)


def test_allreduce_steps_with_overlap_through_train_step():
    """Its exact and gossip branches type the in-flight message differently; init_state
    used to fail on that cond. After the exact steps every device holds the same params."""
    mesh = mesh_of(4)
    tx = optax.chain(optax.sgd(0.1), gradcomm.sgp("data", allreduce_steps=2, overlap=1))
    params = parallel.per_device({"w": np.ones((3, 2), np.float32)}, mesh)
    state = parallel.init_state(tx, params, mesh, params_per_device=True)
    step = parallel.train_step(
        lambda p, b: jnp.sum((b @ p["w"]) ** 2), tx, mesh, params_per_device=True
    )
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    batch = parallel.shard_batch(x, mesh)
    for _ in range(2):
        params, state, metrics = step(params, state, batch)
        jax.block_until_ready(metrics)
    w = np.asarray(params["w"])
    np.testing.assert_allclose(w, np.broadcast_to(w.mean(0), w.shape), rtol=1e-6)
    params, state, metrics = step(params, state, batch)
    assert np.isfinite(np.asarray(params["w"])).all()


def test_state_errors_and_arguments():
    for kwargs, match in [
        ({"topology": "star"}, "unknown topology"),
        ({"overlap": -1}, "overlap"),
        ({"allreduce_steps": -2}, "allreduce_steps must be a non-negative int, got -2"),
        ({"allreduce_steps": True}, "allreduce_steps must be a non-negative int"),
        ({"allreduce_steps": 1.5}, "allreduce_steps must be a non-negative int"),
        ({"topology": 3}, "topology"),
    ]:
        with pytest.raises(ValueError, match=match):
            gradcomm.sgp("data", **kwargs)
    gradcomm.sgp("data", allreduce_steps=np.int64(2))  # any int, as every int argument
    tx = gradcomm.sgp("data", overlap=2)
    state = tx.init({"w": jnp.ones(3)})
    assert [[x.shape for x in slot] for slot in state.in_flight] == [[(3,)], [(3,)]]  # packed
    assert state.in_flight_weight.shape == (2,)
    state = gradcomm.sgp("data").init({"w": jnp.ones(3)})
    assert state.in_flight == () and state.in_flight_weight == ()  # no zero-size arrays
    with pytest.raises(ValueError, match="needs params"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="needs params"):
        d = gradcomm.dpsgd("data")
        jax.vmap(lambda g: d.update(g, d.init(g)), axis_name="data")(jnp.ones((2, 3)))


def first_step_in_flight(z):
    tx = gradcomm.sgp("data", overlap=2)
    state = jax.tree.map(lambda v: lax.pcast(v, "data", to="varying"), tx.init(z))
    _, state = tx.update(jax.tree.map(jnp.zeros_like, z), state, z)
    return state.in_flight


def test_in_flight_messages_stay_packed_per_dtype():
    """The state keeps each slot as the flat buffers it travelled as, one per dtype: after
    one step of the exponential graph (i -> i + 1) slot 1 holds half the in-peer's x."""
    n = 4
    rng = np.random.default_rng(5)
    z = {
        "w": rng.standard_normal((n, 3, 2)).astype(np.float32),
        "h": rng.standard_normal((n, 5)).astype(ml_dtypes.bfloat16),
        "b": rng.standard_normal((n, 4)).astype(np.float32),
    }
    slots = per_device(first_step_in_flight, n, z)
    flat = _flat.FlatBuffers.of(jax.tree.map(lambda x: x[0], z))
    sizes = [layout.padded_size for layout in flat.layouts]
    packed = [((n, size), dtype) for size, dtype in zip(sizes, flat.dtypes, strict=True)]
    assert [[(x.shape, x.dtype) for x in slot] for slot in slots] == [packed, packed]
    sent = {k: np.roll(v, 1, axis=0) / 2 for k, v in z.items()}  # device i - 1's share
    for i in range(n):
        assert not any(x[i].any() for x in slots[0])  # nothing was sent 2 steps ago
        received = flat.unpack([x[i] for x in slots[1]])
        jax.tree.map(np.testing.assert_array_equal, received, {k: v[i] for k, v in sent.items()})


def test_tree_map_params_leaves_the_packed_messages_alone():
    """The in-flight buffers are not params-shaped: `optax.tree_map_params` (which builds
    a state from leafless placeholder params) maps nothing in SGP's state and keeps it."""
    tx = optax.chain(optax.sgd(0.1, momentum=0.9), gradcomm.sgp("data", overlap=2))
    params = {"w": jnp.ones((2, 3)), "h": jnp.ones(4, jnp.bfloat16)}
    state = tx.init(params)
    mapped = optax.tree_map_params(tx, lambda leaf, p: leaf + p, state, params)
    jax.tree.map(np.testing.assert_array_equal, mapped[1], state[1])  # sgp's state as it was
    np.testing.assert_array_equal(mapped[0][0].trace["w"], params["w"])  # momentum: mapped
    empty = gradcomm.sgp("data", overlap=2).init({})  # nothing to send: a scalar per slot
    assert [np.shape(slot) for slot in empty.in_flight] == [(), ()]


def consensus_fn(z):
    return gradcomm.consensus_distance({"a": z, "b": 2 * z}, "data")


def test_consensus_distance():
    z = initial(4)
    got = per_device(consensus_fn, 4, z)
    expected = np.sqrt(5 * np.sum((z - z.mean(0)) ** 2, axis=1))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_wire_one_model_sized_permute_per_peer(n):
    """Bytes per device do not depend on N; at N = 8 about half a dense psum's."""
    tx = gradcomm.sgp("data")
    psum, report = wire_against_psum(lambda t: tx.update(t, tx.init(t), t)[0], n)
    permutes = [c for c in report.collectives if c.kind == "collective-permute"]
    assert len([c for c in permutes if c.payload > 1000]) == 1  # one fused message per peer
    assert model_bytes() <= report.total <= model_bytes() * 1.01 + 64  # padding and the weight
    if n == 8:
        assert 0.5 < report.total / psum < 0.6
