"""Error feedback (LAGS eq. 5, SLGS, gradient dropping's Algorithm 1).

Each device adds its update to what it has not sent yet (`accumulate`), sends part of the
sum, and keeps the rest (`unsent`): `residual' = acc - sent`, computed as `acc` with the
sent entries set to zero, so `residual' + sent == acc` bit for bit. An FSDP leaf's residual
is whole-sized and per device (`zero_residuals`, `check_whole_residual`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _axes, _checks
from gradcomm.sparse._fsdp import fsdp_leaves


def accumulate(residual: jax.Array, update: jax.Array) -> jax.Array:
    """Error feedback's accumulator `residual + update`, flat, in their promoted dtype."""
    return (residual + update).ravel()


def as_residual(kept: jax.Array, residual: jax.Array) -> jax.Array:
    """A flat new residual in the old one's dtype and shape: the state's dtype never drifts
    (a bf16 residual plus f32 updates stays bf16), so a jitted step never retraces."""
    return kept.astype(residual.dtype).reshape(residual.shape)


def unsent(
    acc: jax.Array, indices: jax.Array, residual: jax.Array, *, unique_indices: bool = True
) -> jax.Array:
    """The new residual `acc - sent`: `acc` with the sent entries set to zero, exactly, as
    `as_residual`. Indices outside `acc` are dropped; `unique_indices` promises that the
    others do not repeat."""
    kept = acc.at[indices].set(0, unique_indices=unique_indices, mode="drop")
    return as_residual(kept, residual)


def zero_residuals(params: object, specs: object, axis_name: _axes.AxisName, who: str) -> object:
    """Error feedback's first residuals: zeros like the params, FSDP leaves' whole-sized.

    A residual holds what this device has not sent of its own whole gradient, so an FSDP
    leaf's residual is the whole leaf's size although its param is a shard. Inside a map
    over `axis_name` (`shard_map`, as `gradcomm.parallel.init_state` runs `init`), an FSDP
    leaf of `params` is this device's shard, `(rows / N, ...)`, and its residual is
    zeros of `(1, rows, ...)`; outside one (`jax.eval_shape(tx.init, ...)` on the whole
    params, or `init` before a `vmap`), the leaf is whole and its residual `(1,
    *leaf.shape)`. The leading axis of one is this device's slot on the device axis: the
    param's spec, `P("data", ...)`, which `optax.tree_map_params` gives every state leaf
    shaped like the params (`gradcomm.parallel`), then splits that axis over the devices,
    so the residuals are laid out per device, `(N, rows, ...)`, one whole-sized residual
    on each.

    Args:
      params: the params as this device holds them (a pytree).
      specs: None, or the params' `PartitionSpec`s.
      axis_name: the data axes.
      who: the method, for error messages.

    Returns:
      The residuals, a pytree like `params`.

    Raises:
      ValueError: as `fsdp_leaves`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from gradcomm import sparse
      >>> params = {"b": jnp.zeros(3), "w": jnp.zeros((4, 2))}  # outside a map: whole
      >>> r = sparse.zero_residuals(params, {"b": P(), "w": P("data")}, "data", "lags")
      >>> r["b"].shape, r["w"].shape
      ((3,), (1, 4, 2))
    """
    leaves, names, treedef = _checks.named_leaves(params)
    if specs is None or not leaves:  # (optax.tree_map_params passes a leafless tree)
        return jax.tree.map(jnp.zeros_like, params)
    split = fsdp_leaves(specs, params, names, axis_name, who)
    try:
        n = int(lax.axis_size(axis_name))
    except NameError:  # outside a map: the params are whole
        n = 1
    out = []
    for leaf, s, name in zip(leaves, split, names, strict=True):
        shape = np.shape(leaf)
        if s and not shape:
            raise ValueError(f"{who}: leaf {name!r} is a scalar, which FSDP cannot split")
        whole = (1, shape[0] * n, *shape[1:]) if s else shape
        out.append(jnp.zeros_like(leaf, shape=whole))
    return jax.tree.unflatten(treedef, out)


def check_whole_residual(
    residual: jax.Array, update: jax.Array, n: int, who: str, name: str
) -> None:
    """Raises where an FSDP leaf's residual is not its whole update's size.

    Args:
      residual: the leaf's residual (whole-sized, `zero_residuals`).
      update: the leaf's whole update (the gradient of the gathered param).
      n: the number of devices.
      who: the method, for error messages.
      name: the leaf's name, for error messages.

    Raises:
      ValueError: where the sizes differ, or `update`'s leading dimension is not a
        multiple of n.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradcomm import sparse
      >>> sparse.check_whole_residual(jnp.zeros((1, 4, 2)), jnp.zeros((4, 2)), 2, "lags", "w")
    """
    if not np.ndim(update) or np.shape(update)[0] % n:
        raise ValueError(
            f"{who}: FSDP splits a leaf's leading dimension over the {n} devices of the "
            f"data axes, but leaf {name!r} has shape {np.shape(update)}: give it a leading "
            f"dimension divisible by {n}, or keep it whole (P())"
        )
    if jnp.size(residual) != jnp.size(update):
        raise ValueError(
            f"{who}: leaf {name!r} is split over the data axes (FSDP), so its residual "
            f"holds this device's unsent part of its whole gradient, {jnp.size(update)} "
            f"elements, but it has {jnp.size(residual)} (shape {np.shape(residual)}). "
            f"Build the state with init inside the map, on this device's shard of the "
            f"params (gradcomm.parallel.init_state does), on a mesh of as many "
            f"data-parallel devices as the update's"
        )
