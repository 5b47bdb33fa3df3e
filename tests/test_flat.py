"""The fused flat layout: packing round trips and per-leaf reductions."""

import jax.numpy as jnp
import numpy as np
import pytest

from gradcomm._flat import FlatLayout


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_pack_unpack_round_trip_and_segment_reductions(rows):
    rng = np.random.default_rng(0)
    shapes = [(), (1,), (7,), (5, 3), (300, 20)]
    leaves = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    layout = FlatLayout.of(shapes, rows)
    x = layout.pack([jnp.asarray(v) for v in leaves], jnp.float32)
    assert x.shape == (rows, layout.num_blocks, layout.block)
    assert layout.padded_size == x.size
    for got, want in zip(layout.unpack(x), leaves, strict=True):
        np.testing.assert_array_equal(got, want)
    sums = layout.segment_sum([x, x * x])
    np.testing.assert_allclose(sums[0], [v.sum() for v in leaves], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sums[1], [(v * v).sum() for v in leaves], rtol=1e-5)
    maxima = layout.segment_max([jnp.abs(x)])[0]
    np.testing.assert_array_equal(maxima, [np.abs(v).max() for v in leaves])
    ones = layout.per_block(jnp.arange(len(shapes), dtype=jnp.float32)) * jnp.ones_like(x)
    assert [float(v.max()) for v in layout.unpack(ones)] == list(range(len(shapes)))


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
