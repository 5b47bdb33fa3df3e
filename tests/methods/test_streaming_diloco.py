"""gradcomm.streaming_diloco: fragments of the model take DiLoCo's outer step in turn.

Held against a float64 NumPy transcription of Streaming DiLoCo (Douillard et al. 2025,
Algorithm 1): strided fragments, each synced every H steps at its own offset, the mean
outer gradient applied tau steps later and mixed with alpha, outer gradients sent as 4-bit
E3M0 floats (or bfloat16) and summed in float64 here, float32 in the library.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import mesh_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel, wire
from gradcomm.streaming_diloco import StreamingDilocoState, fragment_of_leaves, streaming_diloco
from gradcomm.streaming_diloco._codecs import decode_e3m0, encode_e3m0

INNER_LR, OUTER_LR, MOMENTUM = 0.1, 0.7, 0.9
SHAPES = {"l0": {"b": (3,), "w": (4, 3)}, "l1": {"b": (2,), "w": (3, 2)}, "l2": {"b": (5,)}}
NAMES = ["l0.b", "l0.w", "l1.b", "l1.w", "l2.b"]  # tree order
LAYER = [0, 0, 1, 1, 2]


def params0(seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: rng.standard_normal(s).astype(np.float32),
        SHAPES,
        is_leaf=lambda s: isinstance(s, tuple),
    )


def grads_of(steps, n, seed=1):
    """Each device's gradient at each step, `(steps, n, *shape)` per leaf."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: rng.standard_normal((steps, n, *s)).astype(np.float32),
        SHAPES,
        is_leaf=lambda s: isinstance(s, tuple),
    )


# ---- the float64 reference, from the paper ----

LEVELS = np.array([0.0] + [2.0**k for k in range(-6, 1)])  # E3M0's magnitudes, times a scale


def quantize_e3m0(x):
    """Each row of `x` to the nearest of +-LEVELS times the row's largest magnitude."""
    scale = np.max(np.abs(x), axis=-1, keepdims=True)
    r = np.abs(x) / np.where(scale > 0, scale, 1)
    distance = np.abs(r[..., None] - LEVELS)
    nearest = len(LEVELS) - 1 - np.argmin(distance[..., ::-1], axis=-1)  # ties upward
    return np.sign(x) * LEVELS[nearest] * scale


def encoded(x, dtype, n):
    """`x` (flat) as it travels: zero-padded to a multiple of 2n, split into n rows."""
    width = -(-x.size // (2 * n)) * 2
    rows = np.pad(x, (0, n * width - x.size)).reshape(n, width)
    if dtype == "bfloat16":
        return rows.astype(ml_dtypes.bfloat16).astype(np.float64)
    return quantize_e3m0(rows)


def exchange_mean(deltas, dtype):
    """The mean over devices of flat `deltas` (n, size) as the exchange forms it."""
    n, size = deltas.shape
    if dtype == "float32":
        return deltas.mean(0)
    sent = np.stack([encoded(d, dtype, n) for d in deltas])  # (n devices, n rows, width)
    mean_rows = sent.sum(0) / n  # row j summed by device j
    regathered = np.concatenate([encoded(r, dtype, 1).reshape(-1) for r in mean_rows])
    return regathered[:size]


def reference(params, grads, n, every, fragments, delay, alpha, dtype, eager=False):
    """Algorithm 1 in float64: each device's flat leaves after each step. With `eager`,
    Kale et al.'s eager updates: each device's outer step on its own outer gradient now
    and the others' mean from the last period, with its own anchor and momentum."""
    if eager:
        return eager_reference(params, grads, n, every, fragments, dtype)
    leaves = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(params)]
    g = [np.asarray(x, np.float64).reshape(*x.shape[:2], -1) for x in jax.tree.leaves(grads)]
    frag = [layer % fragments for layer in LAYER]
    local = [np.repeat(x[None], n, 0) for x in leaves]
    anchor = [x.copy() for x in leaves]
    momentum = [np.zeros_like(x) for x in leaves]
    pending = {}
    offsets = {p: (p + 1) * every // fragments % every for p in range(fragments)}
    history = []
    for step in range(1, g[0].shape[0] + 1):
        for i, x in enumerate(local):  # inner SGD on each device's own gradient
            x -= INNER_LR * g[i][step - 1]
        for p, offset in offsets.items():
            if step % every == offset:  # fragment p sends its outer gradient
                for i in (i for i, f in enumerate(frag) if f == p):
                    pending[i] = exchange_mean(anchor[i][None] - local[i], dtype)
            if step >= delay + 1 and (step - delay) % every == offset:  # it lands
                for i in (i for i, f in enumerate(frag) if f == p):
                    delta = pending.pop(i)
                    momentum[i] = MOMENTUM * momentum[i] + delta  # outer Nesterov
                    anchor[i] = anchor[i] - OUTER_LR * (delta + MOMENTUM * momentum[i])
                    mixed = alpha * local[i] + (1 - alpha) * anchor[i] if delay else anchor[i]
                    local[i] = np.broadcast_to(mixed, local[i].shape).copy()
        history.append([x.copy() for x in local])
    return history


def eager_reference(params, grads, n, every, fragments, dtype):
    leaves = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(params)]
    g = [np.asarray(x, np.float64).reshape(*x.shape[:2], -1) for x in jax.tree.leaves(grads)]
    frag = [layer % fragments for layer in LAYER]
    local = [np.repeat(x[None], n, 0) for x in leaves]
    anchor = [x.copy() for x in local]  # one per device
    momentum = [np.zeros_like(x) for x in local]
    own = [np.zeros_like(x) for x in local]  # each device's last outer gradient
    mean = [np.zeros_like(x) for x in leaves]  # their mean, exchanged over the period
    history = []
    for step in range(1, g[0].shape[0] + 1):
        for i, x in enumerate(local):
            x -= INNER_LR * g[i][step - 1]
        for p in range(fragments):
            if step % every != (p + 1) * every // fragments % every:
                continue
            for i in (i for i, f in enumerate(frag) if f == p):
                delta = anchor[i] - local[i]  # (n, size)
                proxy = mean[i][None] + (delta - own[i]) / n
                momentum[i] = MOMENTUM * momentum[i] + proxy
                anchor[i] = anchor[i] - OUTER_LR * (proxy + MOMENTUM * momentum[i])
                local[i] = anchor[i].copy()
                own[i] = delta
                mean[i] = exchange_mean(delta, dtype)  # lands by the next period
        history.append([x.copy() for x in local])
    return history


# ---- the library, in a hand-written shard_map loop ----


@functools.cache
def looped(n, every, fragments, delay, alpha, dtype, eager=False):
    sync = streaming_diloco("data", every=every, fragments=fragments, delay=delay,
                            alpha=alpha, outer_dtype=dtype, eager=eager)  # fmt: skip
    tx = optax.sgd(INNER_LR)

    def loop(p, g):
        p = jax.tree.map(lambda x: x[0], p)

        def one(carry, g):
            p, opt_state, sync_state = carry
            updates, opt_state = tx.update(g, opt_state, p)
            p, sync_state = sync.update(optax.apply_updates(p, updates), sync_state)
            return (p, opt_state, sync_state), p

        g = jax.tree.map(lambda x: x[:, 0], g)
        _, history = jax.lax.scan(one, (p, tx.init(p), sync.init(p)), g)
        return jax.tree.map(lambda x: x[:, None], history)

    mesh = mesh_of(n)
    specs = (P("data"), P(None, "data"))
    fn = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=specs, out_specs=P(None, "data")))
    return mesh, fn


def run(n, every, fragments, delay, alpha, dtype, steps, eager=False):
    mesh, fn = looped(n, every, fragments, delay, alpha, dtype, eager)
    p = parallel.per_device(params0(), mesh)
    g = jax.device_put(grads_of(steps, n), NamedSharding(mesh, P(None, "data")))
    history = jax.tree.map(np.asarray, fn(p, g))
    return [np.asarray(x).reshape(steps, n, -1) for x in jax.tree.leaves(history)]


CASES = [  # n, H, P, tau, alpha, outer dtype, eager
    (1, 4, 2, 0, None, "e3m0", False),
    (3, 4, 2, 1, 0.5, "e3m0", False),
    (8, 6, 3, 2, 0.25, "e3m0", False),
    (4, 4, 1, 3, 0.5, "float32", False),
    (2, 6, 3, 0, None, "bfloat16", False),
    (5, 2, 2, 1, 0.0, "bfloat16", False),
    (3, 4, 2, None, None, "e3m0", True),
    (4, 1, 1, None, None, "float32", True),
]


@pytest.mark.parametrize(("n", "every", "fragments", "delay", "alpha", "dtype", "eager"), CASES)
def test_matches_the_float64_algorithm(n, every, fragments, delay, alpha, dtype, eager):
    steps = 3 * every + (delay or 0) + 1
    got = run(n, every, fragments, delay, alpha, dtype, steps, eager)
    want = reference(params0(), grads_of(steps, n), n, every, fragments, delay,
                     0.5 if alpha is None else alpha, dtype, eager)  # fmt: skip
    for step in range(steps):
        for i, name in enumerate(NAMES):
            np.testing.assert_allclose(
                got[i][step], want[step][i], rtol=1e-5, atol=1e-5, err_msg=f"{name} step {step + 1}"
            )


def test_a_named_vmap_matches_the_float64_algorithm():
    """Eager updates with E3M0 outer gradients (each device's anchor, the 4-bit exchange,
    whose first operand is the same zeros on every device) under a named `jax.vmap`, the
    steps in a `lax.scan`. `pmap` is left out: its axis is manual, as `shard_map`'s
    (`gradcomm._axes.is_manual`), and it compiled this loop in 8-15 s against vmap's 2."""
    n, every, fragments, steps = 3, 2, 2, 5
    sync = streaming_diloco("data", every=every, fragments=fragments, eager=True)
    tx = optax.sgd(INNER_LR)

    def loop(p, g):
        def one(carry, g):
            p, opt_state, sync_state = carry
            updates, opt_state = tx.update(g, opt_state, p)
            p, sync_state = sync.update(optax.apply_updates(p, updates), sync_state)
            return (p, opt_state, sync_state), p

        return jax.lax.scan(one, (p, tx.init(p), sync.init(p)), g)[1]

    mapped = jax.jit(jax.vmap(loop, axis_name="data"))
    p = jax.tree.map(lambda x: np.broadcast_to(x, (n, *x.shape)), params0())
    grads = grads_of(steps, n)
    history = mapped(p, jax.tree.map(lambda x: np.swapaxes(x, 0, 1), grads))
    got = [np.swapaxes(np.asarray(x), 0, 1).reshape(steps, n, -1) for x in jax.tree.leaves(history)]
    want = reference(params0(), grads, n, every, fragments, None, 0.5, "e3m0", eager=True)
    for step in range(steps):
        for i, name in enumerate(NAMES):
            np.testing.assert_allclose(
                got[i][step], want[step][i], rtol=1e-5, atol=1e-5, err_msg=f"{name} step {step + 1}"
            )


def test_e3m0_codes_are_the_nearest_level_and_special_inputs():
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal(200) * 10.0 ** rng.integers(-3, 3, 200),
        [0.0, -0.0, 1e-38, -1e-45, 0.75, -0.375, 2.0**-7, 3 * 2.0**-8],  # ties go upward
    ]).astype(np.float32)  # fmt: skip
    scale = np.float32(np.max(np.abs(x)))
    got = np.asarray(decode_e3m0(encode_e3m0(jnp.asarray(x), scale), scale))
    np.testing.assert_array_equal(got, quantize_e3m0(np.append(x, scale)[None])[0, :-1]
                                  .astype(np.float32))  # fmt: skip
    one = jnp.float32(1.0)
    ties = np.asarray(decode_e3m0(encode_e3m0(jnp.asarray([0.75, 2.0**-7, -0.375]), one), one))
    np.testing.assert_array_equal(ties, [1.0, 2.0**-6, -0.5])
    # A zero slice sends zeros; a huge one keeps its scale; a non-finite one decodes as NaN.
    for scale, values in [(0.0, [0.0, 0.0]), (3e38, [3e38, -3e38 * 2.0**-6])]:
        s = jnp.float32(scale)
        values = np.asarray(values, np.float32)
        np.testing.assert_array_equal(decode_e3m0(encode_e3m0(jnp.asarray(values), s), s), values)
    for bad in (np.inf, np.nan):
        s = jnp.float32(bad)
        assert np.isnan(decode_e3m0(encode_e3m0(jnp.asarray([1.0, 0.0]), s), s)).all()
    assert int(jnp.max(encode_e3m0(jnp.asarray(x), scale))) < 16


def test_e3m0_decode_is_the_exact_level_wherever_it_is_normal():
    # Every code at scales across float32's whole range (every exponent, random mantissas):
    # the float64 level rounded to float32, wherever that is a normal number; NaN where the
    # scale is not finite.
    rng = np.random.default_rng(1)
    exponents = np.repeat(np.arange(1, 255, dtype=np.uint32), 8) << 23
    bits = exponents | rng.integers(0, 2**23, exponents.size, dtype=np.uint32)
    scale = np.append(bits.view(np.float32), [np.inf, np.nan])[:, None]
    codes = np.arange(16, dtype=np.uint8)[None]
    got = np.asarray(decode_e3m0(jnp.asarray(codes), jnp.asarray(scale)))
    e = (codes & 7).astype(int)
    want = np.where(e > 0, np.ldexp(scale.astype(np.float64), e - 7), 0.0)
    want = np.where(codes & 8, -want, want)
    normal = np.isfinite(scale) & (np.abs(want) >= np.finfo(np.float32).tiny)
    np.testing.assert_array_equal(got[normal], want[normal].astype(np.float32))
    assert np.all(np.isnan(got[~np.isfinite(scale)[:, 0]]))
    assert np.all(got[np.isfinite(scale) & (e == 0)] == 0)


def test_non_finite_outer_gradients_reach_the_params_as_nan():
    n, steps = 2, 2
    mesh, fn = looped(n, 2, 1, 0, None, "e3m0")
    p = parallel.per_device(params0(), mesh)
    g = grads_of(steps, n)
    g["l0"]["w"][0, 1, 0, 0] = np.inf
    history = fn(p, jax.device_put(g, NamedSharding(mesh, P(None, "data"))))
    # The infinity's slice (entries 0-5 of l0.w: 12 entries in 2 slices of 6) has an
    # infinite scale, and comes back NaN on every device; the rest is kept.
    w = np.asarray(history["l0"]["w"][-1]).reshape(n, -1)
    assert np.isnan(w[:, :6]).all() and np.isfinite(w[:, 6:]).all()
    assert all(
        np.isfinite(np.asarray(x[-1])).all()
        for k, x in jax.tree_util.tree_leaves_with_path(history)
        if jax.tree_util.keystr(k) != "['l0']['w']"
    )


def train(n, sync, steps, seed=1):
    """Per-device params after each step of `train_step` with inner SGD on the loss
    sum(params * g), g each device's gradient of the step."""
    mesh = mesh_of(n)
    tx = optax.sgd(INNER_LR)
    p = parallel.per_device(params0(), mesh)
    state = parallel.init_state(tx, p, mesh, params_per_device=True, sync=sync)

    def loss(q, g):
        return sum(jnp.sum(a * b[0]) for a, b in zip(*map(jax.tree.leaves, (q, g)), strict=True))

    step = parallel.train_step(loss, tx, mesh, params_per_device=True, sync=sync)
    grads = grads_of(steps, n, seed)
    history = []
    for t in range(steps):
        batch = jax.tree.map(lambda x, t=t: x[t], grads)
        p, state, _ = step(p, state, batch)
        history.append(jax.tree.map(np.asarray, p))
    return history, state, (step, p, batch)


def test_one_fragment_without_delay_in_float32_is_diloco_bit_for_bit():
    n, every = 4, 3
    ours, state, _ = train(n, streaming_diloco("data", every=every, fragments=1, delay=0,
                                               outer_dtype="float32"), 2 * every)  # fmt: skip
    theirs, _, _ = train(n, gradcomm.diloco("data", every=every), 2 * every)
    for a, b in zip(ours, theirs, strict=True):
        jax.tree.map(np.testing.assert_array_equal, a, b)
    assert isinstance(state.sync, StreamingDilocoState) and int(state.sync.count) == 2 * every
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state.sync))


def test_train_step_matches_the_hand_written_loop():
    n, every, fragments, delay = 3, 4, 2, 1
    sync = streaming_diloco("data", every=every, fragments=fragments, delay=delay)
    history, _, _ = train(n, sync, 2 * every)
    looped_history = run(n, every, fragments, delay, None, "e3m0", 2 * every)
    for t, p in enumerate(history):
        for i, leaf in enumerate(jax.tree.leaves(p)):
            np.testing.assert_array_equal(leaf.reshape(n, -1), looped_history[i][t])


def test_wire_peak_is_one_fragment_and_e3m0_an_eighth():
    """Peak (the worst step) and average bytes per step, read from the compiled step."""
    n, every = 4, 4

    def measured(sync):
        _, state, (step, p, batch) = train(n, sync, 1)
        return wire.measure(step, p, state, batch)

    whole = measured(gradcomm.diloco("data", every=every))
    fp32 = measured(streaming_diloco("data", every=every, fragments=2, outer_dtype="float32"))
    fp4 = measured(streaming_diloco("data", every=every, fragments=2))
    size = sum(np.prod(s) for s in jax.tree.leaves(SHAPES, is_leaf=lambda s: isinstance(s, tuple)))
    loss = whole.steady  # every step's mean loss, outside the conditionals
    assert fp32.steady == fp4.steady == loss and fp4.period == every
    assert whole.total - loss == pytest.approx(2 * (n - 1) / n * 4 * size)
    assert fp32.average == pytest.approx(whole.average)  # the same bytes, spread over H
    frag0 = 4 * (3 + 12 + 5)  # l0 and l2 (strided): the larger fragment is the peak
    assert fp32.total - loss == pytest.approx(2 * (n - 1) / n * frag0)
    # E3M0: half a byte an entry (each leaf padded to 2n), a float32 scale per slice, each way.
    padded = sum(-(-s // (2 * n)) * 2 * n for s in (3, 12, 5))
    assert fp4.total - loss == pytest.approx(2 * (n - 1) / n * (padded / 2 + 4 * 3 * n))


def test_bad_arguments_raise():
    for kwargs, message in [
        ({"every": 0}, "every must be a positive int"),
        ({"fragments": 0}, "fragments must be a positive int"),
        ({"every": 6, "fragments": 4}, r"fragments \(4\) must divide every \(6\)"),
        ({"every": 4, "delay": 4}, r"delay \(4\) must be less than every \(4\)"),
        ({"delay": -1}, "delay must be"),
        ({"delay": 0, "alpha": 0.5}, "without a delay the fragment is set to the global"),
        ({"alpha": 1.5}, r"alpha must be a float in \[0, 1\]"),
        ({"outer_dtype": "float16"}, "outer_dtype must be one of"),
        ({"outer": 0.7}, r"outer must be an optax\.GradientTransformation"),
        ({"eager": True, "delay": 1}, "eager updates overlap the whole period"),
        ({"eager": 1}, "eager must be True or False"),
    ]:
        with pytest.raises(ValueError, match=message):
            streaming_diloco("data", **kwargs)
    with pytest.raises(ValueError, match="4 fragments but the params have 3 layers"):
        streaming_diloco("data", every=4, fragments=4).init(params0())
    with pytest.raises(ValueError, match="floating"):
        streaming_diloco("data", fragments=1).init(jnp.ones(3, jnp.int32))
    assert fragment_of_leaves(params0(), 2) == [0, 0, 1, 1, 0]


def test_eager_keeps_each_devices_anchor_and_outer_state_per_device():
    n, every = 3, 2
    sync = gradcomm.diloco("data", every=every, eager=True)
    history, state, _ = train(n, sync, 2 * every + 1)
    looped_history = run(n, every, 1, None, None, "float32", 2 * every + 1, eager=True)
    for t, p in enumerate(history):
        for i, leaf in enumerate(jax.tree.leaves(p)):
            np.testing.assert_array_equal(leaf.reshape(n, -1), looped_history[i][t])
    per_device = lambda tree: [x.shape[0] == n and not x.sharding.is_fully_replicated  # noqa: E731
                               for x in jax.tree.leaves(tree)]  # fmt: skip
    s = state.sync
    assert all(per_device((s.anchor, s.outer_state, s.own)))
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves((s.pending, s.count)))
    anchors = np.asarray(s.anchor["l0"]["w"])
    assert not np.array_equal(anchors[0], anchors[1])  # they drift apart by each one's share
