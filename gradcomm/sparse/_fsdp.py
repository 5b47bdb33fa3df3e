"""FSDP (ZeRO-3): a leaf split along its leading dimension over the data axes themselves.

Each device selects from its whole gradient as without FSDP and keeps only its shard of the
sum (the `gradcomm.sparse` docstring says what travels, and why). Here: which leaves are
FSDP (`fsdp_leaves`) and their checks, a device's shard (`own_shard`, `shard_index`), the
dense reduce-scatters (`reduce_scatter_dense`, `_all_to_all_in_device_order`), and the
entries chosen shard by shard (`topk_per_shard`) with their `all_to_all` (`_sum_per_shard`).
`sum_scattered`, which sends them all, is in `gradcomm.sparse._exchange`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gradcomm import _axes, _flat, _shards
from gradcomm.sparse._decode import _dense_sent, _divided, _from_bytes, _sum_in_device_order
from gradcomm.sparse._topk import Selector, topk


def scatter_bytes_exceed_dense(size: int, k: int, itemsize: int, n: int) -> bool:
    """Whether an all-gather of k (value, index) pairs sends more than a dense reduce-scatter.

    All-gather: (n - 1) k (itemsize + 4) bytes per device; reduce-scatter of the dense
    leaf (or an all-to-all of its rows): (n - 1) / n * size * itemsize. An FSDP leaf
    (`sum_scattered`) for which this holds is cheaper to send dense.

    Args:
      size: the whole leaf's number of elements.
      k: the pairs each device sends.
      itemsize: the values' bytes each.
      n: the number of devices.

    Returns:
      True where the pairs cost at least the dense reduce-scatter (always for n = 1).

    Example:
      >>> from gradcomm import sparse
      >>> sparse.scatter_bytes_exceed_dense(1000, 10, 4, 8)  # 560 bytes against 3500
      False
      >>> sparse.sparse_bytes_exceed_dense(1000, 100, 4, 8)  # 5600 against an all-reduce's 7000
      False
      >>> sparse.scatter_bytes_exceed_dense(1000, 100, 4, 8)  # 5600 against 3500
      True
    """
    return (n - 1) * k * (itemsize + 4) >= (n - 1) / n * size * itemsize if n > 1 else True


def fsdp_leaves(
    specs: object, updates: object, names: Sequence[str], axis_name: _axes.AxisName, who: str
) -> list[bool]:
    """Per leaf of `updates`, whether `specs` splits it over `axis_name` (FSDP).

    Args:
      specs: None, or the params' `PartitionSpec`s, a pytree shaped like `updates`.
      updates: the updates (or params).
      names: the leaves' names, for error messages.
      axis_name: the data axes.
      who: the method, for error messages.

    Returns:
      One bool per leaf: its spec's first entry names every data axis
      (`gradcomm._shards.scattered`).

    Raises:
      ValueError: where `specs` is not shaped like `updates`, holds something other than
        `PartitionSpec`s, or splits a leaf over data axes elsewhere than FSDP does.

    Example:
      >>> import jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from gradcomm import sparse
      >>> tree = {"b": jnp.zeros(4), "w": jnp.zeros((4, 2))}
      >>> sparse.fsdp_leaves({"b": P(), "w": P("data")}, tree, ["b", "w"], "data", "lags")
      [False, True]
    """
    if specs is None:
        return [False] * len(names)
    return [
        _shards.scattered(spec, axis_name, who, name)
        for spec, name in zip(_shards.leaf_specs(specs, updates, who), names, strict=True)
    ]


def check_fsdp_axes(axes: _shards.Axes, who: str, name: str) -> None:
    """Raises where an FSDP leaf is also split over mesh axes besides the data axes.

    Args:
      axes: the leaf's shard axes (`gradcomm._shards.shard_axes`).
      who: the method, for error messages.
      name: the leaf's name, for error messages.

    Raises:
      ValueError: where `axes` is not empty.

    Example:
      >>> from gradcomm import sparse
      >>> sparse.check_fsdp_axes((), "lags", "w")  # whole over the other axes: fine
    """
    if axes:
        raise ValueError(
            f"{who}: leaf {name!r} is split over the data axes (FSDP) and over mesh axes "
            f"{axes} besides them: {who} takes one or the other on a leaf, not both (keep "
            f"it whole over {axes}, or give it no data axis in its spec)"
        )


def own_shard(flat: jax.Array, n: int, axis_name: _axes.AxisName) -> jax.Array:
    """This device's shard of a flat whole leaf: elements `[j s, (j + 1) s)`, s = size / n.

    That is the leading-dimension slice j of n that FSDP keeps on device j.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> f = lambda x: sparse.own_shard(x, 2, "data")
      >>> jax.jit(jax.vmap(f, axis_name="data"))(jnp.arange(8.0).reshape(2, 4))  # row d: device d's
      Array([[0., 1.],
             [6., 7.]], dtype=float32)
    """
    s = flat.shape[0] // n
    return lax.dynamic_slice_in_dim(flat, lax.axis_index(axis_name) * s, s)


def shard_index(indices: jax.Array, size: int, n: int, axis_name: _axes.AxisName) -> jax.Array:
    """Indices into a flat whole leaf made relative to this device's shard (`own_shard`).

    Those outside it become the shard's size, which `.at[...]` with `mode="drop"` skips.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> f = lambda i: sparse.shard_index(i, 8, 2, "data")
      >>> jax.jit(jax.vmap(f, axis_name="data"))(jnp.array([[1, 5], [1, 5]], jnp.int32))
      Array([[1, 4],
             [4, 1]], dtype=int32)
    """
    s = size // n
    local = indices - lax.axis_index(axis_name).astype(indices.dtype) * s
    return jnp.where((local >= 0) & (local < s), local, s)


def reduce_scatter_dense(xs: Sequence[jax.Array], axis_name: _axes.AxisName) -> list[jax.Array]:
    """This device's shard of the sum of flat dense whole leaves: a `lax.psum_scatter` per
    dtype, the FSDP counterpart of a `lax.psum` of them.

    Each leaf's size must be a multiple of N; device j receives elements `[j s, (j + 1)
    s)` of each sum (s = size / N). XLA:CPU adds a reduce-scatter's terms as it adds an
    all-reduce's, in device order, so each shard is the same bits as the slice of the
    psum there; a ring all-reduce is a reduce-scatter and an all-gather, so on NCCL too.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> f = lambda x: sparse.reduce_scatter_dense([x], "data")[0]
      >>> jax.jit(jax.vmap(f, axis_name="data"))(jnp.array([[1.0, 2.0], [4.0, 8.0]]))
      Array([[ 5.],
             [10.]], dtype=float32)
    """
    n = _axes.axis_size(axis_name)
    out: list[jax.Array | None] = [None] * len(xs)
    for group in _flat.dtype_groups(list(xs)):
        rows = _shards.to_rows([xs[i] for i in group], n, "sum_sparse")
        mine = lax.psum_scatter(rows, axis_name, scatter_dimension=0, tiled=True)[0]
        pieces = _shards.from_rows(mine, [xs[i].shape for i in group], n)
        for i, piece in zip(group, pieces, strict=True):
            out[i] = piece
    return out


def _all_to_all_in_device_order(
    xs: Sequence[jax.Array], axis_name: _axes.AxisName
) -> list[jax.Array]:
    """This device's shard of the sum of flat dense whole leaves: an `all_to_all` of their
    rows per dtype, then `((0 + x_0) + x_1) + ...` in device order: the bits of the sparse
    decode (`_sum_in_device_order`) of the same sent entries, on every backend (adding a
    zero changes no sum, which is never -0.0 there)."""
    n = _axes.axis_size(axis_name)
    out: list[jax.Array | None] = [None] * len(xs)
    for group in _flat.dtype_groups(list(xs)):
        rows = _shards.to_rows([xs[i] for i in group], n, "sum_sparse")
        received = lax.all_to_all(rows, axis_name, 0, 0, tiled=True)  # row d: device d's
        acc = jnp.zeros(received.shape[1], received.dtype)
        for d in range(n):  # device order
            acc = acc + received[d]
        pieces = _shards.from_rows(acc, [xs[i].shape for i in group], n)
        for i, piece in zip(group, pieces, strict=True):
            out[i] = piece
    return out


FsdpTopK = Literal["whole", "per_shard"]
"""How an FSDP leaf's entries are chosen: the whole leaf's top k ("whole", the same
entries as without FSDP, sent in an all-gather) or each shard's own ("per_shard",
`topk_per_shard`, sent in an all-to-all: a reduce-scatter of the compressed vector)."""
FSDP_TOPKS: tuple[str, ...] = ("whole", "per_shard")


def check_fsdp_topk(fsdp_topk: str, specs: object, who: str) -> None:
    """Raises for an unknown `fsdp_topk`, or "per_shard" without the `specs` that name
    the FSDP leaves (it would change nothing, without a word)."""
    if fsdp_topk not in FSDP_TOPKS:
        raise ValueError(f"{who}: fsdp_topk must be one of {FSDP_TOPKS}, got {fsdp_topk!r}")
    if fsdp_topk == "per_shard" and specs is None:
        raise ValueError(
            f"{who}: fsdp_topk='per_shard' selects FSDP leaves' entries shard by shard, and "
            f"FSDP leaves are the ones whose specs split them over the data axes: pass "
            f"specs=, the params' PartitionSpecs"
        )


class PerShardTopK(NamedTuple):
    """An FSDP leaf's entries chosen shard by shard (`topk_per_shard`).

    Attributes:
      values: `(N c,)` shard 0's c entries, then shard 1's, and so on.
      indices: `(N c,)` int32: their indices in the whole flat leaf (shard j's lie in
        `[j s, (j + 1) s)`, s = size / N).
    """

    values: jax.Array
    indices: jax.Array


def topk_per_shard(x: jax.Array, n: int, c: int, selector: Selector = "exact") -> PerShardTopK:
    """The c entries of largest magnitude of each of the n shards of a flat whole leaf.

    Shard j is elements `[j s, (j + 1) s)` (s = size / n), the leading-dimension slice
    that FSDP keeps on device j: each shard is chosen from as a layer of its own, at the
    leaf's density (LAGS's layer-wise selection, one level down), so that the pairs
    bound for device j are known to be c, and `sum_scattered` sends each device only its
    own: `(n - 1) c` pairs, about (n - 1) / n of the leaf's k, a reduce-scatter of the
    compressed vector. Each shard's selection is a top-c compressor, with the contraction
    `|x - C(x)|^2 <= (1 - c / s) |x|^2` of a top-k one at the same density. Ties go to
    lower indices, as in `topk`.

    Args:
      x: a 1-D array whose size n divides.
      n: the number of shards (devices on the data axes).
      c: how many entries to keep per shard, 1 <= c <= size / n.
      selector: as for `topk`.

    Returns:
      A `PerShardTopK`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> sparse.topk_per_shard(jnp.array([1.0, -4.0, 3.0, 0.5]), 2, 1)
      PerShardTopK(values=Array([-4.,  3.], dtype=float32), indices=Array([1, 2], dtype=int32))
    """
    s = x.shape[0] // n
    values, indices = jax.vmap(lambda row: topk(row, c, selector))(x.reshape(n, s))
    indices = indices + (jnp.arange(n, dtype=jnp.int32) * s)[:, None]
    return PerShardTopK(values.reshape(-1), indices.reshape(-1))


def _sum_per_shard(
    sent: Sequence[PerShardTopK],
    sizes: Sequence[int],
    axis_name: _axes.AxisName,
    divide_by: int | None,
) -> list[jax.Array]:
    """This device's shard of the sum of per-shard picks (`topk_per_shard`): per dtype,
    one `all_to_all` sends each device the pairs of its shard, summed in device order
    (the decode's bits). Where the pairs would outweigh the dense shard, the dense rows
    travel instead (`_all_to_all_in_device_order`, the same bits)."""
    n = _axes.axis_size(axis_name)
    out: list[jax.Array | None] = [None] * len(sent)
    dense, pairs = [], []
    for i, picked in enumerate(sent):
        c, itemsize = picked.values.shape[0] // n, picked.values.dtype.itemsize
        (dense if c * (itemsize + 4) >= sizes[i] // n * itemsize else pairs).append(i)
    if dense:
        rows = [_dense_sent(sent[i].values, sent[i].indices, sizes[i]) for i in dense]
        for i, total in zip(dense, _all_to_all_in_device_order(rows, axis_name), strict=True):
            out[i] = _divided(total, divide_by)
    for group in _flat.dtype_groups([sent[i].values for i in pairs]):
        ids = [pairs[g] for g in group]
        parts = [sizes[i] // n for i in ids]
        starts = _flat.offsets(parts)
        values = [sent[i].values.reshape(n, -1) for i in ids]
        # Each pair's index in this device's shard, moved to its leaf's place among the
        # group's shards: the receiver decodes them all in one pass.
        local = [
            sent[i].indices.reshape(n, -1)
            - (jnp.arange(n, dtype=jnp.int32) * part)[:, None]
            + start
            for i, part, start in zip(ids, parts, starts[:-1], strict=True)
        ]
        payload = jnp.concatenate(
            [lax.bitcast_convert_type(v, jnp.uint8).reshape(n, -1) for v in values + local],
            axis=1,
        )  # row j: the pairs bound for device j
        received = lax.all_to_all(payload, axis_name, 0, 0, tiled=True)  # row d: device d's
        cut = sum(v.shape[1] for v in values) * values[0].dtype.itemsize
        total = _sum_in_device_order(
            _from_bytes(received[:, :cut], values[0].dtype),
            _from_bytes(received[:, cut:], jnp.dtype(jnp.int32)),
            starts[-1],
            divide_by,
        )
        for i, (start, end) in zip(ids, itertools.pairwise(starts), strict=True):
            out[i] = total[start:end]
    return out
