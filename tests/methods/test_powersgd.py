"""PowerSGD against a float64 NumPy reference of Algorithms 1 and 2, on 1 to 8 devices."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_of, per_device
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import _axes, parallel, wire
from gradcomm.powersgd import PowerSgdState, powersgd

# The module itself: once gradcomm/__init__.py imports the function, `gradcomm.powersgd`
# names the function, as `gradcomm.adasum` does.
psgd = importlib.import_module("gradcomm.powersgd")

RANK = 2
# In tree order: b, conv, s, thin, w. conv is 36 x 5 (rate 180 / 82 = 2.2) and w 12 x 8
# (96 / 40 = 2.4): compressed; thin (24 / 20 = 1.2), the vector and the scalar: dense.
SHAPES = {"w": (12, 8), "conv": (3, 3, 4, 5), "thin": (6, 4), "b": (7,), "s": ()}
COMPRESSED = ["conv", "w"]
DENSE = ["b", "s", "thin"]
# float32 results are within 4 roundings of the float64 reference's largest entry at N = 1
# to 8 (measured); low-precision ones within 1 (the reference rounds what is stored).
ULPS = {np.float32: 16, jnp.bfloat16: 2, jnp.float16: 2}


def assert_close(got, want, dtype=np.float32, err_msg=""):
    """|got - want| <= ULPS[dtype] roundings of `dtype` at the scale of want's largest entry."""
    want = np.asarray(want, np.float64)
    atol = ULPS[dtype] * float(jnp.finfo(dtype).eps) * np.abs(want).max()
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, rtol=0, atol=atol, err_msg=err_msg
    )


# ------------------------------------------------------------------------------------------
# Float64 reference, straight from the paper


def ref_orthogonalize(p):
    """Gram-Schmidt on the columns in order, each projected out twice; zero stays zero."""
    out = np.zeros_like(p)
    for j in range(p.shape[1]):
        c = p[:, j].copy()
        for _ in range(2):
            c = c - out[:, :j] @ (out[:, :j].T @ c)
        norm = np.linalg.norm(c)
        out[:, j] = c / norm if norm > 0 else 0.0
    return out


def ref_step(grads, residuals, q, dtype=np.float32):
    """Algorithm 1 (one warm-started power step) with Algorithm 2's error feedback, on one
    leaf's matrices, one per device. The residuals are stored in `dtype`."""
    ms = [g + e for g, e in zip(grads, residuals, strict=True)]
    p = ref_orthogonalize(np.mean([m @ q for m in ms], 0))
    new_q = np.mean([m.T @ p for m in ms], 0)
    approx = p @ new_q.T
    residuals = [(m - approx).astype(dtype).astype(np.float64) for m in ms]
    return approx, residuals, np.where(np.any(new_q != 0, axis=0), new_q, q)


def reference(updates, q0):
    """Every step of the tree of `updates` `{key: (n, steps, *shape)}` from Q's `q0`, the
    residuals stored in each leaf's dtype.

    Returns the outputs `{key: (steps, *shape)}`, the residuals `{key: (n, steps, *shape)}`
    and the Q's `{key: (steps, cols, rank)}` of the compressed leaves, in float64.
    """
    outs, residuals, qs = {}, {}, {}
    for key, x in updates.items():
        dtype, x = x.dtype, np.asarray(x, np.float64)
        n, steps, shape = x.shape[0], x.shape[1], x.shape[2:]
        if key not in COMPRESSED:
            outs[key] = x.mean(0)
            continue
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        e = [np.zeros((rows, cols))] * n
        q = np.asarray(q0[key], np.float64)
        out, res, qq = [], [], []
        for t in range(steps):
            approx, e, q = ref_step([x[p, t].reshape(rows, cols) for p in range(n)], e, q, dtype)
            out.append(approx.reshape(shape))
            res.append([r.reshape(shape) for r in e])
            qq.append(q)
        outs[key] = np.stack(out)
        residuals[key] = np.stack(res, axis=1)
        qs[key] = np.stack(qq)
    return outs, residuals, qs


# ------------------------------------------------------------------------------------------
# Running the method on simulated devices


@functools.cache
def steps_fn(steps, rank):
    """Per device: `steps` updates from a fresh state (a `lax.scan`, compiled once); the
    outputs and states, stacked."""
    tx = powersgd("data", rank)

    def f(updates):
        state = tx.init(jax.tree.map(lambda u: u[0], updates))
        # The residuals differ per device from the first step on: typed so from the start.
        residual = jax.tree.map(lambda r: _axes.vary(r, "data"), state.residual)
        state = state._replace(residual=residual)

        def body(state, u):
            out, state = tx.update(u, state)
            return state, (out, state)

        return lax.scan(body, state, updates)[1]

    return f


@functools.cache
def initial_q():
    """The Q's `tx.init` draws, by compressed leaf name (the same on every device)."""
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    state = jax.jit(powersgd("data", RANK).init)(params)
    return dict(zip(COMPRESSED, map(np.asarray, state.q), strict=True))


def random_updates(n, steps, seed, dtype=np.float32, scale=1.0):
    """Per-device updates `{key: (n, steps, *shape)}`; `dtype` one, or one per key."""
    rng = np.random.default_rng(seed)
    dtypes = dtype if isinstance(dtype, dict) else dict.fromkeys(SHAPES, dtype)
    return {
        k: (scale * rng.standard_normal((n, steps, *s))).astype(dtypes[k])
        for k, s in SHAPES.items()
    }


def run(n, updates, steps, rank=RANK):
    """Outputs, residuals and Q's (`{key: (steps, cols, rank)}`), with every device's
    output and Q checked to be the same bits."""
    outs, states = per_device(steps_fn(steps, rank), n, updates)
    for leaf in jax.tree.leaves((outs, states.q)):
        for row in leaf[1:]:
            np.testing.assert_array_equal(row, leaf[0])  # the same bits on every device
    names = [k for k in sorted(SHAPES) if psgd.compresses(SHAPES[k], rank, 2.0)]
    qs = dict(zip(names, (q[0] for q in states.q), strict=True))
    return {k: v[0] for k, v in outs.items()}, states.residual, qs


# ------------------------------------------------------------------------------------------
# The reference, over steps, devices and dtypes


# One device, pairs, an odd count, a full byte (4: the state and train_step tests). The
# properties of CHECKS[n] run on the same program (one per N).
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_matches_the_reference_over_three_steps(n):
    """Outputs, residuals and Q's within float32's rounding of the float64 reference; then
    the properties of CHECKS[n]."""
    steps = 3
    updates = random_updates(n, steps, n)
    outs, residuals, qs = run(n, updates, steps)
    want, want_residuals, want_qs = reference(updates, initial_q())
    for key in SHAPES:
        assert outs[key].dtype == np.float32
        assert_close(outs[key], want[key], err_msg=key)
    for key in COMPRESSED:
        assert_close(residuals[key], want_residuals[key], err_msg=key)
        assert_close(qs[key], want_qs[key], err_msg=key)
        # Error feedback loses nothing: the updates so far plus the devices' mean residual
        # are the sum of the mean gradients.
        total = outs[key].sum(0) + residuals[key][:, -1].mean(0)
        assert_close(total, updates[key].astype(np.float64).mean(0).sum(0))
    for key in DENSE:  # averaged as they are, with no residual
        np.testing.assert_array_equal(residuals[key], 0)
    for check in CHECKS.get(n, ()):
        check(n)


LOW = {"w": jnp.bfloat16, "conv": jnp.float16, "thin": jnp.bfloat16, "b": jnp.float16,
       "s": jnp.bfloat16}  # fmt: skip


def test_bfloat16_and_float16_within_their_rounding():
    """Outputs in the leaf's dtype, residuals stored in it, Q in float32: within the leaf
    dtype's rounding of the reference, which rounds the stored residuals likewise."""
    n, steps = 3, 3
    updates = random_updates(n, steps, 7, dtype=LOW)
    outs, residuals, qs = run(n, updates, steps)
    want, want_residuals, _ = reference(updates, initial_q())
    for key, dtype in LOW.items():
        assert outs[key].dtype == dtype
        assert_close(outs[key], want[key], dtype, err_msg=key)
    for key in COMPRESSED:
        assert residuals[key].dtype == LOW[key]
        assert qs[key].dtype == np.float32  # the factors are computed in float32
        assert_close(residuals[key], want_residuals[key], LOW[key], err_msg=key)


# ------------------------------------------------------------------------------------------
# Zeros, the limits of the float range, non-finite values


# The properties below run on the reference test's programs (CHECKS), at n devices.


def zero_gradients_give_zeros_and_keep_q(n):
    """Zero gradients: zero updates and residuals, no NaN, and Q kept as it was (a zero Q
    would stay zero in every later step); the next step is the reference's."""
    steps = 3
    updates = random_updates(n, steps, 3)
    for key in SHAPES:
        updates[key][:, :2] = 0  # two zero steps, then a random one
    outs, residuals, qs = run(n, updates, steps)
    q0 = initial_q()
    for key in SHAPES:
        np.testing.assert_array_equal(outs[key][:2], 0)
        np.testing.assert_array_equal(residuals[key][:, :2], 0)
    for key in COMPRESSED:
        np.testing.assert_array_equal(qs[key][:2], np.broadcast_to(q0[key], (2, *q0[key].shape)))
    want, _, _ = reference(updates, q0)
    for key in SHAPES:
        assert np.abs(outs[key][2]).max() > 0
        assert_close(outs[key], want[key], err_msg=key)


def tiny_and_huge_float32_gradients(n):
    """Gradients of 1e-30 or 1e30 in float32 give the reference's result, to float32's
    precision: no product or norm under- or overflows (Q and P are scaled by powers of
    two before them)."""
    steps = 3
    for scale in (1e-30, 1e30):
        updates = random_updates(n, steps, 5, scale=scale)
        outs, residuals, qs = run(n, updates, steps)
        want, want_residuals, _ = reference(updates, initial_q())
        for key in SHAPES:
            assert np.isfinite(outs[key]).all()
            assert_close(outs[key], want[key], err_msg=key)
        for key in COMPRESSED:
            assert np.isfinite(qs[key]).all()
            assert_close(residuals[key], want_residuals[key], err_msg=key)


def nan_or_inf_on_one_device_poisons_the_leaf_everywhere(n):
    """A NaN (or an infinity) in one device's leaf makes that leaf's whole update NaN on
    every device, and its Q and residuals NaN; the other leaves are untouched."""
    steps = 3
    updates = random_updates(n, steps, 6)
    updates["w"][1, 0, 2, 3] = np.nan
    updates["conv"][2, 0, 1, 1, 0, 4] = np.inf
    updates["b"][0, 0, 5] = np.nan
    outs, residuals, qs = run(n, updates, steps)
    clean = random_updates(n, steps, 6)
    want, _, _ = reference(clean, initial_q())
    for key in ("w", "conv"):  # and in every later step
        assert np.isnan(outs[key]).all()
        assert np.isnan(residuals[key]).all()
        assert np.isnan(qs[key]).all()
    b = outs["b"][0]
    assert np.isnan(b[5]) and np.isfinite(np.delete(b, 5)).all()  # a dense leaf: that entry
    assert_close(outs["b"][1:], want["b"][1:])
    for key in ("s", "thin"):
        assert_close(outs[key], want[key], err_msg=key)


# ------------------------------------------------------------------------------------------
# The dense path, low rank, the wire


def dense_means(updates):
    """`allreduce` on each step's updates `(steps, ...)`, per device."""
    tx = gradcomm.allreduce("data")
    steps = len(next(iter(updates.values())))
    return [tx.update({k: u[t] for k, u in updates.items()}, None)[0] for t in range(steps)]


def vectors_and_low_rate_leaves_are_the_dense_mean(n):
    """Leaves that are not compressed are `allreduce`'s mean, bit for bit, and keep no Q."""
    steps = 3
    updates = random_updates(n, steps, 8)
    outs, residuals, qs = run(n, updates, steps)
    dense = per_device(dense_means, n, {k: updates[k] for k in DENSE})
    for t, means in enumerate(dense):
        for key in DENSE:
            np.testing.assert_array_equal(outs[key][t], means[key][0])
            np.testing.assert_array_equal(residuals[key][:, t], 0)
    assert list(qs) == COMPRESSED


def test_the_compression_rule():
    """Compressed where rank <= min(m, n) and m n / (rank (m + n)) > min_compression_rate
    (strictly, as PyTorch's hook); conv kernels as (H W in, out)."""
    assert psgd.matrix_shape((3, 3, 16, 32)) == (144, 32)
    assert psgd.matrix_shape((7,)) is None and psgd.matrix_shape(()) is None
    assert psgd.compresses((8, 8), 2, 1.99) and not psgd.compresses((8, 8), 2, 2.0)  # rate 2
    assert not psgd.compresses((6, 4), 2, 2.0) and psgd.compresses((6, 4), 2, 1.0)
    assert not psgd.compresses((100, 3), 4, 0.1)  # rank above min(m, n)
    assert not psgd.compresses((0, 5), 1, 0.1)
    params = {"a": jnp.zeros((6, 4)), "k": jnp.zeros((2, 2, 3, 8)), "v": jnp.zeros(50)}
    state = powersgd("data", 2, min_compression_rate=1.0).init(params)
    assert [q.shape for q in state.q] == [(4, 2), (8, 2)]
    assert powersgd("data", 2).init(params).q[0].shape == (8, 2)  # a alone is dense
    assert jax.tree.structure(state.residual) == jax.tree.structure(params)


def recovers_a_low_rank_gradient(n):
    """A gradient of rank <= r, the same on every device, comes back exactly (to float32
    rounding), also where its rank is below r (P's extra column stays orthogonal). (Rank 1
    with r = 1: `powersgd`'s docstring example.)"""
    steps = 3
    for true_rank in (2, 1):
        rng = np.random.default_rng(true_rank)

        def low_rank(shape, rng=rng, true_rank=true_rank):
            rows, cols = int(np.prod(shape[:-1])), shape[-1]
            g = rng.standard_normal((rows, true_rank)) @ rng.standard_normal((true_rank, cols))
            return np.broadcast_to(g.reshape(shape), (n, steps, *shape)).astype(np.float32)

        updates = {k: low_rank(s) if k in COMPRESSED else random_updates(n, steps, 0)[k]
                   for k, s in SHAPES.items()}  # fmt: skip
        outs, residuals, _ = run(n, updates, steps)  # rank 2
        for key in COMPRESSED:
            g = updates[key][0, 0]
            for t in range(steps):
                assert_close(outs[key][t], g, err_msg=(key, true_rank))
                for p in range(n):  # nothing left behind
                    assert_close(residuals[key][p, t] + g, g, err_msg=(key, true_rank))


CHECKS = {
    2: (
        zero_gradients_give_zeros_and_keep_q,
        tiny_and_huge_float32_gradients,
        recovers_a_low_rank_gradient,
    ),
    3: (
        nan_or_inf_on_one_device_poisons_the_leaf_everywhere,
        vectors_and_low_rate_leaves_are_the_dense_mean,
    ),
}


def test_orthogonalize():
    rng = np.random.default_rng(0)
    p = rng.standard_normal((9, 4))
    p[:, 2] = 2 * p[:, 0] - p[:, 1]  # dependent: rounding noise after the projections
    p[:, 3] = 0
    orthogonalize = jax.jit(psgd.orthogonalize)
    got = np.asarray(orthogonalize(jnp.asarray(p, jnp.float32)), np.float64)
    np.testing.assert_array_equal(got[:, 3], 0)
    np.testing.assert_allclose(got[:, :3].T @ got[:, :3], np.eye(3), atol=1e-6)  # orthonormal
    np.testing.assert_allclose(got[:, :2], ref_orthogonalize(p)[:, :2], atol=1e-6)
    for scale in (1e-30, 1e30):  # no under- or overflow in the norms
        scaled = orthogonalize(jnp.asarray(p[:, :2] * scale, jnp.float32))
        np.testing.assert_allclose(scaled, got[:, :2], atol=1e-6)
    zeros = orthogonalize(jnp.zeros((9, 2)))
    np.testing.assert_array_equal(zeros, 0)


def test_wire_bytes_are_two_all_reduces_of_the_factors():
    """N = 4: 2 (N - 1) / N * r (m + n) * 4 bytes per compressed float32 leaf, plus the
    dense leaves' all-reduce, all under the method's `exchange` scope. (XLA:CPU
    all-reduces bfloat16 in float32: a bfloat16 leaf would read as 4 bytes an element here,
    on the dense path as under `allreduce`.)"""
    n = 4
    mesh = mesh_of(n)
    tx = powersgd("data", RANK)

    def body(g):
        g = jax.tree.map(lambda x: x[0], g)
        return jax.tree.map(lambda x: x[None], tx.update(g, tx.init(g))[0])

    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    sharding = NamedSharding(mesh, P("data"))
    args = {
        k: jax.ShapeDtypeStruct((n, *s), jnp.float32, sharding=sharding) for k, s in SHAPES.items()
    }
    text = mapped.lower(args).compile().as_text()
    report = wire.analyze_hlo(text)
    factors = dense = 0
    for shape in SHAPES.values():
        if psgd.compresses(shape, RANK, 2.0):
            factors += RANK * sum(psgd.matrix_shape(shape)) * 4
        else:
            dense += int(np.prod(shape)) * 4
    assert set(report.by_kind()) == {"all-reduce"}
    assert report.total == pytest.approx(2 * (n - 1) / n * (factors + dense))
    reduces = [line for line in text.splitlines() if " all-reduce(" in line]
    assert reduces and all("gradcomm.powersgd/exchange/" in line for line in reduces)
    for scope in ("compress", "combine"):
        assert f"gradcomm.powersgd/{scope}/" in text


# ------------------------------------------------------------------------------------------
# Leaves sharded over model axes (tensor parallelism): the whole tensor's result

# A (data 2, a 2, b 2) mesh: rows split over a, columns over (b, a) (b the major one), a
# middle dimension over (a, b), both rows and columns, and a vector over b. The whole
# leaves are compressed (min_compression_rate 1); each must get its piece of the whole
# leaf's PowerSGD over the data axis alone.
TP_SPECS = {
    "rows": P("a", None),
    "cols": P(None, ("b", "a")),
    "mid": P(None, ("a", "b"), None),
    "both": P("a", "b"),
    "vec": P("b"),
}
TP_SHAPES = {"rows": (8, 6), "cols": (6, 8), "mid": (3, 4, 5), "both": (8, 8), "vec": (6,)}
TP_STEPS = 3  # the first of zeros


@functools.cache
def tp_meshes():
    explicit = (jax.sharding.AxisType.Explicit,) * 3
    whole = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=explicit[:1])
    split = jax.make_mesh((2, 2, 2), ("data", "a", "b"), axis_types=explicit)
    return whole, split


def tp_grads(dtype):
    rng = np.random.default_rng(11)
    grads = {k: rng.standard_normal((TP_STEPS, 2, *s)) for k, s in TP_SHAPES.items()}
    for g in grads.values():
        g[0] = 0  # a step of zero gradients first
    return {k: g.astype(dtype) for k, g in grads.items()}


def tp_run(tx, mesh, specs, grads):
    """TP_STEPS updates per device under shard_map over every mesh axis: the outputs
    `(steps, devices, ...)`, each step's Q's `(steps, n, rank)` and the last residuals."""
    lead = {k: P(None, "data", *specs[k]) for k in grads}
    residual_specs = {k: P("data", *specs[k]) for k in grads}

    def body(g):
        g = jax.tree.map(lambda x: x[:, 0], g)
        state = tx.init(jax.tree.map(lambda x: x[0] * 0, g))  # typed like the grads

        def step(state, u):  # a `lax.scan`: the update compiled once, not once per step
            out, new = tx.update(u, state)
            return jax.tree.map(typed_like, new, state), (out, new.q)

        state, (outs, qs) = lax.scan(step, state, g)
        outs = jax.tree.map(lambda x: x[:, None], outs)
        return outs, qs, jax.tree.map(lambda r: r[None], state.residual)

    f = shard_map_jit(body, mesh, (lead,), (lead, P(), residual_specs))
    placed = {k: jax.device_put(v, NamedSharding(mesh, lead[k])) for k, v in grads.items()}
    return jax.tree.map(np.asarray, f(placed))


def typed_like(new, old):
    """`new` typed as varying over the mesh axes `old` varies over, as a scan's carry must
    be (a residual that is zero so far is typed as replicated)."""
    missing = tuple(sorted(_axes.varying_axes(old) - _axes.varying_axes(new)))
    return lax.pcast(new, missing, to="varying") if missing else new


def shard_map_jit(body, mesh, in_specs, out_specs, check_vma=True):
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
    )
    return jax.jit(mapped)


# float32 leaves in every layout, and float16 ones split both ways and as a vector (the
# dtype changes what each leaf computes in, not how its pieces combine), in one tree: one
# program per mesh. bfloat16 computes as float16 does.
TP_DTYPES = {"f32": np.float32, "f16": jnp.float16}
TP_KEYS = {f"{k}_f32": (k, "f32") for k in TP_SHAPES}  # key: (layout, dtype)
TP_KEYS |= {f"{k}_f16": (k, "f16") for k in ("both", "vec")}


@functools.cache
def tp_results():
    """The whole leaves' run on a 1-D mesh, and the split leaves' run, on tp_grads in
    each dtype of TP_DTYPES (keys TP_KEYS)."""
    whole, split = tp_meshes()
    grads = {d: tp_grads(dtype) for d, dtype in TP_DTYPES.items()}
    grads = {key: grads[d][k] for key, (k, d) in TP_KEYS.items()}
    specs = {key: TP_SPECS[k] for key, (k, _) in TP_KEYS.items()}
    tx = lambda specs: powersgd("data", RANK, min_compression_rate=1.0, specs=specs)  # noqa: E731
    want = tp_run(tx(None), whole, dict.fromkeys(specs, P()), grads)
    got = tp_run(tx(specs), split, specs, grads)
    return want, got, specs


def test_sharded_leaves_give_the_whole_leaves_result():
    """Outputs, Q's and residuals of the split leaves within a few roundings of the whole
    leaves' (the sums run in another order); in bfloat16 and float16 the factors are in
    float32 and the outputs and residuals are rounded to the leaf's dtype as for whole ones.
    A first step of zero gradients gives zero outputs, no NaN, and keeps the first Q's,
    which are the whole leaves' first draw (the same seed and leaf index)."""
    (want, want_qs, want_res), (got, got_qs, got_res), specs = tp_results()
    for key, (_, d) in TP_KEYS.items():
        dtype = TP_DTYPES[d]
        ulps = 16 if dtype == np.float32 else 2
        assert got[key].dtype == dtype and got_res[key].dtype == dtype
        for t in range(1, TP_STEPS):
            scale = np.abs(np.asarray(want[key][t], np.float64)).max()
            atol = ulps * float(jnp.finfo(dtype).eps) * scale
            np.testing.assert_allclose(
                np.asarray(got[key][t], np.float64), want[key][t], rtol=0, atol=atol, err_msg=key
            )
        scale = np.abs(np.asarray(want_res[key], np.float64)).max()
        atol = ulps * float(jnp.finfo(dtype).eps) * scale
        np.testing.assert_allclose(
            np.asarray(got_res[key], np.float64), want_res[key], rtol=0, atol=atol, err_msg=key
        )
        np.testing.assert_array_equal(got[key][0], 0)  # the step of zeros
        assert np.isfinite(got[key].astype(np.float32)).all()
    assert len(got_qs) == 5  # every matrix is compressed, the vectors are not
    params = {key: jnp.zeros(TP_SHAPES[k], TP_DTYPES[d]) for key, (k, d) in TP_KEYS.items()}
    tx = powersgd("data", RANK, min_compression_rate=1.0, specs=specs)
    first = jax.jit(tx.init)(params).q  # (test_initial_q_depends_on_the_seed_alone: eager)
    for got_q, want_q, q0 in zip(got_qs, want_qs, first, strict=True):
        assert got_q.shape == want_q.shape and got_q.dtype == np.float32  # the whole Q
        np.testing.assert_allclose(got_q, want_q, rtol=0, atol=1e-5 * np.abs(want_q).max())
        np.testing.assert_array_equal(got_q[0], q0)  # init on the pieces: the whole draw
        np.testing.assert_array_equal(want_q[0], q0)


def test_a_sharded_leaf_needs_its_spec():
    """A matrix split over a model axis with no spec (or a spec naming other axes) raises
    at trace time, naming specs; a split vector needs none."""
    _, split = tp_meshes()
    grads = tp_grads(np.float32)
    missing, wrong = {**TP_SPECS, "rows": None}, {**TP_SPECS, "cols": P(None, "a")}
    for specs, match in ((missing, "'rows' is sharded.*pass specs="), (wrong, "'cols' varies")):
        tx = powersgd("data", RANK, min_compression_rate=1.0, specs=specs)
        with pytest.raises(ValueError, match=match):
            tp_run(tx, split, TP_SPECS, grads)
    tx = powersgd("data", RANK, min_compression_rate=1.0, specs={"vec": None})
    tp_run(tx, split, TP_SPECS, {"vec": grads["vec"]})  # traced and run: no error


def test_orthogonalize_over_split_rows():
    """orthogonalize(p, axes=...) on each device's rows of p gives its rows of the whole
    p's result: the dot products and norms are summed over the axes."""
    _, split = tp_meshes()
    p = np.random.default_rng(4).standard_normal((8, 3)).astype(np.float32)
    p[:, 2] = p[:, 0] - 2 * p[:, 1]  # dependent: P stays orthonormal
    f = shard_map_jit(lambda x: psgd.orthogonalize(x, axes=("a", "b")), split,
                      P(("a", "b")), P(("a", "b")))  # fmt: skip
    got = f(jax.device_put(p, NamedSharding(split, P(("a", "b")))))
    np.testing.assert_allclose(got, psgd.orthogonalize(jnp.asarray(p)), atol=1e-6)


# ------------------------------------------------------------------------------------------
# State, dtypes, optax and parallel.train_step


def test_state_keeps_its_dtypes_without_retracing():
    """float32 updates (an optimizer's) on bfloat16 and float16 params: the residuals keep
    the params' dtypes, Q stays float32, and a jitted step traces once."""
    tx = powersgd("d", RANK)
    dtypes = {"w": jnp.bfloat16, "v": jnp.float16, "b": jnp.bfloat16}
    shapes = {"w": (2, 12, 8), "v": (2, 10, 9), "b": (2, 4)}
    params = {k: jnp.zeros(shapes[k], dtypes[k]) for k in shapes}
    traces = []

    def step(grads, state, params):
        traces.append(1)
        return jax.vmap(tx.update, axis_name="d")(grads, state, params)

    step = jax.jit(step)
    state = jax.jit(jax.vmap(tx.init))(params)
    rng = np.random.default_rng(0)
    for _ in range(4):
        grads = jax.tree.map(
            lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params
        )
        updates, state = step(grads, state, params)
        jax.block_until_ready(updates)
        assert {k: r.dtype for k, r in state.residual.items()} == dtypes
        assert [q.dtype for q in state.q] == [jnp.float32, jnp.float32]
        assert updates["w"].dtype == jnp.float32  # the updates' dtype
    assert len(traces) == 1


def test_float64_under_x64():
    """float64 leaves compute and keep Q in float64, to float64's precision."""
    with jax.enable_x64(True):
        tx = powersgd("d", RANK)
        g = jnp.asarray(np.random.default_rng(1).standard_normal((2, 12, 8)), jnp.float64)
        state = tx.init(g[0])
        assert state.q[0].dtype == jnp.float64
        out, new = jax.jit(jax.vmap(lambda x: tx.update(x, state), axis_name="d"))(g)
        assert out.dtype == jnp.float64 and new.q[0].dtype == jnp.float64
        zeros = [np.zeros((12, 8))] * 2
        want, _, _ = ref_step(list(np.asarray(g)), zeros, np.asarray(state.q[0]), np.float64)
        np.testing.assert_allclose(out[0], want, rtol=1e-12, atol=1e-12)


def test_train_step_layout_and_tree_map_params():
    """Under `parallel.train_step` with SGD momentum after it: Q replicated (the same on every
    device), residuals per device where compressed; three steps trace once. The residual
    is shaped like the params, so `optax.tree_map_params` maps it and leaves Q."""
    n = 4
    mesh = mesh_of(n)
    tx = optax.chain(powersgd("data", RANK), optax.sgd(0.1, momentum=0.9))
    traces = []

    def loss(params, batch):
        traces.append(1)
        return sum(jnp.sum(p * jnp.mean(batch[k], 0)) for k, p in params.items())

    rng = np.random.default_rng(2)
    shapes = {"w": (12, 8), "b": (7,)}
    params = parallel.replicate({k: jnp.zeros(s) for k, s in shapes.items()}, mesh)
    state = parallel.init_state(tx, params, mesh)
    assert state[0].q[0].shape == (8, RANK)  # replicated
    assert state[0].residual["w"].shape == (n, 12, 8)  # per device
    step = parallel.train_step(loss, tx, mesh)
    for _ in range(3):
        batch = {k: rng.standard_normal((2 * n, *s)).astype(np.float32) for k, s in shapes.items()}
        params, state, _ = step(params, state, batch)
    assert len(traces) == 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves((params, state)))
    assert np.abs(np.asarray(params["w"])).max() > 0

    local = {k: jnp.zeros(s) for k, s in shapes.items()}
    inner = powersgd("data", RANK)
    st = inner.init(local)
    mapped = optax.tree_map_params(inner, lambda x, p: x + p + 1, st, local)
    np.testing.assert_array_equal(mapped.residual["w"], 1)
    np.testing.assert_array_equal(mapped.q[0], st.q[0])


def test_initial_q_depends_on_the_seed_alone():
    params = {"w": jnp.zeros((12, 8)), "v": jnp.zeros((12, 8))}
    a, b = powersgd("data", seed=0).init(params).q, powersgd("data", seed=1).init(params).q
    c = jax.jit(powersgd("data", seed=0).init)(params).q
    assert not np.array_equal(a[0], b[0]) and not np.array_equal(a[0], a[1])
    jax.tree.map(np.testing.assert_array_equal, a, c)
    on_devices = jax.vmap(powersgd("data", seed=0).init)(jax.tree.map(lambda x: x[None], params))
    np.testing.assert_array_equal(on_devices.q[0][0], a[0])
    assert isinstance(a, tuple) and isinstance(powersgd("data").init({}), PowerSgdState)


# ------------------------------------------------------------------------------------------
# Bad arguments


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 0}, "rank must be a positive int"),
        ({"rank": -1}, "rank must be a positive int"),
        ({"rank": 1.5}, "rank must be a positive int"),
        ({"rank": True}, "rank must be a positive int"),
        ({"min_compression_rate": 0}, "min_compression_rate must be a positive number"),
        ({"min_compression_rate": -2.0}, "min_compression_rate must be a positive number"),
        ({"min_compression_rate": float("nan")}, "min_compression_rate must be a positive"),
        ({"min_compression_rate": "2"}, "min_compression_rate must be a positive number"),
        ({"seed": 0.5}, "seed must be an int"),
        ({"axis_name": ""}, "axis_name must be a non-empty string"),
        ({"specs": {"w": "model"}}, "specs must be None or a pytree of PartitionSpecs"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        powersgd(**kwargs)


def test_injected_structural_arguments_name_static_args():
    for arg, value in (("rank", 2), ("min_compression_rate", 2.0), ("seed", 3)):
        others = tuple(a for a in ("rank", "min_compression_rate", "seed") if a != arg)
        inner = optax.inject_hyperparams(powersgd, static_args=others)
        with pytest.raises(ValueError, match=rf"static_args=\('{arg}',\)"):
            inner(axis_name="data", **{arg: value}).init(jnp.zeros((12, 8)))


def test_trace_time_errors():
    tx = powersgd("data", RANK)
    g = {"w": jnp.zeros((2, 12, 8))}
    with pytest.raises(ValueError, match="not bound"):
        tx.update(jax.tree.map(lambda x: x[0], g), tx.init(jax.tree.map(lambda x: x[0], g)))
    ints = {"w": jnp.zeros((2, 12, 8), jnp.int32)}
    with pytest.raises(ValueError, match="floating-point"):
        jax.vmap(lambda x: tx.update(x, tx.init(x)), axis_name="data")(ints)
    other = tx.init({"w": jnp.zeros((8, 12))})
    with pytest.raises(ValueError, match=r"tx\.init\(params\)"):
        jax.vmap(lambda x: tx.update(x, other), axis_name="data")(g)
