"""Pairwise exchanges, two-member replica groups: the same bits and bytes as the ppermutes.

The reference everywhere is the ppermute formulation on a one-axis mesh ("data", n) with
`exchange="permute"`; the pairwise runs use the same one-axis mesh ("axis") or the axis
factored into size-2 axes, `parallel.pairwise_axes("data", n)` (True, "factored").
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import reference
from helpers import mesh_of
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import _axes, _collectives, parallel, topology, wire
from gradcomm._flat import FlatLayout

SIZES = [2, 4, 8]


@functools.cache
def factored(n):
    """The mesh over the first n devices with the data axis factored into size-2 axes."""
    axes = parallel.pairwise_axes("data", n)
    return parallel.make_mesh(axes, devices=jax.devices()[:n]), tuple(axes)


def mesh_and_names(n, pairwise):
    """pairwise: False or "axis" (the one-axis mesh), True or "factored" (size-2 axes)."""
    return factored(n) if pairwise in (True, "factored") else (mesh_of(n), "data")


def _mapped(fn, n, pairwise, out_replicated):
    """`fn(local_tree, axis_name)` under shard_map; inputs carry a leading device axis."""
    mesh, names = mesh_and_names(n, pairwise)

    def body(*args):
        out = fn(*jax.tree.map(lambda x: x[0], args), names)
        return out if out_replicated else jax.tree.map(lambda x: x[None], out)

    out_specs = P() if out_replicated else P(names)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=out_specs))


def run(fn, n, pairwise, *trees, out_replicated=False):
    """Compiles once; returns the outputs as NumPy and the compiled program's HLO text."""
    mesh, names = mesh_and_names(n, pairwise)
    placed = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(names))), trees)
    program = _mapped(fn, n, pairwise, out_replicated).lower(*placed).compile()
    return jax.tree.map(np.asarray, program(*placed)), program.as_text()


def bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def assert_same_bits(a, b):
    """Bit for bit, except a NaN's sign and payload: those follow the operand order of the
    instruction that made it, which XLA's fusion may change between two programs."""

    def same(x, y):
        x, y = np.asarray(x), np.asarray(y)
        nan = np.isnan(x.astype(np.float32))
        np.testing.assert_array_equal(nan, np.isnan(y.astype(np.float32)))
        np.testing.assert_array_equal(bits(x)[~nan], bits(y)[~nan])

    jax.tree.map(same, a, b)


# --- the primitive -------------------------------------------------------------------------


def special_values(n, dtype):
    """Per-device rows with -0.0, NaN payloads, infinities, subnormals and random values."""
    width = np.dtype(dtype).itemsize * 8
    utype = np.dtype(f"u{width // 8}")
    rng = np.random.default_rng(width)
    x = rng.standard_normal((n, 16)).astype(dtype)
    raw = x.view(utype)
    raw[:, 0] = 1 << (width - 1)  # -0.0
    finfo = ml_dtypes.finfo(dtype)
    exponent = ((1 << (finfo.nexp)) - 1) << finfo.nmant  # all exponent bits set
    raw[:, 1] = exponent | 1  # a signalling-NaN payload
    raw[:, 2] = (1 << (width - 1)) | exponent | (1 << (finfo.nmant - 1)) | 5  # -NaN, payload
    raw[:, 3] = exponent  # +inf
    raw[:, 4] = 1  # the smallest subnormal
    raw[:, 5] = np.arange(n)  # differs per device
    return raw.view(dtype)


def exchange_fn(distance):
    return lambda x, names: _collectives.swap(x, names, distance)


EXCHANGE_FNS = {d: exchange_fn(d) for d in (1, 2, 4)}


@pytest.mark.parametrize("layout", ["factored", "axis"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_exchange_returns_the_partners_bits_in_one_two_member_reduce_scatter(n, dtype, layout):
    x = special_values(n, dtype)
    for level in range(n.bit_length() - 1):
        d = 1 << level
        out, text = run(EXCHANGE_FNS[d], n, layout, x)
        np.testing.assert_array_equal(bits(out), bits(x[[i ^ d for i in range(n)]]))
        [c] = wire.analyze_hlo(text).collectives
        # Sends the message's bytes once, like the ppermute: (2 - 1) / 2 of two slots.
        assert (c.kind, c.group_size, c.sent) == ("reduce-scatter", 2, x[0].nbytes)
        assert f"u{x.dtype.itemsize * 8}[" in text.split("reduce-scatter(")[0].rsplit("=", 1)[-1]


@pytest.mark.parametrize("layout", ["factored", "axis"])
def test_mode_selection(monkeypatch, layout):
    def probe(x, names):
        assert _axes.use_pairwise(names, "pairwise", "t")
        assert not _axes.use_pairwise(names, "permute", "t")
        # "auto": only where gloo carries the collectives, CPU devices in several processes.
        assert not _axes.use_pairwise(names, "auto", "t")
        with monkeypatch.context() as m:
            m.setattr(jax, "process_count", lambda: 2)
            assert _axes.use_pairwise(names, "auto", "t")
            m.setattr(_axes, "_platform", lambda: "gpu")
            assert not _axes.use_pairwise(names, "auto", "t")
        # Across processes a probe of the link (`parallel.calibrate`) decides "auto",
        # whatever the platform; within one process there is no link to probe.
        with monkeypatch.context() as m:
            m.setattr(_axes, "_PROBES", {})
            _axes.record_probe(_axes.link_key(), "pairwise")
            assert not _axes.use_pairwise(names, "auto", "t")  # one process
            m.setattr(jax, "process_count", lambda: 2)  # another link: no probe of it
            assert _axes.use_pairwise(names, "auto", "t")  # gloo's default
            _axes.record_probe(_axes.link_key(), "permute")
            assert not _axes.use_pairwise(names, "auto", "t")
            m.setattr(_axes, "_platform", lambda: "gpu")
            _axes.record_probe(_axes.link_key(), "pairwise")
            assert _axes.use_pairwise(names, "auto", "t")
        return x

    run(probe, 8, layout, np.zeros((8, 1), np.float32))

    def odd(x, names):
        assert not _axes.use_pairwise(names, "auto", "t")
        with pytest.raises(ValueError, match=r"power-of-two number of devices.*'permute'"):
            _axes.use_pairwise(names, "pairwise", "t")
        return x

    run(odd, 6, False, np.zeros((6, 1), np.float32))
    assert _collectives.pair_groups(8, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for bad in (3, 8):
        with pytest.raises(ValueError, match=f"no pairs of 8 devices {bad} apart"):
            _collectives.pair_groups(8, bad)


@pytest.mark.parametrize("name", sorted(topology.TOPOLOGIES))
def test_swap_distance_finds_exactly_the_xor_moves(name):
    for n in range(1, 17):
        if name == "hypercube" and n & (n - 1):
            continue
        for phase in topology.resolve(name, n).phases:
            for move in phase:
                xor = [d for d in range(1, n) if move == tuple(i ^ d for i in range(n))]
                expected = xor[0] if xor and xor[0] & (xor[0] - 1) == 0 else None
                assert topology.swap_distance(move) == expected, (name, n, move)
    assert topology.swap_distance((3, 2, 1, 0)) is None  # i ^ 3: pairwise, not one axis


def test_exchange_argument_is_checked_at_construction():
    for make in (gradcomm.adasum, gradcomm.sgp, gradcomm.dpsgd):
        with pytest.raises(ValueError, match="exchange must be one of"):
            make("data", exchange="swap")


def test_pairwise_axes():
    assert parallel.pairwise_axes("data", 8) == {"data0": 2, "data1": 2, "data2": 2}
    assert parallel.pairwise_axes("node", 2) == {"node0": 2}
    assert parallel.pairwise_axes("x", 1) == {"x0": 1}
    assert parallel.pairwise_axes() == {"data0": 2, "data1": 2, "data2": 2}  # all 8 devices
    for bad in (0, 6, 2.0, True):
        with pytest.raises(ValueError, match="power-of-two"):
            parallel.pairwise_axes("data", bad)
    mesh = parallel.make_mesh(parallel.pairwise_axes("data", 8))
    assert parallel.num_shards(mesh) == 8
    assert parallel.device_spec(mesh) == P(("data0", "data1", "data2"))
    assert list(mesh.devices.flat) == list(parallel.make_mesh().devices.flat)


# --- Adasum --------------------------------------------------------------------------------


def hard_tree(n, dtypes=(np.float32, ml_dtypes.bfloat16)):
    """The stability inputs of test_adasum, one leaf each, in one tree: a group of three
    leaves in each of `dtypes`, and the special float32 (and one bfloat16) leaves."""
    rng = np.random.default_rng(n)
    scale = rng.uniform(0.1, 10.0, size=(n, 1))
    tree = {
        np.dtype(dtype).name: {
            "w": (rng.standard_normal((n, 33, 9)) * scale[:, :, None]).astype(dtype),
            "b": (rng.standard_normal((n, 7)) * scale).astype(dtype),
            "s": rng.standard_normal(n).astype(dtype),
        }
        for dtype in dtypes
    }
    g = rng.standard_normal((n, 50))
    v = rng.standard_normal(40)
    c = np.array([2.0, -0.5, 3.0, 1.5, -1.0, 0.25, 4.0, -2.5])[:n]
    orthogonal = np.zeros((n, 4 * n), np.float32)
    for i in range(n):
        orthogonal[i, 4 * i : 4 * i + 4] = rng.standard_normal(4)
    tree["special"] = {
        "tiny": (g * 1e-30).astype(np.float32),
        "huge": (g * 1e30).astype(np.float32),
        "far_apart": (g * 10.0 ** rng.uniform(-30, 30, (n, 1))).astype(np.float32),
        "parallel": (c[:, None] * v).astype(np.float32),
        "orthogonal": orthogonal,
        "zero": np.zeros((n, 5), np.float32),
        "negative_zero": np.full((n, 5), -0.0, np.float32),
        "one_zero": np.where(np.arange(n)[:, None] == 1, 0, g[:, :9]).astype(np.float32),
        "nan": np.where((np.arange(n)[:, None] == n - 1) & (np.arange(6) == 2), np.nan, g[:, :6]),
        "inf": np.where((np.arange(n)[:, None] == 0) & (np.arange(6) == 3), -np.inf, g[:, :6]),
    }
    for name in ("nan", "inf"):
        tree["special"][name] = tree["special"][name].astype(np.float32)
    tree["special"]["nan_bf16"] = tree["special"]["nan"].astype(ml_dtypes.bfloat16)
    return tree


@functools.cache
def adasum_fn(exchange):
    return lambda tree, names: gradcomm.adasum_reduce(tree, names, exchange=exchange)


def test_adasum_pairwise_on_one_device_is_the_identity():
    tree = {"w": np.random.default_rng(0).standard_normal((1, 3, 4)).astype(np.float32)}
    out, text = run(adasum_fn("pairwise"), 1, True, tree, out_replicated=True)
    assert_same_bits(out, {"w": tree["w"][0]})
    assert wire.analyze_hlo(text).total == 0


# One pair on the one axis, and two levels of pairs factored into size-2 axes. Levels of
# pairs on the one axis are test_hierarchical_adasum_with_factored_node_axes's (4 nodes) and
# test_train_step_pairwise_matches_the_permutes's (4 devices), bit for bit too; the swaps of
# a third level (distance 4, on 8 devices, both layouts) are
# test_exchange_returns_the_partners_bits_in_one_two_member_reduce_scatter's.
@pytest.mark.parametrize(("n", "layout"), [(2, "axis"), (4, "factored")])
def test_adasum_pairwise_is_bit_identical_with_the_same_bytes_and_no_ppermute(n, layout):
    # Each dtype is a flat buffer of its own, which the compiler pays for. Factored, the
    # float32 and bfloat16 groups and the special leaves; on the one axis, the float32 and
    # the special leaves (a bfloat16 one among them). float16 travels as bfloat16 does, in
    # 2-byte words: its exchanges on either layout, bit for bit, and bfloat16's, are the
    # exchange test's above.
    dtypes = (np.float32, ml_dtypes.bfloat16) if layout == "factored" else (np.float32,)
    tree = hard_tree(n, dtypes)
    expected, permute_text = run(adasum_fn("permute"), n, False, tree, out_replicated=True)
    got, text = run(adasum_fn("pairwise"), n, layout, tree, out_replicated=True)
    assert_same_bits(got, expected)
    assert np.isnan(got["special"]["nan"]).all() and np.isnan(got["special"]["inf"]).all()
    assert "collective-permute" not in text
    permute, pairwise = wire.analyze_hlo(permute_text), wire.analyze_hlo(text)
    exchanges = [c for c in pairwise.collectives if c.kind == "reduce-scatter"]
    assert exchanges and all(c.group_size == 2 for c in exchanges)  # XLA may combine some
    # The swaps send (N-1)/N of each fused buffer, and so does the final gather.
    shapes = {}
    for x in jax.tree.leaves(tree):
        shapes.setdefault(np.dtype(x.dtype), []).append(x.shape[1:])
    buffers = sum(FlatLayout.of(s, rows=n).padded_size * d.itemsize for d, s in shapes.items())
    assert pairwise.by_kind()["reduce-scatter"] == 2 * (n - 1) / n * buffers
    # The ppermutes and the all-gather send as much, except that XLA's CPU compiler widens
    # bf16 ones to f32 (twice the bytes); the exchanges move bf16 bits as u16.
    assert 2 * permute.by_kind()["collective-permute"] > pairwise.by_kind()["reduce-scatter"]
    assert pairwise.total < permute.total


@functools.cache
def adasum_grad_fn(exchange):
    def grad(x, names):
        def loss(v):
            return jnp.sum(gradcomm.adasum_reduce(v, names, exchange=exchange) ** 3)

        return jax.grad(loss)(x)

    return grad


def test_adasum_pairwise_gradients_are_the_ppermute_ones():
    """Differentiating through it: a swap transposes to the same swap, the gather evenly.

    The same arithmetic, but XLA fuses the two backward programs differently, which may
    move a rounding (a fused multiply-add) by an ulp of the largest terms.
    """
    n = 4
    x = np.random.default_rng(3).standard_normal((n, 50)).astype(np.float32)
    expected, _ = run(adasum_grad_fn("permute"), n, False, x)
    got, _ = run(adasum_grad_fn("pairwise"), n, True, x)
    ulp = 2.0**-23 * np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=4 * ulp)


def test_hierarchical_adasum_with_factored_node_axes():
    g = np.random.default_rng(9).standard_normal((8, 3, 5)).astype(np.float32)

    def outcome(axes, node_names, exchange):
        mesh = parallel.make_mesh(axes)
        names = tuple(axes)
        tx = gradcomm.adasum(node_names, local_axis="local", exchange=exchange)
        body = lambda x: tx.update(x[0], tx.init(x[0]))[0]  # noqa: E731
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=P()))
        placed = parallel.shard_batch(g, mesh)
        program = f.lower(placed).compile()
        return np.asarray(program(placed)), program.as_text()

    expected, _ = outcome({"node": 4, "local": 2}, "node", "permute")
    axes = {**parallel.pairwise_axes("node", 4), "local": 2}
    for mesh_axes, names in ((axes, ("node0", "node1")), ({"node": 4, "local": 2}, "node")):
        got, text = outcome(mesh_axes, names, "pairwise")
        np.testing.assert_array_equal(bits(got), bits(expected))
        assert "collective-permute" not in text


def test_adasum_pairwise_under_vmap_and_pmap():
    g = np.random.default_rng(10).standard_normal((2, 11)).astype(np.float32)

    def vmapped(exchange):
        f = lambda x: gradcomm.adasum_reduce(x, "data", exchange=exchange)  # noqa: E731
        return jax.jit(jax.vmap(f, axis_name="data"))(g)

    np.testing.assert_array_equal(vmapped("pairwise"), vmapped("permute"))
    programs = {
        exchange: jax.pmap(
            lambda x, exchange=exchange: gradcomm.adasum_reduce(x, "data", exchange=exchange),
            axis_name="data",
            devices=jax.devices()[:2],
        )
        .lower(g)
        .compile()
        for exchange in ("permute", "pairwise")
    }
    np.testing.assert_array_equal(programs["pairwise"](g), programs["permute"](g))
    text = programs["pairwise"].as_text()
    assert "reduce-scatter" in text and "collective-permute" not in text


# --- SGP and D-PSGD ------------------------------------------------------------------------


@functools.cache
def gossip_fn(method, steps, **kwargs):
    """`steps` updates from this device's params (a f32 and a bf16 leaf): every z."""

    def f(z, names):
        tx = getattr(gradcomm, method)(names, **kwargs)
        state = jax.tree.map(lambda v: _axes.vary(v, names), tx.init(z))
        grads = jax.tree.map(lambda v: (0.01 * v).astype(v.dtype), z)

        def body(carry, _):
            z, state = carry
            delta, state = tx.update(grads, state, z)
            z = jax.tree.map(lambda a, b: a + b, z, delta)
            return (z, state), z

        return lax.scan(body, (z, state), None, length=steps)[1]

    return f


GOSSIP = [
    ("sgp", {"topology": "exponential"}),
    ("sgp", {"topology": "exponential", "overlap": 1}),
    ("sgp", {"topology": "hypercube", "overlap": 1}),
    ("sgp", {"topology": "complete"}),
    ("dpsgd", {"topology": "hypercube"}),
    ("dpsgd", {"topology": "exponential-bidirectional"}),
]


@pytest.mark.parametrize(("n", "layout"), [(2, "factored"), (8, "axis")])
@pytest.mark.parametrize(("method", "kwargs"), GOSSIP)
def test_gossip_pairwise_is_bit_identical_over_every_phase_with_the_same_bytes(
    n, layout, method, kwargs
):
    rng = np.random.default_rng(n)
    z = {
        "f32": rng.standard_normal((n, 37)).astype(np.float32),
        "f16": rng.standard_normal((n, 5)).astype(np.float16),
    }
    steps = 2 * topology.resolve(kwargs["topology"], n).num_phases + 1
    expected, permute_text = run(
        gossip_fn(method, steps, exchange="permute", **kwargs), n, False, z
    )
    got, text = run(gossip_fn(method, steps, exchange="pairwise", **kwargs), n, layout, z)
    assert_same_bits(got, expected)
    # A time-varying graph costs its dearest phase per step, the same either way.
    assert wire.analyze_hlo(text).total == wire.analyze_hlo(permute_text).total
    # i <-> i ^ n/2 is a move of every graph here: a two-member reduce-scatter (a swap;
    # alone in its phase, with only the sum wanted, the pair's sum).
    assert "reduce-scatter(" in text and "all-reduce(" not in text
    swaps_only = kwargs["topology"] == "hypercube" or n == 2
    assert ("collective-permute" in text) == (not swaps_only)


def test_gossip_bf16_bits_travel_as_u16():
    """XLA's CPU compiler widens a bf16 ppermute to f32; the exchange sends 2 bytes each."""
    n = 4
    z = np.random.default_rng(0).standard_normal((n, 1000)).astype(ml_dtypes.bfloat16)
    fn = functools.partial(gossip_fn, "sgp", 3, topology="hypercube", overlap=1)
    expected, permute_text = run(fn(exchange="permute"), n, False, z)
    got, text = run(fn(exchange="pairwise"), n, True, z)
    assert_same_bits(got, expected)
    padded = FlatLayout.of([(1000,)], rows=1).padded_size  # 1008
    sent = wire.analyze_hlo(text).by_kind()
    assert sent == {"reduce-scatter": 3 * (padded * 2 + 4)}  # x and the f32 weight, per step
    widened = wire.analyze_hlo(permute_text).by_kind()
    assert widened == {"collective-permute": 3 * (padded + 1) * 4}


# --- the train step ------------------------------------------------------------------------


def linear_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def train(tx_for, n, pairwise, per_device_params, steps=4):
    mesh, names = mesh_and_names(n, pairwise)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8 * n, 5)).astype(np.float32)
    batch = {"x": x, "y": x @ rng.standard_normal(5).astype(np.float32)}
    params = {"w": np.zeros(5, np.float32), "b": np.zeros((), np.float32)}
    tx = tx_for(names)
    place = parallel.per_device if per_device_params else parallel.replicate
    p = place(params, mesh)
    state = parallel.init_state(tx, p, mesh, params_per_device=per_device_params)
    step = parallel.train_step(linear_loss, tx, mesh, params_per_device=per_device_params)
    text = step.lower(p, state, batch).compile().as_text()
    for _ in range(steps):
        p, state, metrics = step(p, state, batch)
    return jax.tree.map(np.asarray, (p, metrics)), text


@pytest.mark.parametrize(
    ("name", "tx_for", "per_device_params"),
    [
        (
            "adasum",
            lambda a, ex="pairwise": optax.chain(optax.adam(0.1), gradcomm.adasum(a, exchange=ex)),
            False,
        ),
        (
            "sgp",
            lambda a, ex="pairwise": optax.chain(optax.sgd(0.1), gradcomm.sgp(a, exchange=ex)),
            True,
        ),
    ],
)
def test_train_step_pairwise_matches_the_permutes(name, tx_for, per_device_params):
    """On the default one-axis mesh (the factored one runs the same program)."""
    n = 4
    expected, _ = train(lambda a: tx_for(a, "permute"), n, False, per_device_params)
    got, text = train(tx_for, n, "axis", per_device_params)
    assert_same_bits(got, expected)
    # The exchanges: reduce-scatters of the bits, in pairs; SGP's swap phase i <-> i ^ 2
    # sums the pair with one of them.
    exchanges = [line for line in text.splitlines() if "reduce-scatter(" in line]
    assert exchanges and all("u32[" in line and "{{0," in line for line in exchanges)
    assert "collective-permute" not in text or name == "sgp"


def _adasum_on_a_large_and_a_small_leaf(exchange):
    mesh = parallel.make_mesh(parallel.pairwise_axes("data", 4), devices=jax.devices()[:4])
    axes = tuple(mesh.axis_names)
    rng = np.random.default_rng(7)
    tree = {"a": rng.normal(size=(4, 200_000)), "b": rng.normal(size=(4, 10))}
    tree = jax.tree.map(lambda x: x.astype(np.float32), tree)
    body = jax.shard_map(
        lambda t: gradcomm.adasum_reduce(jax.tree.map(lambda x: x[0], t), axes, exchange=exchange),
        mesh=mesh,
        in_specs=P(axes),
        out_specs=P(),
    )
    placed = jax.device_put(tree, NamedSharding(mesh, P(axes)))
    return jax.tree.map(np.asarray, jax.jit(body)(placed)), tree


@pytest.mark.parametrize("exchange", ["permute", "pairwise"])
def test_adasum_is_exact_on_a_large_and_a_small_leaf(exchange):
    """The input on which the all-reduce-less-own-bits exchange gave NaN at N = 4 (XLA:CPU
    recomputed the sent bits with a different FMA contraction): both paths now match
    the float64 reference."""
    out, tree = _adasum_on_a_large_and_a_small_leaf(exchange)
    for name in tree:
        want = reference.adasum_tree([tree[name][i].astype(np.float64) for i in range(4)])
        np.testing.assert_allclose(out[name], want, rtol=1e-4, atol=1e-5)
