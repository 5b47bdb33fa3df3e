"""Mixed-radix packing of small integers into uint32 words."""

import jax.numpy as jnp
import numpy as np
import pytest

from gradcomm import _packing


@pytest.mark.parametrize(("base", "per_word"), [(2, 32), (3, 20), (5, 13), (17, 7), (33, 6)])
def test_round_trip_and_density(base, per_word):
    assert _packing.values_per_word(base) == per_word
    assert base**per_word <= 2**32 < base ** (per_word + 1)
    values = np.random.default_rng(base).integers(0, base, size=(3, 4 * per_word))
    values[0, :per_word] = base - 1  # the largest word
    words = _packing.pack(jnp.asarray(values), base)
    assert words.dtype == jnp.uint32 and words.shape == (3, 4)
    np.testing.assert_array_equal(_packing.unpack(words, base), values)


def test_errors():
    with pytest.raises(ValueError, match="base"):
        _packing.values_per_word(1)
    with pytest.raises(ValueError, match="multiple of 20"):
        _packing.pack(jnp.zeros(7, jnp.uint32), 3)
