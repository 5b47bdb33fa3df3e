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

On a mesh with axes besides `axis_name` (tensor parallelism), the leaves go in one buffer
per set of shard axes (the axes besides `axis_name` they vary over, `gradcomm._shards`), so
that a leaf replicated over a model axis stays typed so. A codec whose scales read several
entries (`Codec.scaled`) would scale each piece of a leaf split over such an axis on its
own, which is not the whole tensor's algorithm: there `compressed_mean` raises. A codec
without (bfloat16, elementwise) gives each piece the whole tensor's bits.

Streaming DiLoCo's 4-bit outer gradients and 1-bit Adam's momentum use it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gradcomm import _axes, _collectives, _shards

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
      scaled: whether a value's code depends on other entries of its leaf (a scale per
        slice or per tensor), so that a leaf split over other mesh axes than the data
        axes would be coded per piece.
    """

    encode: Callable[[Sequence[jax.Array], Leg, Sequence[jax.Array]], tuple[jax.Array, jax.Array]]
    decode: Callable[[jax.Array, jax.Array, Sequence[int]], list[jax.Array]]
    multiple: int
    scaled: bool = True


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


def _per_device(x: jax.Array, axis_name: _axes.AxisName) -> jax.Array:
    """`x` as one value per device: typed varying under `shard_map`, batched under a named
    `vmap`, where an `all_to_all` of an unbatched operand (the same on every device, such
    as zeros) comes back with the wrong shape (JAX 0.10.2)."""
    if _axes.is_manual(axis_name):
        return _axes.vary(x, axis_name)
    return x + (lax.axis_index(axis_name) * 0).astype(x.dtype)


def bounds(ws: Sequence[int]) -> list[tuple[int, int]]:
    """The (start, end) of each leaf's columns in rows laid end to end."""
    return list(itertools.pairwise([0, *itertools.accumulate(ws)]))


def compressed_mean(
    leaves: Sequence[jax.Array],
    axis_name: _axes.AxisName,
    codec: Codec,
    errors: Errors | None = None,
    *,
    who: str,
    fix: str,
) -> tuple[list[jax.Array], Errors | None]:
    """The mean over `axis_name` of float `leaves`, sent by `codec` both ways (see the
    module docstring): float32 leaves, the same bits on every device, and the new error
    feedback memory (None without). One exchange per set of shard axes.

    Raises:
      ValueError: where `codec.scaled` and a leaf is split over mesh axes besides
        `axis_name` (or the types cannot say, under `check_vma=False`); the message is
        `who`'s, and ends with `fix`, what to do instead.
    """
    data = set(_axes.axis_names(axis_name))
    groups: dict[frozenset[str], list[int]] = {}
    for i, x in enumerate(leaves):
        split = _shards.shard_axes(x, axis_name, who) if codec.scaled else ()
        if split:
            raise ValueError(
                f"{who} scales its codes over several entries of a leaf, but a leaf of shape "
                f"{x.shape} here is one piece of a tensor split over mesh axes {split}: each "
                f"piece would be scaled on its own, not as the whole tensor. {fix}"
            )
        groups.setdefault(_axes.varying_axes(x) - data, []).append(i)
    means: list[Any] = [None] * len(leaves)
    worker: list[Any] = [None] * len(leaves)
    server: list[Any] = [None] * len(leaves)
    for ids in groups.values():
        part = None
        if errors is not None:
            part = Errors([errors.worker[i] for i in ids], [errors.server[i] for i in ids])
        out, new = _group_mean([leaves[i] for i in ids], axis_name, codec, part)
        for k, i in enumerate(ids):
            means[i] = out[k]
            if new is not None:
                worker[i], server[i] = new.worker[k], new.server[k]
    return means, (Errors(worker, server) if errors is not None else None)


def _group_mean(
    leaves: Sequence[jax.Array],
    axis_name: _axes.AxisName,
    codec: Codec,
    errors: Errors | None,
) -> tuple[list[jax.Array], Errors | None]:
    """`compressed_mean` of leaves that vary over the same axes, in one exchange."""
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
    words, scales = _per_device(words, axis_name), _per_device(scales, axis_name)
    mine = lax.all_to_all(words, axis_name, 0, 0, tiled=True)  # row j from every device
    my_scales = lax.all_to_all(scales, axis_name, 0, 0, tiled=True)
    j = _axes.axis_index(axis_name)
    means = []
    for r, c in zip(codec.decode(mine, my_scales, ws), counts, strict=True):  # (n, w) each
        # The padding stays zero (the codecs' scales read the leaf's entries only). It is
        # zeroed in the rows: zeroed in their mean, XLA:CPU fused the decode, the sum and
        # the encode into one loop that ran 5x slower on a flat leaf (JAX 0.10.2).
        r = jnp.where(jnp.arange(r.shape[-1]) < c[j], r, 0.0)
        acc = r[0]
        for k in range(1, n):  # device order: every element summed the same way
            acc = acc + r[k]
        means.append(acc / n)
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
