"""Streaming DiLoCo's fragments (layers strided over P) and their schedule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


def fragment_of_leaves(params: Any, fragments: int) -> list[int]:
    """Each leaf's fragment: layers strided over the fragments, in tree order.

    A layer is the leaves that share a parent (a dense layer's kernel and bias); a leaf
    at the top of the tree is a layer of its own. Layer i, in order of first
    appearance, goes to fragment i mod `fragments`.

    Raises:
      ValueError: where there are fewer layers than fragments.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradcomm.streaming_diloco import fragment_of_leaves
      >>> layer = {"b": jnp.zeros(2), "w": jnp.zeros((2, 2))}
      >>> fragment_of_leaves({"l0": layer, "l1": layer, "l2": layer}, 2)
      [0, 0, 1, 1, 0, 0]
    """
    if fragments > 1 and not jax.tree.leaves(params):
        raise ValueError(
            f"streaming_diloco(fragments={fragments}) got params without leaves. Where "
            f"parallel.train_step or init_state lays out its state over params split over "
            f"a model axis, they ask for state shaped like the params (with "
            f"optax.tree_map_params), and each fragment's outer state holds only its "
            f"leaves: use fragments=1 there (DiLoCo's outer step, with outer_dtype and "
            f"eager as you like), or run it in a hand-written shard_map loop"
        )
    layers: dict[Any, int] = {}
    out = []
    for path, _ in jax.tree_util.tree_leaves_with_path(params):
        key = tuple(path[:-1]) or tuple(path)
        out.append(layers.setdefault(key, len(layers)) % fragments)
    if len(layers) < fragments:
        raise ValueError(
            f"streaming_diloco: {fragments} fragments but the params have {len(layers)} "
            f"layers (groups of leaves that share a parent); use fragments <= {len(layers)}"
        )
    return out


def split_tree(tree: Any, fragments: int) -> list[list[Any]]:
    """The leaves of `tree`, one list per fragment (all of them for one fragment)."""
    leaves = jax.tree.leaves(tree)
    if fragments == 1:
        return [leaves]
    owner = fragment_of_leaves(tree, fragments)
    return [[x for x, o in zip(leaves, owner, strict=True) if o == p] for p in range(fragments)]


def merge_parts(tree: Any, parts: Sequence[list[Any]], fragments: int) -> Any:
    """Inverse of `split_tree`: `parts` as a tree shaped like `tree`."""
    owner = fragment_of_leaves(tree, fragments) if fragments > 1 else [0] * len(parts[0])
    its = [iter(part) for part in parts]
    return jax.tree.unflatten(jax.tree.structure(tree), [next(its[o]) for o in owner])


def schedule(count: jax.Array, every: int, fragments: int, delay: int) -> tuple[Any, Any]:
    """(send, arrive) indices of the step that increments `count`: 1 + the fragment whose
    outer gradient is sent after it (or arrives after it), 0 for none."""
    stride = every // fragments

    def index(step: jax.Array) -> jax.Array:
        phase = step % every
        due = (step >= 1) & (phase % stride == 0)
        return jnp.where(due, (phase // stride - 1) % fragments + 1, 0)

    step = count + 1
    return index(step), index(step - delay)
