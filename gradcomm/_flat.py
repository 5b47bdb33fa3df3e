"""Fused flat buffers: many leaves of one dtype in one array, with per-leaf reductions.

A collective per leaf per step is what makes a model with hundreds of leaves slow, so
methods that exchange whole leaves pack them into one buffer of shape `(rows, blocks,
block)`. Each leaf is split into `rows` equal parts (zero-padded), one per row, so that
every row has the same per-leaf structure: a method that halves or scatters rows across
devices keeps a static map from blocks to leaves. A leaf owns whole blocks of `block`
elements, which makes per-leaf sums two dense reductions (over the block, then a sorted
segment sum over blocks) instead of a scatter over every element.

`FlatBuffers` is a whole pytree laid out that way: one buffer per dtype, so that a method
moves a model of any number of leaves in one collective per dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm._axes import varying_axes


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each leaf lives in a fused `(rows, num_blocks, block)` buffer.

    Attributes:
      shapes: the leaves' shapes, in order.
      rows: the number of rows each leaf is split across.
      block: elements per block; a leaf owns whole blocks of every row.
      blocks: blocks per row owned by each leaf.
    """

    shapes: tuple[tuple[int, ...], ...]
    rows: int
    block: int
    blocks: tuple[int, ...]

    @classmethod
    def of(
        cls,
        shapes: Sequence[tuple[int, ...]],
        rows: int,
        *,
        max_block: int = 64,
        max_overhead: float = 1 / 32,
    ) -> FlatLayout:
        """Lays out leaves of the given (non-empty) shapes.

        The block size is the largest power of two up to `max_block` whose worst-case
        padding, `len(shapes) * rows * block` elements, stays within `max_overhead` of the
        total size, so tiny models are not inflated and large ones reduce fast.
        """
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        sizes = [math.prod(s) for s in shapes]
        if not sizes or min(sizes) == 0 or rows < 1:
            raise ValueError(f"cannot lay out shapes {shapes} over {rows} rows")
        block = max_block
        while block > 1 and len(sizes) * rows * block > max_overhead * sum(sizes):
            block //= 2
        per_row = rows * block
        blocks = tuple(-(-n // per_row) for n in sizes)
        return cls(shapes, rows, block, blocks)

    @property
    def num_leaves(self) -> int:
        return len(self.shapes)

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks)

    @property
    def shape(self) -> tuple[int, int, int]:
        """The buffer's shape, `(rows, num_blocks, block)`."""
        return (self.rows, self.num_blocks, self.block)

    @property
    def padded_size(self) -> int:
        """Elements in the whole buffer, padding included."""
        return self.rows * self.num_blocks * self.block

    @functools.cached_property
    def segments(self) -> np.ndarray:
        """The leaf index of each block, shape `(num_blocks,)`, sorted."""
        return np.repeat(np.arange(self.num_leaves, dtype=np.int32), self.blocks)

    @functools.cached_property
    def _offsets(self) -> tuple[int, ...]:
        return tuple(int(o) for o in np.cumsum((0, *self.blocks[:-1])))

    def pack(self, leaves: Sequence[jax.Array], dtype: jnp.dtype) -> jax.Array:
        """Leaves to a `(rows, num_blocks, block)` buffer of `dtype`, zero-padded."""
        b = self.block
        parts = []
        for leaf, k in zip(leaves, self.blocks, strict=True):
            flat = jnp.ravel(leaf).astype(dtype)
            # Padded by whole blocks: XLA:CPU runs an elementwise pad of a fused producer
            # (an optimizer's update) about 3x slower than the producer alone.
            whole, used = flat.size // b, -(-flat.size // b)
            blocks = [flat[: whole * b].reshape(whole, b)]
            if used > whole:  # the last, partial block
                blocks.append(jnp.pad(flat[whole * b :], (0, used * b - flat.size))[None])
            if self.rows * k > used:
                blocks.append(jnp.zeros((self.rows * k - used, b), dtype))
            parts.append(jnp.concatenate(blocks).reshape(self.rows, k, b))
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)

    def unpack(self, x: jax.Array) -> list[jax.Array]:
        """Inverse of `pack` (in the buffer's dtype)."""
        out = []
        for shape, off, k in zip(self.shapes, self._offsets, self.blocks, strict=True):
            flat = x[:, off : off + k, :].reshape(-1)
            out.append(flat[: math.prod(shape)].reshape(shape))
        return out

    def segment_sum(self, xs: Sequence[jax.Array]) -> jax.Array:
        """Per-leaf sums of each `(R, num_blocks, block)` array: shape `(len(xs), leaves)`.

        One variadic reduction reads all the arrays in a single pass.
        """
        zeros = tuple(jnp.zeros((), x.dtype) for x in xs)
        sums = lax.reduce(tuple(xs), zeros, lambda a, b: tuple(map(jnp.add, a, b)), (0, 2))
        v = jnp.stack(sums, axis=-1)
        return jax.ops.segment_sum(v, self.segments, self.num_leaves, indices_are_sorted=True).T

    def segment_max(self, xs: Sequence[jax.Array]) -> jax.Array:
        """Per-leaf maxima of each `(R, num_blocks, block)` array: `(len(xs), leaves)`."""
        v = jnp.stack([x.max((0, 2)) for x in xs], axis=-1)
        return jax.ops.segment_max(v, self.segments, self.num_leaves, indices_are_sorted=True).T

    def per_block(self, v: jax.Array) -> jax.Array:
        """Per-leaf values `(leaves,)` broadcast to a `(1, num_blocks, 1)` array."""
        return v[self.segments][None, :, None]


def dtype_groups(leaves: Sequence[jax.Array]) -> list[list[int]]:
    """Indices of the non-empty leaves, grouped by dtype in first-seen order.

    Under `shard_map`, leaves of one dtype that vary over different mesh axes (a leaf
    sharded over a model axis beside one replicated over it) form separate groups: fused
    together, every leaf would come out typed as varying over both.
    """
    groups: dict[tuple[np.dtype, frozenset[str]], list[int]] = {}
    for i, leaf in enumerate(leaves):
        if leaf.size:
            groups.setdefault((np.dtype(leaf.dtype), varying_axes(leaf)), []).append(i)
    return list(groups.values())


@dataclasses.dataclass(frozen=True)
class FlatBuffers:
    """A pytree's leaves fused into one `FlatLayout` buffer per dtype.

    The groups are `dtype_groups`: the non-empty leaves of each dtype (and, under
    `shard_map`, each set of mesh axes they vary over), in first-seen order.
    Empty leaves belong to no buffer and unpack as zeros.

    Attributes:
      treedef: the pytree's structure.
      leaves: every leaf's shape and dtype, in `treedef` order.
      groups: per buffer, the indices of its leaves.
      layouts: per buffer, where its leaves live.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradcomm._flat import FlatBuffers
      >>> tree = {"a": jnp.ones((2, 3)), "b": jnp.zeros(5, jnp.bfloat16), "c": jnp.arange(4.0)}
      >>> flat = FlatBuffers.of(tree)
      >>> [(x.shape, x.dtype.name) for x in flat.pack(tree)]
      [((1, 10, 1), 'float32'), ((1, 5, 1), 'bfloat16')]
      >>> flat.unpack(flat.pack(tree))["c"]
      Array([0., 1., 2., 3.], dtype=float32)
    """

    treedef: jax.tree_util.PyTreeDef
    leaves: tuple[jax.ShapeDtypeStruct, ...]
    groups: tuple[tuple[int, ...], ...]
    layouts: tuple[FlatLayout, ...]

    @classmethod
    def of(cls, tree: Any, rows: int = 1) -> FlatBuffers:
        """Lays out the leaves of `tree` (arrays or `jax.ShapeDtypeStruct`s), `rows` rows."""
        leaves, treedef = jax.tree.flatten(tree)
        groups = tuple(tuple(ids) for ids in dtype_groups(leaves))
        layouts = tuple(FlatLayout.of([leaves[i].shape for i in ids], rows) for ids in groups)
        specs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
        return cls(treedef, specs, groups, layouts)

    @property
    def dtypes(self) -> tuple[np.dtype, ...]:
        """The dtype of each buffer."""
        return tuple(np.dtype(self.leaves[ids[0]].dtype) for ids in self.groups)

    def pack(self, tree: Any) -> list[jax.Array]:
        """A tree of this structure as its buffers, each `(rows, num_blocks, block)`."""
        leaves = self.treedef.flatten_up_to(tree)
        return [
            layout.pack([leaves[i] for i in ids], dtype)
            for layout, ids, dtype in zip(self.layouts, self.groups, self.dtypes, strict=True)
        ]

    def unpack(self, buffers: Sequence[jax.Array]) -> Any:
        """Inverse of `pack`. A buffer may come in any shape of its size (a flat one)."""
        out: list[jax.Array | None] = [None] * len(self.leaves)
        for layout, ids, buffer in zip(self.layouts, self.groups, buffers, strict=True):
            for i, leaf in zip(ids, layout.unpack(buffer.reshape(layout.shape)), strict=True):
                out[i] = leaf
        for i, spec in enumerate(self.leaves):
            out[i] = jnp.zeros(spec.shape, spec.dtype) if out[i] is None else out[i]
        return jax.tree.unflatten(self.treedef, out)


def offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    """Where each of consecutive parts of the given sizes starts, then the total.

    `itertools.pairwise(offsets(sizes))` gives each part's `(start, end)`.
    """
    return tuple(int(o) for o in np.cumsum((0, *sizes)))
