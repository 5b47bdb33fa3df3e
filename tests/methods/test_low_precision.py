"""gradcomm.low_precision: the mean over the devices with 16-bit values on the wire.

Held against a float64 NumPy mean within the 16-bit formats' rounding, on 1 to 8
simulated devices; bfloat16 also bit for bit against a NumPy model of its scheme (float32
sums, in device order, of the bfloat16 values), and the ring and pairwise exchanges
against NumPy models of theirs. The wire is read from compiled programs. With FSDP
(`specs`), each device's shard against the slice of the mean without specs, its bytes
(a 16-bit reduce-scatter) and `parallel.train_step` against the replicated run.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import FSDP_SPECS, mesh_of, mlp_loss, mlp_problem, per_device
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel, wire
from gradcomm.low_precision import EXCHANGES, LowPrecisionState, low_precision

BF16, F16 = np.dtype(jnp.bfloat16), np.dtype(np.float16)
UNIT_ROUNDOFF = {BF16: 2.0**-8, F16: 2.0**-11}
# Mixed leaves: a matrix, an odd length, a scalar, and 16-bit inputs.
SHAPES = {"w": (4, 3), "odd": (7,), "s": (), "half": (5,), "brain": (3,)}
DTYPES = {"half": np.float16, "brain": BF16}


def _bf16(tree):
    tx = low_precision("data", jnp.bfloat16)
    return tx.update(tree, tx.init(tree))


def _f16(tree):
    tx = low_precision("data", jnp.float16)
    return tx.update(tree, tx.init(tree))


RUN = {BF16: _bf16, F16: _f16}


def _ring(dtype):
    def run(tree):
        tx = low_precision("data", dtype, exchange="ring")
        return tx.update(tree, tx.init(tree))

    return run


RING = {BF16: _ring(BF16), F16: _ring(F16)}


def _rings(tree):  # one compilation for both formats' rings
    return {d.name: RING[d](tree) for d in (BF16, F16)}


def _both(tree):  # one compilation for both formats
    return {BF16.name: _bf16(tree), F16.name: _f16(tree)}


def _rows(n, seed):
    rng = np.random.default_rng(seed)
    return {
        k: rng.standard_normal((n, *s)).astype(DTYPES.get(k, np.float32)) for k, s in SHAPES.items()
    }


def reference_mean(rows):
    """The float64 mean over the devices (axis 0)."""
    return np.asarray(rows).astype(np.float64).mean(0)


def tolerance(rows, n, dtype):
    """An elementwise bound on |mean - reference|, growing with n, for the wire `dtype`.

    bfloat16: the inputs and the mean are rounded once each to 8 significant bits (unit
    roundoff u), the float32 sum adds (n - 1) float32 roundings: 2 u (1 + n 2^-16) mean|x|.
    float16: x_i / n rounded (u), then n - 1 float16 additions in turn, each rounding a
    partial sum of at most sum|x_i| / n: (n + 1) u mean|x|, plus half a subnormal
    spacing (2^-25) per rounding below 2^-14. Then one rounding to the leaf's dtype.
    """
    u = UNIT_ROUNDOFF[dtype]
    rows = np.asarray(rows)
    mean_abs = np.abs(rows.astype(np.float64)).mean(0)
    if dtype == BF16:
        bound = 2 * u * (1 + n * 2.0**-16) * mean_abs
    else:
        bound = (n + 1) * u * mean_abs + n * 2.0**-24
    leaf_u = float(jnp.finfo(rows.dtype).eps) / 2
    return bound + leaf_u * (np.abs(reference_mean(rows)) + bound)


def rounded_sums_bound(x, n, dtype):
    """|mean - reference| for the gloo schemes (ring, pairwise), whose every partial sum is
    rounded to `dtype`: x_i / n rounded (u), at most n - 1 roundings of partial sums of
    at most sum|x_i| / n, (n + 1) u mean|x|, plus half a float16 subnormal spacing per
    rounding; then one rounding to the leaf's dtype."""
    u = UNIT_ROUNDOFF[dtype]
    bound = (n + 1) * u * np.abs(x.astype(np.float64)).mean(0) + n * 2.0**-24
    return bound + float(jnp.finfo(x.dtype).eps) / 2 * (np.abs(reference_mean(x)) + bound)


def bf16_scheme(rows):
    """NumPy model of the all_to_all scheme for bfloat16 (`all_to_all_scheme`)."""
    return all_to_all_scheme(rows, BF16)


def _same_bits(x):
    bits = np.asarray(x).view(f"uint{np.asarray(x).dtype.itemsize * 8}")
    return bool((bits == bits[:1]).all())


@pytest.mark.parametrize("n", range(1, 9))  # every count, cheaply: one small program each
def test_mean_matches_float64_reference(n):
    rows = _rows(n, seed=n)
    results = per_device(_both, n, rows)
    for dtype in (BF16, F16):
        out, state = results[dtype.name]
        for key, x in rows.items():
            got = out[key]
            assert got.dtype == x.dtype and got.shape == x.shape
            assert _same_bits(got), (dtype, key)
            err = np.abs(got[0].astype(np.float64) - reference_mean(x))
            assert (err <= tolerance(x, n, dtype)).all(), (dtype, key, err.max())
            if dtype == BF16:  # exactly the scheme: float32 sums of the bfloat16 values
                np.testing.assert_array_equal(got[0], bf16_scheme(x).astype(x.dtype))
        assert not state.overflow.any() and not state.overflow_count.any()


def all_to_all_scheme(rows, wire):
    """NumPy model of the all_to_all scheme: float32 sums in device order of the values rounded
    to `wire`, divided by n, rounded to `wire`."""
    values = np.asarray(rows).astype(wire).astype(np.float32)
    total = values[0]
    for v in values[1:]:
        total = total + v
    return (total / np.float32(len(values))).astype(wire)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_float16_by_all_to_all_matches_float64_reference(n):
    """`exchange="all_to_all"` moves float16 as bfloat16 does by default: exactly the scheme,
    within 2 u (1 + n 2^-16) mean|x| (plus float16's subnormal spacing) of the mean."""
    rows = _rows(n, seed=10 + n)
    tx = low_precision("data", jnp.float16, exchange="all_to_all")
    out, state = per_device(lambda t: tx.update(t, tx.init(t)), n, rows)
    u = UNIT_ROUNDOFF[F16]
    for key, x in rows.items():
        got = out[key]
        assert got.dtype == x.dtype and _same_bits(got), key
        np.testing.assert_array_equal(got[0], all_to_all_scheme(x, np.float16).astype(x.dtype))
        mean_abs = np.abs(np.asarray(x, np.float64)).mean(0)
        bound = 2 * u * (1 + n * 2.0**-16) * mean_abs + 2.0**-24
        bound = bound + float(jnp.finfo(x.dtype).eps) / 2 * (np.abs(reference_mean(x)) + bound)
        err = np.abs(got[0].astype(np.float64) - reference_mean(x))
        assert (err <= bound).all(), (key, err.max())
    assert not state.overflow.any()
    # A value past float16's range overflows on the wire: flagged, not silent.
    big = {"w": np.full((n, 2), 7e4, np.float32)}
    out, state = per_device(lambda t: tx.update(t, tx.init(t)), n, big)
    assert np.isinf(out["w"]).all() and state.overflow.all()


def test_exchange_picks_the_collectives():
    """The forced exchanges; "auto" (float16: all-reduce, bfloat16: all-gather and
    all-to-all) is read in test_wire_is_half_of_allreduce, "ring" in
    test_ring_sums_around_a_one_way_ring, for both formats."""
    n, shapes = 4, [(100, 60), (100,)]
    for dtype, exchange, kinds in [
        (jnp.float16, "all_to_all", ["all-gather", "all-to-all"]),
        (jnp.bfloat16, "psum", ["all-reduce"]),
    ]:
        report = _wire(_with_state(low_precision("data", dtype, exchange)), n, shapes)
        assert sorted(report.by_kind()) == kinds, (dtype, exchange)
    with pytest.raises(ValueError, match="exchange must be one of"):
        low_precision("data", jnp.float16, exchange="tree")
    with pytest.raises(ValueError, match="exchange='bits' is now exchange='all_to_all'"):
        low_precision("data", jnp.float16, exchange="bits")  # its name before "all_to_all"


def _with_state(tx):
    def update(tree):
        out, state = tx.update(tree, tx.init(tree))
        return out, state  # the state too: its flag travels with the values

    return update


def _wire(update, n, shapes):
    mesh = mesh_of(n)
    sharding = NamedSharding(mesh, P("data"))
    tree = [jax.ShapeDtypeStruct((n, *s), np.float32, sharding=sharding) for s in shapes]

    def body(t):
        out, state = update([x[0] for x in t])
        return [x[None] for x in out], state

    mapped = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P()))
    return wire.measure(jax.jit(mapped), tree)


@pytest.mark.parametrize(
    "shapes", [[(100, 60), (100,), (7,), ()], [(5, 3), (2,)]], ids=["divisible", "padded"]
)
def test_wire_is_half_of_allreduce(shapes):
    n = 4
    size = sum(int(np.prod(s)) for s in shapes)
    dense = _wire(_with_state(gradcomm.allreduce("data")), n, shapes)
    assert dense.total == pytest.approx(2 * (n - 1) / n * 4 * size)
    half = dense.total / 2
    bf16 = _wire(_with_state(low_precision("data", jnp.bfloat16)), n, shapes)
    assert sorted(bf16.by_kind()) == ["all-gather", "all-to-all"]
    assert len(bf16.collectives) == 2  # the whole tree in one of each
    padded = -(-size // n) * n
    # (n - 1) / n of the padded 16-bit buffer each way, plus one flag word per device.
    assert bf16.total == pytest.approx(2 * (n - 1) / n * 2 * padded + 2 * (n - 1))
    if size % n == 0:
        assert bf16.total == half + 2 * (n - 1)
    f16 = _wire(_with_state(low_precision("data", jnp.float16)), n, shapes)
    assert sorted(f16.by_kind()) == ["all-reduce"] and len(f16.collectives) == 1
    assert f16.total == pytest.approx(half + 2 * (n - 1) / n * 2)  # plus the flag element


def _steps(dtype, *steps, exchange="auto"):
    """Runs the updates `steps` (each one row per device) in turn under a named vmap."""
    run = _steps_fn(np.dtype(dtype), exchange)
    return run(*(jnp.asarray(s, jnp.float32) for s in steps))


@functools.cache
def _steps_fn(dtype, exchange):
    """`_steps`'s jitted function, compiled once per number and shape of the steps."""
    tx = low_precision("data", dtype, exchange)

    def run(*gs):
        state = tx.init(gs[0])
        outs = []
        for g in gs:
            out, state = tx.update(g, state)
            outs.append(out)
        return outs, state

    return jax.jit(jax.vmap(run, axis_name="data"))


@pytest.mark.parametrize("exchange", ["auto", "ring"])
def test_float16_overflow_is_flagged(exchange):
    # 6e4 on 2 devices: divided by 2 first, the sum 3e4 + 3e4 fits (float16 max 65504).
    (out,), state = _steps(jnp.float16, [[6e4], [6e4]], exchange=exchange)
    np.testing.assert_array_equal(out, [[6e4], [6e4]])
    assert not state.overflow.any()
    # 7e4 on 2 devices: the mean itself does not fit; 2e5 and -2e5: x / 2 does not fit
    # (the mean, 0, would); then a step that fits clears the flag and keeps the count.
    (big, cancel, small), state = _steps(
        jnp.float16, [[7e4], [7e4]], [[2e5], [-2e5]], [[1.0], [3.0]], exchange=exchange
    )
    assert np.isposinf(big).all() and np.isnan(cancel).all()
    np.testing.assert_array_equal(small, [[2.0], [2.0]])
    assert not state.overflow.any() and (state.overflow_count == 2).all()
    (out,), state = _steps(jnp.float16, [[7e4], [7e4]], exchange=exchange)
    assert state.overflow.all() and (state.overflow_count == 1).all()


@pytest.mark.parametrize("exchange", ["auto", "ring"])
def test_non_finite_inputs_are_not_overflow(exchange):
    """An inf or a NaN in either format (one program per format and exchange)."""
    for dtype in (jnp.bfloat16, jnp.float16):
        for bad in (np.inf, np.nan):
            (out,), state = _steps(dtype, [[bad, 1.0], [1.0, 1.0]], exchange=exchange)
            assert not np.isfinite(out[:, 0]).any(), (dtype, bad)
            np.testing.assert_array_equal(out[:, 1], [1.0, 1.0])
            assert not state.overflow.any() and not state.overflow_count.any()


def test_bfloat16_overflow_is_flagged():
    big = 3e38  # bfloat16 has float32's range: the float32 sum 6e38 overflows, as in pmean
    (out,), state = _steps(jnp.bfloat16, [[big, 1.0], [big, 1.0]])
    assert np.isposinf(out[:, 0]).all() and state.overflow.all()
    # Rounding a finite float32 above bfloat16's largest (3.39e38) to bfloat16 overflows.
    (out,), state = _steps(jnp.bfloat16, [[3.4e38], [-1.0]])
    assert np.isposinf(out).all() and state.overflow.all()
    (out,), state = _steps(jnp.bfloat16, [[1e38], [1e38]])  # fits
    assert np.isfinite(out).all() and not state.overflow.any()


def _all(tree):  # both formats, by the default exchange and by the ring
    return {**_both(tree), **{f"ring-{d.name}": RING[d](tree) for d in (BF16, F16)}}


def test_zero_tiny_and_huge_inputs():
    n = 8
    zeros = {k: np.zeros_like(v) for k, v in _rows(n, 0).items()}
    for out, state in per_device(_all, n, zeros).values():
        for key in zeros:
            np.testing.assert_array_equal(out[key], zeros[key])
        assert not state.overflow.any()
    # Tiny: float16 subnormals after the division by n (their spacing is the bound);
    # bfloat16 far below float16's range. Huge: a mean near float16's largest value, and
    # for bfloat16 a float32 sum just within float32's range (as in lax.pmean).
    uniform = np.random.default_rng(1).uniform(0.5, 1.0, (n, 64))
    for tiny, huge in ((1e-6, 6e4), (1e-35, 4e37)):
        rows = {
            "tiny": (uniform * tiny).astype(np.float32),
            "huge": (uniform * huge).astype(np.float32),
        }
        results = per_device(_all, n, rows)
        for dtype in (BF16,) if huge == 4e37 else (BF16, F16):
            ring = f"ring-{dtype.name}"
            for name, bound in ((dtype.name, tolerance), (ring, rounded_sums_bound)):
                out, state = results[name]
                for key, x in rows.items():
                    err = np.abs(out[key][0].astype(np.float64) - reference_mean(x))
                    assert (err <= bound(x, n, dtype)).all(), (name, key, err.max())
                    assert _same_bits(out[key])
                assert not state.overflow.any()


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_float64_inputs(dtype):
    rows = np.random.default_rng(2).standard_normal((3, 9))
    with jax.enable_x64(True):
        (out,), state = jax.jit(jax.vmap(lambda g: RUN[dtype]([g]), axis_name="data"))(
            jnp.asarray(rows, jnp.float64)
        )
        assert out.dtype == jnp.float64 and not state.overflow.any()
        err = np.abs(np.asarray(out[0]) - reference_mean(rows))
        assert (err <= tolerance(rows, 3, dtype)).all()


@pytest.mark.parametrize("exchange", ["auto", "ring"])
def test_shard_map_pmap_and_vmap_agree(exchange):
    """Both formats (one program per way of mapping)."""
    n = 3
    rows = {"w": _rows(n, seed=7)["w"]}
    run = _both if exchange == "auto" else _rings
    expected = per_device(run, n, rows)
    for mapped in (jax.pmap(run, axis_name="data"), jax.jit(jax.vmap(run, axis_name="data"))):
        out = mapped(rows)
        for dtype in (BF16, F16):
            got, want = out[dtype.name][0]["w"], expected[dtype.name][0]["w"]
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=dtype.name)


def test_in_a_train_step_the_state_is_replicated():
    n = 4
    mesh = mesh_of(n)
    rng = np.random.default_rng(3)
    batch = {"x": rng.standard_normal((4 * n, 5)).astype(np.float32)}
    batch["y"] = batch["x"] @ np.arange(5, dtype=np.float32)

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    params = {"w": np.zeros(5, np.float32)}
    results = []
    for first in (gradcomm.allreduce("data"), low_precision("data")):
        tx = optax.chain(first, optax.sgd(0.05))
        p = parallel.replicate(params, mesh)
        state = parallel.init_state(tx, p, mesh)
        step = parallel.train_step(loss, tx, mesh)
        for _ in range(3):
            p, state, metrics = step(p, state, batch)
        results.append((p, state, metrics))
    (dense, _, _), (low, state, _) = results
    assert isinstance(state[0], LowPrecisionState)
    assert state[0].overflow.shape == () and state[0].overflow.sharding.is_fully_replicated
    np.testing.assert_allclose(low["w"], dense["w"], rtol=2e-2, atol=2e-2)


def test_bad_arguments_raise():
    for dtype in (jnp.float32, np.int16, "float8", 3, jnp.ones(())):
        with pytest.raises(ValueError, match=r"bfloat16 or jnp\.float16"):
            low_precision("data", dtype)
    with pytest.raises(ValueError, match="axis_name"):
        low_precision("")
    tx = low_precision("data")
    with pytest.raises(ValueError, match="floating"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="not bound"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="other")(jnp.ones((2, 3)))
    assert low_precision("data", "float16") is not None  # names of the formats work too


def test_allreduce_with_a_dtype_is_low_precision():
    """The same program (jaxpr) as low_precision's in each format; another format's is not."""
    rows = _rows(4, seed=5)

    def traced(fn):
        return str(jax.make_jaxpr(jax.vmap(fn, axis_name="data"))(rows))

    for dtype, other in ((BF16, F16), (F16, BF16)):
        tx = gradcomm.allreduce("data", dtype=dtype)
        got = traced(lambda g, tx=tx: tx.update(g, tx.init(g)))
        assert got == traced(RUN[dtype]) and got != traced(RUN[other])
    assert gradcomm.allreduce("data", dtype=None).init(rows) == gradcomm.AllReduceState()


def pairwise_scheme(rows, wire):
    """NumPy model of the pairwise scheme: each value / n rounded to `wire` (in float32),
    summed by recursive halving, each sum of two in float32 rounded to `wire`."""
    held = [(np.asarray(r, np.float32) / np.float32(len(rows))).astype(wire) for r in rows]
    while len(held) > 1:  # the lowest bit first: device i meets device i ^ 1, then i ^ 2...
        held = [
            (held[i].astype(np.float32) + held[i + 1].astype(np.float32)).astype(wire)
            for i in range(0, len(held), 2)
        ]
    return held[0]


@pytest.mark.parametrize("n", [2, 8])  # one level, and three
def test_pairwise_sums_by_halving_in_reduce_scatters(n):
    """`exchange="pairwise"` over size-2 axes, for both formats: exactly the halving tree
    of the scaled 16-bit values, within (n + 1) u mean|x| of the float64 mean, the same
    bits on every device, through two-member reduce-scatters only."""
    axes = parallel.pairwise_axes("data", n)
    mesh = parallel.make_mesh(axes, devices=jax.devices()[:n])
    names = tuple(axes)
    rows = _rows(n, seed=20 + n)
    sharding = NamedSharding(mesh, P(names))
    placed = jax.tree.map(lambda x: jax.device_put(x, sharding), rows)
    txs = {d.name: low_precision(names, d, exchange="pairwise") for d in (BF16, F16)}

    def body(t):  # both formats, one program
        t = jax.tree.map(lambda a: a[0], t)
        outs = {name: tx.update(t, tx.init(t)) for name, tx in txs.items()}
        return {k: jax.tree.map(lambda a: a[None], o) for k, (o, _) in outs.items()}, {
            k: st for k, (_, st) in outs.items()
        }

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=(P(names), P())))
    outs, states = step(placed)
    kinds = wire.measure(step, placed).by_kind()
    assert set(kinds) == {"reduce-scatter"}, kinds
    for dtype in (BF16, F16):
        out, state = outs[dtype.name], states[dtype.name]
        for key, x in rows.items():
            got = np.asarray(out[key])
            assert got.dtype == x.dtype and _same_bits(got), (dtype, key)
            model = pairwise_scheme(x.astype(np.float32), dtype).astype(x.dtype)
            np.testing.assert_array_equal(got[0], model)
            err = np.abs(got[0].astype(np.float64) - reference_mean(x))
            assert (err <= rounded_sums_bound(x, n, dtype)).all(), (dtype, key, err.max())
        assert not np.asarray(state.overflow).any()
    with pytest.raises(ValueError, match="power-of-two number of devices"):
        jax.vmap(
            lambda g: low_precision("data", exchange="pairwise").update(g, None),
            axis_name="data",
        )(jnp.ones((3, 2)))


def ring_scheme(rows, wire):
    """NumPy model of the ring: the leaves end to end in tree order, each value / n
    rounded to `wire` (in float32), zero-padded to n chunks; chunk c summed in the order
    device c + 1, c + 2, ..., c (mod n), each sum of two in float32 rounded to `wire`."""
    leaves, treedef = jax.tree.flatten(rows)
    n = len(leaves[0])
    scaled = [(np.asarray(x, np.float32) / np.float32(n)).astype(wire) for x in leaves]
    flat = np.concatenate([v.reshape(n, -1) for v in scaled], axis=1)
    total = flat.shape[1]
    chunk = -(-total // n)
    values = np.zeros((n, n * chunk), wire)
    values[:, :total] = flat
    values = values.reshape(n, n, chunk)  # (device, chunk, element)
    sums = []
    for c in range(n):
        held = values[(c + 1) % n, c].astype(np.float32)
        for k in range(2, n + 1):
            held = (held + values[(c + k) % n, c]).astype(wire).astype(np.float32)
        sums.append(held.astype(wire))
    mean = np.concatenate(sums)[:total]
    ends = np.cumsum([v[0].size for v in scaled])[:-1]
    return jax.tree.unflatten(
        treedef, [m.reshape(v.shape[1:]) for m, v in zip(np.split(mean, ends), scaled, strict=True)]
    )


@functools.cache
def _rings_step(n):
    """Both formats' rings over n devices as one jitted program, `(means, states)`: the
    means per device, the states replicated. Its wire is read from the program it runs."""

    def body(t):
        means, states = {}, {}
        for d in (BF16, F16):
            mean, states[d.name] = RING[d]({k: x[0] for k, x in t.items()})
            means[d.name] = {k: x[None] for k, x in mean.items()}
        return means, states

    mapped = jax.shard_map(body, mesh=mesh_of(n), in_specs=P("data"), out_specs=(P("data"), P()))
    return jax.jit(mapped)


@pytest.mark.parametrize("n", [1, 2, 3, 8])  # none, one, an odd count, the largest
def test_ring_sums_around_a_one_way_ring(n):
    """`exchange="ring"`, for both formats and any n: exactly the ring's partial sums of
    the scaled 16-bit values, within (n + 1) u mean|x| of the float64 mean, the same bits
    on every device, through n - 1 one-way permutes and one all-gather per format that
    send (n - 1) / n of the 16-bit buffer each (plus the flag word)."""
    rows = _rows(n, seed=30 + n)
    step = _rings_step(n)
    placed = jax.device_put(rows, NamedSharding(mesh_of(n), P("data")))
    means, states = jax.tree.map(np.asarray, step(placed))
    for dtype in (BF16, F16):
        out, state = means[dtype.name], states[dtype.name]
        model = ring_scheme(rows, dtype)
        for key, x in rows.items():
            got = out[key]
            assert got.dtype == x.dtype and _same_bits(got), (dtype, key)
            np.testing.assert_array_equal(got[0], model[key].astype(x.dtype))
            err = np.abs(got[0].astype(np.float64) - reference_mean(x))
            assert (err <= rounded_sums_bound(x, n, dtype)).all(), (dtype, key, err.max())
        assert not state.overflow.any()
    if n > 1:  # the two formats' rings, side by side
        padded = -(-sum(int(np.prod(s)) for s in SHAPES.values()) // n) * n
        report = wire.measure(step, placed)
        kinds = [c.kind for c in report.collectives for _ in range(c.count)]
        assert sorted(kinds) == ["all-gather"] * 2 + ["collective-permute"] * 2 * (n - 1)
        assert report.total == pytest.approx(2 * (2 * (n - 1) / n * 2 * padded + 2 * (n - 1)))


def test_auto_on_gloo_is_pairwise_at_two_and_the_ring_above(monkeypatch):
    """On CPU devices in several processes (gloo), "auto" is the pairwise scheme at N = 2
    and the ring above, for both formats and on a flat axis; under a named vmap (no
    link), the one-process choice."""
    shapes = [(10, 6), (10,)]
    expected = {2: ["reduce-scatter"], 4: ["all-gather", "collective-permute"]}
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for n, kinds in expected.items():
        for dtype in (jnp.float16, jnp.bfloat16):
            report = _wire(_with_state(low_precision("data", dtype)), n, shapes)
            assert sorted(report.by_kind()) == kinds, (n, dtype)
    # Under a named vmap there is no link: the one-process choice.
    tx = low_precision("data", jnp.float16)
    fn = jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")
    text = str(jax.make_jaxpr(fn)(jnp.ones((4, 3))))
    assert "psum" in text and "ppermute" not in text


# A tensor-parallel mesh: leaves sharded over 'model' (by rows, by columns; one float16)
# beside one replicated over it (issue 27).
MODEL_SPECS = {"rows": P("model", None), "cols": P(None, "model"), "half": P("model"), "bias": P()}
MODEL_SHAPES = {"rows": (8, 6), "cols": (5, 4), "half": (6,), "bias": (7,)}


def _model_rows(seed, big=None):
    rng = np.random.default_rng(seed)
    rows = {
        k: rng.standard_normal((4, *s)).astype(np.float16 if k == "half" else np.float32)
        for k, s in MODEL_SHAPES.items()
    }
    if big is not None:  # on data device 1, in the rows of model device 1 only
        rows["rows"][1, -1, 0] = big
    return rows


def _on_mesh(exchanges, mesh, data, specs, rows):
    """Both formats' means by each of `exchanges`, keyed "exchange-dtype", each leaf whole
    (data device, ...), and every device's flag."""
    return _mesh_step(exchanges, mesh, data, tuple(specs.items()))(rows)


@functools.cache
def _mesh_step(exchanges, mesh, data, specs):
    """`_on_mesh`'s compiled step on (leaf, spec) pairs `specs`, reused across inputs."""
    specs = dict(specs)
    txs = {f"{e}-{d.name}": low_precision(data, d, e) for e in exchanges for d in (BF16, F16)}
    leaf_specs = {k: P(data, *specs[k]) for k in specs}
    every = P(tuple(mesh.axis_names))

    def body(t):
        t = {k: x[0] for k, x in t.items()}
        out = {}
        for name, tx in txs.items():
            mean, state = tx.update(t, tx.init(t))
            out[name] = ({k: x[None] for k, x in mean.items()}, state.overflow[None])
        return out

    out_specs = {name: (leaf_specs, every) for name in txs}
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(leaf_specs,), out_specs=out_specs))

    def run(rows):
        placed = {k: jax.device_put(x, NamedSharding(mesh, leaf_specs[k])) for k, x in rows.items()}
        return jax.tree.map(np.asarray, step(placed))

    return run


def _model_meshes(exchange):
    """(data axes, the (data 4, model 2) mesh, the 1-D mesh of the 4 data devices)."""
    explicit = jax.sharding.AxisType.Explicit
    if exchange == "pairwise":  # size-2 data axes
        names, sizes = ("data0", "data1"), (2, 2)
    else:
        names, sizes = ("data",), (4,)
    two = jax.make_mesh((*sizes, 2), (*names, "model"), axis_types=(explicit,) * (len(names) + 1))
    one = jax.make_mesh(
        sizes, names, devices=jax.devices()[:4], axis_types=(explicit,) * len(names)
    )
    return (names if len(names) > 1 else names[0]), two, one


def _ring_on_model_axis(rows, wire):
    """The ring's model where the leaves sharded over 'model' are one buffer per model
    device (its pieces, in tree order) and the replicated one another."""
    whole = ring_scheme({"bias": rows["bias"]}, wire)
    pieces = []
    for m in range(2):
        piece = {
            "cols": np.split(rows["cols"], 2, axis=2)[m],
            "half": np.split(rows["half"], 2, axis=1)[m],
            "rows": np.split(rows["rows"], 2, axis=1)[m],
        }
        pieces.append(ring_scheme(piece, wire))
    for key, axis in (("cols", 1), ("half", 0), ("rows", 0)):
        whole[key] = np.concatenate([p[key] for p in pieces], axis=axis)
    return whole


# The exchanges of one process in one program; the pairwise scheme on its own mesh axes.
# ("auto" is the all-to-all for bfloat16 and psum for float16 here: the same jaxprs.)
MODEL_GROUPS = {"one_process": ("all_to_all", "psum", "ring"), "pairwise": ("pairwise",)}


@pytest.mark.parametrize("group", MODEL_GROUPS)
def test_leaves_sharded_over_a_model_axis(group):
    """On a (data 4, model 2) mesh, with leaves sharded over 'model' beside one replicated
    over it, every exchange keeps each leaf's type (the replicated one leaves the map as
    replicated over 'model', the state as replicated over every axis) and gives the bits
    of the whole tensors on the 4 data devices alone: the scheme is elementwise. The ring
    is too, but which device starts an element's sum depends on where the element lies
    in the buffer, and a piece lies elsewhere than in the whole tensor: it gives the
    ring's model of the buffers it exchanges, the replicated leaf and each model device's
    pieces. A float16 overflow in one model shard is flagged on every device."""
    exchanges = MODEL_GROUPS[group]
    data, two, one = _model_meshes(exchanges[0])
    rows = _model_rows(seed=40)
    got = _on_mesh(exchanges, two, data, MODEL_SPECS, rows)
    want = _on_mesh(exchanges, one, data, {k: P() for k in MODEL_SPECS}, rows)
    for exchange in exchanges:
        for dtype in (BF16, F16):
            name = f"{exchange}-{dtype.name}"
            (mean, overflow), (whole, _) = got[name], want[name]
            model = _ring_on_model_axis(rows, dtype) if exchange == "ring" else None
            for key, x in rows.items():
                assert mean[key].dtype == x.dtype and _same_bits(mean[key]), (name, key)
                expected = whole[key] if model is None else model[key].astype(x.dtype)[None]
                np.testing.assert_array_equal(mean[key], np.broadcast_to(expected, x.shape))
            assert not overflow.any()
    big = _on_mesh(exchanges, two, data, MODEL_SPECS, _model_rows(seed=41, big=7e5))
    for exchange in exchanges:
        assert big[f"{exchange}-{F16.name}"][1].all()  # the mean 1.75e5 overflows float16
        assert not big[f"{exchange}-{BF16.name}"][1].any()
    if group == "one_process":
        assert {"auto", *(e for g in MODEL_GROUPS.values() for e in g)} == set(EXCHANGES)
        traced = functools.partial(_traced_on_mesh, mesh=two, data=data, rows=rows)
        assert traced("auto", BF16) == traced("all_to_all", BF16) != traced("psum", BF16)
        assert traced("auto", F16) == traced("psum", F16) != traced("all_to_all", F16)


def _traced_on_mesh(exchange, dtype, mesh, data, rows):
    """The jaxpr of one format's update by `exchange` on the model mesh (not compiled)."""
    tx = low_precision(data, dtype, exchange)
    leaf_specs = {k: P(data, *MODEL_SPECS[k]) for k in rows}

    def body(t):
        mean, state = tx.update({k: x[0] for k, x in t.items()}, tx.init(t))
        return {k: x[None] for k, x in mean.items()}, state.overflow[None]

    out_specs = (leaf_specs, P(tuple(mesh.axis_names)))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(leaf_specs,), out_specs=out_specs)
    shapes = {
        k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, leaf_specs[k]))
        for k, x in rows.items()
    }
    return str(jax.make_jaxpr(mapped)(shapes))


# FSDP (ZeRO-3, issue 27): leaves split over the data axes along their leading dimension
# (`specs`); each device keeps its shard of the 16-bit mean, by the reduce-scatter alone.
# Shard shapes; an FSDP leaf's whole leading dimension is n times this one.
FSDP_SHAPES = {"w": (2, 3), "v": (3,), "half": (1, 2), "brain": (1, 2, 2), "bias": (5,), "s": ()}
FSDP_KEYS = ("brain", "half", "v", "w")  # in tree order


def _fsdp_rows(n, seed, scale=1.0):
    """Per device, the whole updates: the FSDP leaves n times their shard's rows."""
    rng = np.random.default_rng(seed)
    rows = {}
    for k, s in FSDP_SHAPES.items():
        shape = (s[0] * n, *s[1:]) if k in FSDP_KEYS else s
        rows[k] = (rng.standard_normal((n, *shape)) * scale).astype(DTYPES.get(k, np.float32))
    return rows


def _fsdp_mesh(exchange, n):
    """(the data axes for the method, the mesh): size-2 axes for the pairwise scheme."""
    if exchange == "pairwise":
        axes = parallel.pairwise_axes("data", n)
        names = tuple(axes)
        return (names if len(names) > 1 else names[0]), parallel.make_mesh(
            axes, devices=jax.devices()[:n]
        )
    return "data", mesh_of(n)


def _fsdp_specs(data):
    return {k: P(data) if k in FSDP_KEYS else P() for k in FSDP_SHAPES}


def _fsdp_run(exchange, n, rows, whole=True):
    """Per device, both formats' results with specs (the FSDP leaves as this device's
    shard) and, with `whole`, without, and the states; one compilation."""
    data, mesh = _fsdp_mesh(exchange, n)
    device = P(data)
    txs = {
        (d.name, sharded): low_precision(
            data, d, exchange, specs=_fsdp_specs(data) if sharded else None
        )
        for d in (BF16, F16)
        for sharded in ((True, False) if whole else (True,))
    }

    def body(t):
        t = {k: x[0] for k, x in t.items()}
        out = {}
        for key, tx in txs.items():
            mean, state = tx.update(t, tx.init(t))
            out[key] = ({k: x[None] for k, x in mean.items()}, state)
        return out

    out_specs = {key: (device, P()) for key in txs}  # the state leaves replicated
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(device,), out_specs=out_specs))
    placed = jax.device_put(rows, NamedSharding(mesh, device))
    return jax.tree.map(np.asarray, step(placed))


def _shard(x, j, n):
    """Shard j of n of a whole leaf, along its leading dimension."""
    size = len(x) // n
    return x[j * size : (j + 1) * size]


def fsdp_ring_scheme(rows, wire):
    """NumPy model of the ring on FSDP leaves: the rows of `_shards.to_rows` (row j every
    FSDP leaf's shard j, in tree order) summed as `ring_scheme` sums its chunks, row j
    starting on device j + 1. Returns per FSDP leaf the (n, *shard) shards, row j device
    j's; the other leaves go in a buffer of their own, as `ring_scheme` sums them."""
    n = len(rows[FSDP_KEYS[0]])
    layout = np.concatenate(
        [np.asarray(rows[k], np.float32).reshape(n, n, -1) for k in FSDP_KEYS], axis=2
    )  # (device, row, element)
    mean = ring_scheme({"rows": layout.reshape(n, -1)}, wire)["rows"].reshape(n, -1)
    out, start = {}, 0
    for k in FSDP_KEYS:
        shard = (rows[k].shape[1] // n, *rows[k].shape[2:])
        size = int(np.prod(shard))
        out[k] = mean[:, start : start + size].reshape(n, *shard)
        start += size
    out.update(ring_scheme({k: rows[k] for k in FSDP_SHAPES if k not in FSDP_KEYS}, wire))
    return out


# Every exchange at 8 devices, and an odd count (4: the train_step tests; at 1 a shard is
# the whole leaf, test_allreduce_with_a_dtype_passes_specs_through splits over 2).
FSDP_N = [("all_to_all", 3), ("ring", 3)]
FSDP_N += [(e, 8) for e in ("all_to_all", "psum", "ring", "pairwise")]


# The NumPy models of the schemes whose sums run in the same order wherever an element
# lies (the unsharded means are held to them: test_mean_matches_float64_reference,
# test_float16_by_all_to_all_matches_float64_reference, test_pairwise_sums_by_halving...).
WHOLE_MODELS = {
    "all_to_all": all_to_all_scheme,
    "pairwise": lambda x, wire: pairwise_scheme(np.asarray(x, np.float32), wire),
}


@pytest.mark.parametrize(("exchange", "n"), FSDP_N, ids=[f"{e}-{n}" for e, n in FSDP_N])
def test_fsdp_shard_is_the_slice_of_the_whole_mean(exchange, n):
    """With specs splitting some leaves over 'data' (float32, float16 and bfloat16 ones,
    beside two whole leaves), device j receives shard j of each such leaf's mean, in both
    wire formats: for the all_to_all, psum and pairwise schemes the same bits as shard j of
    the mean without specs (each element is summed in the same order wherever it lies: by
    the all_to_all and pairwise schemes, shard j of their NumPy models' whole mean; by
    psum, of the compiled mean without specs); for the ring exactly its model on the rows
    of `_shards.to_rows` (an element's sum starts on the device after its row, not after
    its chunk of the fused buffer). Every result is within the scheme's bound of the
    float64 mean, so a ring shard is within twice that bound of the ring's unsharded
    mean. The state stays replicated."""
    rows = _fsdp_rows(n, seed=50 + n)
    results = _fsdp_run(exchange, n, rows, whole=exchange == "psum")
    bound = tolerance if exchange == "all_to_all" else rounded_sums_bound
    for dtype in (BF16, F16):
        got, state = results[dtype.name, True]
        if exchange in WHOLE_MODELS:
            whole = {
                k: np.broadcast_to(WHOLE_MODELS[exchange](x, dtype).astype(x.dtype), x.shape)
                for k, x in rows.items()
            }
        elif exchange == "psum":
            whole = results[dtype.name, False][0]
        model = fsdp_ring_scheme(rows, dtype) if exchange == "ring" else None
        for key, x in rows.items():
            split = key in FSDP_KEYS
            assert got[key].dtype == x.dtype and got[key].shape[0] == n, (dtype, key)
            if not split:
                assert got[key].shape == x.shape and _same_bits(got[key]), (dtype, key)
            reference, limit = reference_mean(x), bound(x, n, dtype)
            for j in range(n):
                mine = got[key][j]
                if split:
                    reference_j, limit_j = _shard(reference, j, n), _shard(limit, j, n)
                    assert mine.shape == _shard(x[j], j, n).shape, (dtype, key)
                else:
                    reference_j, limit_j = reference, limit
                if model is None:
                    expected = _shard(whole[key][j], j, n) if split else whole[key][j]
                else:
                    expected = model[key][j] if split else model[key]
                np.testing.assert_array_equal(mine, expected.astype(x.dtype), err_msg=key)
                err = np.abs(mine.astype(np.float64) - reference_j)
                assert (err <= limit_j).all(), (dtype, key, j, err.max())
        assert not state.overflow.any() and not state.overflow_count.any()


@pytest.mark.parametrize("exchange", ["all_to_all", "psum", "ring"])
def test_fsdp_overflow_in_one_shard_is_flagged_everywhere(exchange):
    """A float16 overflow in one device's shard alone (the others' means fit) is flagged
    on every device, and a non-finite input there is not an overflow."""
    n = 4
    rows = {k: x for k, x in _fsdp_rows(n, seed=60).items() if k in ("w", "bias")}
    big = {k: x.copy() for k, x in rows.items()}
    big["w"][:, 3 * 2, 0] = 7e4  # all devices, in row 0 of shard 3: the mean 7e4
    bad = {k: x.copy() for k, x in rows.items()}
    bad["w"][1, 3 * 2, 0] = np.inf  # device 1 only, in shard 3
    specs = {"w": P("data"), "bias": P()}
    tx = low_precision("data", jnp.float16, exchange, specs=specs)
    mesh = mesh_of(n)

    def body(t):
        mean, state = tx.update({k: x[0] for k, x in t.items()}, tx.init(t))
        return {k: x[None] for k, x in mean.items()}, state

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P())))
    placed = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))  # noqa: E731
    out, state = step(placed(big))
    w = np.asarray(out["w"])
    assert np.isposinf(w[3, 0, 0]) and np.isfinite(np.delete(w.reshape(n, -1), 0, 1)).all()
    assert np.isfinite(w[:3]).all() and bool(state.overflow)
    out, state = step(placed(bad))
    assert not np.isfinite(np.asarray(out["w"])[3, 0, 0]) and not bool(state.overflow)
    assert np.isfinite(np.asarray(out["w"])[:3]).all()


def _fsdp_wire(tx, n, shapes, specs):
    """The wire report of `tx.update` on whole per-device updates, compiled."""
    mesh = mesh_of(n)
    sharding = NamedSharding(mesh, P("data"))
    tree = {
        k: jax.ShapeDtypeStruct((n, *s), np.float32, sharding=sharding) for k, s in shapes.items()
    }
    out_specs = {k: P("data") for k in shapes}

    def body(t):
        out, state = tx.update({k: x[0] for k, x in t.items()}, tx.init(t))
        return {k: x[None] for k, x in out.items()}, state

    mapped = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=(out_specs, P()))
    return wire.measure(jax.jit(mapped), tree)


@pytest.mark.parametrize("n", [8])  # the same programs' shape at 4
def test_fsdp_wire_is_half_of_the_reduce_scatter(n):
    """The FSDP leaves leave as a 16-bit reduce-scatter: (n - 1) / n of their 16-bit bytes
    per device, half of `allreduce(specs=...)`'s float32 reduce-scatter, by every
    exchange: the all-to-all of "all_to_all", float16's reduce-scatter, the ring's n - 1 permutes,
    the pairwise scheme's log2 n two-member reduce-scatters. One all-reduce of two int32
    words (the flags) is added. The whole bias keeps its path (an all-to-all and an
    all-gather of bfloat16 bits, or float16's all-reduce)."""
    shapes = {"w1": (64, 256), "w2": (256, 64)}
    split = sum(int(np.prod(s)) for s in shapes.values())
    specs = {k: P("data") for k in shapes}
    share = (n - 1) / n
    flags = 2 * share * 8  # the pmax of two int32 words
    dense = _fsdp_wire(gradcomm.allreduce("data", specs=specs), n, shapes, specs)
    assert dense.by_kind() == {"reduce-scatter": share * 4 * split}
    for dtype, exchange, kind in [
        (jnp.bfloat16, "auto", "all-to-all"),
        (jnp.float16, "auto", "reduce-scatter"),
        (jnp.float16, "all_to_all", "all-to-all"),
        (jnp.bfloat16, "ring", "collective-permute"),
        (jnp.float16, "ring", "collective-permute"),
    ]:
        tx = low_precision("data", dtype, exchange, specs=specs)
        report = _fsdp_wire(tx, n, shapes, specs)
        assert report.by_kind() == {kind: share * 2 * split, "all-reduce": flags}, (
            dtype,
            exchange,
            report.by_kind(),
        )
        assert report.by_kind()[kind] == dense.total / 2
    # With a whole leaf beside them, that leaf keeps today's exchange and bytes.
    mixed = {**shapes, "b": (64,)}
    mixed_specs = {**specs, "b": P()}
    bf16 = _fsdp_wire(low_precision("data", specs=mixed_specs), n, mixed, mixed_specs).by_kind()
    bias = share * 2 * 64  # 64 elements: no padding for n | 64
    assert bf16 == {
        "all-to-all": share * 2 * split + bias,
        "all-gather": bias + 2 * (n - 1),
        "all-reduce": flags,
    }
    f16 = low_precision("data", jnp.float16, specs=mixed_specs)
    f16 = _fsdp_wire(f16, n, mixed, mixed_specs).by_kind()
    assert f16 == {
        "reduce-scatter": share * 2 * split,
        "all-reduce": 2 * share * 2 * 65 + flags,  # the bias and its flag element
    }


def test_fsdp_pairwise_wire():
    n = 8
    axes = parallel.pairwise_axes("data", n)
    names = tuple(axes)
    mesh = parallel.make_mesh(axes, devices=jax.devices()[:n])
    shapes = {"w1": (64, 256), "w2": (256, 64)}
    split = sum(int(np.prod(s)) for s in shapes.values())
    specs = {k: P(names) for k in shapes}
    sharding = NamedSharding(mesh, P(names))
    tree = {
        k: jax.ShapeDtypeStruct((n, *s), np.float32, sharding=sharding) for k, s in shapes.items()
    }
    for dtype in (jnp.bfloat16, jnp.float16):
        tx = low_precision(names, dtype, "pairwise", specs=specs)

        def body(t, tx=tx):
            out, state = tx.update({k: x[0] for k, x in t.items()}, tx.init(t))
            return {k: x[None] for k, x in out.items()}, state

        mapped = jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=(P(names), P()))
        report = wire.measure(jax.jit(mapped), tree)
        kinds = [c.kind for c in report.collectives for _ in range(c.count)]
        assert sorted(kinds) == ["all-reduce"] + ["reduce-scatter"] * 3, kinds
        assert report.by_kind() == {
            "reduce-scatter": (n - 1) / n * 2 * split,
            "all-reduce": 2 * (n - 1) / n * 8,
        }


def _train(tx, mesh, params, batches):
    state = parallel.init_state(tx, params, mesh)
    step = parallel.train_step(mlp_loss, tx, mesh)
    for batch in batches:
        params, state, _ = step(params, state, batch)
    return jax.tree.map(np.asarray, params), state


@pytest.mark.parametrize(
    ("dtype", "exchange"),
    [(jnp.bfloat16, "auto"), (jnp.float16, "auto"), (jnp.bfloat16, "ring")],
    ids=["bf16-all_to_all", "f16-psum", "bf16-ring"],
)
def test_fsdp_train_step_matches_the_replicated_one(dtype, exchange):
    """parallel.train_step with the MLP's kernels split over 'data' (params and Adam's
    moments 1/N per device) and `low_precision(specs=...)` before Adam gives the
    replicated run's params: the all_to_all and the psum give the same 16-bit means, so the
    params agree within float32 rounding (1e-6 of the largest entry; bfloat16 bit for
    bit, float16 within 6e-8 here). The ring's means differ from the replicated ring's
    by a 16-bit rounding here and there (its sums start on other devices), which Adam's
    normalized step (at most about lr per element) carries at about two roundings,
    2^-7 relative for bfloat16: within lr * steps * 2^-7 = 3.9e-4 (1.4e-4 here)."""
    mesh = mesh_of(4)
    params, batches = mlp_problem(7)
    adam = optax.adam(1e-2)
    whole = optax.chain(low_precision("data", dtype, exchange), adam)
    want, _ = _train(whole, mesh, parallel.replicate(params, mesh), batches)
    split = optax.chain(low_precision("data", dtype, exchange, specs=FSDP_SPECS), adam)
    placed = parallel.shard_params(params, mesh, FSDP_SPECS)
    got, state = _train(split, mesh, placed, batches)
    rtol = 1e-6 if exchange == "auto" else None
    for k in params:
        assert not np.allclose(got[k], params[k]), k  # it trained
        if rtol is not None:
            scale = np.abs(want[k]).max()
            assert np.abs(got[k] - want[k]).max() <= rtol * scale, k
        else:
            assert np.abs(got[k] - want[k]).max() <= 1e-2 * len(batches) * 2.0**-7, k
    low, adam_state = state[0], state[1][0]
    assert isinstance(low, LowPrecisionState) and low.overflow.sharding.is_fully_replicated
    assert adam_state.mu["w1"].addressable_shards[0].data.shape == (2, 16)


def test_allreduce_with_a_dtype_passes_specs_through():
    n = 2
    rows = {"w": np.arange(n * 2 * n * 3, dtype=np.float32).reshape(n, 2 * n, 3) / 7}
    specs = {"w": P("data")}
    out = {}
    for name, tx in (
        ("allreduce", gradcomm.allreduce("data", dtype=jnp.bfloat16, specs=specs)),
        ("low_precision", low_precision("data", jnp.bfloat16, specs=specs)),
    ):
        fn = jax.vmap(lambda g, tx=tx: tx.update(g, tx.init(g))[0], axis_name="data")
        out[name] = np.asarray(jax.jit(fn)(rows)["w"])
    assert out["allreduce"].shape == (n, 2, 3)  # each device's shard
    np.testing.assert_array_equal(out["allreduce"], out["low_precision"])
    mean = bf16_scheme(rows["w"]).astype(np.float32)
    np.testing.assert_array_equal(out["allreduce"], mean.reshape(n, 2, 3))


def _fsdp_on_model_mesh(exchanges, mesh, model):
    """Both formats' FSDP shards, by each of `exchanges` (keyed "exchange-dtype"), of a
    (8, 6) leaf split over 'data' by rows (and over 'model' by columns where `model`),
    beside a whole (7,) leaf, and the overflow flags; one program."""
    rng = np.random.default_rng(70)
    rows = {
        "k": rng.standard_normal((4, 8, 6)).astype(np.float32),
        "b": rng.standard_normal((4, 7)).astype(np.float32),
    }
    cols = "model" if model else None
    specs = {"k": P("data", cols), "b": P()}
    in_specs = {"k": P("data", None, cols), "b": P("data")}
    out_specs = {"k": P("data", None, cols), "b": P("data")}
    txs = {
        f"{e}-{d.name}": low_precision("data", d, e, specs=specs)
        for e in exchanges
        for d in (BF16, F16)
    }

    def body(t):
        t = {k: x[0] for k, x in t.items()}
        out = {}
        for name, tx in txs.items():
            mean, state = tx.update(t, tx.init(t))
            out[name] = ({k: x[None] for k, x in mean.items()}, state.overflow)
        return out

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(in_specs,), out_specs={d: (out_specs, P()) for d in txs}
    )
    placed = {k: jax.device_put(x, NamedSharding(mesh, in_specs[k])) for k, x in rows.items()}
    return jax.tree.map(np.asarray, jax.jit(mapped)(placed))


def test_fsdp_leaf_also_split_over_a_model_axis():
    """A leaf split over 'data' by rows (FSDP) and over 'model' by columns, on a (data 4,
    model 2) mesh: each device's piece of its shard is the same bits as the shard on the
    4 data devices alone, by the all_to_all, psum and ring schemes (for the ring too: a row
    is a shard, wherever its columns lie), and the flags are reduced over both axes (the
    state leaves the map replicated)."""
    exchanges = ("all_to_all", "psum", "ring")
    _, two, one = _model_meshes(exchanges[0])
    got = _fsdp_on_model_mesh(exchanges, two, model=True)
    want = _fsdp_on_model_mesh(exchanges, one, model=False)
    assert sorted(got) == sorted(f"{e}-{d.name}" for e in exchanges for d in (BF16, F16))
    for name in got:
        (mean, overflow), (whole, _) = got[name], want[name]
        assert mean["k"].shape == (4, 2, 6) and not overflow
        for key in mean:
            np.testing.assert_array_equal(mean[key], whole[key], err_msg=f"{name} {key}")
