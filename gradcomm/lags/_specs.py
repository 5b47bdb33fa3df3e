"""What `lags` and `slgs` do with the params' `PartitionSpec`s (`specs=`).

`with_specs` is `gradcomm._transform.with_residuals` for a method that takes `specs`: its
step also gets, per leaf, whether FSDP splits it over the data axes and its spec.
`whole_order` is the tie order a spec gives: each element's place in its whole leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomm import _axes, _shards, _transform, sparse

Leaves = list[jax.Array]


class Inputs(NamedTuple):
    """A step's inputs, lists in the order of the updates' leaves: the leaves, their
    names, their residuals, whether `specs` splits each over the data axes (FSDP,
    `sparse.fsdp_leaves`), and each one's spec (None where not given)."""

    leaves: Leaves
    names: list[str]
    residuals: Leaves
    fsdp: list[bool]
    specs: list[Any]


def with_specs(
    who: str,
    axis_name: _axes.AxisName,
    state_type: Callable[..., NamedTuple],
    init_fn: Callable[[Any], NamedTuple],
    specs: Any,
    step: Callable[[Inputs], tuple[Leaves, Leaves]],
) -> optax.GradientTransformationExtraArgs:
    """`_transform.with_residuals` with the leaves' specs (`specs=None`: none given).

    Args:
      who: as for `_transform.transformation`.
      axis_name: as for `_transform.transformation`.
      state_type: the state, a NamedTuple with the one field `residual`.
      init_fn: the transformation's `init` (FSDP's residuals are whole-sized:
        `sparse.zero_residuals`).
      specs: None, or the params' `PartitionSpec`s (a pytree like them).
      step: `step(inputs) -> (outputs, new_residuals)`, `inputs` an `Inputs`.

    Returns:
      An `optax.GradientTransformationExtraArgs`.
    """

    def residual_step(leaves: Leaves, names: list[str], state: Any) -> tuple[Leaves, Any]:
        tree = state.residual  # shaped like the updates: what `specs` must match
        fsdp = sparse.fsdp_leaves(specs, tree, names, axis_name, who)
        leaf_specs = _shards.leaf_specs(specs, tree, who)
        out, residuals = step(Inputs(leaves, names, jax.tree.leaves(tree), fsdp, leaf_specs))
        return out, state_type(residual=jax.tree.unflatten(jax.tree.structure(tree), residuals))

    return _transform.leafwise(who, axis_name, init_fn, residual_step)


def whole_order(
    leaf: jax.Array,
    spec: Any,
    axes: tuple[str, ...],
    axis_name: _axes.AxisName,
    who: str,
    name: str,
    offset: int = 0,
) -> jax.Array:
    """`offset` plus each element's index in the whole row-major leaf, flat int32: an
    `order` for `sparse.topk_over_shards` (`leaf`: this device's piece, shaped)."""
    index = _shards.global_index(leaf, spec, axes, axis_name, who, name)
    if index is None:  # a whole leaf: its own index
        return jnp.arange(offset, offset + leaf.size, dtype=jnp.int32)
    return (index.ravel() + jnp.uint32(offset)).astype(jnp.int32)
