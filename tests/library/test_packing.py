"""Mixed-radix packing of small integers into unsigned words, digit-major."""

import jax.numpy as jnp
import numpy as np
import pytest

from gradcomm import _packing


@pytest.mark.parametrize(
    ("base", "dtype", "per_word"),
    [
        (2, np.uint32, 32),
        (3, np.uint32, 20),
        (5, np.uint32, 13),
        (17, np.uint32, 7),
        (33, np.uint32, 6),
        (3, np.uint8, 5),
        (5, np.uint8, 3),
        (17, np.uint16, 3),
    ],
)
def test_round_trip_and_density(base, dtype, per_word):
    bits = 8 * np.dtype(dtype).itemsize
    assert _packing.values_per_word(base, bits) == per_word
    assert base**per_word <= 2**bits < base ** (per_word + 1)
    values = np.random.default_rng(base).integers(0, base, size=(3, per_word, 4))
    values[0, :, 0] = base - 1  # the largest word
    words = _packing.pack(jnp.asarray(values), base, dtype)
    assert words.dtype == dtype and words.shape == (3, 4)
    # Row i is digit i of every word.
    powers = np.asarray([base**i for i in range(per_word)], np.uint64)
    np.testing.assert_array_equal(words, (values * powers[:, None]).sum(1))
    np.testing.assert_array_equal(_packing.unpack(words, base), values)
    np.testing.assert_array_equal(_packing.unpack(words, base, axis=0), values.transpose(1, 0, 2))
    rows = [jnp.asarray(values[:, i]) for i in range(per_word)]  # the same, given as rows
    np.testing.assert_array_equal(_packing.pack(rows, base, dtype), words)


def test_digit_sums():
    values = np.random.default_rng(0).integers(0, 3, size=(6, 5, 9))
    words = _packing.pack(jnp.asarray(values), 3, np.uint8)
    sums = _packing.digit_sums(words, 3, np.uint8)
    assert sums.dtype == np.uint8
    np.testing.assert_array_equal(sums, values.sum(0))


def test_concatenate():
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal(n).astype(np.float32) for n in (1000, 3, 1, 70)]
    out = _packing.concatenate([jnp.asarray(p) for p in parts])
    np.testing.assert_array_equal(out, np.concatenate(parts))
    np.testing.assert_array_equal(_packing.concatenate([jnp.asarray(parts[0])]), parts[0])


def test_errors():
    with pytest.raises(ValueError, match="base"):
        _packing.values_per_word(1)
    with pytest.raises(ValueError, match="fit"):
        _packing.values_per_word(300, 8)
    with pytest.raises(ValueError, match="packs 20 digits"):
        _packing.pack(jnp.zeros((7, 3), jnp.uint32), 3)
