"""Streaming DiLoCo's fragments (layers strided over P) and their schedule."""

from __future__ import annotations

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
