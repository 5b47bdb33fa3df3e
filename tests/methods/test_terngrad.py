"""TernGrad against the paper's equations, on 1 to 8 simulated devices."""

import functools

import helpers
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import reference
from helpers import FSDP_SPECS, mlp_loss, mlp_problem, per_device, wire_against_psum
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm.terngrad._scales import round_up_scale as _round_up_scale

EXCHANGES = ("psum", "all_gather", "all_to_all", "auto")
# "auto" traces to the very program of the packed exchange it picks (checked on the
# jaxprs in test_exchanges_agree_and_levels_use_the_shared_scale), so the tests compile
# the other three.
COMPILED = EXCHANGES[:3]


def mixed_tree(rng, n):
    """Sizes 185 (whole bytes of codes), 1, 11 and 18, in all three dtypes."""
    return {
        "w": rng.standard_normal((n, 37, 5)).astype(np.float32),
        "scalar": rng.standard_normal((n,)).astype(np.float32),
        "half": rng.standard_normal((n, 11)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal((n, 2, 9)).astype(np.float16),
    }


@functools.cache
def update_fn(exchange="auto", clip=2.5, dense=None):
    """A hashable per-device function: one terngrad update at step `count`."""

    def f(tree, count):
        tx = gradcomm.terngrad("data", clip=clip, exchange=exchange, dense=dense)
        state = tx.init(tree)._replace(count=count)
        return tx.update(tree, state)[0]

    return f


def expected_scale(gs, clip, n):
    top = max(np.abs(reference.terngrad_clip(g, clip)).max() for g in gs)
    return float(_round_up_scale(jnp.float32(top), n))


def every_exchange(tree, count):
    """Per exchange of COMPILED, one terngrad update (clip 2.5) at step `count`."""
    return {mode: update_fn(mode)(tree, count) for mode in COMPILED}


def traced(fn, tree):
    """The jaxpr of per-device `fn(tree, count)` under shard_map on `tree`'s shapes (traced,
    not compiled): two functions with equal jaxprs compile to the same program."""
    n = len(jax.tree.leaves(tree)[0])
    mesh = helpers.mesh_of(n)
    sharding = NamedSharding(mesh, P("data"))
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding), tree)

    def body(t):
        out = fn(jax.tree.map(lambda x: x[0], t), jnp.int32(0))
        return jax.tree.map(lambda x: x[None], out)

    f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    return str(jax.make_jaxpr(f)(shapes))


# One device, an odd count, a full byte. (Two devices: the sharded tests' data axis; three:
# the FSDP test's whole leaf; each compares every exchange, bit for bit.)
@pytest.mark.parametrize("n", [1, 5, 8])
def test_exchanges_agree_and_levels_use_the_shared_scale(n):
    """Every exchange gives the same bits on every device, in each leaf's dtype; every
    element of the float32 leaf is k * s / N with |k| <= N and s the max over devices
    (eq. 4), here on the last device. On other inputs to the same program (one compiled
    per N): a zero leaf stays zero, a constant leaf (sigma 0: not clipped) and a size-one
    one are kept, not zeroed; a NaN or an inf on one device makes its leaf non-finite and
    no other; the random bits differ between devices and steps. "auto" is the all-gather
    up to N = 2 and the all-to-all from 3: the same jaxpr."""
    rng = np.random.default_rng(n)

    def run(tree, count=0):
        return per_device(every_exchange, n, tree, np.full(n, count, np.int32))

    tree = mixed_tree(rng, n)
    tree["w"][n - 1] *= 3  # the largest scale lives on the last device
    outs = run(tree)
    for mode in COMPILED[1:]:
        for leaf in tree:
            np.testing.assert_array_equal(outs[mode][leaf], outs["psum"][leaf], err_msg=mode)
    for leaf, value in outs["psum"].items():
        assert value.dtype == tree[leaf].dtype
        for row in value[1:]:
            np.testing.assert_array_equal(row, value[0])
    g = tree["w"].reshape(n, -1)
    scale = expected_scale(list(g), 2.5, n)
    levels = outs["all_to_all"]["w"][0].reshape(-1).astype(np.float64) * n / scale
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-5)
    assert np.abs(levels).max() <= n
    assert scale >= max(np.abs(reference.terngrad_clip(x, 2.5)).max() for x in g)

    special = mixed_tree(rng, n)
    special["w"][n - 1, 2, 0] = np.nan
    special["half"][0, 4] = np.inf
    special["f16"][:] = 0
    special["scalar"][:] = -2.0  # a size-one leaf, equal on every device
    for mode, out in run(special).items():
        assert not np.isfinite(out["w"]).any(), mode
        assert not np.isfinite(out["half"].astype(np.float32)).any(), mode
        np.testing.assert_array_equal(out["f16"], 0, err_msg=mode)
        np.testing.assert_allclose(out["scalar"], -2.0, rtol=1e-6, err_msg=mode)

    same = mixed_tree(rng, n)
    same["w"][:] = same["w"][0]  # equal gradients on every device
    same["f16"][:] = 0.75  # a constant leaf
    first, later = run(same), run(same, count=1)
    scale = expected_scale(list(same["w"].reshape(n, -1)), 2.5, n)
    for mode, out in first.items():
        np.testing.assert_allclose(out["f16"], 0.75, rtol=1e-6, err_msg=mode)
        assert not np.array_equal(out["w"], later[mode]["w"]), mode
        # With equal bits on every device, every level would be -N, 0 or N.
        levels = np.round(out["w"][0].astype(np.float64) * n / scale)
        assert n == 1 or np.any(np.abs(levels) % n != 0), mode

    picked, other = ("all_gather", "all_to_all") if n <= 2 else ("all_to_all", "all_gather")
    auto = traced(update_fn("auto"), tree)
    assert auto == traced(update_fn(picked), tree)
    assert n != 8 or auto != traced(update_fn(other), tree)  # the jaxprs tell them apart


def test_ternarize_codes_and_scale():
    ternarize = jax.jit(gradcomm.ternarize, static_argnames="clip")  # not op by op
    g = np.random.default_rng(1).standard_normal((50, 3)).astype(np.float32)
    codes, scale = ternarize(jnp.asarray(g), jax.random.key(3))
    assert codes.dtype == jnp.int8 and set(np.unique(codes)) <= {-1, 0, 1}
    np.testing.assert_allclose(scale, np.abs(reference.terngrad_clip(g, 2.5)).max(), rtol=1e-6)
    assert np.all((codes == 0) | (np.sign(codes) == np.sign(g)))
    _, unclipped = ternarize(jnp.asarray(g), jax.random.key(3), clip=None)
    np.testing.assert_allclose(unclipped, np.abs(g).max(), rtol=1e-7)


CLIPS = (2.5, None)


def many_steps(g):
    """4,000 steps of terngrad on one device's gradient, per clip of CLIPS (one program):
    (4000, *shape) outputs each."""
    outs = []
    for clip in CLIPS:
        tx = gradcomm.terngrad("data", clip=clip, seed=7)
        state = tx.init(g)
        steps = jax.vmap(lambda c, tx=tx, state=state: tx.update(g, state._replace(count=c))[0])
        outs.append(steps(jnp.arange(4000)))
    return outs


def test_unbiased_over_4000_steps():
    """With clipping at c = 2.5 and without, the mean of the output equals the mean of the
    clipped gradients within 5 standard errors; on other inputs to the same program, a
    zero gradient gives zeros and a NaN or an inf on one device a non-finite leaf.

    The variance of one output element is sum_i (s |g_i| - g_i^2) / N^2 (eqs. 1-4);
    outliers make clipping active at c = 2.5.
    """
    n = 4
    rng = np.random.default_rng(11)
    g = rng.standard_normal((n, 60)).astype(np.float32)
    g[:, :3] *= 8  # outliers that clipping cuts
    outs = per_device(many_steps, n, g)
    for clip, out in zip(CLIPS, outs, strict=True):
        out = out[0].astype(np.float64)  # (4000, 60)
        scale = expected_scale(list(g), clip, n)
        mean, variance = reference.terngrad_moments(list(g), clip, scale)
        standard_error = np.sqrt(variance / out.shape[0])
        assert np.all(np.abs(out.mean(0) - mean) <= 5 * standard_error + 1e-6 * scale), clip
        if clip is not None:  # clipping changed the target: the unclipped mean is far off
            unclipped = g.astype(np.float64).mean(0)
            assert np.abs(out.mean(0)[:3] - unclipped[:3]).max() > 10 * standard_error[:3].max()
    for zero in per_device(many_steps, n, np.zeros_like(g)):
        np.testing.assert_array_equal(zero, 0)
    for bad in (np.nan, np.inf):
        g[1, 7] = bad
        for out in per_device(many_steps, n, g):
            assert not np.isfinite(out).any(), bad


def test_dense_leaves_are_averaged_in_float():
    """Leaves named in `dense` are averaged in float, the others ternarized; a predicate
    and a size threshold pick leaves as names do."""
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
    out = per_device(update_fn(dense=("Dense_1",)), n, tree, np.zeros(n, np.int32))
    # The other forms of `dense` pick leaves as the names do: the same programs.
    by_name = traced(update_fn(dense=("Dense_1",)), tree)
    assert traced(update_fn(dense=_in_dense_1), tree) == by_name
    assert traced(update_fn(dense=("Dense_0",)), tree) != by_name
    small = ("Dense_0/bias", "Dense_1/bias")  # the leaves of at most 4 elements
    assert traced(update_fn(dense=4), tree) == traced(update_fn(dense=small), tree)
    assert traced(update_fn(dense=4), tree) != by_name
    mean = jax.tree.map(lambda x: x.mean(0), tree)
    for leaf in ("bias", "kernel"):
        np.testing.assert_allclose(out["Dense_1"][leaf][0], mean["Dense_1"][leaf], rtol=1e-5)
    assert not np.allclose(out["Dense_0"]["kernel"][0], mean["Dense_0"]["kernel"])


def _in_dense_1(name, leaf):
    return name.startswith("Dense_1")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip": -1.0}, "clip"),
        ({"clip": 0}, "clip"),
        ({"clip": float("inf")}, "clip"),
        ({"seed": 1.5}, "seed"),
        ({"exchange": "carrier-pigeon"}, "exchange must be one of"),
        ({"exchange": "packed"}, "exchange='packed' is now exchange='auto'"),
        ({"exchange": "simulate"}, "exchange='simulate' is now exchange='psum'"),
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


def test_the_former_wire_argument_is_gone():
    """`wire=` was renamed `exchange=` (its values "packed" and "simulate": "auto", "psum")."""
    with pytest.raises(TypeError, match="wire"):
        gradcomm.terngrad("data", wire="packed")


def test_unknown_dense_leaves_raise_at_trace_time():
    tx = gradcomm.terngrad("data", dense=["Dense_9", "w"])
    grads = {"w": jnp.ones((2, 3)), "b": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match=r"\['Dense_9'\] match no leaf"):
        jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")(grads)


# 1.2M parameters in two matrices, beside a small odd leaf and a scalar (the per-leaf
# scales): the bytes of helpers.MODEL_SHAPES in 4 leaves instead of 6 (fewer to compile).
WIRE_SHAPES = [(1000, 1000), (200, 1000), (7,), ()]


@pytest.mark.parametrize("n", [2, 8])  # "auto": the all-gather at 2, the all-to-all from 3
def test_wire_bytes_against_a_dense_psum(n):
    """At N = 8 on 1.2M parameters, at most 1/6 of a float32 psum's bytes."""
    tx = gradcomm.terngrad("data")
    psum, report = wire_against_psum(lambda t: tx.update(t, tx.init(t))[0], n, WIRE_SHAPES)
    assert report.total <= psum / 6
    if n == 8:
        assert psum / report.total > 9  # about 10x: 1.6-bit codes out, 4.6-bit sums back


# A leaf sharded over a model axis: a (data 2, model 4) mesh against the whole tensors on
# a data axis of 2, in each float dtype (one tree of {dtype: leaves}, one program).
SHARDED_SPECS = {"rows": P("model", None), "cols": P(None, "model"), "bias": P()}
SHARDED_SHAPES = {"rows": (16, 6), "cols": (5, 8), "bias": (7,)}
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
TWO_EXCHANGES = ("psum", "auto")


@functools.cache
def sharded_update(sharded, dtypes=tuple(DTYPES), clip=2.5, dense=None, specs=True, modes=COMPILED):
    """One terngrad update per exchange of `modes` on `{dtype: leaves}` (the `dtypes`
    names of DTYPES), the leaves split over 'model' or whole."""
    explicit = (AxisType.Explicit,) * 2
    if sharded:
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=explicit)
        leaf_specs = SHARDED_SPECS
    else:
        mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=explicit[:1])
        leaf_specs = {k: P() for k in SHARDED_SPECS}
    in_specs = {d: {k: P("data", *spec) for k, spec in leaf_specs.items()} for d in dtypes}

    def body(tree):
        tree = jax.tree.map(lambda x: x[0], tree)
        outs = {}
        for mode in modes:
            tx = gradcomm.terngrad(
                "data",
                clip=clip,
                seed=5,
                dense=dense,
                exchange=mode,
                specs=dict.fromkeys(dtypes, SHARDED_SPECS) if specs and sharded else None,
            )
            outs[mode] = tx.update(tree, tx.init(tree))[0]
        return jax.tree.map(lambda x: x[None], outs)

    out_specs = dict.fromkeys(modes, in_specs)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs))

    def run(tree):
        placed = jax.tree.map(
            lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec)), tree, in_specs
        )
        return jax.tree.map(np.asarray, f(placed))

    return run


def sharded_tree(dtypes=tuple(DTYPES), seed=0):
    rng = np.random.default_rng(seed)
    trees = {}
    for d in dtypes:
        tree = {k: rng.standard_normal((2, *s)) for k, s in SHARDED_SHAPES.items()}
        tree["rows"][:, :2] *= 6  # outliers that clipping cuts, on model shard 0
        trees[d] = {k: v.astype(DTYPES[d]) for k, v in tree.items()}
    return trees


def assert_same_on_every_exchange_and_device(outs):
    for mode in outs:
        for d, leaves in outs[mode].items():
            for leaf, value in leaves.items():
                np.testing.assert_array_equal(value, outs["psum"][d][leaf], err_msg=mode)
                np.testing.assert_array_equal(value[1], value[0], err_msg=leaf)


def test_a_leaf_sharded_over_a_model_axis_is_ternarized_whole():
    """In float32, bfloat16 and float16, every exchange gives the same bits, the same codes
    as on the whole tensors, up to the last bits of sigma's sums. (The whole tensors by the
    floats' exchange alone: the others give its bits, test_exchanges_agree...) Zeros stay
    zeros; a NaN or an inf on one piece of one device poisons its whole leaf, no other."""
    tree = sharded_tree()
    run, whole_run = sharded_update(True), sharded_update(False, modes=("psum",))
    got, want = run(tree), whole_run(tree)["psum"]
    assert sorted(got) == sorted(COMPILED)
    assert_same_on_every_exchange_and_device(got)
    for d, dtype in DTYPES.items():
        for leaf, value in got["all_gather"][d].items():
            assert value.dtype == dtype
            value, whole = value.astype(np.float64), want[d][leaf].astype(np.float64)
            np.testing.assert_array_equal(np.sign(value), np.sign(whole), err_msg=(d, leaf))
            np.testing.assert_allclose(value, whole, rtol=0, atol=1e-6 * np.abs(whole).max())

    tree["float32"]["rows"][:] = 0
    tree["float32"]["cols"][1, 3, 7] = np.nan  # data device 1, model shard 3
    tree["float16"]["cols"][0, 2, 1] = np.inf  # data device 0, model shard 0
    got, want = run(tree), whole_run(tree)["psum"]
    assert_same_on_every_exchange_and_device(got)
    for d in ("float32", "float16"):
        assert not np.isfinite(want[d]["cols"].astype(np.float32)).any()
    for mode, out in got.items():
        np.testing.assert_array_equal(out["float32"]["rows"], 0)
        for d in ("float32", "float16"):
            assert not np.isfinite(out[d]["cols"].astype(np.float32)).any(), (mode, d)
            np.testing.assert_array_equal(out[d]["bias"], want[d]["bias"])
            assert np.isfinite(out[d]["bias"].astype(np.float32)).all()
        for x in out["bfloat16"].values():
            assert np.isfinite(x.astype(np.float32)).all(), mode


def test_without_clipping_and_with_a_size_threshold_the_bits_are_the_whole_tensors():
    """No sigma to sum: the same bits. The threshold counts the whole tensor's elements."""
    f32 = ("float32",)
    tree = sharded_tree(f32)
    piece = SHARDED_SHAPES["rows"][0] // 4 * SHARDED_SHAPES["rows"][1]
    got = sharded_update(True, f32, clip=None, dense=piece, modes=TWO_EXCHANGES)(tree)
    want = sharded_update(False, f32, clip=None, dense=piece, modes=("psum",))(tree)["psum"]
    assert_same_on_every_exchange_and_device(got)
    got, want, tree = got["auto"]["float32"], want["float32"], tree["float32"]
    for leaf in SHARDED_SPECS:
        np.testing.assert_array_equal(got[leaf], want[leaf], err_msg=leaf)
    np.testing.assert_allclose(got["bias"][0], tree["bias"].mean(0), rtol=1e-6)
    assert not np.allclose(got["rows"][0], tree["rows"].mean(0))


def test_a_sharded_leaf_without_specs_raises():
    with pytest.raises(ValueError, match=r"'\w+/cols' is sharded over .*'model'.* pass specs="):
        sharded_update(True, specs=False)(sharded_tree())


# FSDP (ZeRO-3): leaves split over 'data' along their leading dimension. Each device gets
# the whole gradient and returns its shard of the mean: the slice of the whole mean.
FSDP_SHAPES = {  # name: (shape, dtype)
    "w": ((24, 37), np.float32),  # shards of 37 * 24 / N elements
    "v": ((48, 2, 3), ml_dtypes.bfloat16),
    "tiny": ((24,), np.float16),  # shards of 3 to 12 codes: one padded byte row
    "dense": ((24, 5), ml_dtypes.bfloat16),  # averaged in float by a reduce-scatter
    "empty": ((0, 3), np.float16),
    "bias": ((7,), np.float32),  # not FSDP: the whole mean, as without specs
}
FSDP_LEAF_SPECS = {k: P("data") for k in FSDP_SHAPES} | {"bias": P()}
# Every packed exchange sends FSDP leaves by the same all-to-all of the codes (the exchange
# only picks how whole leaves travel, which the tests above hold for every exchange): the
# FSDP tests run the floats' exchange and the packed default, and the whole leaves by the
# floats' exchange alone (every exchange gives its bits: test_exchanges_agree...).
FSDP_RUNS = (("psum", "fsdp"), ("auto", "fsdp"), ("psum", "whole"))


@functools.cache
def fsdp_update(n, clip=2.5):
    """Per device, the results of one terngrad update (seed 9) for each (exchange, FSDP
    or whole) of FSDP_RUNS."""
    mesh = helpers.mesh_of(n)

    def body(tree):
        tree = jax.tree.map(lambda x: x[0], tree)
        outs = {}
        for mode, fsdp in FSDP_RUNS:
            specs = FSDP_LEAF_SPECS if fsdp == "fsdp" else None
            tx = gradcomm.terngrad(
                "data", clip=clip, seed=9, dense=["dense"], exchange=mode, specs=specs
            )
            outs[mode, fsdp] = tx.update(tree, tx.init(tree))[0]
        return jax.tree.map(lambda x: x[None], outs)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    sharding = NamedSharding(mesh, P("data"))
    return lambda tree: jax.tree.map(np.asarray, f(jax.device_put(tree, sharding)))


def fsdp_tree(n, seed=0):
    rng = np.random.default_rng(seed)
    tree = {k: rng.standard_normal((n, *s)) for k, (s, _) in FSDP_SHAPES.items()}
    tree["w"][:, :3] *= 6  # outliers that clipping cuts, in device 0's shard
    return {k: v.astype(FSDP_SHAPES[k][1]) for k, v in tree.items()}


@pytest.mark.parametrize("n", [3])  # 2, 4 and 8: the model-axis, train_step and wire tests
def test_fsdp_shard_is_the_slice_of_the_whole_mean(n):
    """Device j gets rows [j r, (j + 1) r) of what it gets without specs, bit for bit with
    the floats' and the packed exchange (the same seed draws the same codes), in float32,
    bfloat16 and float16; the float (dense) leaf to rounding."""
    tree = fsdp_tree(n)
    outs = fsdp_update(n)(tree)
    want = outs["psum", "whole"]
    for mode in TWO_EXCHANGES:
        got = outs[mode, "fsdp"]
        np.testing.assert_array_equal(got["bias"], want["bias"], err_msg=mode)
        for leaf, (shape, _) in FSDP_SHAPES.items():
            if leaf == "bias":
                continue
            r = shape[0] // n
            assert got[leaf].shape == (n, r, *shape[1:]), (mode, leaf)
            assert got[leaf].dtype == tree[leaf].dtype
            for j in range(n):
                mine = want[leaf][j, j * r : (j + 1) * r]
                if leaf == "dense":
                    np.testing.assert_allclose(
                        got[leaf][j].astype(np.float32), mine.astype(np.float32), rtol=1e-2
                    )
                else:
                    np.testing.assert_array_equal(got[leaf][j], mine, err_msg=(mode, leaf, j))
    assert not np.allclose(outs["auto", "fsdp"]["w"][0], tree["w"].mean(0)[: 24 // n])


def test_fsdp_leading_dimension_must_split():
    tx = gradcomm.terngrad("data", specs={"w": P("data")})
    with pytest.raises(ValueError, match="divisible by 2"):
        jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")({"w": jnp.ones((2, 3))})


@functools.cache
def fsdp_and_model_update():
    """On a (data 2, model 4) mesh, per exchange, terngrad with 'cols' split over 'model'
    by columns and FSDP over 'data' by rows, and with the split over 'model' only."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    model = {"rows": P("model", None), "cols": P(None, "model"), "bias": P()}
    fsdp = {"rows": P("model", None), "cols": P("data", "model"), "bias": P("data")}
    in_specs = {k: P("data", *spec) for k, spec in model.items()}

    def body(tree):
        tree = jax.tree.map(lambda x: x[0], tree)
        outs = {}
        for mode, name in keys:
            tx = gradcomm.terngrad(
                "data", seed=5, exchange=mode, specs={"fsdp": fsdp}.get(name, model)
            )
            outs[mode, name] = tx.update(tree, tx.init(tree))[0]
        return jax.tree.map(lambda x: x[None], outs)

    # The model-only run by the floats' exchange alone: every exchange gives its bits on
    # leaves split over 'model' (test_a_leaf_sharded_over_a_model_axis_is_ternarized_whole).
    keys = [("psum", "fsdp"), ("auto", "fsdp"), ("psum", "model")]
    out_specs = dict.fromkeys(keys, in_specs)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs))

    def run(tree):
        placed = {k: jax.device_put(v, NamedSharding(mesh, in_specs[k])) for k, v in tree.items()}
        return jax.tree.map(np.asarray, f(placed))

    return run


def test_fsdp_of_a_leaf_split_over_a_model_axis():
    """The codes of a piece split over 'model' are numbered by their place in the whole
    tensor: data device j's FSDP shard is the slice of the model-only result."""
    rng = np.random.default_rng(0)
    tree = {
        "rows": rng.standard_normal((2, 16, 6)).astype(np.float32),
        "cols": rng.standard_normal((2, 4, 8)).astype(np.float32),
        "bias": rng.standard_normal((2, 8)).astype(np.float32),
    }
    outs = fsdp_and_model_update()(tree)
    want = outs["psum", "model"]
    for mode in TWO_EXCHANGES:
        got = outs[mode, "fsdp"]
        np.testing.assert_array_equal(got["rows"], want["rows"], err_msg=mode)
        for leaf in ("cols", "bias"):
            r = got[leaf].shape[1]
            assert r * 2 == want[leaf].shape[1]
            for j in range(2):
                mine = want[leaf][j, j * r : (j + 1) * r]
                np.testing.assert_array_equal(got[leaf][j], mine, err_msg=(mode, leaf))


FSDP_WIRE_SHAPES = [(1000, 1000), (200, 1000), (1000,), (64, 3, 3, 32)]  # 1.2M parameters


@pytest.mark.parametrize("n", [8])  # the same program shape at 4
def test_fsdp_wire_is_a_reduce_scatter_of_the_packed_codes(n):
    """Each device sends (N - 1)/N of the packed codes (ceil(size / N / 5) bytes per leaf
    shard) in one all-to-all, nothing gathered back; at N = 8 on 1.2M parameters, 210 KB:
    1/20 of a float32 reduce-scatter's bytes, 1/40 of a float32 psum's."""
    specs = [P("data")] * len(FSDP_WIRE_SHAPES)
    tx = gradcomm.terngrad("data", specs=specs)
    psum, report = wire_against_psum(lambda t: tx.update(t, tx.init(t))[0], n, FSDP_WIRE_SHAPES)
    packed = sum(n * -(-int(np.prod(s)) // n // 5) for s in FSDP_WIRE_SHAPES)
    kinds = report.by_kind()
    assert kinds["all-to-all"] == (n - 1) / n * packed
    assert "all-gather" not in kinds and "reduce-scatter" not in kinds
    assert report.total <= 1.001 * (n - 1) / n * packed  # plus the scales' and sigmas' floats
    params = sum(int(np.prod(s)) for s in FSDP_WIRE_SHAPES)
    assert report.total <= (n - 1) / n * params * 4 / 19
    if n == 8:
        assert psum / report.total > 39


def test_fsdp_train_step_matches_the_replicated_one():
    """`parallel.train_step` with w1 and w2 (and Adam's moments) split over 4 devices, by
    the packed default exchange. (The replicated run by the floats' exchange: the same
    bits, test_exchanges_agree_and_levels_use_the_shared_scale.)"""
    from gradcomm import parallel

    mesh = helpers.mesh_of(4)
    params, batches = mlp_problem()

    def train(placed, specs):
        exchange = "auto" if specs else "psum"
        tx = gradcomm.terngrad("data", seed=0, specs=specs, exchange=exchange)
        tx = optax.chain(tx, optax.adam(1e-2))
        state = parallel.init_state(tx, placed, mesh)
        step = parallel.train_step(mlp_loss, tx, mesh)
        for batch in batches:
            placed, state, _ = step(placed, state, batch)
        return jax.tree.map(np.asarray, placed), state

    want, _ = train(parallel.replicate(params, mesh), None)
    got, state = train(parallel.shard_params(params, mesh, FSDP_SPECS), FSDP_SPECS)
    for k in params:
        err = np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()
        assert err <= 1e-6, f"param {k} off by {err:.3g} relative"
        assert not np.allclose(got[k], params[k])  # it trained
    adam = next(s for s in jax.tree.leaves(state, is_leaf=_is_adam) if _is_adam(s))
    assert adam.mu["w1"].addressable_shards[0].data.shape == (2, 16)


def _is_adam(x):
    return isinstance(x, optax.ScaleByAdamState)
