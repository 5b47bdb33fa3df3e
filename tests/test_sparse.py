"""The sparse core: top-k selection, fixed-capacity exchange, exact residuals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from helpers import per_device

from gradcomm import sparse


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
    residual = sparse.drop_sent(acc, idx)
    sent = sparse.densify(values, idx, acc.size)
    np.testing.assert_array_equal(residual + sent, acc)
    assert int((residual == 0).sum()) == 17


def exchange_fn(values, indices):
    return sparse.exchange(values, indices, 50, "data")


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
