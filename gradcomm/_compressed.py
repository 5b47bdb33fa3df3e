"""The mean over the devices of float leaves sent compressed both ways, summed in float32.

Each device lays its leaves out as `(n, w)` rows (row j: every leaf's j-th of n equal
slices, each leaf flat and zero-padded so that its slice is a whole number of wire words),
encodes them with a `Codec`, and sends row j to device j (an `all_to_all`: the
reduce-scatter's bytes). Device j decodes the n rows it receives, sums them in float32 in
device order and divides by n, encodes that mean slice again and gathers everyone's (an
`all_gather`); every device decodes the same gathered words, so the mean is the same bits
everywhere. Both legs carry (n - 1) / n of the encoded buffer, as a ring all-reduce does
of the float32 one.

With error feedback (1-bit Adam, Tang et al. 2021, Algorithm 1), each device adds its
worker error to its leaves before encoding and keeps what the encoding lost; device j adds
its server error to the mean slice before encoding it again, and keeps what that lost.

Streaming DiLoCo's 4-bit outer gradients and 1-bit Adam's momentum use it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gradcomm import _axes, _collectives

Leg = Literal["worker", "server"]


class Codec(NamedTuple):
    """How values travel.

    Attributes:
      encode: `encode(rows, leg, counts) -> (words, scales)`: float32 rows, one
        `(..., w_leaf)` array per leaf, to uint8 words `(..., W)` and float32 scales
        `(..., leaves)` (`(..., 0)` for a codec without scales); `leg` says which way
        they go, and `counts` (one `(...,)` array per leaf) how many entries of each
        row are the leaf's rather than padding.
      decode: `decode(words, scales, widths) -> rows`: the float32 rows of each leaf.
      multiple: each leaf's slice width is a multiple of this (values per word).
    """

    encode: Callable[[Sequence[jax.Array], Leg, Sequence[jax.Array]], tuple[jax.Array, jax.Array]]
    decode: Callable[[jax.Array, jax.Array, Sequence[int]], list[jax.Array]]
    multiple: int


class Errors(NamedTuple):
    """Error feedback's memory, per device, float32, each leaf shaped like its leaf:
    `worker`, what the device's own encoding lost; `server`, what the encoding of the
    mean slices it owns lost (zeros elsewhere). The padding's errors are not kept."""

    worker: Any
    server: Any


def widths(sizes: Sequence[int], n: int, multiple: int) -> list[int]:
    """Each leaf's slice width: `size / n` rounded up to a multiple of `multiple`."""
    return [-(-size // (n * multiple)) * multiple for size in sizes]


def _rows(x: jax.Array, n: int, w: int) -> jax.Array:
    """Leaf `x` flat in float32, zero-padded to n w entries, as `(n, w)` rows."""
    return jnp.pad(jnp.ravel(x).astype(jnp.float32), (0, n * w - x.size)).reshape(n, w)


def _leaf(rows: jax.Array, like: jax.Array) -> jax.Array:
    """Inverse of `_rows`: the padding dropped, shaped like `like`."""
    return rows.reshape(-1)[: like.size].reshape(like.shape)


def bounds(ws: Sequence[int]) -> list[tuple[int, int]]:
    """The (start, end) of each leaf's columns in rows laid end to end."""
    return list(itertools.pairwise([0, *itertools.accumulate(ws)]))


def compressed_mean(
    leaves: Sequence[jax.Array],
    axis_name: _axes.AxisName,
    codec: Codec,
    errors: Errors | None = None,
) -> tuple[list[jax.Array], Errors | None]:
    """The mean over `axis_name` of float `leaves`, sent by `codec` both ways (see the
    module docstring): float32 leaves, the same bits on every device, and the new error
    feedback memory (None without)."""
    n = _axes.axis_size(axis_name)
    ws = widths([x.size for x in leaves], n, codec.multiple)
    rows = [_rows(x, n, w) for x, w in zip(leaves, ws, strict=True)]
    if errors is not None:
        rows = [r + _rows(e, n, w) for r, e, w in zip(rows, errors.worker, ws, strict=True)]
    counts = [jnp.clip(x.size - jnp.arange(n) * w, 0, w) for x, w in zip(leaves, ws, strict=True)]
    words, scales = codec.encode(rows, "worker", counts)
    if errors is not None:
        sent = codec.decode(words, scales, ws)
        worker = [_leaf(r - s, x) for r, s, x in zip(rows, sent, leaves, strict=True)]
    words, scales = _axes.vary(words, axis_name), _axes.vary(scales, axis_name)
    mine = lax.all_to_all(words, axis_name, 0, 0, tiled=True)  # row j from every device
    my_scales = lax.all_to_all(scales, axis_name, 0, 0, tiled=True)
    means = []
    for r in codec.decode(mine, my_scales, ws):  # per leaf (n, w)
        acc = r[0]
        for j in range(1, n):  # device order: every element summed the same way
            acc = acc + r[j]
        means.append(acc / n)
    j = _axes.axis_index(axis_name)
    # The padding stays zero (the codecs' scales read the leaf's entries only).
    means = [
        jnp.where(jnp.arange(m.size) < c[j], m, 0.0) for m, c in zip(means, counts, strict=True)
    ]
    if errors is not None:
        means = [m + _rows(e, n, m.size)[j] for m, e in zip(means, errors.server, strict=True)]
    words, scales = codec.encode(means, "server", [c[j] for c in counts])
    new_errors = None
    if errors is not None:
        sent = codec.decode(words, scales, ws)
        server = [
            _leaf(jnp.zeros((n, m.size)).at[j].set(m - s), x)
            for m, s, x in zip(means, sent, leaves, strict=True)
        ]
        new_errors = Errors(worker, server)
    gathered = _collectives.all_gather_invariant(words, axis_name)  # (n, W): everyone's
    gathered_scales = _collectives.all_gather_invariant(scales, axis_name)
    values = codec.decode(gathered, gathered_scales, ws)  # per leaf (n, w)
    return [_leaf(v, x) for v, x in zip(values, leaves, strict=True)], new_errors
