"""The fused flat layout: packing round trips and per-leaf reductions."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from gradcomm._flat import FlatBuffers, FlatLayout


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_pack_unpack_round_trip_and_segment_reductions(rows):
    rng = np.random.default_rng(0)
    shapes = [(), (1,), (7,), (5, 3), (300, 20)]
    leaves = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    layout = FlatLayout.of(shapes, rows)

    @jax.jit  # one compilation instead of one per operation
    def run(leaves):
        x = layout.pack(leaves, jnp.float32)
        ones = layout.per_block(jnp.arange(len(shapes), dtype=jnp.float32)) * jnp.ones_like(x)
        sums = layout.segment_sum([x, x * x])
        maxima = layout.segment_max([jnp.abs(x)])[0]
        return x, layout.unpack(x), sums, maxima, [v.max() for v in layout.unpack(ones)]

    x, unpacked, sums, maxima, ones = run([jnp.asarray(v) for v in leaves])
    assert x.shape == (rows, layout.num_blocks, layout.block)
    assert layout.padded_size == x.size
    for got, want in zip(unpacked, leaves, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(sums[0], [v.sum() for v in leaves], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sums[1], [(v * v).sum() for v in leaves], rtol=1e-5)
    np.testing.assert_array_equal(maxima, [np.abs(v).max() for v in leaves])
    assert [float(v) for v in ones] == list(range(len(shapes)))


def test_block_size_keeps_padding_small():
    """Padding is bounded by leaves * rows * block, at most 1/32 of the model."""
    small = FlatLayout.of([(10,), (3,)], rows=8)
    assert small.block == 1
    big = FlatLayout.of([(1000, 1000), (10,)], rows=8)
    assert big.block == 64
    assert big.padded_size - 1_000_010 <= 2 * 8 * 64


def test_rejects_empty_layouts():
    with pytest.raises(ValueError, match="cannot lay out"):
        FlatLayout.of([(0,)], rows=2)


def test_flat_buffers_one_per_dtype_round_trip():
    """Leaves of each dtype share one buffer, in first-seen order; empty leaves come back
    as zeros; a buffer unpacks from any shape of its size (a flat one)."""
    rng = np.random.default_rng(1)
    tree = {
        "a": rng.standard_normal((4, 3)).astype(np.float32),
        "b": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
        "c": [rng.standard_normal(()).astype(np.float32), np.zeros((2, 0), np.float16)],
        "d": rng.standard_normal(9).astype(ml_dtypes.bfloat16),
    }
    flat = FlatBuffers.of(tree, rows=2)
    assert flat.groups == ((0, 2), (1, 4))  # a, c[0] in float32; b, d in bfloat16
    assert [np.dtype(d) for d in flat.dtypes] == [np.float32, ml_dtypes.bfloat16]
    buffers = flat.pack(tree)
    assert [b.shape for b in buffers] == [layout.shape for layout in flat.layouts]
    assert [b.dtype for b in buffers] == list(flat.dtypes)
    for back in (flat.unpack(buffers), flat.unpack([b.reshape(-1) for b in buffers])):
        assert jax.tree.structure(back) == jax.tree.structure(tree)
        for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError):
        flat.pack({"a": tree["a"]})  # another structure
