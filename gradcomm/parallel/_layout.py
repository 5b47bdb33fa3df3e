"""Per-device state layout: which state leaves differ across devices, and how each is split.

A leaf that the transformation makes differ between devices is stored with a leading
device axis sharded over the data axes; the rest is replicated. `layout` finds which by
tracing one update (see `gradcomm.parallel`); `init_state` (`_state`) and `train_step`
place the state by it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomm import _axes, _checks, _collectives
from gradcomm.parallel._placement import device_spec, is_fsdp, model_specs, with_device_axis
from gradcomm.parallel._validate import per_device_hint


def per_device_leaves(state: Any, spec: P) -> list[bool]:
    """Which leaves of a placed state carry a leading device axis (sharded as `spec`)."""
    flags = []
    for x in jax.tree.leaves(state):
        sharding = getattr(x, "sharding", None)
        leading = (
            sharding.spec[0] if isinstance(sharding, NamedSharding) and sharding.spec else None
        )
        flags.append(leading is not None and leading == spec[0])
    return flags


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def fsdp_leaves(models: Any, names: tuple[str, ...]) -> list[bool]:
    """Per param leaf, whether `model_specs` splits it over the data axes (FSDP)."""
    return [is_fsdp(s, names) for s in jax.tree.leaves(models, is_leaf=_is_spec)]


def gather_fsdp(params: Any, fsdp: Sequence[bool], names: tuple[str, ...]) -> Any:
    """Inside the map: the FSDP-split params gathered whole (the forward's all-gather)."""
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(
        treedef,
        [
            lax.all_gather(x, names, axis=0, tiled=True) if f else x
            for x, f in zip(leaves, fsdp, strict=True)
        ],
    )


def state_model_specs(tx: Any, shapes: Any, param_models: Any) -> list[P]:
    """Per state leaf of `tx` (a transformation or a `ParamsSync`), how it is split over
    the mesh: as its param, where it mirrors one.

    Leaves shaped like the params (Adam's moments, residuals) follow `param_models` (from
    `model_specs`), found with `optax.tree_map_params`; the others (counts, keys, factors)
    are whole, `P()`.
    """
    state = jax.eval_shape(tx.init, shapes)
    if not any(jax.tree.leaves(param_models, is_leaf=_is_spec)):
        return [P()] * len(jax.tree.leaves(state))
    mapped = optax.tree_map_params(
        tx, lambda _, s: s, state, param_models,
        transform_non_params=lambda v: jax.tree.map(lambda _: P(), v), is_leaf=_is_spec,
    )  # fmt: skip
    return jax.tree.leaves(mapped, is_leaf=_is_spec)


def state_specs(
    state: Any, flags: Sequence[bool], spec: P, models: Sequence[P] | None = None
) -> Any:
    """The state's specs: a leading device axis `spec` where flagged, then its model split."""
    leaves, treedef = jax.tree.flatten(state)
    models = [P()] * len(leaves) if models is None else models
    return jax.tree.unflatten(
        treedef, [P(*spec, *m) if f else m for f, m in zip(flags, models, strict=True)]
    )


def unstack(tree: Any, flags: Sequence[bool]) -> Any:
    """Inside the map: drops the (size 1) device axis of the flagged leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [x[0] if f else x for x, f in zip(leaves, flags, strict=True)]
    )


def stack(tree: Any, flags: Sequence[bool]) -> Any:
    """Inside the map: adds the device axis back to the flagged leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [x[None] if f else x for x, f in zip(leaves, flags, strict=True)]
    )


def local_params(params: Any, params_per_device: bool) -> Any:
    """Inside the map: this device's params (per-device ones carry a size-1 device axis)."""
    return jax.tree.map(lambda x: x[0], params) if params_per_device else params


def local_shapes(params: Any, params_per_device: bool) -> Any:
    """One device's view of the params' shapes."""
    cut = 1 if params_per_device else 0
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[cut:], x.dtype), params)


_NO_OPERAND = object()


def _select(index: Any, outs: Sequence[Any]) -> Any:
    """The branch outputs joined by `index`: each leaf typed as varying where any branch's is."""
    index = jnp.asarray(index).astype(jnp.int32)

    def pick(*xs: jax.Array) -> jax.Array:
        out = xs[0]
        for i, x in enumerate(xs[1:], 1):
            out = jnp.where(index == i, x, out)
        return out.astype(xs[0].dtype)

    return jax.tree.map(pick, *outs)


def _joined_cond(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any,
                 operand: Any = _NO_OPERAND) -> Any:  # fmt: skip
    return _joined_switch(pred, [false_fun, true_fun], *operands, operand=operand)


def _joined_switch(index: Any, branches: Sequence[Callable], *operands: Any,
                   operand: Any = _NO_OPERAND) -> Any:  # fmt: skip
    operands = operands if operand is _NO_OPERAND else (operand,)
    return _select(index, [branch(*operands) for branch in branches])


@contextlib.contextmanager
def _joined_branches() -> Any:
    """While the layout is probed, `lax.cond` and `lax.switch` run every branch and select.

    A real `cond` needs its branches to agree on which values vary over the data axes.
    Wrappers such as `optax.MultiSteps` return a state leaf unchanged in one branch and
    recomputed from this device's gradients in the other, so until the leaf is known to
    be per device, tracing fails and the fixed point cannot find it. Selected, each output
    is typed as varying wherever any branch makes it vary: the layout the real `cond`
    needs. The probe only reads types, so running every branch costs nothing. (It swaps
    the `jax.lax` module's functions for the length of one `eval_shape`: another thread
    tracing at that moment would see them too.)
    """
    saved = lax.cond, lax.switch
    lax.cond, lax.switch = _joined_cond, _joined_switch
    try:
        yield
    finally:
        lax.cond, lax.switch = saved


def _check_decisions(shapes: Any, flags: Sequence[bool]) -> None:
    """Raises where an optax wrapper's skip decision would differ between devices."""
    guards = (optax.ApplyIfFiniteState, optax.MultiStepsState)
    flag_tree = jax.tree.unflatten(jax.tree.structure(shapes), flags)

    def is_guard(x: Any) -> bool:
        return isinstance(x, guards)

    for node in jax.tree.leaves(flag_tree, is_leaf=is_guard):
        if isinstance(node, optax.ApplyIfFiniteState) and node.last_finite:
            raise ValueError(
                "optax.apply_if_finite here tests this device's own updates, so one device "
                "could skip a step, and the collectives in it, that the others take. Use "
                "gradcomm.apply_if_finite(inner, max_consecutive_errors, axis_name), whose "
                "decision every device shares, or place optax.apply_if_finite after the "
                "method has reduced the updates."
            )
        if isinstance(node, optax.MultiStepsState) and node.mini_step:
            raise ValueError(
                "optax.MultiSteps here decides per device whether to skip (its "
                "should_skip_update_fn reads this device's own updates), so devices could "
                "disagree about the step. Give it a skip function whose answer every device "
                "shares, or guard the inner transformation with gradcomm.apply_if_finite."
            )


def layout(
    tx: optax.GradientTransformation,
    params: Any,
    mesh: Mesh,
    names: tuple[str, ...],
    params_per_device: bool,
) -> list[bool]:
    """Which state leaves must live per device: the fixed point of tracing one update.

    Start with every leaf replicated; trace `tx.update` on per-device gradients; every state
    leaf that comes out varying over the data axes must be per device. Repeat until no
    leaf changes (leaves only ever move to per device, so this ends). The tracing joins
    conditional branches (`_joined_branches`), and the result is checked for optax
    wrappers that would decide per device (`_check_decisions`).
    """
    models = model_specs(params, mesh, names, params_per_device)
    param_spec = with_device_axis(models, device_spec(mesh, names) if params_per_device else None)
    fsdp = fsdp_leaves(models, names)
    tx = optax.with_extra_args_support(tx)
    shapes = jax.eval_shape(tx.init, local_shapes(params, params_per_device))
    state_models = state_model_specs(tx, local_shapes(params, params_per_device), models)
    state_fsdp = [is_fsdp(m, names) for m in state_models]
    others = set(mesh.axis_names) - set(names)

    def probe(params: Any, flags: list[bool], found: list[bool]) -> jax.Array:
        params = local_params(params, params_per_device)
        leaves, treedef = jax.tree.flatten(tx.init(params))
        leaves = [_axes.vary(x, names) if f else x for x, f in zip(leaves, flags, strict=True)]
        whole = gather_fsdp(params, fsdp, names)
        grads = jax.tree.map(lambda x: _axes.vary(jnp.zeros_like(x), names), whole)
        try:
            _, new_state = tx.update(grads, jax.tree.unflatten(treedef, leaves), params)
        except (TypeError, ValueError) as e:
            if not any(fsdp):
                raise
            leaves = jax.tree.leaves(params)
            hint = per_device_hint([np.shape(x) for x, f in zip(leaves, fsdp, strict=True) if f])
            raise ValueError(
                f"with params split over the data axes {names} (FSDP), the "
                f"transformation gets each param's whole gradient and must return this "
                f"device's shard of it; this one failed to ({e}). The gradcomm methods "
                f"that reduce-scatter take the params' specs: allreduce(specs=...).{hint}"
            ) from e
        paths = jax.tree_util.tree_leaves_with_path(new_state)
        for (path, x), model in zip(paths, state_models, strict=True):
            split = _axes.varying_axes(x) & others
            unlaid = split - {n for e in model if e for n in _axes.axis_names(e)}
            if unlaid:
                raise ValueError(
                    f"state leaf {jax.tree_util.keystr(path)} differs across the model "
                    f"axes {sorted(unlaid)}, but it mirrors no param split over them, so "
                    f"train_step cannot lay it out; this transformation's state is not "
                    f"supported on params split over model axes"
                )
        # A leaf split like an FSDP param varies over the data axes by being split.
        found.extend(
            bool(_axes.varying_axes(x) & set(names)) and not split
            for x, split in zip(jax.tree.leaves(new_state), state_fsdp, strict=True)
        )
        return jnp.zeros(())

    flags = _fixed_point(len(jax.tree.leaves(shapes)), probe, mesh, param_spec, params)
    _check_decisions(shapes, flags)
    return flags


def sync_layout(sync: Any, params: Any, mesh: Mesh, names: tuple[str, ...]) -> list[bool]:
    """Which leaves of a `ParamsSync`'s state live per device: as `layout`, the fixed point
    of tracing one update (on per-device params, from a state that starts the same on
    every device), every leaf that comes out varying over the data axes."""
    models = model_specs(params, mesh, names, True)
    param_spec = with_device_axis(models, device_spec(mesh, names))
    count = len(jax.tree.leaves(jax.eval_shape(sync.init, local_shapes(params, True))))

    def probe(params: Any, flags: list[bool], found: list[bool]) -> jax.Array:
        params = local_params(params, True)
        first = jax.tree.map(lambda x: _collectives.all_gather_invariant(x, names)[0], params)
        leaves, treedef = jax.tree.flatten(sync.init(first))
        leaves = [_axes.vary(x, names) if f else x for x, f in zip(leaves, flags, strict=True)]
        varied = jax.tree.map(lambda x: _axes.vary(x, names), params)
        _, new_state = sync.update(varied, jax.tree.unflatten(treedef, leaves))
        found.extend(bool(_axes.varying_axes(x) & set(names)) for x in jax.tree.leaves(new_state))
        return jnp.zeros(())

    return _fixed_point(count, probe, mesh, param_spec, params)


def _fixed_point(
    count: int, probe: Callable[..., jax.Array], mesh: Mesh, param_spec: Any, params: Any
) -> list[bool]:
    """The per-device flags of `count` state leaves: from all replicated, trace
    `probe(params, flags, found)` under `shard_map` (shapes only, conditional branches
    joined), which appends to `found` whether each new state leaf varies over the data
    axes, until no flag turns on (flags only ever turn on, so this ends)."""
    flags = [False] * count
    while True:
        found: list[bool] = []
        traced = functools.partial(probe, flags=flags, found=found)
        probe_map = jax.shard_map(traced, mesh=mesh, in_specs=(param_spec,), out_specs=P())
        with _checks.shapes_only(), _joined_branches():
            jax.eval_shape(probe_map, params)
        new = [f or g for f, g in zip(flags, found, strict=True)]
        if new == flags:
            return flags
        flags = new
