"""The sparse core: top-k selection, fixed-capacity exchange, exact residuals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from helpers import (
    explicit_mesh,
    per_device,
    tied,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import sparse
from gradcomm.sparse import _topk


def inputs(kind, size, rng):
    if kind == "gaussian":
        return rng.standard_normal(size)
    if kind == "heavy":  # Student-t with 1.5 degrees of freedom
        return rng.standard_t(1.5, size)
    if kind == "clustered":  # the large values packed into a few neighbouring blocks
        x = rng.standard_normal(size) * 0.01
        x[size // 3 : size // 3 + size // 50] = rng.standard_normal(size // 50) * 10
        return x
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["gaussian", "heavy", "clustered"])
@pytest.mark.parametrize(("size", "density"), [(100_003, 0.001), (50_000, 0.01), (4_096, 0.1)])
def test_sampled_sends_exactly_k_of_the_exact_top_k(kind, size, density):
    x = inputs(kind, size, np.random.default_rng(size)).astype(np.float32)
    k = sparse.num_kept(size, density)
    exact_values, exact_idx = jax.jit(sparse.topk, static_argnums=(1, 2))(x, k, "exact")
    values, idx = jax.jit(sparse.topk, static_argnums=(1, 2))(x, k, "sampled")
    assert values.shape == idx.shape == (k,) and len(np.unique(idx)) == k
    np.testing.assert_array_equal(values, x[idx])
    np.testing.assert_array_equal(np.sort(np.abs(exact_idx)), np.sort(reference.topk_indices(x, k)))
    captured = np.abs(values).sum() / np.abs(exact_values).sum()
    assert captured >= 0.9  # the floor
    np.testing.assert_allclose(captured, 1.0, rtol=1e-6)  # and in fact the exact values


def test_ties_zeros_and_non_finite_values():
    tied = jnp.ones(10)
    _, idx = sparse.topk(tied, 3)
    np.testing.assert_array_equal(idx, [0, 1, 2])  # ties go to lower indices
    values, _ = sparse.topk(jnp.zeros(5), 2)
    np.testing.assert_array_equal(values, 0)
    x = jnp.array([1.0, jnp.nan, 5.0, -jnp.inf, 2.0])
    values, idx = sparse.topk(x, 2)
    assert set(np.asarray(idx).tolist()) == {1, 3}  # non-finite values go out first
    with pytest.raises(ValueError, match="k must be"):
        sparse.topk(jnp.ones(4), 5)
    with pytest.raises(ValueError, match="selector"):
        sparse.topk(jnp.ones(4), 1, "approximate")


def test_residual_plus_sent_is_acc_bit_for_bit():
    acc = jnp.asarray(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    values, idx = sparse.topk(acc, 17, "sampled")
    residual = sparse.unsent(acc, idx, acc)
    sent = sparse.densify(values, idx, acc.size)
    np.testing.assert_array_equal(residual + sent, acc)
    assert int((residual == 0).sum()) == 17


def exchange_fn(values, indices):
    return sparse.sum_pairs(values, indices, 50, "data")


@pytest.mark.parametrize("n", [1, 3, 8])
def test_exchange_sums_every_devices_pairs(n):
    rng = np.random.default_rng(n)
    indices = np.stack([rng.choice(50, 6, replace=False) for _ in range(n)]).astype(np.int32)
    values = rng.standard_normal((n, 6)).astype(np.float32)
    out = per_device(exchange_fn, n, values, indices)
    expected = np.zeros(50)
    for v, i in zip(values, indices, strict=True):
        np.add.at(expected, i, v)
    for row in out:
        np.testing.assert_array_equal(row, out[0])
    np.testing.assert_allclose(out[0], expected, rtol=1e-6, atol=1e-7)


def sum_sparse_fn(big, small):
    sent = [sparse.topk(big, 3), sparse.topk(small, 2)]
    return sparse.sum_sparse(sent, [big.size, small.size], "data")


def test_sum_sparse_merges_sparse_leaves_and_sends_dense_ones_dense():
    n = 4
    rng = np.random.default_rng(7)
    big = rng.standard_normal((n, 400)).astype(np.float32)  # 3 of 400: sparse
    small = rng.standard_normal((n, 4)).astype(np.float32)  # 2 of 4: cheaper dense
    assert not sparse.sparse_bytes_exceed_dense(400, 3, 4, n)
    assert sparse.sparse_bytes_exceed_dense(4, 2, 4, n)
    out = per_device(sum_sparse_fn, n, big, small)
    for x, got, k in ((big, out[0][0], 3), (small, out[1][0], 2)):
        expected = np.zeros(x.shape[1])
        for row in x:
            idx = reference.topk_indices(row, k)
            expected[idx] += row[idx]
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("density", [0, -0.1, 1.5, float("nan"), True, "0.1"])
def test_bad_densities(density):
    with pytest.raises(ValueError, match="density"):
        sparse.check_density(density)


def sampled_fn(x, k):
    return sparse.topk(x, k, "sampled")


@pytest.mark.parametrize(
    "case", ["ties", "zeros", "non-finite", "adam-like", "tail", "bfloat16", "negative"]
)
def test_sampled_is_the_exact_top_k_with_ties_to_lower_indices(case):
    """Large leaves take the block-sampled path; it picks the very entries `lax.top_k` does.

    Ties, mostly-zero leaves and near-constant magnitudes (Adam's first updates) overflow
    its buffers and take the exact fallback; all cases must agree with the reference.
    """
    rng = np.random.default_rng(3)
    size, k = 200_000, 2_000
    x = rng.standard_normal(size).astype(np.float32)
    if case == "ties":
        x = np.round(x * 4) / 4  # a handful of distinct magnitudes
    elif case == "zeros":
        x[rng.random(size) < 0.995] = 0  # fewer nonzeros than k: zeros fill in index order
    elif case == "non-finite":
        x[[5, 70_000, 199_999]] = [np.nan, np.inf, -np.inf]
    elif case == "adam-like":
        x = (1e-3 * np.sign(x) * (1 - np.abs(rng.standard_normal(size)) * 1e-3)).astype(np.float32)
        x[::7] = 1e-3
    elif case == "tail":
        size = 200_003
        x = rng.standard_normal(size).astype(np.float32)
        x[-3:] = 50.0  # the largest sit in the incomplete last block
    elif case == "negative":
        x = -np.abs(x)
    if case == "bfloat16":
        x = jnp.asarray(x, jnp.bfloat16)
    assert _topk._sampled_fits(size, k)
    values, idx = jax.jit(sampled_fn, static_argnums=1)(jnp.asarray(x), k)
    reference_x = np.asarray(x, np.float32)
    magnitude = np.where(np.isfinite(reference_x), np.abs(reference_x), np.inf)
    expected = np.argsort(-magnitude, kind="stable")[:k]
    np.testing.assert_array_equal(np.sort(np.asarray(idx)), np.sort(expected))
    np.testing.assert_array_equal(np.asarray(values, np.float32), reference_x[np.asarray(idx)])


def kth_fn(keys, k):
    return sparse.kth_largest(keys, k), sparse.kth_largest(keys, k, top_bits=8)


@pytest.mark.parametrize("k", [1, 17, 999, 1000])
def test_kth_largest_by_bisection_with_a_traced_k(k):
    x = np.random.default_rng(k).standard_normal(1000).astype(np.float32)
    x[:10] = x[10]  # ties
    keys = sparse.magnitude_bits(jnp.asarray(x))
    kth, coarse = jax.jit(kth_fn)(keys, jnp.int32(k))
    expected = np.sort(np.asarray(keys))[::-1][k - 1]
    assert int(kth) == expected
    assert int(coarse) <= expected and int(coarse) == expected & ~((1 << 23) - 1)


def test_compact_gives_positions_in_order():
    mask = np.random.default_rng(0).random(1000) < 0.1
    positions, count = _topk._compact(jnp.asarray(mask), 150)
    expected = np.flatnonzero(mask)
    assert int(count) == expected.size
    np.testing.assert_array_equal(positions[: expected.size], expected)
    np.testing.assert_array_equal(positions[expected.size :], 1000)
    cut, count = _topk._compact(jnp.asarray(mask), 20)  # overflow: the first 20
    np.testing.assert_array_equal(cut, expected[:20])


def mean_fn(values, indices):
    return sparse.sum_pairs(values, indices, 50, "data", divide_by=3)


def test_exchange_divided_on_the_sent_entries_gives_the_bits_of_dividing_the_sum():
    n = 3
    rng = np.random.default_rng(9)
    indices = np.stack([rng.choice(50, 6, replace=False) for _ in range(n)]).astype(np.int32)
    values = rng.standard_normal((n, 6)).astype(np.float32)
    total = per_device(exchange_fn, n, values, indices)
    mean = per_device(mean_fn, n, values, indices)
    np.testing.assert_array_equal(mean, np.asarray(jnp.asarray(total) / 3))


# The decode against the previous one: N scatter-adds in device order, in float32.


def device_order_sum(values, indices, size, divide_by=None, order=None):
    """NumPy: each device's pairs added into a float32 vector of zeros, device after device.

    The mean divides the sent entries as XLA:CPU divides (as the previous decode did), which
    can differ from NumPy's float32 division in the last bit.
    """
    dense = np.zeros(size, np.float32)
    for d in order if order is not None else range(len(values)):
        np.add.at(dense, indices[d], np.asarray(values[d], np.float32))  # in index order
    if divide_by is not None:
        sent = np.unique(indices)
        dense[sent] = np.asarray(jnp.asarray(dense[sent]) / divide_by)
    return dense


def overlapping_pairs(n, size, k, dtype, seed):
    """Pairs whose indices repeat across devices, values of mixed magnitudes and signs, with
    -0.0; devices 0 and 1 send x and -x at index 0 (an exact cancellation), and devices 0,
    1, 2 send 1, 2^-24, 2^-24 at index 1, whose float32 sum depends on the order."""
    rng = np.random.default_rng(seed)
    pool = rng.choice(np.arange(2, size), min(size - 2, k + k // 2), replace=False)
    indices = np.stack([rng.choice(pool, k, replace=False) for _ in range(n)]).astype(np.int32)
    values = rng.standard_normal((n, k)) * 10.0 ** rng.integers(-3, 4, (n, k))
    values[rng.random((n, k)) < 0.1] = -0.0
    indices[:2, 0] = 0
    values[1:2, 0] = -values[0, 0]
    indices[:3, 1] = 1
    values[:3, 1] = [1.0, 2.0**-24, 2.0**-24][: min(n, 3)]
    return np.asarray(values, dtype), indices


SIZE = 256


def sum_fn(values, indices):
    return sparse.sum_pairs(values, indices, SIZE, "data")


def mean_over_devices_fn(values, indices):
    return sparse.sum_pairs(values, indices, SIZE, "data", divide_by=jax.lax.axis_size("data"))


# float32 on every count, the narrow dtypes (widened to float32 before the sum) on one each.
@pytest.mark.parametrize(
    ("n", "dtype"),
    [(2, np.float32), (3, np.float32), (5, np.float32), (8, np.float32), (8, jnp.bfloat16),
     (3, np.float16)],
)  # fmt: skip
def test_exchange_is_bit_identical_to_scatter_adds_in_device_order(n, dtype):
    """Duplicates across devices are summed in device order, as the N scatter-adds did:
    the same bits, on every device, for the sum and for the mean. (One device takes the
    dense path, a psum, as before.)"""
    values, indices = overlapping_pairs(n, SIZE, 12, dtype, seed=n)
    assert not sparse.sparse_bytes_exceed_dense(SIZE, 12, np.dtype(dtype).itemsize, n)
    total = per_device(sum_fn, n, values, indices)
    mean = per_device(mean_over_devices_fn, n, values, indices)
    for got, divide_by in ((total, None), (mean, n)):
        expected = device_order_sum(values, indices, SIZE, divide_by)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), got[:1].view(np.uint32).repeat(n, 0))
        np.testing.assert_array_equal(got[0].view(np.uint32), expected.view(np.uint32))
    if n >= 3:  # the values are such that another order gives other bits
        backwards = device_order_sum(values, indices, SIZE, order=range(n - 1, -1, -1))
        assert np.any(backwards.view(np.uint32) != total[0].view(np.uint32))


def segments_fn(values, indices):
    return sparse.sum_sparse_segments((values, indices), [20, 1, 235], "data", divide_by=8)


def test_segments_are_the_device_order_sum_of_the_concatenation_cut():
    values, indices = overlapping_pairs(8, SIZE, 6, np.float32, seed=11)
    out = per_device(segments_fn, 8, values, indices)
    expected = np.split(device_order_sum(values, indices, SIZE, divide_by=8), [20, 21])
    for got, want in zip(out, expected, strict=True):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32)[None].repeat(8, 0))


def test_the_loop_decode_has_the_bits_of_the_sort_decode(tmp_path):
    """experiments/benchmarks/bench_decode.py's alternative (sort, fold runs, one scatter)
    agrees bit for bit with the loop on N = 2..4, with NaN, -0.0 and inf planted, and the
    script says so."""
    import importlib.util
    import json
    import pathlib
    import sys

    # Loaded from its path (as tests/experiments/test_experiments.py's import_script does,
    # under the same module name), so this file runs on its own.
    if "bench_decode" not in sys.modules:
        root = pathlib.Path(__file__).resolve().parents[2]
        path = root / "experiments" / "benchmarks" / "bench_decode.py"
        spec = importlib.util.spec_from_file_location("bench_decode", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_decode"] = module
        spec.loader.exec_module(module)
    bench_decode = sys.modules["bench_decode"]

    args = "--max-devices 4 --sizes 4096 --densities 0.05 --repeats 1".split()
    bench_decode.main([*args, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_decode.json").read_text())["rows"]
    assert [r["n"] for r in rows] == [2, 3, 4]
    assert all(r["same_bits"] for r in rows)


# Leaves sharded over a mesh axis beyond the data axis (tensor parallelism, issue 27). The
# harness runs a transformation for a few steps under shard_map over a (data, model...)
# mesh and over the data axis alone on the whole leaves; test_lags and test_dropping use it.


def top_pieces(x, k, selector):
    picked = sparse.topk_over_shards([x[0]], [("model",)], k, selector)[0]
    return picked.indices[None], picked.positions[None], picked.entries[None]


@functools.cache
def top_pieces_fn(k, selector, model):
    mesh = explicit_mesh((2, model), ("data", "model"))
    body = functools.partial(top_pieces, k=k, selector=selector)
    spec = P("data", "model")
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, P("data"), P("data")))
    return mesh, jax.jit(f)


# "sampled" once: below 2^14 entries it compiles the very program "exact" does.
@pytest.mark.parametrize(("selector", "model"), [("exact", 2), ("exact", 4), ("sampled", 2)])
def test_topk_over_shards_is_the_whole_top_k_in_shard_major_order(selector, model):
    """Ties across pieces (to lower positions of the whole), zeros and non-finite values:
    the same set as `topk` on the whole row, every piece agreeing on it."""
    rng = np.random.default_rng(model)
    size, k = 96, 10
    x = rng.standard_normal((2, size)).astype(np.float32)
    x[0] = np.round(x[0])  # many ties at the threshold, across the pieces
    x[1, : size // 2] = 0  # whole pieces of zeros
    x[1, [3, 60]] = [np.nan, -np.inf]  # non-finite: sent first
    mesh, f = top_pieces_fn(k, selector, model)
    out = f(jax.device_put(x, NamedSharding(mesh, P("data", "model"))))
    indices, positions, entries = map(np.asarray, out)
    local = size // model
    for row in range(2):
        want = np.sort(np.asarray(sparse.topk(jnp.asarray(x[row]), k)[1]))
        np.testing.assert_array_equal(np.sort(positions[row]), want)
        np.testing.assert_array_equal(entries[row], x[row][positions[row]])
        pieces = indices[row].reshape(model, -1)
        mine = [s * local + i for s in range(model) for i in pieces[s] if i < local]
        np.testing.assert_array_equal(np.sort(mine), want)  # the pieces' own picks


@functools.cache
def ordered_top_fn(shape, spec, mesh_shape, names, ks, selector):
    """Per data row of `(2, *shape)` split by `spec` beyond 'data', for each k of `ks` (in
    one program): the picked entries' indices in the whole row-major tensor (-1 for a
    piece's unpicked candidates), with `topk_over_shards(..., order=)` from
    `_shards.global_index`."""
    from gradcomm import _collectives, _shards

    mesh = explicit_mesh(mesh_shape, names)
    axes = tuple(n for n in names if n != "data")

    def body(x):
        piece = x[0]
        index = _shards.global_index(piece, spec, axes, "data", "test", "x").ravel()
        order = index.astype(jnp.int32)
        out = []
        for k in ks:
            picked = sparse.topk_over_shards([piece.ravel()], [axes], k, selector, [order])[0]
            inside = picked.indices < piece.size
            where = jnp.where(inside, order[jnp.minimum(picked.indices, piece.size - 1)], -1)
            out.append(_collectives.all_gather_invariant(where, axes).reshape(1, -1))
        return tuple(out)

    full = P("data", *spec)
    f = jax.shard_map(body, mesh=mesh, in_specs=full, out_specs=(P("data"),) * len(ks))
    return mesh, full, jax.jit(f)


# "sampled" once: below 2^14 entries it compiles the very program "exact" does.
@pytest.mark.parametrize(
    ("shape", "spec", "mesh_shape", "names", "selector"),
    [
        ((8, 12), P(None, "model"), (2, 2), ("data", "model"), "exact"),
        ((8, 12), P(None, "model"), (2, 4), ("data", "model"), "exact"),
        ((3, 8, 2), P(None, "model", None), (2, 4), ("data", "model"), "exact"),
        ((3, 4, 2), P(None, "a", "b"), (2, 2, 2), ("data", "a", "b"), "exact"),
        ((8, 3), P(("b", "a"), None), (2, 2, 2), ("data", "a", "b"), "exact"),
        ((8, 3), P(("b", "a"), None), (2, 2, 2), ("data", "a", "b"), "sampled"),
    ],
)
def test_topk_over_shards_with_an_order_ties_as_the_whole_tensor_does(
    selector, shape, spec, mesh_shape, names
):
    """Split along a column, a middle dimension, two dimensions or by two axes in reverse,
    a tensor full of exact ties: `order=` (each element's index in the whole row-major
    tensor) picks exactly `topk` of the whole tensor, ties to lower indices."""
    rng = np.random.default_rng(len(names) + mesh_shape[-1])
    x = tied((2, *shape), rng)
    size = int(np.prod(shape))
    ks = (1, 7, size // 3)
    mesh, full, f = ordered_top_fn(shape, spec, mesh_shape, names, ks, selector)
    outs = f(jax.device_put(x, NamedSharding(mesh, full)))
    for k, got in zip(ks, map(np.asarray, outs), strict=True):
        for row in range(2):
            want = np.sort(np.asarray(sparse.topk(jnp.asarray(x[row].ravel()), k)[1]))
            np.testing.assert_array_equal(np.sort(got[row][got[row] >= 0]), want)


def test_topk_over_shards_rejects_an_order_unlike_the_pieces():
    with pytest.raises(ValueError, match="order must"):
        sparse.topk_over_shards([jnp.ones(4)], [()], 2, order=[jnp.arange(3)])


def test_topk_over_shards_rejects_k_out_of_range():
    with pytest.raises(ValueError, match="k must be"):
        sparse.topk_over_shards([jnp.ones(4)], [()], 5)


def test_the_data_axis_carries_one_share_of_a_sharded_leafs_pairs():
    """wire.measure per replica group: over 'data' (groups of 4), a leaf split in S = 2
    pieces costs half of the whole leaf's exchange; the pooling runs over 'model'."""
    from gradcomm import wire

    shape, density = (256, 64), 0.01  # k = 164 pairs of the whole leaf
    tx = gradcomm.lags("data", density=density, selector="exact")

    def data_bytes(mesh, spec):
        def body(g):
            return tx.update(g, tx.init(g))[0]

        f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
        x = jax.ShapeDtypeStruct((4 * shape[0], shape[1]), jnp.float32)
        x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        report = wire.measure(f, x)
        by_group = {}
        for c in report.collectives:
            by_group[c.group_size] = by_group.get(c.group_size, 0) + c.sent
        return by_group

    whole = data_bytes(explicit_mesh((4,), ("data",)), P("data"))
    split = data_bytes(explicit_mesh((4, 2), ("data", "model")), P("data", "model"))
    k = sparse.num_kept(shape[0] * shape[1], density)
    assert whole == {4: 3 / 4 * 4 * k * 8}  # an all-gather of k (value, index) pairs
    assert split[4] == whole[4] / 2  # k / 2 pairs per device over 'data'
    assert set(split) == {2, 4}  # and small statistics and the pooling over 'model'


# FSDP (ZeRO-3): leaves split along their leading dimension over 'data'. Each device's
# shard must be the slice of the result without FSDP, bit for bit.


def scattered_fn(fsdp, x, y, z, w, h):
    """Five leaves' top-k through `sum_sparse`, split as `fsdp` says: (x, y) sparse
    pairs in float32 and bfloat16, z at a density sent by the rows' all-to-all under FSDP,
    w at one sent dense, h whole."""
    leaves = [x, y, z, w, h]
    ks = [3, 2, 6, 20, 4]
    sent = [sparse.topk(leaf, k) for leaf, k in zip(leaves, ks, strict=True)]
    sizes = [leaf.size for leaf in leaves]
    scatter = [*fsdp, False]
    return sparse.sum_sparse(sent, sizes, "data", divide_by=4, scatter=scatter)


@functools.cache
def scattered(fsdp):
    return functools.partial(scattered_fn, fsdp)


def test_sum_scattered_gives_each_device_its_slice_of_the_sum():
    """Every way an FSDP leaf travels (the pairs' all-gather, the rows' all-to-all, the
    dense reduce-scatter) beside a whole leaf: each shard is the slice of the whole sum, in
    float32 and bfloat16, with indices repeated across devices, zeros and -0.0."""
    n = 4
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 96)).astype(np.float32)
    x[:, 5] = [2.0, -2.0, 7.0, -0.0]  # duplicates across devices, and a cancellation
    y = rng.standard_normal((n, 64)).astype(jnp.bfloat16)
    z = rng.standard_normal((n, 40)).astype(np.float32)  # k = 6: 0.15 of it
    w = rng.standard_normal((n, 40)).astype(np.float32)
    h = rng.standard_normal((n, 30)).astype(np.float32)
    assert not sparse.sparse_bytes_exceed_dense(40, 6, 4, n)
    assert sparse.scatter_bytes_exceed_dense(40, 6, 4, n)
    assert not sparse.scatter_bytes_exceed_dense(96, 3, 4, n)
    assert sparse.sparse_bytes_exceed_dense(40, 20, 4, n)
    want = per_device(scattered((False,) * 4), n, x, y, z, w, h)
    got = per_device(scattered((True,) * 4), n, x, y, z, w, h)
    for leaf, size in enumerate([96, 64, 40, 40]):
        s = size // n
        for j in range(n):
            np.testing.assert_array_equal(
                got[leaf][j].view(np.uint8), want[leaf][j, j * s : (j + 1) * s].view(np.uint8)
            )
    np.testing.assert_array_equal(got[4].view(np.uint8), want[4].view(np.uint8))
    assert got[0].dtype == np.float32 and got[1].dtype == np.float32


def test_sum_scattered_rejects_sizes_the_devices_do_not_divide():
    def f(x):
        return sparse.sum_scattered([sparse.topk(x, 1)], [6], "data", [True])[0]

    with pytest.raises(ValueError, match="not a multiple of 4"):
        per_device(f, 4, np.zeros((4, 6), np.float32))


def test_zero_residuals_are_whole_sized_for_fsdp_leaves():
    params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3, jnp.bfloat16)}
    specs = {"w": P("data"), "b": P()}
    outside = sparse.zero_residuals(params, specs, "data", "lags")
    assert outside["w"].shape == (1, 2, 3) and outside["b"].dtype == jnp.bfloat16

    def inside(w):
        r = sparse.zero_residuals({"w": w, "b": params["b"]}, specs, "data", "lags")
        return r["w"]

    got = per_device(inside, 4, np.zeros((4, 2, 3), np.float32))  # each device: a shard
    assert got.shape == (4, 1, 8, 3)  # (1, 8, 3) on each device: the whole leaf's rows
    tree = sparse.zero_residuals(params, None, "data", "lags")
    assert jax.tree.map(jnp.shape, tree) == jax.tree.map(jnp.shape, params)
