"""The checks of a state and of updates against the mesh and the params, with their hints.

A per-device state leaf restores only onto as many data-parallel devices as made it, and a
state laid out for one value of `params_per_device` does not fit a step built for the
other: `check_state_layout` says which and what to do. `check_update_shapes` catches an
update not shaped like its param (FSDP: a transformation that does not reduce-scatter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

RELAY_HINT = (
    "per-device state (residuals, keys, push-sum weights, each device's optimizer "
    "moments) belongs to the devices that made it and cannot be re-laid onto another "
    "number of devices. Restore it onto a mesh with as many data-parallel devices as it "
    "was saved from, or start this state afresh on this mesh with "
    "`parallel.init_state(tx, params, mesh)` (replicated leaves, such as step counts and "
    "the moments of an optimizer after an all-reduce, restore onto any mesh)"
)


def _misfit(
    shapes: Sequence[tuple[int, ...]], flags: Sequence[bool], local: Any, n: int
) -> int | None:
    """The first state leaf (by index) not laid out for one device's state `local`: a
    per-device leaf has shape `(n, *local)`, a replicated one `local`. -1 where the trees
    differ (or `local` is None); None where every leaf fits."""
    if local is None:
        return -1
    wants = [tuple(np.shape(x)) for x in jax.tree.leaves(local)]
    if len(wants) != len(shapes):
        return -1
    for i, (shape, want, per_device) in enumerate(zip(shapes, wants, flags, strict=True)):
        if shape != ((n, *want) if per_device else want):
            return i
    return None


def check_state_layout(
    state: Any,
    flags: Sequence[bool],
    local: Any,
    n: int,
    names: tuple[str, ...],
    params_per_device: bool,
    other: Callable[[], Any],
) -> None:
    """Raises for state leaves whose device axis does not fit the mesh (see `TrainStep`).

    `local` holds one device's state shapes (`tx.init`'s): a per-device leaf must have
    shape `(n, *local)`, a replicated one `local`. `other()` returns them for the other
    value of `params_per_device` (None where these params rule it out); it is called only
    where a state placed on the mesh does not fit `local`, and a state that fits it instead
    was laid out for that value: the error names the flag. (A state of host arrays is a
    checkpoint restored without its shardings: the checks below report it.)
    """
    leaves = jax.tree_util.tree_leaves_with_path(state)
    shapes = [tuple(np.shape(x)) for _, x in leaves]
    placed = all(isinstance(getattr(x, "sharding", None), NamedSharding) for _, x in leaves)
    misfit = _misfit(shapes, flags, local, n) if placed else None
    if misfit is not None and _misfit(shapes, flags, other(), n) is None:
        detail = ""
        if misfit >= 0:
            path, x = leaves[misfit]
            want = tuple(np.shape(jax.tree.leaves(local)[misfit]))
            detail = (
                f" (state leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
                f"{np.shape(x)}; laid out for params_per_device={params_per_device} it would "
                f"have shape {(n, *want) if flags[misfit] else want})"
            )
        raise ValueError(
            f"this state was laid out for params_per_device={not params_per_device}, but "
            f"the step was built with params_per_device={params_per_device}{detail}: "
            f"rebuild the state with `parallel.init_state(tx, params, mesh, "
            f"params_per_device={params_per_device})` from the params that the step takes, "
            f"or build the step with params_per_device={not params_per_device}, as the state was"
        )
    local_leaves = jax.tree.leaves(local)
    if len(local_leaves) != len(leaves):
        return  # not this transformation's state: its update reports the mismatch
    for (path, x), want, per_device in zip(leaves, local_leaves, flags, strict=True):
        shape, name = tuple(np.shape(x)), jax.tree_util.keystr(path) or "<root>"
        if shape == tuple(want.shape) or shape[1:] != tuple(want.shape):
            continue  # replicated as expected, or a mismatch the update reports
        if per_device and shape[0] != n:
            raise ValueError(
                f"state leaf {name} holds {shape[0]} per-device copies (shape {shape}), "
                f"but this mesh has {n} data-parallel devices; {RELAY_HINT}"
            )
        if not per_device:
            raise ValueError(
                f"state leaf {name} has a leading device axis of {shape[0]} copies (shape "
                f"{shape}) but is not sharded over the data axes {names}; "
                f"pass the state as `parallel.init_state` placed it: restore a checkpoint "
                f"with the shardings of `init_state`'s state (for example "
                f"`jax.tree.map(orbax.checkpoint.utils.to_shape_dtype_struct, state)` as "
                f"the restore target)"
            )


def per_device_hint(shards: Sequence[tuple[int, ...]]) -> str:
    """A hint for FSDP-split params whose shards (this device's shapes) hold one row each:
    per-device copies (`per_device` places them split over the data axes) passed without
    params_per_device=True read as FSDP. Empty where no shard has a single row."""
    if not any(shape[:1] == (1,) for shape in shards):
        return ""
    return (
        " If the params are per-device copies (`parallel.per_device`), build the state and "
        "the step with params_per_device=True."
    )


def check_update_shapes(updates: Any, params: Any, fsdp: Sequence[bool]) -> None:
    """Raises where an update is not shaped like its param (inside the map)."""
    paths = jax.tree_util.tree_leaves_with_path(params)
    for (path, p), u, split in zip(paths, jax.tree.leaves(updates), fsdp, strict=True):
        if np.shape(u) != np.shape(p):
            how = (
                " The param is split over the data axes (FSDP): the transformation must "
                "return this device's shard of the combined gradient; the gradcomm methods "
                "that reduce-scatter take the params' specs, allreduce(specs=...)."
                if split
                else ""
            )
            if split:
                how += per_device_hint([np.shape(p)])
            raise ValueError(
                f"the update of param {jax.tree_util.keystr(path)} has shape {np.shape(u)}, "
                f"but the param here has shape {np.shape(p)}.{how}"
            )
