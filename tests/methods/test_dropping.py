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


LOCALS = (None, "sum", "compensated")


def every_local(grads):
    """`steps_fn(local)` for each of LOCALS on the same gradients, in one program."""
    return {str(local): steps_fn(local)(grads) for local in LOCALS}


def random_grads(n, steps, seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((n, steps, *s)).astype(np.float32) for k, s in SHAPES.items()}


# Algorithm 1 (local=None) and the combinations (elementwise after the same exchange), in
# one program per device count: one device, pairs, odd counts, a full byte.
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_matches_algorithm_1_and_the_combinations(n):
    drop_ratio, steps = 0.9, 2
    grads = random_grads(n, steps, n)
    results = per_device(every_local, n, grads)
    for local in LOCALS:
        outs, residuals = results[str(local)]
        check_against_algorithm_1(n, local, drop_ratio, steps, grads, outs, residuals)


def check_against_algorithm_1(n, local, drop_ratio, steps, grads, outs, residuals):
    """Every device's outputs and residuals against the float64 reference, step by step;
    the output less the mean of what was sent is the combination's local term."""
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


def test_warmup_follows_the_formula():
    """At steps 0, 10, 999 and 1000 (the step is an argument: one program)."""
    drop_ratio, size = 0.99, 10_000
    tx = gradcomm.gradient_dropping("data", drop_ratio=drop_ratio)
    update = jax.jit(jax.vmap(lambda x, state: tx.update(x, state), axis_name="data"))
    for t in (0, 10, 999, 1000):
        expected_rate = drop_ratio ** (1000 / (1 + t)) if t < 1000 else drop_ratio
        rate = drop_rate(jnp.int32(t), drop_ratio, 1000)
        np.testing.assert_allclose(rate, expected_rate, rtol=1e-5)
        g = jnp.asarray(np.random.default_rng(t).standard_normal(size).astype(np.float32))
        state = jax.tree.map(lambda x: x[None], tx.init(g)._replace(count=jnp.int32(t)))
        _, state = update(g[None], state)
        sent = int(np.sum(np.asarray(state.residual) == 0))
        assert sent == max(1, round((1 - expected_rate) * size)), t


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


# Leaves split over a 'model' axis (tensor parallelism): the whole leaves' results, bit for
# bit (the harness is test_sparse's), through the warm-up and after it, in each float dtype
# with one of the combinations. Exact ties at the threshold on leaves split along a column
# or a middle dimension: with specs, the whole leaves' entries go; without them, ties go in
# shard-major order. Beside them, random leaves split by rows and by columns, which give
# the whole leaves' bits with specs or without (float32's: a leaf of zeros, and a piece of
# zeros with non-finite values).
TIED_SPECS = {"cols": P(None, "model"), "mid": P(None, "model", None), "bias": P()}
RANDOM_SPECS = {"rows": P("model", None), "rcols": P(None, "model"), "rbias": P()}


def dropping_factory(local, warmup_steps=2, selector="sampled"):
    return functools.partial(
        gradcomm.gradient_dropping,
        "data",
        drop_ratio=0.9,
        local=local,
        warmup_steps=warmup_steps,
        selector=selector,
    )


def split_grads(dtype, special, steps=2, seed=3):
    rng = np.random.default_rng(seed)
    tied_shapes = {"cols": (6, 8), "mid": (3, 4, 2), "bias": (6,)}
    grads = {k: tied((steps, 2, *s), rng) for k, s in tied_shapes.items()}
    random_shapes = {"rows": (16, 6), "rcols": (5, 8), "rbias": (6,)}
    grads |= {k: rng.standard_normal((steps, 2, *s)) for k, s in random_shapes.items()}
    if special:
        grads["rcols"][:] = 0
        grads["rows"][:, :, 8:] = 0  # the second piece over 'model'
        grads["rows"][1, 0, 2, [0, 5]] = [-np.inf, np.nan]
    return {k: v.astype(dtype) for k, v in grads.items()}


@pytest.mark.parametrize(
    ("local", "dtype"), [(None, np.float32), ("compensated", jnp.bfloat16), ("sum", np.float16)]
)
def test_ties_on_split_leaves_go_as_on_the_whole_leaves_with_specs(local, dtype):
    """A warm-up step (its own branch), then a sparse one from its residual."""
    special = dtype == np.float32
    grads = split_grads(dtype, special)
    specs = TIED_SPECS | RANDOM_SPECS
    make = dropping_factory(local, warmup_steps=1)
    # The whole leaves over 'data' alone, once for both checks (specs there split nothing).
    want = run_on_mesh(make(), grads, explicit_mesh((2,), ("data",)), dict.fromkeys(grads, P()))
    mesh = explicit_mesh((2, 2), ("data", "model"))
    got = run_on_mesh(make(specs=specs), grads, mesh, specs)
    assert_same_bits(got, want)
    without = run_on_mesh(make(), grads, mesh, specs)
    assert_same_bits(without, {k: want[k] for k in RANDOM_SPECS})
    if special:
        assert np.isfinite(got["rows"][0]).all() and not np.isfinite(got["rows"][1]).all()
        np.testing.assert_array_equal(got["rcols"], 0)
    # Without specs, ties go in shard-major order: other entries of the split leaves.
    assert not all(np.array_equal(without[k], want[k]) for k in ("cols", "mid"))


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
        ("compensated", 0.9, "exact", jnp.bfloat16),  # the pairs' all-gather
        ("sum", 0.8, "exact", np.float32),  # the rows' all-to-all
        ("compensated", 0.5, "exact", np.float32),  # dense: a reduce-scatter
    ],  # not "sampled": below 2^14 entries it compiles the very program "exact" does; local
    # None (the output the mean of what was sent) on FSDP leaves: the train_step test below
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
