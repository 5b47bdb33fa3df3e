"""LAGS-SGD and SLGS against a NumPy reference of Algorithm 1, on 1 to 8 devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
from helpers import (
    FSDP_SPECS,
    PER_SHARD_SHAPES,
    assert_same_bits,
    assert_shards_match,
    explicit_mesh,
    fsdp_against_whole,
    mesh_of,
    mlp_loss,
    mlp_problem,
    per_device,
    per_shard_grads,
    run_fsdp,
    run_on_mesh,
    run_steps,
    sharded_against_whole,
    spec_of,
    tied,
    train_fsdp_against_replicated,
    wire_against_psum,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm

SHAPES = {"w": (20, 9), "b": (9,), "scalar": (), "one": (1,)}


@functools.cache
def steps_fn(density, selector="sampled", steps=3, method="lags"):
    factory = gradcomm.lags if method == "lags" else gradcomm.slgs
    return run_steps(factory("data", density=density, selector=selector), steps)


def random_updates(n, steps, seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((n, steps, *s)).astype(np.float32) for k, s in SHAPES.items()}


# One device, pairs, odd counts, a full byte ("sampled": below 2^14 entries it takes the
# very program "exact" does, test_sampled_is_exact_on_small_leaves; test_sparse checks it
# on large leaves, where it differs).
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_matches_algorithm_1_over_several_steps(n):
    density, steps = 0.1, 3
    updates = random_updates(n, steps, n)
    outs, residuals = per_device(steps_fn(density, "exact", steps), n, updates)
    for leaf, shape in SHAPES.items():
        size = int(np.prod(shape))
        k = max(1, round(density * size))
        r = [np.zeros(shape, np.float32)] * n
        for t in range(steps):
            u = [updates[leaf][p, t] for p in range(n)]
            expected, r, sent = reference.lags_step(r, u, k)
            for p in range(n):
                np.testing.assert_array_equal(outs[leaf][p, t], outs[leaf][0, t])  # same bits
                # The residual keeps exactly what was not sent.
                np.testing.assert_array_equal(residuals[leaf][p, t], r[p])
                acc = (residuals[leaf][p, t - 1] if t else 0) + u[p]
                np.testing.assert_array_equal(
                    residuals[leaf][p, t].ravel() + sent[p], np.ravel(acc)
                )
            np.testing.assert_allclose(outs[leaf][0, t], expected, rtol=1e-6, atol=1e-7)
            assert np.count_nonzero(outs[leaf][0, t]) <= n * k


def test_sampled_is_exact_on_small_leaves():
    """Below 2^14 entries the "sampled" selector traces to the program of "exact" (so the
    reference test above holds for both), and above it to another."""
    n, mesh = 6, mesh_of(6)
    sharding = NamedSharding(mesh, P("data"))

    def traced(selector, shapes):
        body = lambda u: jax.tree.map(  # noqa: E731
            lambda x: x[None], steps_fn(0.1, selector, 2)(jax.tree.map(lambda x: x[0], u))
        )
        f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        tree = {k: jax.ShapeDtypeStruct((n, 2, *s), np.float32, sharding=sharding)
                for k, s in shapes.items()}  # fmt: skip
        return str(jax.make_jaxpr(f)(tree))

    assert traced("sampled", SHAPES) == traced("exact", SHAPES)
    big = {"w": (128, 128)}
    assert traced("sampled", big) != traced("exact", big)


def test_density_one_gives_the_dense_mean():
    n = 4
    updates = random_updates(n, 2, 0)
    outs, residuals = per_device(steps_fn(1.0, steps=2), n, updates)
    for leaf in SHAPES:
        np.testing.assert_allclose(outs[leaf][0], updates[leaf].mean(0), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(residuals[leaf], 0)


def test_size_one_leaves_always_send():
    """k >= 1: a scalar at density 0.001 is sent every step, so its output is the mean."""
    n = 3
    updates = random_updates(n, 2, 1)
    outs, _ = per_device(steps_fn(0.001, steps=2), n, updates)
    for leaf in ("scalar", "one"):
        np.testing.assert_allclose(outs[leaf][0], updates[leaf].mean(0), rtol=1e-6)


def test_zero_and_non_finite_updates():
    n = 2
    updates = random_updates(n, 2, 2)
    updates["w"][:] = 0
    updates["b"][1, 0, 3] = np.nan
    outs, residuals = per_device(steps_fn(0.2, steps=2), n, updates)
    np.testing.assert_array_equal(outs["w"], 0)
    np.testing.assert_array_equal(residuals["w"], 0)
    # A NaN is sent at once (non-finite values rank first), so it shows in the output
    # instead of hiding in the residual.
    assert np.isnan(outs["b"][0, 0, 3])
    assert np.isfinite(residuals["b"]).all()


def test_slgs_is_one_top_k_over_the_whole_model():
    n, density = 4, 0.05
    updates = random_updates(n, 1, 3)
    outs, residuals = per_device(steps_fn(density, steps=1, method="slgs"), n, updates)
    names = list(SHAPES)
    flat = [np.concatenate([updates[k][p, 0].ravel() for k in names]) for p in range(n)]
    total = flat[0].size
    k = max(1, round(density * total))
    expected, r, _ = reference.lags_step([np.zeros(total, np.float32)] * n, flat, k)
    got = np.concatenate([outs[name][0, 0].ravel() for name in names])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    got_residual = np.concatenate([residuals[name][2, 0].ravel() for name in names])
    np.testing.assert_array_equal(got_residual, r[2])


def test_per_leaf_densities_by_name_and_prefix():
    tx = gradcomm.lags("data", density={"layer": 0.5, "head/bias": 1.0, "head/kernel": 0.25})
    updates = {
        "layer": {"kernel": jnp.arange(8.0)},
        "head": {"kernel": jnp.arange(8.0), "bias": jnp.ones(2)},
    }
    state = tx.init(updates)
    out, _ = jax.vmap(lambda u: tx.update(u, state), axis_name="data")(
        jax.tree.map(lambda x: x[None], updates)
    )
    assert int(jnp.count_nonzero(out["layer"]["kernel"])) == 4
    assert int(jnp.count_nonzero(out["head"]["kernel"])) == 2
    np.testing.assert_array_equal(out["head"]["bias"][0], 1.0)
    missing = gradcomm.lags("data", density={"layer": 0.5})
    with pytest.raises(ValueError, match="no value for leaves"):
        jax.vmap(lambda u: missing.update(u, missing.init(u)), axis_name="data")(
            jax.tree.map(lambda x: x[None], updates)
        )
    unknown = gradcomm.lags("data", density={"nope": 0.5, "layer": 0.5, "head": 0.5})
    with pytest.raises(ValueError, match=r"\['nope'\] match no leaf"):
        jax.vmap(lambda u: unknown.update(u, unknown.init(u)), axis_name="data")(
            jax.tree.map(lambda x: x[None], updates)
        )


@pytest.mark.parametrize("density", [0, -0.5, 1.01, {"w": 0.0}, {}])
def test_bad_densities_raise(density):
    with pytest.raises(ValueError, match="density"):
        gradcomm.lags("data", density=density)
    if not isinstance(density, dict):
        with pytest.raises(ValueError, match="density"):
            gradcomm.slgs("data", density=density)


def test_bad_selector_raises():
    with pytest.raises(ValueError, match="selector"):
        gradcomm.lags("data", selector="heap")


def delta_fn(acc):
    return gradcomm.lags_delta(acc, 0.1, "data")


def test_delta_matches_eq_20():
    n = 4
    rng = np.random.default_rng(4)
    acc = {"w": rng.standard_normal((n, 300)).astype(np.float32)}
    acc["w"][:, :5] *= 20  # a few large entries every device agrees on: top-k shines
    got = per_device(delta_fn, n, acc)["w"][0]
    np.testing.assert_allclose(got, reference.lags_delta(list(acc["w"]), 30), rtol=1e-5)
    assert got < 1


def test_speedup_bound_follows_eq_19():
    tf, tb = 1.0, 3.0
    for tc in (0.5, 1.0, 3.0, 6.0):
        expected = (tf + tb + tc) / (tf + tb + tc - min(tb, tc))
        assert gradcomm.lags_speedup_bound(tf, tb, tc) == pytest.approx(expected)
    peak = gradcomm.lags_speedup_bound(tf, tb, tb)
    assert peak == pytest.approx(1 + tb / (tf + tb))
    assert all(gradcomm.lags_speedup_bound(tf, tb, tc) <= peak for tc in np.linspace(0.01, 10, 50))
    assert gradcomm.lags_speedup_bound(tf, tb, 0.0) == 1.0
    with pytest.raises(ValueError):
        gradcomm.lags_speedup_bound(1.0, 0.0, 1.0)


def test_plan_gives_lower_density_where_communication_cannot_hide():
    sizes = {"head": 50_000, "middle": 50_000, "stem": 50_000}
    # The head's communication hides behind the middle's long backward pass, the middle's
    # behind the stem's short one, and the stem's behind nothing.
    backward = {"head": 1e-3, "middle": 5e-3, "stem": 2e-4}
    plan = gradcomm.lags_plan(backward, sizes, num_devices=8, latency=1e-5, bandwidth=1e9)
    d = plan.densities
    assert d["head"] > d["middle"] > d["stem"] == pytest.approx(1 / 1000)
    assert plan.hidden == {"head": True, "middle": True, "stem": False}
    for name in sizes:
        k = round(d[name] * sizes[name])
        assert plan.comm_seconds[name] == pytest.approx(1e-5 * 7 + 7 * k * 8 / 1e9)
    slow = gradcomm.lags_plan(backward, sizes, num_devices=8, latency=1e-5, bandwidth=1e7)
    assert all(slow.densities[name] <= d[name] for name in sizes)
    single = gradcomm.lags_plan(backward, sizes, num_devices=1, latency=1e-5, bandwidth=1e9)
    assert set(single.densities.values()) == {1.0}
    assert "| stem |" in plan.table()
    with pytest.raises(ValueError, match="different leaves"):
        gradcomm.lags_plan(backward, {"head": 1}, num_devices=2, latency=0, bandwidth=1)


def test_profile_orders_leaves_from_the_output():
    def loss(p, x):
        h = jnp.tanh(x @ p["stem"])
        h = jnp.tanh(h @ p["middle"])
        return jnp.sum(h @ p["head"])

    params = {"stem": jnp.ones((32, 64)), "middle": jnp.ones((64, 64)), "head": jnp.ones((64, 4))}
    times = gradcomm.lags_profile(loss, params, jnp.ones((16, 32)))
    assert list(times) == ["head", "middle", "stem"]
    assert all(t >= 0 for t in times.values())
    plan = gradcomm.lags_plan(
        times, {k: v.size for k, v in params.items()}, num_devices=4, latency=1e-6, bandwidth=1e9
    )
    assert list(plan.densities) == ["head", "middle", "stem"]


def test_wire_bytes_at_density_one_in_a_thousand():
    """N = 8, density 0.001, 1.2M parameters: at least 100x fewer bytes than a dense psum."""
    tx = gradcomm.lags("data", density=0.001)
    psum, report = wire_against_psum(lambda t: tx.update(t, tx.init(t))[0], 8)
    assert psum / report.total >= 100


# Leaves sharded over model axes (tensor parallelism): the whole leaves' results, bit for
# bit (the harness is test_sparse's).


def sharded_grads(dtype, steps=2, data=2, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"rows": (16, 6), "cols": (5, 8), "bias": (6,)}
    return {k: rng.standard_normal((steps, data, *s)).astype(dtype) for k, s in shapes.items()}


def test_slgs_on_a_model_split_over_two_axes_and_a_density_of_one():
    """Pieces over ('a', 'b') (4 of them, k not a multiple of 4), and density 1, where the
    model goes dense: the whole model's bits."""
    specs = {"rows": P(("a", "b"), None), "cols": P(None, "b"), "bias": P()}
    grads = sharded_grads(np.float32, data=2, seed=1)
    for density in (0.07, 1.0):
        make = functools.partial(gradcomm.slgs, "data", density=density)
        got, want = sharded_against_whole(make, grads, specs, (2, 2, 2), ("data", "a", "b"))
        assert_same_bits(got, want)


def test_delta_on_sharded_leaves_is_the_whole_leaves():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 12, 4)).astype(np.float32)
    mesh = explicit_mesh((2, 2), ("data", "model"))

    def delta(a):
        return gradcomm.lags_delta(a[0], 0.2, "data")[None, None]

    spec = P("data", "model")
    f = jax.jit(jax.shard_map(delta, mesh=mesh, in_specs=spec, out_specs=spec))
    got = np.asarray(f(jax.device_put(x, NamedSharding(mesh, spec))))
    want = per_device(whole_delta_fn, 2, x)
    assert got.shape == (2, 2)
    np.testing.assert_allclose(got, np.stack([want, want], 1), rtol=1e-6)


def whole_delta_fn(a):
    return gradcomm.lags_delta(a, 0.2, "data")


# Exact ties at the threshold (Adam's first updates, before lags, are nearly all of one
# magnitude): with specs, leaves split along a column, a middle dimension or two of them
# send the whole leaves' entries; without them ties go in shard-major order, which is the
# whole leaf's order only where its leading dimension is split. Beside them, a leaf of
# zeros (ties everywhere: sent zeros whatever the order) and one with a piece of zeros and
# non-finite values (sent first, so the residual stays finite), split like "cols" and
# "rows"; for lags (a top-k per leaf) random leaves split so too, which give the whole
# leaves' bits with specs or without.
TIED_LAYOUTS = {
    "model": (
        {"rows": P("model", None), "cols": P(None, "model"), "mid": P(None, "model", None)},
        (2, 2),
        ("data", "model"),
    ),
    "two_axes": (
        {"rows": P(("b", "a"), None), "cols": P(None, ("a", "b")), "mid": P(None, "a", "b")},
        (2, 2, 2),
        ("data", "a", "b"),
    ),
}


RANDOM = ("rows", "cols")  # the layouts of the random leaves


def tied_grads(dtype, steps=2, data=2, seed=0, random=False):
    rng = np.random.default_rng(seed)
    shapes = {"rows": (8, 6), "cols": (6, 8), "mid": (3, 4, 2), "bias": (6,), "bad": (8, 6)}
    grads = {k: tied((steps, data, *s), rng) for k, s in shapes.items()}
    if random:
        grads |= {f"random_{k}": rng.standard_normal((steps, data, *shapes[k])) for k in RANDOM}
    grads["zero"] = np.zeros((steps, data, 6, 8), np.float32)
    grads["bad"][:, :, :2] = 0  # in the first piece of either split
    grads["bad"][0, 1, 6, [1, 4]] = [np.nan, np.inf]
    return {k: v.astype(dtype) for k, v in grads.items()}


# The whole leaves' bits in bfloat16 and float16 (float32: the train_step test below), on
# a mesh of two model axes and of one.
@pytest.mark.parametrize(
    ("method", "layout", "dtype"),
    [("lags", "two_axes", jnp.bfloat16), ("slgs", "model", np.float16)],
)
def test_ties_on_split_leaves_go_as_on_the_whole_leaves_with_specs(method, layout, dtype):
    factory = gradcomm.lags if method == "lags" else gradcomm.slgs
    specs, shape, names = TIED_LAYOUTS[layout]
    random = {f"random_{k}": specs[k] for k in RANDOM} if method == "lags" else {}
    specs = {**specs, "bias": P(), "zero": specs["cols"], "bad": specs["rows"], **random}
    grads = tied_grads(dtype, random=method == "lags")
    make = functools.partial(factory, "data", density=0.1)
    # The whole leaves over 'data' alone, once for both checks (specs there split nothing).
    whole = explicit_mesh(shape[:1], names[:1])
    want = run_on_mesh(make(), grads, whole, dict.fromkeys(grads, P()))
    mesh = explicit_mesh(shape, names)
    got = run_on_mesh(make(specs=specs), grads, mesh, specs)
    assert_same_bits(got, want)
    np.testing.assert_array_equal(got["zero"], 0)
    assert np.isnan(got["bad"][0, :, 6, 1]).all() and np.isfinite(got["bad"][1:]).all()
    # Without specs, ties go in shard-major order: other entries of the split leaves.
    got = run_on_mesh(make(), grads, mesh, specs)
    assert not all(np.array_equal(got[k], want[k]) for k in ("cols", "mid"))
    assert_same_bits(got, {k: want[k] for k in random})


def test_delta_with_specs_ties_as_the_whole_leaf():
    rng = np.random.default_rng(6)
    x = tied((2, 4, 12), rng)
    mesh = explicit_mesh((2, 2), ("data", "model"))
    spec = P(None, "model")

    def delta(a):
        return gradcomm.lags_delta(a[0], 0.2, "data", specs=spec)[None, None]

    full = P("data", None, "model")
    f = jax.jit(jax.shard_map(delta, mesh=mesh, in_specs=full, out_specs=P("data", "model")))
    got = np.asarray(f(jax.device_put(x, NamedSharding(mesh, full))))
    want = per_device(whole_delta_fn, 2, x)
    np.testing.assert_allclose(got, np.stack([want, want], 1), rtol=1e-6)


def test_specs_that_do_not_match_the_split_or_split_over_data_raise():
    mesh = explicit_mesh((2, 2), ("data", "model"))
    full = P("data", None, "model")  # each device: a (4, 3) piece of a column-split leaf

    def run(tx):
        f = jax.shard_map(
            lambda g: tx.update(g[0], tx.init(g[0]))[0][None], mesh=mesh, in_specs=full,
            out_specs=full,
        )  # fmt: skip
        x = jax.ShapeDtypeStruct((2, 4, 6), jnp.float32, sharding=NamedSharding(mesh, full))
        jax.eval_shape(f, x)

    for factory in (gradcomm.lags, gradcomm.slgs):
        with pytest.raises(ValueError, match="splits it over"):
            run(factory("data", density=0.2, specs=P()))
    with pytest.raises(ValueError, match="slgs does not take"):
        run(gradcomm.slgs("data", density=0.2, specs=P("data", None)))


# Adam before lags (the paper's placement) in parallel.train_step, on a model whose
# gradients are the same bits split over 'model' as whole (elementwise: no product sums a
# split dimension): Adam's first updates tie, and with specs the params are the whole
# model's bit for bit. (A row-parallel product sums partial products over 'model', which
# changes the gradients' last bits, and Adam's near-ties then flip on an ulp.)
ELEMENTWISE_SPECS = {"w": P(None, "model"), "v": P(None, "model", None), "c": P()}


def elementwise_loss(params, batch, model_axis=None):
    terms = {k: batch[k] for k in ("w", "v")}
    if model_axis is not None:  # this device's columns of the targets
        i = jax.lax.axis_index(model_axis)
        terms = {k: jax.lax.dynamic_slice_in_dim(t, i * 4, 4, 2) for k, t in terms.items()}
    split = sum(jnp.sum((params[k][None] - t) ** 2) for k, t in terms.items())
    if model_axis is not None:
        split = jax.lax.psum(split, model_axis)
    return split + jnp.sum((params["c"] - batch["c"]) ** 2)


@pytest.mark.parametrize("method", ["lags", "slgs"])
def test_adam_before_lags_in_train_step_keeps_the_whole_models_bits(method):
    from gradcomm import parallel

    rng = np.random.default_rng(7)
    params = {
        "w": rng.standard_normal((4, 8)).astype(np.float32),
        "v": rng.standard_normal((3, 8, 2)).astype(np.float32),
        "c": rng.standard_normal(6).astype(np.float32),
    }
    batches = [
        {k: rng.standard_normal((8, *p.shape)).astype(np.float32) for k, p in params.items()}
        for _ in range(3)
    ]
    factory = gradcomm.lags if method == "lags" else gradcomm.slgs

    def train(mesh, placed, specs, loss):
        tx = optax.chain(optax.adam(1e-2), factory("data", density=0.1, specs=specs))
        state = parallel.init_state(tx, placed, mesh, axes="data")
        step = parallel.train_step(loss, tx, mesh, axes="data")
        for batch in batches:
            placed, state, _ = step(placed, state, batch)
        return jax.tree.map(np.asarray, placed)

    one, two = explicit_mesh((4,), ("data",)), explicit_mesh((4, 2), ("data", "model"))
    want = train(one, parallel.replicate(params, one), None, elementwise_loss)
    split = functools.partial(elementwise_loss, model_axis="model")
    placed = parallel.shard_params(params, two, ELEMENTWISE_SPECS)
    assert_same_bits(train(two, placed, ELEMENTWISE_SPECS, split), want)
    # Without specs (shard-major ties), the split leaves step differently.
    got = train(two, parallel.shard_params(params, two, ELEMENTWISE_SPECS), None, split)
    assert not all(np.array_equal(got[k], want[k]) for k in ("w", "v"))


# FSDP (ZeRO-3): leaves split along their leading dimension over 'data' (test_sparse's
# harness): each device's shard is the slice of the whole mean, bit for bit.
FSDP_SHAPES = {"w": (16, 24), "v": (8, 3, 5), "d": (12, 10), "e": (0, 4), "b": (24,)}
FSDP_SPLIT = {"w": True, "v": True, "d": True, "e": True, "b": False}
# w: pairs in the all-gather; v: the rows' all-to-all; d: dense (a reduce-scatter).
FSDP_DENSITY = {"w": 0.05, "v": 0.2, "d": 0.5, "e": 0.1, "b": 0.1}


def fsdp_grads(dtype=np.float32, steps=2, n=4, seed=0):
    rng = np.random.default_rng(seed)
    grads = {k: rng.standard_normal((steps, n, *s)).astype(dtype) for k, s in FSDP_SHAPES.items()}
    grads["w"][1, 2, 3, :2] = [np.inf, np.nan]  # non-finite values are sent first
    grads["w"][:, :, 5] = np.round(grads["w"][:, :, 5])  # ties at the threshold
    return grads


# "exact" only: below 2^14 entries "sampled" compiles the very program "exact" does.
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_fsdp_shards_are_the_slices_of_the_whole_mean(dtype):
    """Two steps (the residuals carry over): every device's shard of an FSDP leaf is the
    slice of the mean without FSDP and its whole-sized residual the same, bit for bit,
    whichever way the leaf travels; the whole leaf is unchanged."""

    def make(specs):
        return gradcomm.lags("data", density=FSDP_DENSITY, selector="exact", specs=specs)

    got, _ = fsdp_against_whole(make, fsdp_grads(dtype), FSDP_SPLIT)
    assert got["w"].shape == (2, 4, 4, 24) and got["e"].shape == (2, 4, 0, 4)
    assert not np.isfinite(got["w"][1]).all()  # the non-finite values arrived


def test_fsdp_leaves_must_divide_and_stay_whole_over_other_axes():
    grads = {"w": np.ones((1, 4, 6, 3), np.float32)}
    with pytest.raises(ValueError, match="divisible by 4"):
        run_fsdp(gradcomm.lags("data", specs={"w": P("data")}), grads, {"w": False}, 4)
    with pytest.raises(ValueError, match="unsent part of its whole gradient"):
        grads = {"w": np.ones((1, 4, 8, 3), np.float32)}  # init given the whole param
        run_fsdp(gradcomm.lags("data", specs={"w": P("data")}), grads, {"w": False}, 4)
    # Split over 'data' (FSDP) and over 'model' too: not supported.
    mesh = explicit_mesh((2, 2), ("data", "model"))
    tx = gradcomm.lags("data", specs=P("data", "model"))

    def body(g):  # g: this data device's whole rows, its half of the columns
        return tx.update(g[0], gradcomm.LagsState(jnp.zeros((1, *g.shape[1:]))))[0][None]

    spec = P("data", None, "model")
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    with pytest.raises(ValueError, match="one or the other"):
        x = jax.ShapeDtypeStruct((2, 4, 6), jnp.float32, sharding=NamedSharding(mesh, spec))
        jax.eval_shape(f, x)


def test_fsdp_train_step_matches_the_replicated_one():
    """`parallel.train_step` with the MLP's kernels split over 'data': lags before Adam, and
    after a stateless SGD (the paper's placement), give the replicated run's params within
    1e-6; Adam's moments are split like the params and the residual is per device and
    whole-sized, the replicated run's residual."""
    for make in (
        lambda specs: optax.chain(
            gradcomm.lags("data", density=0.1, specs=specs), optax.adam(1e-2)
        ),
        lambda specs: optax.chain(optax.sgd(0.1), gradcomm.lags("data", density=0.1, specs=specs)),
    ):
        got, state, _, want_state = train_fsdp_against_replicated(make)
        lags_state = next(s for s in state if isinstance(s, gradcomm.LagsState))
        want_residual = next(s for s in want_state if isinstance(s, gradcomm.LagsState)).residual
        for k in FSDP_SPECS:
            residual = lags_state.residual[k]
            assert residual.shape == (4, *got[k].shape), k  # one whole residual per device
            assert spec_of(residual)[0] == "data", k
            assert residual.addressable_shards[0].data.shape == (1, *got[k].shape)
            np.testing.assert_allclose(
                np.asarray(residual).reshape(4, -1),
                np.asarray(want_residual[k]).reshape(4, -1),
                rtol=1e-6,
                atol=1e-7,
            )
        adam = [s for s in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(s)]
        for moments in adam:  # split like the params: 1/N per device
            assert spec_of(moments.mu["w1"]) == P("data")
            assert moments.mu["w1"].addressable_shards[0].data.shape == (2, 16)


def test_fsdp_after_adam_is_rejected():
    """Adam before lags would see whole gradients with moments shaped like the shards: its
    state would have to be whole and per device, N times FSDP's, so it is not supported."""
    from gradcomm import parallel

    mesh = explicit_mesh((4,), ("data",))
    params, batches = mlp_problem(steps=1)
    tx = optax.chain(optax.adam(1e-2), gradcomm.lags("data", density=0.1, specs=FSDP_SPECS))
    placed = parallel.shard_params(params, mesh, FSDP_SPECS)
    with pytest.raises(ValueError, match="FSDP"):
        state = parallel.init_state(tx, placed, mesh)
        parallel.train_step(mlp_loss, tx, mesh)(placed, state, batches[0])


def is_adam(x):
    return isinstance(x, optax.ScaleByAdamState)


def test_fsdp_wire_bytes():
    """Per device over 4 devices, a (256, 64) leaf: at density 0.01 the FSDP exchange is the
    all-gather of k pairs that it is without FSDP, (N - 1) k * 8 bytes (N times a
    reduce-scatter's (N - 1) / N k pairs); at 0.2 (pairs would outweigh a dense
    reduce-scatter), an all-to-all of the dense rows, (N - 1) / N of the leaf's bytes."""
    from gradcomm import wire

    n, shape = 4, (256, 64)
    mesh = explicit_mesh((n,), ("data",))
    spec = P("data")
    x = jax.ShapeDtypeStruct((n * shape[0], shape[1]), jnp.float32)
    x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    def kinds(density, specs):
        tx = gradcomm.lags("data", density=density, selector="exact", specs=specs)
        split = specs is not None

        def body(g):
            params = g[: g.shape[0] // n] if split else g
            return tx.update(g, tx.init(params))[0]

        f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
        return wire.measure(f, x).by_kind()

    size = shape[0] * shape[1]
    k = gradcomm.sparse.num_kept(size, 0.01)
    pairs = (n - 1) * k * 8
    assert kinds(0.01, None) == {"all-gather": pairs}
    assert kinds(0.01, spec) == {"all-gather": pairs}
    k = gradcomm.sparse.num_kept(size, 0.2)
    assert kinds(0.2, None) == {"all-gather": (n - 1) * k * 8}
    assert kinds(0.2, spec) == {"all-to-all": (n - 1) / n * size * 4}


# w: pairs in the all-to-all; v: dense rows at n = 8 (2 of a shard's 3 entries); z: zeros;
# h: huge entries, as large as the dtype allows for a sum over 8 devices in float32.
PER_SHARD_DENSITY = {"w": 0.1, "v": 0.5, "z": 0.25, "h": 0.25}


@pytest.mark.parametrize(
    ("n", "dtype"),
    [(1, np.float32), (2, np.float16), (4, jnp.bfloat16), (8, np.float32)],
)
def test_fsdp_per_shard_is_lags_with_each_shard_a_layer(n, dtype):
    """`fsdp_topk="per_shard"`: LAGS (eq. 5, the float64 reference) on each of an FSDP
    leaf's n shards as a layer of its own at the leaf's density, for two steps with
    residuals; each device gets its shard's mean, and every residual is the reference's,
    bit for bit."""
    grads = per_shard_grads(n, dtype, steps=2)
    specs = dict.fromkeys(PER_SHARD_SHAPES, P("data"))
    tx = gradcomm.lags(
        "data", density=PER_SHARD_DENSITY, selector="exact", specs=specs, fsdp_topk="per_shard"
    )
    got, residuals = run_fsdp(tx, grads, dict.fromkeys(PER_SHARD_SHAPES, True), n)
    for k in PER_SHARD_SHAPES:
        keep = functools.partial(gradcomm.sparse.num_kept, density=PER_SHARD_DENSITY[k])
        want, want_residuals = reference.per_shard(reference.lags_step, grads[k], n, keep)
        assert got[k].shape == (2, n, PER_SHARD_SHAPES[k][0] // n, PER_SHARD_SHAPES[k][1])
        assert_shards_match(got[k], want, dtype, n)
        np.testing.assert_array_equal(residuals[k], want_residuals)
    assert not got["z"].any() and np.isfinite(got["h"]).all()


def test_fsdp_per_shard_needs_specs_and_a_known_mode():
    with pytest.raises(ValueError, match="pass specs="):
        gradcomm.lags("data", fsdp_topk="per_shard")
    with pytest.raises(ValueError, match="fsdp_topk must be one of"):
        gradcomm.lags("data", specs=P("data"), fsdp_topk="shard")


def test_fsdp_per_shard_wire_is_a_reduce_scatter_of_the_pairs():
    """Per device over 4 devices, a (256, 64) leaf at density 0.01: `per_shard` sends each
    other device the c = round(0.01 * size / 4) pairs of its shard, (N - 1) c * 8 bytes in
    one all-to-all: (N - 1) / N of the k pairs that "whole" all-gathers N - 1 times."""
    from gradcomm import wire

    n, shape = 4, (256, 64)
    mesh = explicit_mesh((n,), ("data",))
    spec = P("data")
    x = jax.ShapeDtypeStruct(
        (n * shape[0], shape[1]), jnp.float32, sharding=NamedSharding(mesh, spec)
    )
    tx = gradcomm.lags("data", density=0.01, specs=spec, fsdp_topk="per_shard")

    def body(g):
        return tx.update(g, tx.init(g[: g.shape[0] // n]))[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    size = shape[0] * shape[1]
    c = gradcomm.sparse.num_kept(size // n, 0.01)
    assert wire.measure(f, x).by_kind() == {"all-to-all": (n - 1) * c * 8}
    assert (n - 1) * c == (n - 1) / n * gradcomm.sparse.num_kept(size, 0.01)
