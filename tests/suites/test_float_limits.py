"""Adasum at the edges of float32's normal range, against the float64 reference.

As in Horovod's stability tests: the same vectors scaled towards the smallest normal and
towards sqrt(float32 max), where a naive a.b / (2|a|^2) under- or overflows. XLA on CPU
flushes subnormals to zero, so inputs and results are kept normal; what must not flush
are the intermediates (a correction term near the minimum normal).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference

import gradcomm

F32 = np.finfo(np.float32)
EPS = float(F32.eps)
# Scales that put the vectors' entries (in [1, 4)) just above the minimum normal, deep in
# the normal range, and at sqrt(float32 max), where |a|^2 alone would overflow.
SCALES = {
    "min-normal": float(F32.tiny),
    "tiny": 2.0**-100,
    "one": 1.0,
    "huge": 2.0**60,
    "sqrt-max": float(np.sqrt(F32.max)) / 4,
}


def _vectors(n, size=37, seed=0):
    """n positive vectors that point roughly the same way (entries in [1, 4))."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(1.0, 2.0, size)
    return [base * rng.uniform(1.0, 2.0, size) for _ in range(n)]


# Compiled once per shape: the eager op-by-op dispatch of the same code compiled each
# primitive anew and took most of this file's time.
_pair = jax.jit(gradcomm.adasum_pair)
_reduce = jax.jit(jax.vmap(lambda x: gradcomm.adasum_reduce(x, "d"), axis_name="d"))


def _relative_error(got, want):
    return float(np.max(np.abs(np.float64(got) - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("scale", SCALES)
def test_pair_at_the_limits(scale):
    s = SCALES[scale]
    a, b = (np.float32(v * s) for v in _vectors(2))
    want = reference.adasum_pair(np.float64(a), np.float64(b))
    got = _pair(jnp.asarray(a), jnp.asarray(b))
    assert np.all(np.abs(want) >= F32.tiny)  # the result is normal: it must not flush
    assert _relative_error(got, want) <= 100 * EPS


@pytest.mark.parametrize("scale", ["min-normal", "sqrt-max"])
def test_two_times_t_and_t(scale):
    # AS(2t, t) = 2t (1 - 1/4) + t (1 - 1) = 1.5 t: the correction term of 2t is t/2,
    # below the normal range when t is the minimum normal.
    t = np.float32(SCALES[scale])
    got = _pair(jnp.float32(2 * t), jnp.float32(t))
    assert float(got) == pytest.approx(1.5 * float(t), rel=100 * EPS)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("scale", ["min-normal", "sqrt-max"])
def test_reduce_at_the_limits(n, scale):
    s = SCALES[scale]
    values = [np.float32(v * s) for v in _vectors(n, seed=n)]
    want = reference.adasum([np.float64(v) for v in values])
    got = _reduce(jnp.stack(values))
    assert np.all(np.abs(want) >= F32.tiny)
    for row in np.asarray(got):
        assert _relative_error(row, want) <= 100 * EPS


def test_unequal_magnitudes_stay_finite():
    # b 2^-120 times a: c_b = a.b / (2|b|^2) is about 2^119, beyond the coefficient-first
    # form; the term becomes -q_b (b / Sb) scaled back, still within 100 eps.
    a, b = (np.float32(v) for v in _vectors(2))
    b = np.float32(b * 2.0**-120)
    want = reference.adasum_pair(np.float64(a), np.float64(b))
    got = _pair(jnp.asarray(a), jnp.asarray(b))
    assert _relative_error(got, want) <= 100 * EPS


@pytest.mark.parametrize("overlap", [0, 1])
def test_gossip_keeps_float64(overlap):
    # Models 1e-12 apart: float32 would make them equal. x, the push-sum weight and the
    # in-flight messages must all stay float64, and the mix match the float64 reference.
    from gradcomm import topology

    n = 4
    with jax.enable_x64(True):
        params = jnp.asarray(1.0 + 1e-12 * np.arange(n * 3).reshape(n, 3), jnp.float64)
        tx = gradcomm.sgp("d", overlap=overlap)

        def step(p, state):
            delta, state = tx.update(jnp.zeros_like(p), state, p)
            return p + delta, state

        state = jax.jit(jax.vmap(tx.init, axis_name="d"))(params)
        assert state.weight.dtype == jnp.float64
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(state.in_flight))
        p, mapped = params, jax.jit(jax.vmap(step, axis_name="d"))  # one compilation
        for _ in range(3):
            p, state = mapped(p, state)
        assert p.dtype == jnp.float64
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(state.in_flight_weight))
        assert len(jax.tree.leaves(state)) == (4 if overlap else 2)  # no in-flight arrays at 0
        if overlap == 0:  # push-sum of x = z w with w = 1 at the start: z' = P x / P w
            graph = topology.resolve("exponential", n)
            x, w = np.asarray(params, np.float64), np.ones(n)
            for t in range(3):
                m = graph.mixing_matrix(t)
                x, w = m @ x, m @ w
            np.testing.assert_allclose(np.asarray(p), x / w[:, None], rtol=0, atol=1e-15)


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_nan_in_one_model_shard_skips_the_step_everywhere(check_vma):
    """`apply_if_finite` on a (data 4, model 2) mesh: a NaN in one piece of a leaf sharded
    over 'model' (on one data device) skips the step on all 8 devices, the leaf replicated
    over 'model' keeps its type, and each step's updates and state are those of the whole
    tensors on the 4 data devices alone. With `check_vma=False` the flag is reduced over
    'model' all the same."""
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    explicit = (AxisType.Explicit,) * 2
    two = jax.make_mesh((4, 2), ("data", "model"), axis_types=explicit)
    one = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=explicit[:1])
    rng = np.random.default_rng(0)
    grads = {"w": rng.standard_normal((2, 4, 4, 3)), "b": rng.standard_normal((2, 4, 3))}
    grads = {k: v.astype(np.float32) for k, v in grads.items()}
    grads["w"][0, 1, 3, 0] = np.nan  # step 0, data device 1, a row of model device 1
    tx = gradcomm.apply_if_finite(optax.chain(gradcomm.allreduce("data"), optax.sgd(1.0)), 3)

    def run(mesh, specs, check_vma=True):
        leaf_specs = {k: P(None, "data", *specs[k]) for k in grads}
        every = P(None, tuple(mesh.axis_names))

        def body(g):
            g = {k: x[:, 0] for k, x in g.items()}
            state = tx.init({k: x[0] for k, x in g.items()})
            outs, counts = [], []
            for t in range(2):
                out, state = tx.update({k: x[t] for k, x in g.items()}, state)
                outs.append({k: x[None] for k, x in out.items()})
                counts.append(state.notfinite_count[None])
            return jax.tree.map(lambda *xs: jnp.stack(xs), *outs), jnp.stack(counts)

        f = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(leaf_specs,),
            out_specs=(leaf_specs, every),
            check_vma=check_vma,
        )
        put = lambda k, v: jax.device_put(v, NamedSharding(mesh, leaf_specs[k]))  # noqa: E731
        return jax.tree.map(np.asarray, jax.jit(f)({k: put(k, v) for k, v in grads.items()}))

    got, counts = run(two, {"w": P("model", None), "b": P()}, check_vma)
    want, _ = run(one, {"w": P(), "b": P()})
    for k in grads:
        np.testing.assert_array_equal(got[k][0], 0.0)  # skipped on every device
        np.testing.assert_array_equal(got[k], want[k])
    assert (counts[0] == 1).all() and (counts[1] == 0).all()
