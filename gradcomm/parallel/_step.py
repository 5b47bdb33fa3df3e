"""`TrainStep`, the jitted data-parallel step that `parallel.train_step` builds."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, get_args

import jax
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomm import _axes
from gradcomm.parallel._calibrate import (
    StepProbe,
    probe_step,
    spans_processes,
)
from gradcomm.parallel._layout import (
    fsdp_leaves,
    gather_fsdp,
    layout,
    local_params,
    local_shapes,
    per_device_leaves,
    stack,
    state_model_specs,
    state_specs,
    sync_layout,
    unstack,
)
from gradcomm.parallel._overlap import check_layerwise, layerwise, overlapped_update
from gradcomm.parallel._placement import (
    check_copies,
    device_spec,
    is_fsdp,
    model_specs,
    num_shards,
    place,
    place_batch,
    with_device_axis,
)
from gradcomm.parallel._state import TrainState, check_sync
from gradcomm.parallel._validate import check_state_layout, check_update_shapes
from gradcomm.sync import ParamsSync

Metrics = Literal["mean", "per_device"]


class TrainStep:
    """The jitted data-parallel step built by `train_step`.

    Call it as `params, state, metrics = step(params, state, batch)` with a state from
    `init_state` (or restored from a checkpoint with its shardings); host inputs are placed
    on the mesh first. A replicated state leaf restores onto a mesh of any size; a
    per-device one (and per-device params) only onto as many data-parallel devices as
    made it: other counts raise a `ValueError` that says what to do, as does a state laid
    out for the other value of `params_per_device` where its shapes tell.
    `step.lower(params, state, batch)` lowers it, which is what
    `gradcomm.wire.measure(step, params, state, batch)` uses. Built with `overlap=True`,
    it takes the per-layer state of `init_state(..., overlap=True)`.

    Where the mesh spans processes and the step's swaps could go either way
    (`exchange="auto"`: `ppermute`s or two-member reduce-scatters), its first call times
    the step both ways (a few steps each, outputs dropped) and keeps the faster:
    `step.probe` is then the `StepProbe`, else None.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        tx: optax.GradientTransformation,
        mesh: Mesh,
        names: tuple[str, ...],
        params_per_device: bool,
        has_aux: bool,
        donate: bool,
        sync: ParamsSync | None = None,
        overlap: bool = False,
        metrics: Metrics = "mean",
    ) -> None:
        check_sync(sync, params_per_device)
        if metrics not in get_args(Metrics):
            raise ValueError(f"metrics must be one of {get_args(Metrics)}, not {metrics!r}")
        self._sync, self._overlap, self._inner = sync, overlap, tx
        self._metrics = metrics
        tx = layerwise(tx) if overlap else tx
        self._tx, self._mesh, self._names = optax.with_extra_args_support(tx), mesh, names
        self._loss_fn = loss_fn
        self._params_per_device, self._has_aux, self._donate = params_per_device, has_aux, donate
        self._grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
        self._spec = device_spec(mesh, names)
        # Computed once: placing inputs on every call reuses them.
        self._batch_sharding = NamedSharding(mesh, self._spec)
        self._num_shards = num_shards(mesh, names)
        self._compiled: dict[Any, Any] = {}
        self._shapes: dict[Any, Any] = {}
        self.probe: StepProbe | None = None

    def _body(
        self, flags: list[bool], fsdp: list[bool], exchange: str | None
    ) -> Callable[..., Any]:
        names, tx = self._names, self._tx

        def body(params: Any, state: Any, batch: Any) -> tuple[Any, Any, dict[str, jax.Array]]:
            with _axes.forced_exchange(exchange):  # "auto" swaps as the probe found faster
                return update(params, state, batch)

        def update(params: Any, state: Any, batch: Any) -> tuple[Any, Any, dict[str, jax.Array]]:
            params = local_params(params, self._params_per_device)
            # Differentiating replicated (invariant) params would make JAX sum the gradient
            # over the devices; the transformation must see each device's own gradient.
            # FSDP-split params are gathered whole first, and the transformation returns
            # this device's shard of their combined gradient.
            whole = gather_fsdp(params, fsdp, names)
            varied = jax.tree.map(lambda x: _axes.vary(x, names), whole)
            state = unstack(state, flags)
            tx_state = state.tx if self._sync else state
            if self._overlap:  # each layer's update runs in the backward pass
                if any(fsdp):
                    raise ValueError(
                        "overlap=True does not support params split over the data axes "
                        "(FSDP); build the step with overlap=False"
                    )
                out, updates, tx_state = overlapped_update(
                    self._loss_fn, self._inner, params, varied, tx_state, batch, self._has_aux
                )
            else:
                out, grads = self._grad_fn(varied, batch)
                updates, tx_state = tx.update(grads, tx_state, params)
            loss, aux = out if self._has_aux else (out, {})
            check_update_shapes(updates, params, fsdp)
            params = optax.apply_updates(params, updates)
            if self._params_per_device:
                if self._sync:
                    params, sync_state = self._sync.update(params, state.sync)
                    tx_state = TrainState(tx_state, sync_state)
                params = jax.tree.map(lambda x: x[None], params)
            else:
                paths = jax.tree_util.tree_leaves_with_path(params)
                for (path, leaf), split in zip(paths, fsdp, strict=True):
                    varying = _axes.varying_axes(leaf) & set(names)
                    if varying and not split:
                        raise ValueError(
                            f"params are replicated, but after this transformation param "
                            f"{jax.tree_util.keystr(path)} differs across axes "
                            f"{sorted(varying)}; end the chain with a synchronising method "
                            f"(gradcomm.allreduce, gradcomm.adasum) or pass "
                            f"params_per_device=True"
                        )
            metrics = {"loss": loss, **aux}
            if self._metrics == "mean":
                metrics = lax.pmean(metrics, names)
            else:  # no collective: each device's own, along a leading device axis
                metrics = jax.tree.map(lambda x: _axes.vary(x, names)[None], metrics)
            return params, stack(tx_state, flags), metrics

        return body

    def _param_specs(self, params: Any) -> tuple[Any, Any]:
        """The params' model-axis split (`model_specs`) and their specs in the map."""
        models = model_specs(params, self._mesh, self._names, self._params_per_device)
        lead = self._spec if self._params_per_device else None
        return models, with_device_axis(models, lead)

    def _state_shapes(self, params: Any, models: Any, split: tuple) -> tuple[Any, list[P]]:
        """One device's state shapes (`tx.init`'s) and each state leaf's split (the sync's
        state's too), cached."""
        shapes = local_shapes(params, self._params_per_device)
        key = (jax.tree.structure(shapes), tuple(jax.tree.leaves(shapes)), split)
        if key not in self._shapes:
            state_models = state_model_specs(self._tx, shapes, models)
            if self._sync:
                state_models += state_model_specs(self._sync, shapes, models)
            local = jax.eval_shape(self._tx.init, shapes)
            if self._overlap:
                check_layerwise(self._inner, local)
            if self._sync:
                local = TrainState(local, jax.eval_shape(self._sync.init, shapes))
            self._shapes[key] = (local, state_models)
        return self._shapes[key]

    def _other_state_shapes(self, params: Any, state: Any) -> Any:
        """One device's state shapes had the state been laid out for the other value of
        `params_per_device` from these params: None unless they hold one copy per device
        (which per-device params must, and replicated ones read as per-device must too)."""
        if any(np.shape(x)[:1] != (self._num_shards,) for x in jax.tree.leaves(params)):
            return None  # with params_per_device=True, `_place` reports the missing copies
        try:
            shapes = jax.eval_shape(
                self._tx.init, local_shapes(params, not self._params_per_device)
            )
        except (TypeError, ValueError):
            return None
        return TrainState(shapes, state.sync) if self._sync else shapes

    def _jitted(self, params: Any, state: Any, args: Callable[[], tuple[Any, ...]]) -> Any:
        if isinstance(state, TrainState) != bool(self._sync):
            raise ValueError(
                "a step built with sync takes the TrainState of init_state(..., sync=sync)"
                if self._sync
                else "this state holds a sync's state (a TrainState): build the step with "
                "the same sync, train_step(..., sync=sync)"
            )
        shapes = tuple(np.shape(x) for x in jax.tree.leaves(state))
        models, param_specs = self._param_specs(params)
        split = tuple(jax.tree.leaves(models, is_leaf=lambda x: isinstance(x, P)))
        local, state_models = self._state_shapes(params, models, split)
        if self._num_shards == 1:
            # One device: with Auto axes, JAX drops the size-1 device axis from a state
            # leaf's sharding, which then cannot say which leaves are per device; the
            # transformation's layout says, once per state structure (it traces an update).
            key = (jax.tree.structure(state), shapes, split)
            if key in self._compiled:
                return self._compiled[key]
            flags = layout(self._tx, params, self._mesh, self._names, self._params_per_device)
            if self._sync:
                flags += sync_layout(self._sync, params, self._mesh, self._names)
        else:
            # A leaf split over the data axes like an FSDP param has no device axis.
            fsdp_state = [is_fsdp(m, self._names) for m in state_models]
            flags = [
                f and not s
                for f, s in zip(per_device_leaves(state, self._spec), fsdp_state, strict=True)
            ]
            key = (jax.tree.structure(state), tuple(flags), shapes, split)
        if key not in self._compiled:
            check_state_layout(
                state,
                flags,
                local,
                self._num_shards,
                self._names,
                self._params_per_device,
                lambda: self._other_state_shapes(params, state),
            )
            specs = state_specs(state, flags, self._spec, state_models)
            fsdp = fsdp_leaves(models, self._names)

            def mapped(exchange: str | None) -> Callable[..., Any]:
                return jax.shard_map(
                    self._body(flags, fsdp, exchange),
                    mesh=self._mesh,
                    in_specs=(param_specs, specs, self._spec),
                    out_specs=(param_specs, specs, P() if self._metrics == "mean" else self._spec),
                )

            probe = None
            if spans_processes(self._mesh):  # a link: time the step's swaps both ways
                probe = probe_step(lambda kind: jax.jit(mapped(kind)).lower(*args()), args())
                self.probe = probe or self.probe
            self._compiled[key] = jax.jit(
                mapped(probe and probe.exchange), donate_argnums=(0, 1) if self._donate else ()
            )
        return self._compiled[key]

    def _place(self, params: Any, state: Any, batch: Any) -> tuple[Any, Any, Any]:
        if self._params_per_device:
            hint = (
                "per-device params carry one copy per device (`parallel.per_device(params, "
                "mesh)`); to move them to another number of devices, pick one copy "
                "(`parallel.host_copy(params, per_device=True)`) and place it again; "
                "replicated params take a step (and a state) built with params_per_device=False"
            )
            check_copies(params, self._num_shards, "param", hint)
        _, specs = self._param_specs(params)
        return (
            jax.tree.map(lambda x, s: place(x, NamedSharding(self._mesh, s)), params, specs),
            state,
            place_batch(batch, self._batch_sharding, self._num_shards),
        )

    def __call__(self, params: Any, state: Any, batch: Any) -> tuple[Any, Any, dict]:
        # Placed once, when first needed: after `_jitted` checks the state (its errors say more).
        args = functools.cache(lambda: self._place(params, state, batch))
        return self._jitted(params, state, args)(*args())

    def lower(self, params: Any, state: Any, batch: Any) -> Any:
        args = functools.cache(lambda: self._place(params, state, batch))
        return self._jitted(params, state, args).lower(*args())
