"""TernGrad against the paper's equations, on 1 to 8 simulated devices."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference
from helpers import per_device, wire_against_psum
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm.terngrad import _round_up_scale

WIRE_MODES = ("simulate", "all_gather", "all_to_all", "packed")


def mixed_tree(rng, n):
    return {
        "w": rng.standard_normal((n, 37, 5)).astype(np.float32),
        "b": rng.standard_normal((n, 3)).astype(np.float32),
        "scalar": rng.standard_normal((n,)).astype(np.float32),
        "one": rng.standard_normal((n, 1)).astype(np.float32),
        "half": rng.standard_normal((n, 11)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal((n, 2, 9)).astype(np.float16),
    }


@functools.cache
def update_fn(wire_mode="packed", clip=2.5, dense=None):
    """A hashable per-device function: one terngrad update at step `count`."""

    def f(tree, count):
        tx = gradcomm.terngrad("data", clip=clip, wire=wire_mode, dense=dense)
        state = tx.init(tree)._replace(count=count)
        return tx.update(tree, state)[0]

    return f


def run(n, tree, count=0, **kwargs):
    return per_device(update_fn(**kwargs), n, tree, np.full(n, count, np.int32))


def expected_scale(gs, clip, n):
    top = max(np.abs(reference.terngrad_clip(g, clip)).max() for g in gs)
    return float(_round_up_scale(jnp.float32(top), n))


def every_wire_mode(tree, count):
    return {mode: update_fn(mode)(tree, count) for mode in WIRE_MODES}


@pytest.mark.parametrize("n", range(1, 9))
def test_wire_modes_agree_bit_for_bit_and_devices_agree(n):
    tree = mixed_tree(np.random.default_rng(n), n)
    outs = per_device(every_wire_mode, n, tree, np.zeros(n, np.int32))
    for mode in WIRE_MODES[1:]:
        for leaf in tree:
            np.testing.assert_array_equal(outs[mode][leaf], outs["simulate"][leaf], err_msg=mode)
    for leaf, value in outs["packed"].items():
        assert value.dtype == tree[leaf].dtype
        for row in value[1:]:
            np.testing.assert_array_equal(row, value[0])


@pytest.mark.parametrize("n", [1, 3, 8])
def test_levels_use_the_shared_scale(n):
    """Every element is k * s / N with |k| <= N and s the max over devices (eq. 4)."""
    g = np.random.default_rng(0).standard_normal((n, 200)).astype(np.float32)
    g[n - 1] *= 3  # the largest scale lives on the last device
    out = run(n, {"g": g})["g"][0].astype(np.float64)
    scale = expected_scale(list(g), 2.5, n)
    levels = out * n / scale
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-5)
    assert np.abs(levels).max() <= n
    assert scale >= max(np.abs(reference.terngrad_clip(x, 2.5)).max() for x in g)


def test_ternarize_codes_and_scale():
    g = np.random.default_rng(1).standard_normal((50, 3)).astype(np.float32)
    codes, scale = gradcomm.ternarize(jnp.asarray(g), jax.random.key(3))
    assert codes.dtype == jnp.int8 and set(np.unique(codes)) <= {-1, 0, 1}
    np.testing.assert_allclose(scale, np.abs(reference.terngrad_clip(g, 2.5)).max(), rtol=1e-6)
    assert np.all((codes == 0) | (np.sign(codes) == np.sign(g)))
    _, unclipped = gradcomm.ternarize(jnp.asarray(g), jax.random.key(3), clip=None)
    np.testing.assert_allclose(unclipped, np.abs(g).max(), rtol=1e-7)


@functools.cache
def many_steps(clip):
    """4,000 steps of terngrad on one device's gradient: (4000, *shape) outputs."""

    def f(g):
        tx = gradcomm.terngrad("data", clip=clip, seed=7)
        state = tx.init(g)
        return jax.vmap(lambda c: tx.update(g, state._replace(count=c))[0])(jnp.arange(4000))

    return f


@pytest.mark.parametrize("clip", [2.5, None])
def test_unbiased_over_4000_steps(clip):
    """The mean of the output equals the mean of the clipped gradients within 5 standard errors.

    The variance of one output element is sum_i (s |g_i| - g_i^2) / N^2 (eqs. 1-4);
    outliers make clipping active at c = 2.5.
    """
    n = 4
    rng = np.random.default_rng(11)
    g = rng.standard_normal((n, 60)).astype(np.float32)
    g[:, :3] *= 8  # outliers that clipping cuts
    out = per_device(many_steps(clip), n, g)[0].astype(np.float64)  # (4000, 60)
    scale = expected_scale(list(g), clip, n)
    mean, variance = reference.terngrad_moments(list(g), clip, scale)
    standard_error = np.sqrt(variance / out.shape[0])
    assert np.all(np.abs(out.mean(0) - mean) <= 5 * standard_error + 1e-6 * scale)
    if clip is not None:  # clipping changed the target: the unclipped mean is far off
        unclipped = g.astype(np.float64).mean(0)
        assert np.abs(out.mean(0)[:3] - unclipped[:3]).max() > 10 * standard_error[:3].max()


def test_random_bits_differ_between_devices_and_steps():
    n = 4
    g = np.tile(np.random.default_rng(2).standard_normal((1, 300)).astype(np.float32), (n, 1))
    first = run(n, {"g": g}, count=0)["g"][0]
    second = run(n, {"g": g}, count=1)["g"][0]
    assert not np.array_equal(first, second)
    # Equal gradients everywhere: with equal bits every level would be -N, 0 or N.
    scale = expected_scale(list(g), 2.5, n)
    levels = np.round(first.astype(np.float64) * n / scale)
    assert np.any(np.abs(levels) % n != 0)


def test_constant_and_size_one_leaves_are_not_zeroed():
    n = 4
    tree = {
        "constant": np.full((n, 10), 0.75, np.float32),
        "one": np.full((n, 1), -2.0, np.float32),
    }
    out = run(n, tree)
    np.testing.assert_allclose(out["constant"][0], 0.75, rtol=1e-5)
    np.testing.assert_allclose(out["one"][0], -2.0, rtol=1e-5)


def test_zero_and_non_finite_inputs():
    n = 3
    rng = np.random.default_rng(4)
    tree = {
        "zero": np.zeros((n, 6), np.float32),
        "nan": rng.standard_normal((n, 6)).astype(np.float32),
        "inf": rng.standard_normal((n, 6)).astype(np.float32),
        "clean": rng.standard_normal((n, 6)).astype(np.float32),
    }
    tree["nan"][1, 2] = np.nan
    tree["inf"][2, 0] = np.inf
    for mode in ("packed", "simulate"):
        for clip in (2.5, None):
            out = run(n, tree, wire_mode=mode, clip=clip)
            np.testing.assert_array_equal(out["zero"], 0)
            assert not np.isfinite(out["nan"]).any()
            assert not np.isfinite(out["inf"]).any()
            assert np.isfinite(out["clean"]).all()


def test_dense_leaves_are_averaged_in_float():
    n = 4
    rng = np.random.default_rng(5)
    tree = {
        "Dense_0": {
            "kernel": rng.standard_normal((n, 8, 4)).astype(np.float32),
            "bias": rng.standard_normal((n, 4)).astype(np.float32),
        },
        "Dense_1": {
            "kernel": rng.standard_normal((n, 4, 2)).astype(np.float32),
            "bias": rng.standard_normal((n, 2)).astype(np.float32),
        },
    }
    for dense in (("Dense_1",), 4, lambda name, leaf: name.startswith("Dense_1")):
        out = run(n, tree, dense=dense)
        mean = jax.tree.map(lambda x: x.mean(0), tree)
        np.testing.assert_allclose(out["Dense_1"]["bias"][0], mean["Dense_1"]["bias"], rtol=1e-5)
        if dense != 4:
            np.testing.assert_allclose(
                out["Dense_1"]["kernel"][0], mean["Dense_1"]["kernel"], rtol=1e-5
            )
        assert not np.allclose(out["Dense_0"]["kernel"][0], mean["Dense_0"]["kernel"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip": -1.0}, "clip"),
        ({"clip": 0}, "clip"),
        ({"clip": float("inf")}, "clip"),
        ({"seed": 1.5}, "seed"),
        ({"wire": "carrier-pigeon"}, "wire"),
        ({"dense": -3}, "dense"),
        ({"dense": [3]}, "dense"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gradcomm.terngrad("data", **kwargs)
    if "clip" in kwargs:
        with pytest.raises(ValueError, match="clip"):
            gradcomm.ternarize(jnp.ones(3), jax.random.key(0), clip=kwargs["clip"])


def test_unknown_dense_leaves_raise_at_trace_time():
    tx = gradcomm.terngrad("data", dense=["Dense_9", "w"])
    grads = {"w": jnp.ones((2, 3)), "b": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match=r"\['Dense_9'\] match no leaf"):
        jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")(grads)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_wire_bytes_against_a_dense_psum(n):
    """At N = 8 on 1.2M parameters, at most 1/6 of a float32 psum's bytes."""
    tx = gradcomm.terngrad("data")
    psum, report = wire_against_psum(lambda t: tx.update(t, tx.init(t))[0], n)
    assert report.total <= psum / 6
    if n == 8:
        assert psum / report.total > 9  # about 10x: 1.6-bit codes out, 4.6-bit sums back


# A leaf sharded over a model axis: a (data 2, model 4) mesh against the whole tensors on
# a data axis of 2.
SHARDED_SPECS = {"rows": P("model", None), "cols": P(None, "model"), "bias": P()}
SHARDED_SHAPES = {"rows": (16, 6), "cols": (5, 8), "bias": (7,)}


@functools.cache
def sharded_update(sharded, clip=2.5, dense=None, specs=True):
    """One terngrad update per wire mode, on leaves split over 'model' or whole."""
    explicit = (AxisType.Explicit,) * 2
    if sharded:
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=explicit)
        leaf_specs = SHARDED_SPECS
    else:
        mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=explicit[:1])
        leaf_specs = {k: P() for k in SHARDED_SPECS}
    in_specs = {k: P("data", *spec) for k, spec in leaf_specs.items()}

    def body(tree):
        tree = jax.tree.map(lambda x: x[0], tree)
        outs = {}
        for mode in WIRE_MODES:
            tx = gradcomm.terngrad(
                "data",
                clip=clip,
                seed=5,
                dense=dense,
                wire=mode,
                specs=SHARDED_SPECS if specs and sharded else None,
            )
            outs[mode] = tx.update(tree, tx.init(tree))[0]
        return jax.tree.map(lambda x: x[None], outs)

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(in_specs,), out_specs={m: in_specs for m in WIRE_MODES}
        )
    )

    def run(tree):
        placed = {k: jax.device_put(v, NamedSharding(mesh, in_specs[k])) for k, v in tree.items()}
        return jax.tree.map(np.asarray, f(placed))

    return run


def sharded_tree(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    tree = {k: rng.standard_normal((2, *s)) for k, s in SHARDED_SHAPES.items()}
    tree["rows"][:, :2] *= 6  # outliers that clipping cuts, on model shard 0
    return {k: v.astype(dtype) for k, v in tree.items()}


def assert_same_on_every_wire_and_device(outs):
    for mode in WIRE_MODES:
        for leaf, value in outs[mode].items():
            np.testing.assert_array_equal(value, outs["simulate"][leaf], err_msg=mode)
            np.testing.assert_array_equal(value[1], value[0], err_msg=leaf)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_a_leaf_sharded_over_a_model_axis_is_ternarized_whole(dtype):
    """The same codes as on the whole tensors, up to the last bits of sigma's sums."""
    tree = sharded_tree(dtype)
    got = sharded_update(True)(tree)
    want = sharded_update(False)(tree)
    assert_same_on_every_wire_and_device(got)
    for leaf, value in got["packed"].items():
        assert value.dtype == dtype
        value, whole = value.astype(np.float64), want["packed"][leaf].astype(np.float64)
        np.testing.assert_array_equal(np.sign(value), np.sign(whole), err_msg=leaf)
        np.testing.assert_allclose(value, whole, rtol=0, atol=1e-6 * np.abs(whole).max())


def test_without_clipping_and_with_a_size_threshold_the_bits_are_the_whole_tensors():
    """No sigma to sum: the same bits. The threshold counts the whole tensor's elements."""
    tree = sharded_tree()
    piece = SHARDED_SHAPES["rows"][0] // 4 * SHARDED_SHAPES["rows"][1]
    got = sharded_update(True, clip=None, dense=piece)(tree)
    want = sharded_update(False, clip=None, dense=piece)(tree)
    assert_same_on_every_wire_and_device(got)
    for leaf in SHARDED_SPECS:
        np.testing.assert_array_equal(got["packed"][leaf], want["packed"][leaf], err_msg=leaf)
    np.testing.assert_allclose(got["packed"]["bias"][0], tree["bias"].mean(0), rtol=1e-6)
    assert not np.allclose(got["packed"]["rows"][0], tree["rows"].mean(0))


def test_a_sharded_leaf_without_specs_raises():
    with pytest.raises(ValueError, match=r"'cols' is sharded over .*'model'.* pass specs="):
        sharded_update(True, specs=False)(sharded_tree())


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_zero_and_non_finite_sharded_leaves_behave_as_whole_ones(bad):
    """Zeros stay zeros; a NaN or inf on one piece of one device poisons the whole leaf."""
    tree = sharded_tree()
    tree["rows"][:] = 0
    tree["cols"][1, 3, 7] = bad  # data device 1, model shard 3
    got = sharded_update(True)(tree)
    want = sharded_update(False)(tree)
    for mode in WIRE_MODES:
        np.testing.assert_array_equal(got[mode]["rows"], 0)
        assert not np.isfinite(got[mode]["cols"]).any()
        assert not np.isfinite(want[mode]["cols"]).any()
        np.testing.assert_array_equal(got[mode]["bias"], want[mode]["bias"])
