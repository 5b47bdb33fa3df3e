"""Gradient dropping with local gradients, periodic averaging and local SGD."""

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
    per_device,
    per_shard_grads,
    run_fsdp,
    run_on_mesh,
    run_steps,
    sharded_against_whole,
    tied,
    train_fsdp_against_replicated,
    wire_against_psum,
)
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel
from gradcomm.dropping import drop_rate

SHAPES = {"w": (30, 7), "b": (7,), "scalar": ()}


@functools.cache
def steps_fn(local, drop_ratio=0.9, steps=2, warmup_steps=0):
    tx = gradcomm.gradient_dropping(
        "data", drop_ratio=drop_ratio, local=local, warmup_steps=warmup_steps
    )
    return run_steps(tx, steps)


def random_grads(n, steps, seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((n, steps, *s)).astype(np.float32) for k, s in SHAPES.items()}


# Algorithm 1 (local=None) on every device count; the combinations, elementwise after the
# same exchange, on 1, 3 and 8.
@pytest.mark.parametrize(
    ("local", "n"),
    [
        *((None, n) for n in range(1, 9)),
        *((c, n) for c in ("sum", "compensated") for n in (1, 3, 8)),
    ],
)
def test_matches_algorithm_1_and_the_combinations(n, local):
    drop_ratio, steps = 0.9, 2
    grads = random_grads(n, steps, n)
    outs, residuals = per_device(steps_fn(local, drop_ratio, steps), n, grads)
    for leaf, shape in SHAPES.items():
        size = int(np.prod(shape))
        k = max(1, round((1 - drop_ratio) * size))
        r = [np.zeros(shape, np.float32)] * n
        for t in range(steps):
            g = [grads[leaf][p, t] for p in range(n)]
            expected, r, sent = reference.gradient_dropping_step(r, g, k, local)
            total = np.sum(sent, axis=0) / n
            for p in range(n):
                np.testing.assert_allclose(outs[leaf][p, t], expected[p], rtol=1e-5, atol=1e-6)
                np.testing.assert_array_equal(residuals[leaf][p, t], r[p])  # exactly unsent
                difference = outs[leaf][p, t].ravel() - total
                if local == "sum":
                    np.testing.assert_allclose(difference, np.ravel(g[p]) / n, atol=1e-6)
                elif local == "compensated":
                    np.testing.assert_allclose(
                        difference, (np.ravel(g[p]) - sent[p]) / n, atol=1e-6
                    )
                else:
                    np.testing.assert_allclose(difference, 0, atol=1e-6)


def test_nothing_dropped_and_compensated_is_the_dense_mean():
    n = 4
    grads = random_grads(n, 2, 0)
    outs, residuals = per_device(steps_fn("compensated", 0.0), n, grads)
    for leaf in SHAPES:
        np.testing.assert_allclose(outs[leaf][0], grads[leaf].mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(residuals[leaf], 0)


@pytest.mark.parametrize("t", [0, 10, 999, 1000])
def test_warmup_follows_the_formula(t):
    drop_ratio, size = 0.99, 10_000
    expected_rate = drop_ratio ** (1000 / (1 + t)) if t < 1000 else drop_ratio
    np.testing.assert_allclose(drop_rate(jnp.int32(t), drop_ratio, 1000), expected_rate, rtol=1e-5)
    tx = gradcomm.gradient_dropping("data", drop_ratio=drop_ratio)
    g = jnp.asarray(np.random.default_rng(t).standard_normal(size).astype(np.float32))
    state = tx.init(g)._replace(count=jnp.int32(t))
    _, state = jax.jit(jax.vmap(lambda x: tx.update(x, state), axis_name="data"))(g[None])
    sent = int(np.sum(np.asarray(state.residual) == 0))
    assert sent == max(1, round((1 - expected_rate) * size))


def test_averaging_makes_devices_bit_identical_and_they_drift_between():
    """Under parallel.train_step(sync=...) the params are the exact mean after steps k, 2k."""
    n, k = 4, 3
    mesh = mesh_of(n)
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal((6, 3)).astype(np.float32) * 0.1}
    batches = [
        {
            "x": rng.standard_normal((16, 6)).astype(np.float32),
            "y": rng.standard_normal((16, 3)).astype(np.float32),
        }
        for _ in range(2 * k)
    ]

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    for tx, sync in (
        (
            optax.chain(
                gradcomm.gradient_dropping(
                    "data", drop_ratio=0.8, local="compensated", warmup_steps=0
                ),
                optax.adam(1e-2),
            ),
            gradcomm.periodic_average("data", every=k),
        ),
        (optax.sgd(0.1), gradcomm.local_sgd("data", every=k)),
    ):
        copies = parallel.per_device(params, mesh)
        state = parallel.init_state(tx, copies, mesh, params_per_device=True, sync=sync)
        step = parallel.train_step(loss, tx, mesh, params_per_device=True, sync=sync)
        for t in range(1, 2 * k + 1):
            copies, state, _ = step(copies, state, batches[t - 1])
            w = np.asarray(copies["w"])
            identical = all(np.array_equal(w[0], w[i]) for i in range(1, n))
            assert identical == (t % k == 0), t


def test_arguments_and_params_are_checked():
    for kwargs, match in [
        ({"drop_ratio": 1.0}, "drop_ratio"),
        ({"drop_ratio": -0.1}, "drop_ratio"),
        ({"local": "both"}, "local"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"selector": "heap"}, "selector"),
    ]:
        with pytest.raises(ValueError, match=match):
            gradcomm.gradient_dropping("data", **kwargs)
    with pytest.raises(ValueError, match="every"):
        gradcomm.local_sgd("data", every=0)
    with pytest.raises(TypeError, match="average_every"):  # now a sync: periodic_average
        gradcomm.gradient_dropping("data", average_every=5)


def test_wire_bytes_at_drop_ratio_099():
    """N = 8, 99% dropped, 1.2M parameters: at least 10x fewer bytes than a dense psum."""
    tx = gradcomm.gradient_dropping("data", drop_ratio=0.99, local="compensated", warmup_steps=0)
    psum, report = wire_against_psum(lambda t: tx.update(t, tx.init(t))[0], 8)
    assert psum / report.total >= 10


# Leaves sharded over a 'model' axis (tensor parallelism): the whole leaves' results, bit
# for bit (the harness is test_sparse's), through the warm-up and after it.
SHARDED = {"rows": P("model", None), "cols": P(None, "model"), "bias": P()}


def sharded_grads(dtype, steps=2, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"rows": (16, 6), "cols": (5, 8), "bias": (6,)}
    return {k: rng.standard_normal((steps, 2, *s)).astype(dtype) for k, s in shapes.items()}


def dropping_factory(local, warmup_steps=2, selector="sampled"):
    return functools.partial(
        gradcomm.gradient_dropping,
        "data",
        drop_ratio=0.9,
        local=local,
        warmup_steps=warmup_steps,
        selector=selector,
    )


# (local=None on split leaves: the ties test's first case.)
@pytest.mark.parametrize(("local", "dtype"), [("compensated", jnp.bfloat16), ("sum", np.float16)])
def test_sharded_leaves_in_bf16_and_fp16_give_the_whole_leaves_bits(local, dtype):
    """A warm-up step, then a sparse one from its residual."""
    make = dropping_factory(local, warmup_steps=1, selector="exact")
    assert_same_bits(*sharded_against_whole(make, sharded_grads(dtype), SHARDED))


def test_sharded_zero_and_non_finite_gradients():
    grads = sharded_grads(np.float32, steps=2)
    grads["cols"][:] = 0
    grads["rows"][:, :, 8:] = 0  # the second piece over 'model'
    grads["rows"][1, 0, 2, [0, 5]] = [-np.inf, np.nan]
    # A warm-up step (its own branch), then the sparse one that warmup_steps=0 would run.
    make = dropping_factory("compensated", warmup_steps=1)
    got, want = sharded_against_whole(make, grads, SHARDED)
    assert_same_bits(got, want)
    assert np.isfinite(got["rows"][0]).all() and not np.isfinite(got["rows"][1]).all()
    np.testing.assert_array_equal(got["cols"], 0)


# Exact ties at the threshold on leaves split along a column or a middle dimension: with
# specs, the whole leaves' entries go; without them, ties go in shard-major order.
TIED_SPECS = {"cols": P(None, "model"), "mid": P(None, "model", None), "bias": P()}


@pytest.mark.parametrize(
    ("local", "dtype", "warmup_steps"),
    [(None, np.float32, 0), ("compensated", jnp.bfloat16, 1), ("sum", np.float16, 0)],
)
def test_ties_on_split_leaves_go_as_on_the_whole_leaves_with_specs(local, dtype, warmup_steps):
    rng = np.random.default_rng(3)
    shapes = {"cols": (6, 8), "mid": (3, 4, 2), "bias": (6,)}
    grads = {k: tied((2, 2, *s), rng).astype(dtype) for k, s in shapes.items()}
    make = dropping_factory(local, warmup_steps)
    # The whole leaves over 'data' alone, once for both checks (specs there split nothing).
    want = run_on_mesh(make(), grads, explicit_mesh((2,), ("data",)), dict.fromkeys(grads, P()))
    mesh = explicit_mesh((2, 2), ("data", "model"))
    assert_same_bits(run_on_mesh(make(specs=TIED_SPECS), grads, mesh, TIED_SPECS), want)
    # Without specs, ties go in shard-major order: other entries of the split leaves.
    got = run_on_mesh(make(), grads, mesh, TIED_SPECS)
    assert not all(np.array_equal(got[k], want[k]) for k in ("cols", "mid"))


# FSDP (ZeRO-3): leaves split along their leading dimension over 'data' (test_sparse's
# harness): each device's shard is the slice of its own C without FSDP, bit for bit.
FSDP_SHAPES = {"w": (16, 24), "v": (8, 3, 5), "e": (0, 4), "b": (24,)}
FSDP_SPLIT = {"w": True, "v": True, "e": True, "b": False}


def fsdp_grads(dtype=np.float32, steps=3, n=4, seed=0):
    rng = np.random.default_rng(seed)
    grads = {k: rng.standard_normal((steps, n, *s)).astype(dtype) for k, s in FSDP_SHAPES.items()}
    grads["v"][:, :, 2] = np.round(grads["v"][:, :, 2])  # ties at the threshold
    return grads


@pytest.mark.parametrize(
    ("local", "drop_ratio", "selector", "dtype"),
    [
        (None, 0.9, "exact", np.float32),  # the pairs' all-gather
        ("sum", 0.8, "exact", np.float32),  # the rows' all-to-all
        ("compensated", 0.5, "exact", np.float32),  # dense: a reduce-scatter
        ("compensated", 0.9, "exact", jnp.bfloat16),
    ],  # not "sampled": below 2^14 entries it compiles the very program "exact" does
)
def test_fsdp_shards_are_the_slices_of_each_devices_result(local, drop_ratio, selector, dtype):
    """A warm-up step (a reduce-scatter of the dense S), then two sparse ones: every
    device's shard of an FSDP leaf is the slice of its own C without FSDP (with its own L
    and S), its whole-sized residual the same, bit for bit; the whole leaf unchanged."""

    def make(specs):
        return gradcomm.gradient_dropping(
            "data",
            drop_ratio=drop_ratio,
            local=local,
            warmup_steps=1,
            selector=selector,
            specs=specs,
        )

    got, _ = fsdp_against_whole(make, fsdp_grads(dtype), FSDP_SPLIT)
    assert got["w"].shape == (3, 4, 4, 24) and got["e"].shape == (3, 4, 0, 4)


def test_fsdp_train_step_matches_the_replicated_one():
    """`parallel.train_step` with the MLP's kernels split over 'data', gradient dropping
    before Adam through its warm-up and after: the replicated run's params within 1e-6,
    one whole-sized residual per device."""

    def make(specs):
        tx = gradcomm.gradient_dropping("data", drop_ratio=0.9, warmup_steps=2, specs=specs)
        return optax.chain(tx, optax.adam(1e-2))

    got, state, _, want_state = train_fsdp_against_replicated(make)
    residual, want = state[0].residual, want_state[0].residual
    for k in FSDP_SPECS:
        assert residual[k].shape == (4, *got[k].shape), k
        assert residual[k].addressable_shards[0].data.shape == (1, *got[k].shape)
        np.testing.assert_allclose(np.asarray(residual[k]), np.asarray(want[k]), atol=1e-7)


@pytest.mark.parametrize("local", [None, "sum", "compensated"])
def test_fsdp_per_shard_is_dropping_with_each_shard_a_leaf(local):
    """`fsdp_topk="per_shard"`: Algorithm 1 (the float64 reference) on each of an FSDP
    leaf's shards as a leaf of its own, after the warm-up; device j gets its own C on
    shard j, and every residual is the reference's, bit for bit."""
    n, dtype, drop_ratio = 4, np.float32, 0.75
    grads = per_shard_grads(n, dtype, steps=2)
    tx = gradcomm.gradient_dropping(
        "data",
        drop_ratio=drop_ratio,
        local=local,
        warmup_steps=0,
        selector="exact",
        specs=dict.fromkeys(PER_SHARD_SHAPES, P("data")),
        fsdp_topk="per_shard",
    )
    got, residuals = run_fsdp(tx, grads, dict.fromkeys(PER_SHARD_SHAPES, True), n)
    keep = functools.partial(gradcomm.sparse.num_kept, density=1 - drop_ratio)

    def step(residuals, grads, c):
        return reference.gradient_dropping_step(residuals, grads, c, local)

    for k in PER_SHARD_SHAPES:
        want, want_residuals = reference.per_shard(step, grads[k], n, keep)
        assert_shards_match(got[k], want, dtype, n)
        np.testing.assert_array_equal(residuals[k], want_residuals)
