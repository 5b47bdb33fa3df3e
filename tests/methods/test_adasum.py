"""Adasum against the NumPy float64 reference of eqs. 8-9, on 1 to 8 simulated devices."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import reference
from helpers import mesh_of, per_device
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel

SHAPES = {"scalar": (), "one": (1,), "odd": (7,), "w": (5, 3), "big": (33, 9), "t": (2, 3, 4)}
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
# Unit roundoff of each wire dtype: half an ulp of 1.
UNIT = {"f32": 2.0**-24, "bf16": 2.0**-8, "f16": 2.0**-11}


def random_tree(rng, n, dtypes=DTYPES, scale_range=(0.1, 10.0)):
    """{dtype: {leaf: (n, *shape)}}: Gaussian leaves, each device's leaf with its own scale."""
    tree = {}
    for name, dtype in dtypes.items():
        tree[name] = {}
        for leaf, shape in SHAPES.items():
            scale = rng.uniform(*scale_range, size=(n,) + (1,) * len(shape))
            tree[name][leaf] = (rng.standard_normal((n, *shape)) * scale).astype(dtype)
    return tree


def reduce_fn(tree):
    return gradcomm.adasum_reduce(tree, "data")


def reference_tree(tree):
    """The float64 reference, leaf by leaf, on the same (rounded) inputs."""
    return jax.tree.map(
        lambda x: reference.adasum([np.asarray(row, np.float64) for row in x]), tree
    )


# The 16-bit formats at one device, a fold and three levels; float32 at every count of
# MIXED_N (each format is its own buffer: a format adds a program's worth of work). N = 4
# (two levels, no fold) has its float64 reference in test_result_is_typed_replicated...
# and test_orthogonality_measure; three folds (N = 7) fold as two do (N = 6).
LOW_PRECISION_N = (1, 3, 8)
MIXED_N = (1, 2, 3, 5, 6, 8)
# Beside the mixed leaves, two float32 leaves of PROBE elements ("probe": {"a", "b"}) on
# which the property checks below put their inputs, in the same program (one per N).
PROBE = 40


def mixed_tree(rng, n):
    """The mixed leaves of the formats at n (random_tree) and the two probe leaves."""
    tree = random_tree(rng, n, DTYPES if n in LOW_PRECISION_N else {"f32": DTYPES["f32"]})
    tree["probe"] = {k: rng.standard_normal((n, PROBE)).astype(np.float32) for k in "ab"}
    return tree


def probe(n, a, b):
    """`reduce_fn` on the probe leaves a and b as float32 `(n, PROBE)`, the mixed leaves
    beside them zero (Adasum is per leaf): N's program of test_matches_reference...."""
    tree = jax.tree.map(np.zeros_like, mixed_tree(np.random.default_rng(0), n))
    tree["probe"] = {"a": np.asarray(a, np.float32), "b": np.asarray(b, np.float32)}
    assert all(x.shape == (n, PROBE) for x in tree["probe"].values())
    return per_device(reduce_fn, n, tree)["probe"]


def padded(g):
    """`g` (n, size <= PROBE) zero-padded to (n, PROBE): the reduce of the padded leaf is
    the padded reduce (zeros add nothing to a dot product or a norm)."""
    return np.pad(g, ((0, 0), (0, PROBE - g.shape[1])))


# Compiled once per shape and reused across the pair tests (eager dispatch compiles every
# primitive anew).
pair_fn = jax.jit(gradcomm.adasum_pair)


def assert_same_on_every_device(out):
    for leaf in jax.tree.leaves(out):
        for row in leaf[1:]:
            np.testing.assert_array_equal(row, leaf[0])


# The properties held on the probe leaves, each at some device counts (the checks below).
def orthogonal_inputs_give_the_sum(n):
    """Disjoint supports make every dot product exactly 0: the result is the exact sum."""
    g = np.zeros((n, PROBE), np.float32)
    rng = np.random.default_rng(0)
    for i in range(n):
        g[i, 4 * i : 4 * i + 4] = rng.standard_normal(4)
    other = rng.standard_normal((n, PROBE)).astype(np.float32)
    out = probe(n, g, other)
    np.testing.assert_array_equal(out["a"][0], g.sum(0))
    assert_same_on_every_device(out)
    np.testing.assert_allclose(out["b"][0], reference.adasum(list(other)), rtol=1e-5, atol=1e-6)


def parallel_inputs_with_unequal_and_negative_scales(n):
    """g_i = c_i v: the mean for a power-of-two N (the fold weights it otherwise)."""
    rng = np.random.default_rng(1)
    v, w = rng.standard_normal((2, PROBE))
    c = np.array([2.0, -0.5, 3.0, 1.5, -1.0, 0.25, 4.0, -2.5])[:n]
    g = (c[:, None] * v).astype(np.float32)
    h = (c[::-1, None] * w).astype(np.float32)  # the scales in the other order
    out = probe(n, g, h)
    for x, got, base, scales in ((g, out["a"][0], v, c), (h, out["b"][0], w, c[::-1])):
        if n & (n - 1) == 0:
            np.testing.assert_allclose(got, scales.mean() * base, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, reference.adasum(list(x)), rtol=1e-5, atol=1e-6)


def scale_equivariance_across_devices(n):
    g = np.random.default_rng(3).standard_normal((n, PROBE)).astype(np.float32)
    out = probe(n, g, g / 4)
    scaled = probe(n, 8 * g, 2 * g)  # a power of two: exactly
    np.testing.assert_array_equal(scaled["a"][0], 8 * out["a"][0])
    np.testing.assert_array_equal(scaled["b"][0], 8 * out["b"][0])


def zero_leaves(n):
    """All-zero leaves stay exactly zero; one device's zero leaf gets coefficient 1."""
    g = padded(np.random.default_rng(5).standard_normal((n, 9)).astype(np.float32))
    g[1] = 0  # one device's leaf is zero
    out = probe(n, np.zeros((n, PROBE)), g)
    np.testing.assert_array_equal(out["a"][0], 0)
    np.testing.assert_allclose(out["b"][0], reference.adasum(list(g)), rtol=1e-5)


def tiny_and_huge_magnitudes_in_fp32(n):
    """Squares of 1e-30 underflow and of 1e30 overflow in fp32; scaling avoids both."""
    rng = np.random.default_rng(6)
    tiny, huge = ((rng.standard_normal((n, PROBE)) * m).astype(np.float32) for m in (1e-30, 1e30))
    out = probe(n, tiny, huge)
    for g32, got in ((tiny, out["a"][0]), (huge, out["b"][0])):
        got = got.astype(np.float64)
        ref = reference.adasum(list(g32.astype(np.float64)))
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def devices_of_very_different_magnitudes(n):
    """A parallel pair 1e-30 v and 1e30 v must average, not drop the tiny one."""
    v = np.random.default_rng(7).standard_normal(PROBE)
    g = np.stack([1e-30 * v, 1e30 * v]).astype(np.float32)
    out = probe(n, g, g[::-1])  # and the huge one first
    for x, got in ((g, out["a"][0]), (g[::-1], out["b"][0])):
        want = reference.adasum(list(x.astype(np.float64)))
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5)


def non_finite_input_poisons_only_its_leaf(n):
    """A NaN, an inf or a -inf on the last device (folded away for n = 6)."""
    rng = np.random.default_rng(8)
    for bad in (np.nan, np.inf, -np.inf):
        hit = rng.standard_normal((n, PROBE)).astype(np.float32)
        clean = rng.standard_normal((n, PROBE)).astype(np.float32)
        hit[n - 1, 2] = bad
        out = probe(n, hit, clean)
        assert not np.isfinite(out["a"]).any(), bad
        want = reference.adasum(list(clean))
        np.testing.assert_allclose(out["b"][0], want, rtol=1e-5, atol=1e-6, err_msg=str(bad))


# Powers of two, one fold, two folds; the extremes where every level adds rounding.
PROBE_CHECKS = {
    2: (
        orthogonal_inputs_give_the_sum,
        parallel_inputs_with_unequal_and_negative_scales,
        devices_of_very_different_magnitudes,
        non_finite_input_poisons_only_its_leaf,
    ),
    3: (parallel_inputs_with_unequal_and_negative_scales, zero_leaves),
    6: (
        orthogonal_inputs_give_the_sum,
        parallel_inputs_with_unequal_and_negative_scales,
        non_finite_input_poisons_only_its_leaf,
    ),
    8: (
        orthogonal_inputs_give_the_sum,
        parallel_inputs_with_unequal_and_negative_scales,
        scale_equivariance_across_devices,
        zero_leaves,
        tiny_and_huge_magnitudes_in_fp32,
        non_finite_input_poisons_only_its_leaf,
    ),
}


@pytest.mark.parametrize("n", MIXED_N)
def test_matches_reference_on_mixed_pytree(n):
    """fp32 to rtol 1e-5 at every N; bf16 and fp16 (at LOW_PRECISION_N) within a derived
    normwise bound; then, in the same program, the properties of PROBE_CHECKS[n].

    Each of the ceil(log2 N) levels of the tree (the fold counts as one) rounds its result
    to the wire dtype once, a relative error of at most u (the unit roundoff) per element,
    so at most u * |x_level| in norm. A level's result has norm at most 1.5 times the sum
    of its inputs' norms (|AS(a, b)| <= |a| + |b| + |a.b| (1/|a| + 1/|b|) / 2), and later
    levels pass an error on with a gain near 1 for these inputs. With a factor 4 for those
    gains, the error of each leaf obeys
        |y - y_ref|_2 <= 4 * ceil(log2 N) * u * sum_i |g_i|_2.
    The dot products are accumulated in float32, whose error is far below this bound.
    """
    rng = np.random.default_rng(n)
    tree = mixed_tree(rng, n)
    out = per_device(reduce_fn, n, tree)
    assert_same_on_every_device(out)
    ref = reference_tree(tree)
    levels = math.ceil(math.log2(n))
    for name, leaves in tree.items():
        for leaf, x in leaves.items():
            y, y_ref = out[name][leaf][0], ref[name][leaf]
            assert y.dtype == x.dtype
            if n == 1:
                np.testing.assert_array_equal(y, x[0])
                continue
            y = y.astype(np.float64)
            if x.dtype == np.float32:
                scale = np.abs(y_ref).max()
                np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5 * scale)
            else:
                inputs = x.astype(np.float64).reshape(n, -1)
                bound = 4 * levels * UNIT[name] * np.linalg.norm(inputs, axis=1).sum()
                assert np.linalg.norm(y - y_ref) <= bound, (name, leaf)
    for check in PROBE_CHECKS.get(n, ()):
        check(n)


@pytest.mark.parametrize("c", [4.0, 2.0**-20, 3.7, -1.3])
def test_scale_equivariance_of_the_pair(c):
    rng = np.random.default_rng(2)
    a = {"x": rng.standard_normal((6, 5)).astype(np.float32), "y": np.float32(1.5)}
    b = {"x": rng.standard_normal((6, 5)).astype(np.float32), "y": np.float32(-0.5)}
    scaled = pair_fn(jax.tree.map(lambda x: c * x, a), jax.tree.map(lambda x: c * x, b))
    expected = jax.tree.map(lambda x: c * x, pair_fn(a, b))
    if math.log2(abs(c)).is_integer():  # powers of two scale exactly
        jax.tree.map(np.testing.assert_array_equal, scaled, expected)
    else:
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), scaled, expected)


def test_pair_matches_reference_and_checks_its_arguments():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((2, 3, 7))
    out = pair_fn(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    np.testing.assert_allclose(out, reference.adasum_pair(a, b), rtol=1e-5)
    with pytest.raises(ValueError, match="matching pytrees"):
        gradcomm.adasum_pair({"a": jnp.ones(2)}, {"b": jnp.ones(2)})
    with pytest.raises(ValueError, match="equal shape and dtype"):
        gradcomm.adasum_pair(jnp.ones(2), jnp.ones(3))


def test_zero_operands_of_the_pair():
    """AS(0, b) = b: zero operands get coefficient 1 (on devices: zero_leaves)."""
    b = np.random.default_rng(5).standard_normal(9).astype(np.float32)
    np.testing.assert_array_equal(pair_fn(jnp.zeros(9), jnp.asarray(b)), b)
    np.testing.assert_array_equal(pair_fn(jnp.asarray(b), jnp.zeros(9)), b)


@pytest.mark.parametrize("n", [3])  # a fold; powers of two: the shard_map tests
def test_under_pmap(n):
    g = np.random.default_rng(10).standard_normal((n, 11)).astype(np.float32)
    out = jax.pmap(reduce_fn, axis_name="data", devices=jax.devices()[:n])(g)
    out = np.asarray(out)
    assert_same_on_every_device(out)
    np.testing.assert_allclose(out[0], reference.adasum(list(g)), rtol=1e-5)


def test_under_vmap_on_one_device():
    g = np.random.default_rng(11).standard_normal((5, 11)).astype(np.float32)
    out = np.asarray(jax.jit(jax.vmap(reduce_fn, axis_name="data"))(g))
    np.testing.assert_allclose(out[3], reference.adasum(list(g)), rtol=1e-5)


def test_result_is_typed_replicated_under_shard_map():
    """It may leave shard_map with out_specs=P() under check_vma."""
    mesh = mesh_of(4)
    f = jax.jit(
        jax.shard_map(lambda x: reduce_fn(x[0]), mesh=mesh, in_specs=P("data"), out_specs=P())
    )
    g = np.random.default_rng(12).standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_allclose(
        f(parallel.shard_batch(g, mesh)), reference.adasum(list(g)), rtol=1e-5
    )


def test_chained_after_adam_the_loss_falls():
    mesh = mesh_of(8)
    rng = np.random.default_rng(13)
    w_true = rng.standard_normal(6).astype(np.float32)
    x = rng.standard_normal((256, 6)).astype(np.float32)
    batch = {"x": x, "y": x @ w_true}

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

    tx = optax.chain(optax.adam(5e-2), gradcomm.adasum("data"))
    params = parallel.replicate({"w": np.zeros(6, np.float32), "b": np.float32(0)}, mesh)
    state = parallel.init_state(tx, params, mesh)
    step = parallel.train_step(loss, tx, mesh)
    losses = []
    for _ in range(60):
        params, state, metrics = step(params, state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.05 * losses[0]
    assert state[1] == gradcomm.AdasumState()  # nothing to keep


def test_orthogonality_measure():
    rng = np.random.default_rng(14)
    n = 4
    orthogonal = np.zeros((n, 8), np.float32)
    for i in range(n):
        orthogonal[i, 2 * i] = rng.uniform(1, 2)
    same = np.repeat(rng.standard_normal((1, 8)).astype(np.float32), n, axis=0)
    mixed = rng.standard_normal((n, 8)).astype(np.float32)
    tree = {"orthogonal": orthogonal, "same": same, "mixed": mixed, "zero": np.zeros((n, 3))}
    tree["zero"] = tree["zero"].astype(np.float32)
    out = per_device(orthogonality_fn, n, tree)
    np.testing.assert_allclose(out["orthogonal"][0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(out["same"][0], 1 / n, rtol=1e-5)
    expected = np.sum(reference.adasum(list(mixed)) ** 2) / np.sum(mixed.astype(np.float64) ** 2)
    np.testing.assert_allclose(out["mixed"][0], expected, rtol=1e-5)
    assert np.isnan(out["zero"][0])


def orthogonality_fn(tree):
    return gradcomm.orthogonality(tree, "data")


def test_state_is_empty():
    tx = gradcomm.adasum()
    state = tx.init({"w": jnp.ones(3)})
    assert state == gradcomm.AdasumState() and not jax.tree.leaves(state)
    _, state = jax.jit(jax.vmap(lambda g: tx.update(g, state), axis_name="data"))(jnp.ones((2, 3)))
    assert state == gradcomm.AdasumState()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"axis_name": ""}, "axis_name"),
        ({"axis_name": 3}, "axis_name"),
        ({"axis_name": "data", "local_axis": "data"}, "local_axis"),
        ({"axis_name": ("node", "local"), "local_axis": "local"}, "local_axis"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gradcomm.adasum(**kwargs)


def test_unknown_axis_and_non_float_leaf_raise_at_trace_time():
    mesh = mesh_of(2)

    def run(tx, tree):
        body = lambda t: tx.update(jax.tree.map(lambda x: x[0], t), tx.init(t))[0]  # noqa: E731
        f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P())
        return jax.jit(f)(parallel.shard_batch(tree, mesh))

    with pytest.raises(ValueError, match="'model'"):
        run(gradcomm.adasum("model"), {"w": np.ones((2, 3), np.float32)})
    with pytest.raises(ValueError, match=r"\['steps'\].*int32"):
        run(
            gradcomm.adasum("data"),
            {"w": np.ones((2, 3), np.float32), "steps": np.ones((2, 1), np.int32)},
        )
    with pytest.raises(ValueError, match="'local'"):
        run(gradcomm.adasum("data", local_axis="local"), {"w": np.ones((2, 3), np.float32)})


def test_hierarchical_equals_adasum_over_node_means_and_sends_a_share_across_nodes():
    """Hierarchical Adasum is Adasum over the node means (float64 reference), and each of a
    node's 2 devices carries half of what one device per node would send across nodes
    (the programs whose bytes are read are the ones run)."""
    g = np.random.default_rng(9).standard_normal((8, 1 << 16)).astype(np.float32)

    def compiled(axes, tx):
        mesh = parallel.make_mesh(axes, devices=jax.devices()[: int(np.prod(list(axes.values())))])
        body = lambda x: tx.update(x[0], tx.init(x[0]))[0]  # noqa: E731
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(tuple(axes)), out_specs=P()))
        x = parallel.shard_batch(g[: mesh.size], mesh)
        return gradcomm.wire.measure(f, x), f, x

    hierarchical, f, x = compiled(
        {"node": 4, "local": 2}, gradcomm.adasum("node", local_axis="local")
    )
    node_means = [g[2 * k : 2 * k + 2].astype(np.float64).mean(0) for k in range(4)]
    want = reference.adasum(node_means)
    np.testing.assert_allclose(f(x), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    flat, _, _ = compiled({"data": 4}, gradcomm.adasum("data"))
    big = lambda c: c.payload > 1024  # noqa: E731  (not the per-leaf statistics)
    across = sum(c.sent for c in hierarchical.collectives if c.group_size != 2 and big(c))
    assert across == sum(c.sent for c in flat.collectives if big(c)) / 2


@pytest.mark.parametrize("n", [6, 8])
def test_statistics_travel_only_within_each_level_group(n):
    """Level j's per-leaf statistics (5 float32 per leaf per member) go only to its group
    of 2^(j+1) devices: each device sends 2^(j+1) - 1 members' worth, whatever N."""
    shapes = [(4096,), (300,), (7,)]
    mesh = mesh_of(n)
    sharding = jax.sharding.NamedSharding(mesh, P("data"))
    tree = [jax.ShapeDtypeStruct((n, *s), np.float32, sharding=sharding) for s in shapes]
    body = lambda t: gradcomm.adasum_reduce([x[0] for x in t], "data")  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))
    report = gradcomm.wire.measure(f, tree)
    stats = [c for c in report.collectives if c.payload < 1024]  # the data moves in KiBs
    member = 5 * len(shapes) * 4
    levels = n.bit_length() - 1  # of the tree over the 2^floor(log2 n) devices
    assert sum(c.sent for c in stats) == sum((2 ** (j + 1) - 1) * member for j in range(levels))
    assert {c.kind for c in stats} == {"collective-permute"}
