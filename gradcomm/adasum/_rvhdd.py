"""Adasum across devices: recursive vector-halving distance-doubling (Algorithm 1).

`reduce_buffer` runs the balanced tree of `gradcomm.adasum._pair.pair` over a named axis on
one fused buffer, with the fold for a non-power-of-two axis size and the hierarchical
(node-mean) mode; `group_stats` moves each level's per-leaf statistics within the level's
group only. `gradcomm.adasum` holds the public API and the design notes.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _axes, _collectives
from gradcomm._flat import FlatLayout
from gradcomm.adasum._pair import pair


def bit_reversed(width: int) -> np.ndarray:
    """i with its `width` low bits reversed, for i < 2**width."""
    return np.array([int(f"{i:0{width}b}"[::-1], 2) if width else 0 for i in range(1 << width)])


def group_stats(
    axis_name: _axes.AxisName,
    size: int,
    in_tree: int,
    index: jax.Array,
    pairwise: bool,
    local_axis: _axes.AxisName | None = None,
) -> Callable[[jax.Array], jax.Array]:
    """Stats of the aligned group of `size` devices that holds one pair, in device order.

    Only the group's devices exchange them, so a level's bytes grow with its group, not
    with the axis: each device sends the stats of `size - 1` members, as an all-gather
    within the group would. With `pairwise` (under `shard_map` or `pmap`) one all-gather
    collects it, each group a replica group. Otherwise (a named `vmap` takes no replica
    groups) a gather by recursive doubling: at distance d = 1, 2, .. size / 2 each device
    swaps the d members it holds with device i ^ d (a `ppermute`), the lower half first,
    so every member of the group ends with the same array, bit for bit, in device order.

    With `local_axis`, each group device's node-mates hold slices of the pair too: the
    members are every (local device, group device), local-major, gathered in the same
    all-gather with `pairwise`, else in an all-gather over the local axis.
    """
    local = () if local_axis is None else _axes.axis_names(local_axis)
    if pairwise:  # one all-gather, each group (and its node-mates) a replica group
        n, per_node = _axes.axis_size(axis_name), _axes.axis_size(local) if local else 1
        groups = [
            [mate * n + start + j for mate in range(per_node) for j in range(size)]
            for start in range(0, n, size)
        ]
        axes = local + _axes.axis_names(axis_name)
        return lambda stats: lax.all_gather(stats, axes, axis_index_groups=groups)

    def gather(stats: jax.Array) -> jax.Array:
        held = stats[None]
        for level in range(size.bit_length() - 1):
            distance = 1 << level
            pairs = [(i, i ^ distance) for i in range(in_tree)]
            received = _collectives.ppermute(held, axis_name, pairs)
            lower = (index & distance) == 0  # this device's members come first
            first, second = jnp.where(lower, held, received), jnp.where(lower, received, held)
            held = jnp.concatenate([first, second])
        if not local:
            return held
        return lax.all_gather(held, local).reshape(-1, *stats.shape)

    return gather


def reduce_buffer(
    x: jax.Array,
    layout: FlatLayout,
    axis_name: _axes.AxisName,
    index: jax.Array,
    pairwise: bool,
    local_axis: _axes.AxisName | None = None,
    shards: tuple[str, ...] = (),
) -> jax.Array:
    """Adasum across the axis of one fused buffer `x` of `layout` (Algorithm 1).

    `layout` has P = 2^floor(log2 N) rows per device of the node (P L rows with
    `local_axis`, L devices per node). Level j pairs device i with i ^ 2^j, which differ
    in bit j. Each device stores its rows in the order p -> row i ^ bitreverse(p): at
    every level the rows it keeps are the first half of its buffer and the rows it sends
    the second half, in the order its partner keeps them; after the last level it holds
    row i, and a gather gives every device the whole result, the same bits everywhere.
    With `pairwise`, every swap and the final gather are `_collectives.swap`s, two-member
    replica groups of the axis.

    With `local_axis`, a reduce-scatter over the node leaves each local device the node's
    mean of 1/L of every leaf, the tree runs on those slices with per-leaf statistics
    gathered over the local devices too, and an all-gather within the node reassembles
    the result. So each of a node's L devices sends 1/L of the Adasum traffic across
    nodes.

    `shards` are the mesh axes over which the buffer's leaves are split (`_adasum_pair.pair`).
    """
    n = _axes.axis_size(axis_name)
    in_tree = 1 << (n.bit_length() - 1)
    levels = in_tree.bit_length() - 1
    folded = n - in_tree
    if local_axis is not None:
        per_node = _axes.axis_size(local_axis)
        x = lax.psum_scatter(x, local_axis, scatter_dimension=0, tiled=True) / per_node
    if folded:
        partner = _collectives.ppermute(x, axis_name, [(in_tree + i, i) for i in range(folded)])
        whole = None if local_axis is None else lambda stats: lax.all_gather(stats, local_axis)
        x = lax.cond(
            index < folded, lambda: pair(x, partner, layout, group=whole, shards=shards), lambda: x
        )
    if levels:
        rows = (index % in_tree) ^ jnp.asarray(bit_reversed(levels), index.dtype)
        own, send = (jnp.take(x, r, axis=0, mode="clip") for r in jnp.split(rows, 2))
    for level in range(levels):
        distance = 1 << level
        own_is_b = (index >> level) & 1 == 1
        with jax.named_scope("exchange"):
            if pairwise:
                received = _collectives.swap(send, axis_name, distance)
            else:
                pairs = [(i, i ^ distance) for i in range(in_tree)]
                received = _collectives.ppermute(send, axis_name, pairs)
        group = group_stats(axis_name, 2 * distance, in_tree, index, pairwise, local_axis)
        if level + 1 < levels:
            own, send = pair(own, received, layout, own_is_b, group, halves=True, shards=shards)
        else:
            x = pair(own, received, layout, own_is_b, group, shards=shards)
    with jax.named_scope("gather"):
        if pairwise:
            rows = _collectives.all_gather_pairwise(x[0], axis_name)
        else:
            rows = _collectives.all_gather_invariant(x[0], axis_name)[:in_tree]
        if local_axis is not None:
            rows = _collectives.all_gather_invariant(rows, local_axis, tiled=True)
    return rows
