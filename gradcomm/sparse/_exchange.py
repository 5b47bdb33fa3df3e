"""The public sparse exchange: `sum_sparse` and its forms for one vector (`sum_pairs`), one
vector over segments (`sum_sparse_segments`) and FSDP leaves (`sum_scattered`).

`sum_sparse` sends whole leaves by `gradcomm.sparse._decode`, leaves sharded over other
mesh axes by `gradcomm.sparse._sharded` and FSDP leaves by `sum_scattered`, which uses
`gradcomm.sparse._fsdp`'s collectives.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _axes, _flat, _shards, perfmodel
from gradcomm.sparse._decode import (
    _dense_sent,
    _divided,
    _gather_pairs,
    _sum_in_device_order,
    _sum_whole,
    sparse_bytes_exceed_dense,
)
from gradcomm.sparse._fsdp import (
    PerShardTopK,
    _all_to_all_in_device_order,
    _sum_per_shard,
    reduce_scatter_dense,
    scatter_bytes_exceed_dense,
)
from gradcomm.sparse._sharded import ShardedTopK, _sum_with_shards


def sum_pairs(
    values: jax.Array,
    indices: jax.Array,
    size: int,
    axis_name: _axes.AxisName,
    *,
    divide_by: int | None = None,
) -> jax.Array:
    """The sum over devices of sparse vectors given as fixed-capacity (value, index) pairs.

    Args:
      values: `(k,)` values of this device's sparse vector (any float dtype).
      indices: `(k,)` int32 indices into a vector of `size`, distinct on each device.
      size: the length of the dense vector.
      axis_name: the axis to sum over.
      divide_by: divide the sum by this (the mean over N devices for N).

    Returns:
      The dense `(size,)` sum, accumulated in float32 or wider in device order (the same
      bits on every device) and returned in that dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> values = jnp.array([[1.0, 2.0], [4.0, 8.0]])  # one row per device
      >>> indices = jnp.array([[0, 3], [3, 1]], jnp.int32)  # both send index 3
      >>> f = lambda v, i: sparse.sum_pairs(v, i, 4, "data")
      >>> jax.jit(jax.vmap(f, axis_name="data"))(values, indices)[0]
      Array([1., 8., 0., 6.], dtype=float32)
    """
    return sum_sparse([(values, indices)], [size], axis_name, divide_by=divide_by)[0]


def sum_sparse(
    sent: Sequence[tuple[jax.Array, jax.Array] | ShardedTopK | PerShardTopK],
    sizes: list[int],
    axis_name: _axes.AxisName,
    *,
    divide_by: int | None = None,
    shards: Sequence[_shards.Axes] | None = None,
    scatter: Sequence[bool] | None = None,
) -> list[jax.Array]:
    """The sums over devices of several leaves' sparse vectors, in as few collectives as fit.

    Leaves for which (value, index) pairs would outweigh the dense leaf (see
    `sparse_bytes_exceed_dense`) go together through one `psum` of their dense form; all
    others of one dtype share a single all-gather of their pairs, decoded in device order
    (the `gradcomm.sparse` docstring says how). Leaves sharded over mesh axes beyond `axis_name`
    take `topk_over_shards`'s exchange (see there), with the same bits as on the whole
    leaf. FSDP leaves (`scatter`) come back as this device's shard of the sum, the same
    bits as its slice of the whole sum (`sum_scattered` says how they travel).

    Args:
      sent: per leaf, `(values, indices)` from `topk` on the flattened leaf, or, for a
        leaf sharded over mesh axes, a `ShardedTopK` from `topk_over_shards`, or, for
        an FSDP leaf, a `PerShardTopK` from `topk_per_shard`.
      sizes: per leaf, its number of elements (on this device: a sharded leaf's piece).
      axis_name: the axis to sum over.
      divide_by: divide the sums by this (N for the mean over N devices); on sparse
        leaves only the sent entries are divided, which gives the same bits.
      shards: per leaf, the mesh axes it is sharded over (`gradcomm._shards.shard_axes`;
        empty for a whole leaf). None: no leaf is sharded.
      scatter: per leaf, whether it is split over `axis_name` along its leading dimension
        (FSDP, `gradcomm._shards.scattered`): its pairs index the whole flat leaf, whose
        size N divides, and this device (j of N) receives only elements `[j * size / N,
        (j + 1) * size / N)` of the sum, its shard. None: no leaf is.

    Returns:
      Per leaf, the flat dense sum (or mean), in float32 or wider (a sharded leaf's piece
      of it; an FSDP leaf's shard of it).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> x = jnp.array([[0.0, 3.0, 0.0, 1.0], [2.0, 5.0, 0.0, 0.0]])  # one row per device
      >>> f = lambda x: sparse.sum_sparse([sparse.topk(x, 1)], [4], "data", divide_by=2)
      >>> jax.jit(jax.vmap(f, axis_name="data"))(x)[0][0]
      Array([0., 4., 0., 0.], dtype=float32)
    """
    if scatter is not None and any(scatter):
        return sum_scattered(sent, sizes, axis_name, scatter, divide_by=divide_by, shards=shards)
    if shards is not None and any(shards):
        return _sum_with_shards(sent, sizes, axis_name, shards, divide_by)
    return _sum_whole(sent, sizes, axis_name, divide_by)


def sum_sparse_segments(
    sent: tuple[jax.Array, jax.Array],
    sizes: list[int],
    axis_name: _axes.AxisName,
    *,
    divide_by: int | None = None,
) -> list[jax.Array]:
    """The sum over devices of one sparse vector over the concatenation of segments.

    `sum_sparse` on the concatenation of leaves of `sizes`, cut into the segments: one
    decode for the whole concatenation, whatever the number of segments.

    Args:
      sent: `(values, indices)` from `topk` on the concatenation.
      sizes: the segments' sizes, in order.
      axis_name: the axis to sum over.
      divide_by: as for `sum_sparse`.

    Returns:
      Per segment, its flat dense sum (or mean), in float32 or wider.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> x = jnp.array([[0.0, 3.0, 0.0], [2.0, 0.0, 0.0]])  # one row per device
      >>> f = lambda x: sparse.sum_sparse_segments(sparse.topk(x, 1), [1, 2], "data")
      >>> jax.jit(jax.vmap(f, axis_name="data"))(x)[1][0]
      Array([3., 0.], dtype=float32)
    """
    starts = _flat.offsets(sizes)
    [flat] = sum_sparse([sent], [starts[-1]], axis_name, divide_by=divide_by)
    return [flat[start:end] for start, end in itertools.pairwise(starts)]


def sum_scattered(
    sent: Sequence[tuple[jax.Array, jax.Array] | ShardedTopK | PerShardTopK],
    sizes: list[int],
    axis_name: _axes.AxisName,
    scatter: Sequence[bool],
    *,
    divide_by: int | None = None,
    shards: Sequence[_shards.Axes] | None = None,
) -> list[jax.Array]:
    """`sum_sparse` where some leaves are FSDP-split: each device keeps its shard of those.

    Each device's pairs of an FSDP leaf index its whole (flat) gradient, as without
    FSDP; device j of N receives only elements `[j s, (j + 1) s)` of the sum (s = size /
    N: the leaf's leading-dimension slice j), the same bits as the slice of `sum_sparse`'s
    whole sum. The leaves travel as follows (per dtype, one collective each):

    * where `sparse_bytes_exceed_dense` holds (the leaves `sum_sparse` sends dense), by a
      `lax.psum_scatter` of the dense sent vectors (`reduce_scatter_dense`): (N - 1) / N
      of the leaf's bytes, half the all-reduce's;
    * else where `scatter_bytes_exceed_dense` holds (the pairs' all-gather would cost more
      than the dense reduce-scatter), by an `all_to_all` of the dense rows summed in
      device order: the same bytes as a reduce-scatter, and the sparse decode's bits;
    * per-shard picks (`PerShardTopK`, from `topk_per_shard`) by one `all_to_all` per
      dtype that sends each device its shard's pairs: (N - 1) c pairs per device, a
      reduce-scatter of the compressed vector; dense rows where pairs outweigh them;
    * the others in the one fixed-capacity all-gather of pairs that `sum_sparse` sends
      (with the group's whole leaves), each device decoding only its own shard of the
      FSDP leaves: (N - 1) k pairs per device, as without FSDP, with 1/N of the decode's
      dense buffer.

    Why not fewer pairs (the `gradcomm.sparse` docstring): a fixed-capacity exchange cannot know
    where a device's k pairs fall, and exactly summing every device's pairs into one
    shard can need all (N - 1) k of the others', so each device must be able to receive
    that many whatever its shard: the all-gather's bytes.

    Args:
      sent: per leaf, `(values, indices)` from `topk` on the whole flattened leaf (a
        `ShardedTopK` for a leaf sharded over other mesh axes, which must not be FSDP;
        a `PerShardTopK` for an FSDP leaf chosen shard by shard).
      sizes: per leaf, its number of elements (an FSDP leaf's whole size, a multiple of N).
      axis_name: the data axes.
      scatter: per leaf, whether it is FSDP-split.
      divide_by: as for `sum_sparse`.
      shards: as for `sum_sparse`.

    Returns:
      Per leaf, the flat sum (or mean) in float32 or wider: an FSDP leaf's shard of it
      (`size / N` elements), the others as `sum_sparse` gives them.

    Raises:
      ValueError: for an FSDP leaf that is also sharded over other mesh axes, or whose
        size N does not divide.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> x = jnp.array([[0.0, 3.0, 0.0, 1.0], [2.0, 5.0, 0.0, 0.0]])  # one row per device
      >>> f = lambda x: sparse.sum_scattered([sparse.topk(x, 1)], [4], "data", [True])[0]
      >>> jax.jit(jax.vmap(f, axis_name="data"))(x)  # device j: elements 2j, 2j + 1 of [0, 8, 0, 0]
      Array([[0., 8.],
             [0., 0.]], dtype=float32)
    """
    n = _axes.axis_size(axis_name)
    count = len(sent)
    shards = [()] * count if shards is None else list(shards)
    for i, (split, axes) in enumerate(zip(scatter, shards, strict=True)):
        if split and axes:
            raise ValueError(
                f"sum_sparse: leaf {i} is split over the data axes (FSDP) and over mesh axes "
                f"{axes}: an FSDP leaf must be whole over the other axes"
            )
        if split and sizes[i] % n:
            raise ValueError(
                f"sum_sparse: leaf {i} is split over the {n} data-parallel devices (FSDP), "
                f"but its size {sizes[i]} is not a multiple of {n}"
            )
    out: list[jax.Array | None] = [None] * count
    per_shard = [i for i in range(count) if isinstance(sent[i], PerShardTopK)]
    if any(not scatter[i] for i in per_shard):
        raise ValueError("sum_sparse: per-shard picks (topk_per_shard) are for FSDP leaves")
    if per_shard:
        sums = _sum_per_shard(
            [sent[i] for i in per_shard], [sizes[i] for i in per_shard], axis_name, divide_by
        )
        for i, total in zip(per_shard, sums, strict=True):
            out[i] = total
    sharded = [i for i in range(count) if shards[i]]
    if sharded:
        sums = _sum_with_shards(
            [sent[i] for i in sharded],
            [sizes[i] for i in sharded],
            axis_name,
            [shards[i] for i in sharded],
            divide_by,
        )
        for i, total in zip(sharded, sums, strict=True):
            out[i] = total
    whole_dense, split_dense, rows, pairs = [], [], [], []
    for i in range(count):
        if shards[i] or i in per_shard:
            continue
        values = sent[i][0]
        k, itemsize = values.shape[0], values.dtype.itemsize
        if sparse_bytes_exceed_dense(sizes[i], k, itemsize, n):
            (split_dense if scatter[i] else whole_dense).append(i)
        elif scatter[i] and scatter_bytes_exceed_dense(sizes[i], k, itemsize, n):
            rows.append(i)
        else:
            pairs.append(i)

    def dense(i: int) -> jax.Array:
        return _dense_sent(*sent[i][:2], sizes[i])

    if whole_dense:
        totals = lax.psum([dense(i) for i in whole_dense], axis_name)
        for i, total in zip(whole_dense, totals, strict=True):
            out[i] = _divided(total, divide_by)
    for ids, reduce in ((split_dense, reduce_scatter_dense), (rows, _all_to_all_in_device_order)):
        if ids:
            for i, total in zip(ids, reduce([dense(i) for i in ids], axis_name), strict=True):
                out[i] = _divided(total, divide_by)
    j = lax.axis_index(axis_name)
    for group in _flat.dtype_groups([sent[i][0] for i in pairs]):
        # One all-gather for the group, whole leaves' columns first; two decodes, so that
        # a whole leaf's sum stays typed as the same on every device: the whole leaves'
        # (as `sum_sparse` decodes them) and this device's shards of the FSDP ones (each
        # pair outside its leaf's shard dropped), over their concatenation.
        whole = [pairs[g] for g in group if not scatter[pairs[g]]]
        split = [pairs[g] for g in group if scatter[pairs[g]]]
        all_values, all_indices = _gather_pairs([sent[i][:2] for i in whole + split], axis_name)
        cut = sum(sent[i][0].shape[0] for i in whole)
        if whole:
            columns = _flat.offsets([sent[i][0].shape[0] for i in whole])
            starts = _flat.offsets([sizes[i] for i in whole])
            shift = np.repeat(starts[:-1], np.diff(columns)).astype(np.int32)
            total = _sum_in_device_order(
                all_values[:, :cut], all_indices[:, :cut] + shift, starts[-1], divide_by
            )
            for i, (start, end) in zip(whole, itertools.pairwise(starts), strict=True):
                out[i] = total[start:end]
        if split:
            widths = [sent[i][0].shape[0] for i in split]
            parts = [sizes[i] // n for i in split]
            starts = _flat.offsets(parts)
            column_start = np.repeat(np.asarray(starts[:-1], np.int32), widths)
            column_size = np.repeat(np.asarray(parts, np.int32), widths)
            local = all_indices[:, cut:] - j.astype(jnp.int32) * column_size
            inside = (local >= 0) & (local < column_size)
            index = jnp.where(inside, local + column_start, starts[-1])
            total = _sum_in_device_order(all_values[:, cut:], index, starts[-1], divide_by)
            for i, (start, end) in zip(split, itertools.pairwise(starts), strict=True):
                out[i] = total[start:end]
    return out


def collectives(options: Mapping[str, Any], s: perfmodel.Setting) -> list[perfmodel.Collective]:
    """What `sum_sparse` sends per step for a model of `s.params` at `options["density"]`:
    one all-gather in which each device contributes its k (value, index) pairs.

    The step-time model's pattern of the methods that send top-k pairs (`gradcomm.lags`,
    `gradcomm.slgs`, `gradcomm.gradient_dropping`).

    Example:
      >>> from gradcomm import perfmodel, sparse
      >>> [c.size for c in sparse.collectives({"density": 0.01}, perfmodel.Setting(4, 1000))]
      [320.0]
    """
    k = max(1, round(options["density"] * s.params))
    return [perfmodel.Collective("allgather", s.nodes, float(s.nodes * k * (s.itemsize + 4)))]
