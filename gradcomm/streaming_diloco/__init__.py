"""Streaming DiLoCo: DiLoCo's outer step on one fragment of the model at a time.

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed
Free Lunch" (2025), Algorithm 1. The model's layers are split into P fragments, strided
(layer i in fragment i mod P). Each fragment takes DiLoCo's outer step
(`gradcomm.diloco`) every H inner steps, fragment p after steps (p + 1) H / P, 2H + ...,
so one fragment's outer gradient is on the wire at a time: the peak bytes of a step are
about 1/P of DiLoCo's, and the bytes per step on average the same.

With `delay` tau, fragment p's mean outer gradient is sent after step s and applied after
step s + tau (the paper's overlap: the all-reduce runs while tau inner steps compute).
The outer step then gives the fragment's new global params, and each device mixes them
into its own, which have taken tau more inner steps:

    params_p = alpha params_p + (1 - alpha) global_p.

The next outer gradient is taken against the global params (the anchor), never the mixed
ones. With tau = 0 the fragment is set to the global params, as in DiLoCo; with P = 1,
tau = 0 and float32 outer gradients the sync is `gradcomm.diloco`, bit for bit.

Outer gradients travel in `outer_dtype`: "float32" (one all-reduce), "bfloat16", or
"e3m0", the paper's 4-bit float (1 sign, 3 exponent, no mantissa bits) with a scale per
slice; the low precisions go as a reduce-scatter and an all-gather of the encoded values,
summed in float32 (see `gradcomm._compressed`): a quarter or an eighth of float32's bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import (
    _axes,
    _checks,
    _collectives,
    _compressed,
    _transform,
    perfmodel,
    registry,
    wire,
)
from gradcomm.diloco import _cast_like, _typed_like
from gradcomm.streaming_diloco._branches import switch
from gradcomm.streaming_diloco._codecs import CODECS, E3M0_FIX, E3M0_WHO, OuterDtype
from gradcomm.streaming_diloco._fragments import (
    fragment_of_leaves,
    merge_parts,
    schedule,
    split_tree,
)
from gradcomm.sync import ParamsSync, _params_sync, average_params

__all__ = ["StreamingDilocoState", "fragment_of_leaves", "streaming_diloco"]


class StreamingDilocoState(NamedTuple):
    """State of `streaming_diloco`.

    Attributes:
      anchor: the global params: each fragment's after its last outer step (before the
        first, the initial params); per device with eager updates.
      outer_state: one outer optimizer state per fragment, on that fragment's leaves (on
        the params' tree with one fragment); per device with eager updates.
      pending: with a delay or eager updates, each fragment's last mean outer gradient
        (float32, shaped like the params, the same on every device); () without.
      own: with a delay or eager updates, each fragment's last outer gradient on this
        device (float32, shaped like the params, per device); () without.
      count: the number of steps taken (calls of `update`).
    """

    anchor: Any
    outer_state: tuple[Any, ...]
    pending: Any
    own: Any
    count: jax.Array


def streaming_diloco(
    axis_name: _axes.AxisName = "data",
    outer: optax.GradientTransformation | None = None,
    every: int = 100,
    fragments: int = 2,
    delay: int | None = None,
    alpha: float | None = None,
    outer_dtype: OuterDtype = "e3m0",
    eager: bool = False,
) -> ParamsSync:
    """Streaming DiLoCo (Douillard et al. 2025, Algorithm 1), as a `ParamsSync`.

    The inner optimizer is yours, run by each device on its own params. Fragment p of
    the params (`fragment_of_leaves`: layers strided over `fragments`) takes an outer
    step every H = `every` steps, after steps (p + 1) H / P + kH (counting from 1): its
    outer gradient `anchor_p - params_p` is averaged over the devices in `outer_dtype`,
    and `delay` steps later `outer` steps the fragment's anchor (the global params) by
    it; the device's params become `alpha params_p + (1 - alpha) anchor_p`, or the
    anchor itself without a delay. Every device must start from the same params
    (`parallel.per_device(params, mesh)`).

        step = parallel.train_step(loss, optax.adamw(4e-4), mesh, params_per_device=True,
                                   sync=streaming_diloco("data", every=100),
                                   metrics="per_device")  # no collective between syncs

    A hand-written `shard_map` loop adds one line after `optax.apply_updates`:
    `params, sync_state = sync.update(params, sync_state)`.

    Args:
      axis_name: the mesh axis (or tuple of axes) of the workers to average over.
      outer: the outer optimizer, applied to each fragment's mean outer gradient with its
        anchor as the params (one state per fragment); default `optax.sgd(0.7,
        momentum=0.9, nesterov=True)`, DiLoCo's Nesterov momentum. With params sharded
        over a model axis it must be elementwise (see `gradcomm.diloco`).
      every: H >= 1, the inner steps between two outer steps of a fragment (the paper
        uses 100).
      fragments: P >= 1, dividing H: how many fragments (the paper keeps 3 transformer
        blocks in each). With P = 1 the model syncs whole, as in DiLoCo.
      delay: tau, 0 <= tau < H: the inner steps between sending a fragment's outer
        gradient and applying the outer step; default 1 (the paper's overlap), 0 with
        `eager`. With tau >= 1 the exchange runs in the step after the sending one, from
        the state alone, so that it can overlap that step's compute.
      alpha: with a delay, the weight of the device's own params in the mix, in [0, 1];
        default 0.5 (the paper's). Not taken without a delay.
      outer_dtype: how outer gradients travel: "float32" (an all-reduce), "bfloat16" or
        "e3m0" (4-bit floats), both summed in float32.
      eager: Kale et al.'s eager updates: the exchange of a fragment's outer gradients
        overlaps the whole next period, and its outer step does not wait for it. Each
        device steps on a proxy of the mean, its own outer gradient now with the others'
        from the last period, `mean_prev + (own - own_prev) / N` (the mean of the last
        period, its own share swapped for its current one); so each device keeps its own
        anchor and outer state, which drift apart by its share. No `delay` with it.

    Returns:
      A `ParamsSync` whose state is a `StreamingDilocoState`: replicated, but for each
      device's own outer gradients (with a delay or eager updates) and, with eager
      updates, its anchor and outer state; `parallel.train_step` keeps those per device.

    Raises:
      ValueError: at construction for a malformed axis name or option; at trace time for
        params that are not floating point or have fewer layers than fragments, and
        with "e3m0" for a leaf split over mesh axes besides `axis_name` (its scales are
        per slice of the whole leaf: use "bfloat16" or "float32" there).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from gradcomm.streaming_diloco import streaming_diloco
      >>> inner = optax.sgd(1.0)
      >>> sync = streaming_diloco("data", optax.sgd(1.0), every=2, fragments=2, delay=0,
      ...                         outer_dtype="float32")
      >>> def run(p, g):  # two steps: fragment "a" syncs after step 1, "b" after step 2
      ...     opt_state, sync_state, history = inner.init(p), sync.init(p), []
      ...     for _ in range(2):
      ...         p = optax.apply_updates(p, inner.update(g, opt_state, p)[0])
      ...         p, sync_state = sync.update(p, sync_state)
      ...         history.append(p)
      ...     return history
      >>> params = {"a": jnp.zeros((2, 1)), "b": jnp.zeros((2, 1))}
      >>> grads = {"a": jnp.array([[-1.0], [-3.0]]), "b": jnp.array([[-1.0], [-3.0]])}
      >>> first, second = jax.jit(jax.vmap(run, axis_name="data"))(params, grads)
      >>> jnp.stack([first["a"], first["b"], second["a"], second["b"]])[..., 0]
      Array([[2., 2.],
             [1., 3.],
             [3., 5.],
             [4., 4.]], dtype=float32)

      With outer SGD(1) an outer step averages the fragment: "a" after step 1, "b"
      after step 2 (from 2 and 6).

    References:
      Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
      Distributed Free Lunch", arXiv 2501.18512 (2025): Algorithm 1 (strided fragments,
      their schedule, the overlap and its mixing factor alpha, 4-bit E3M0 outer
      gradients). Kale, Douillard and Donchev, "Eager Updates For Overlapped
      Communication and Computation in DiLoCo", arXiv 2502.12996 (2025): the proxy
      above is our reading of its eager updates (its algorithm box was not available).
    """
    _axes.check_axis_name(axis_name)
    _checks.check_int(every, "every", minimum=1)
    _checks.check_int(fragments, "fragments", minimum=1)
    if eager and delay:
        raise ValueError(
            "eager updates overlap the whole period (Kale et al.); they take no delay: drop "
            "delay, or eager"
        )
    delay = (0 if eager else 1) if delay is None else delay
    _checks.check_int(delay, "delay", minimum=0)
    if not isinstance(eager, bool):
        raise ValueError(f"eager must be True or False, got {eager!r}")
    if every % fragments:
        raise ValueError(
            f"fragments ({fragments}) must divide every ({every}): fragment p syncs "
            f"(p + 1) every / fragments steps into each period"
        )
    if delay >= every:
        raise ValueError(
            f"delay ({delay}) must be less than every ({every}): a fragment's outer step "
            f"must land before its next outer gradient is sent"
        )
    if alpha is not None and delay == 0:
        raise ValueError(
            "alpha mixes the global params into params that took `delay` more steps; "
            "without a delay the fragment is set to the global params: drop alpha, or "
            "give delay >= 1"
        )
    alpha = 0.5 if alpha is None else alpha
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be a float in [0, 1], got {alpha!r}")
    if outer_dtype not in get_args(OuterDtype):
        raise ValueError(f"outer_dtype must be one of {get_args(OuterDtype)}, got {outer_dtype!r}")
    if outer is None:
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    elif not isinstance(outer, optax.GradientTransformation):
        raise ValueError(
            f"outer must be an optax.GradientTransformation (the outer optimizer, such as "
            f"optax.sgd(0.7, momentum=0.9, nesterov=True)), got {outer!r}"
        )

    split = functools.partial(split_tree, fragments=fragments)
    merge = functools.partial(merge_parts, fragments=fragments)

    def outer_tree(part: list[Any], like: Any) -> Any:
        """What the outer optimizer steps: fragment p's leaves, or with one fragment the
        params' tree (its state then mirrors the params, as `parallel` lays state out)."""
        return jax.tree.unflatten(jax.tree.structure(like), part) if fragments == 1 else part

    deferred = bool(delay or eager)  # the exchange runs one step after the sending step

    def init(params: Any) -> StreamingDilocoState:
        _checks.check_float_leaves(params, "streaming_diloco")
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
        zeros = _typed_like(zeros, params)  # varying where the params are
        return StreamingDilocoState(
            anchor=jax.tree.map(jnp.array, params),  # a copy: params may be donated
            outer_state=tuple(outer.init(outer_tree(part, params)) for part in split(params)),
            pending=zeros if deferred else (),
            own=zeros if deferred else (),
            count=_transform.zero_count(),
        )

    def replaced(tree: Any, p: int, part: list[Any]) -> Any:
        parts = split(tree)
        parts[p] = part
        return merge(tree, parts)

    def own_delta(params: list[Any], anchor: list[Any]) -> list[Any]:
        """This device's outer gradient of a fragment, in float32."""
        return [
            a.astype(jnp.float32) - x.astype(jnp.float32)
            for a, x in zip(anchor, params, strict=True)
        ]

    def mean_of(deltas: list[Any]) -> list[Any]:
        """The devices' mean of their outer gradients, sent in `outer_dtype`."""
        if outer_dtype == "float32":
            mean = lax.pmean(deltas, axis_name)
            return [_collectives.assume_invariant(m, axis_name) for m in mean]
        codec = CODECS[outer_dtype]
        return _compressed.compressed_mean(deltas, axis_name, codec, who=E3M0_WHO, fix=E3M0_FIX)[0]

    def outer_step(
        p: int, operands: tuple[Any, ...], deltas: list[Any], mix: bool
    ) -> tuple[Any, ...]:
        """Fragment p's outer step on the outer gradient `deltas`; its params set to the
        new anchor, or mixed with it."""
        params, anchor, outer_state = operands[:3]
        params_p, anchor_p = split(params)[p], split(anchor)[p]
        deltas = [d.astype(a.dtype) for d, a in zip(deltas, anchor_p, strict=True)]
        anchor_tree = outer_tree(anchor_p, anchor)
        updates, new_state = outer.update(outer_tree(deltas, anchor), outer_state[p], anchor_tree)
        new_anchor = jax.tree.leaves(optax.apply_updates(anchor_tree, updates))
        new = list(new_anchor)
        if mix:
            new = [
                (alpha * x.astype(jnp.float32) + (1 - alpha) * a.astype(jnp.float32)).astype(
                    x.dtype
                )
                for x, a in zip(params_p, new_anchor, strict=True)
            ]
        new_state = jax.tree.map(_cast_like, new_state, outer_state[p])
        outer_state = tuple(new_state if q == p else s for q, s in enumerate(outer_state))
        return (
            replaced(params, p, new),
            replaced(anchor, p, list(new_anchor)),
            outer_state,
            *operands[3:],
        )

    def branches(make: Callable[[int], Callable], label: str | None) -> list[Callable]:
        """One branch per fragment, each `_typed_like` its operands (and named for the wire
        meter where it exchanges: one in P of the steps that exchange)."""

        def wrap(p: int) -> Callable:
            def branch(operands: tuple[Any, ...]) -> tuple[Any, ...]:
                return _typed_like(make(p)(operands), operands)

            return wire.branch(label.format(p=p), every=fragments)(branch) if label else branch

        return [wrap(p) for p in range(fragments)]

    def sent(p: int) -> Callable:  # no delay: the exchange and the outer step at once
        def run(ops: tuple[Any, ...]) -> tuple[Any, ...]:
            params, anchor = split(ops[0])[p], split(ops[1])[p]
            if outer_dtype == "float32":  # DiLoCo's: the anchor minus the params' exact mean
                mean = average_params(params, axis_name)
                deltas = [
                    a - _collectives.assume_invariant(m, axis_name)
                    for a, m in zip(anchor, mean, strict=True)
                ]
            else:
                deltas = mean_of(own_delta(params, anchor))
            return outer_step(p, ops, deltas, mix=False)

        return run

    def flush(p: int) -> Callable:  # the step after sending: the exchange, off the state
        def run(ops: tuple[Any, ...]) -> tuple[Any, ...]:
            return (*ops[:3], replaced(ops[3], p, mean_of(split(ops[4])[p])), ops[4])

        return run

    def store(p: int) -> Callable:  # the sending step: this device's outer gradient kept
        def run(ops: tuple[Any, ...]) -> tuple[Any, ...]:
            deltas = own_delta(split(ops[0])[p], split(ops[1])[p])
            return (*ops[:4], replaced(ops[4], p, deltas))

        return run

    def arrive(p: int) -> Callable:  # tau steps on: the outer step, the params mixed
        def run(ops: tuple[Any, ...]) -> tuple[Any, ...]:
            return outer_step(p, ops, split(ops[3])[p], mix=True)

        return run

    def eager_step(p: int) -> Callable:  # Kale et al.: the own outer gradient, at once
        def run(ops: tuple[Any, ...]) -> tuple[Any, ...]:
            n = _axes.axis_size(axis_name)
            mine = own_delta(split(ops[0])[p], split(ops[1])[p])
            proxy = [
                m_prev + (d - d_prev) / n
                for m_prev, d_prev, d in zip(split(ops[3])[p], split(ops[4])[p], mine, strict=True)
            ]
            out = outer_step(p, ops, proxy, mix=False)
            return (*out[:4], replaced(ops[4], p, mine))

        return run

    def step(params: Any, state: StreamingDilocoState) -> tuple[Any, StreamingDilocoState]:
        _checks.check_float_leaves(params, "streaming_diloco")
        sending, flushing = schedule(state.count, every, fragments, 1)
        ops = (params, state.anchor, state.outer_state, state.pending, state.own)
        # ops: params, anchor, outer states, pending and own; each switch passes those it changes.
        if not deferred:
            outer = branches(sent, "fragment {p} outer step")
            ops = switch(sending, outer, ops, axis_name, (0, 1, 2), every // fragments)
        else:
            syncs = branches(flush, "fragment {p} sync")
            ops = switch(flushing, syncs, ops, axis_name, (3,), every // fragments)
            if eager:
                ops = switch(sending, branches(eager_step, None), ops, axis_name, (0, 1, 2, 4))
            else:
                landing = schedule(state.count, every, fragments, delay)[1]
                ops = switch(landing, branches(arrive, None), ops, axis_name, (0, 1, 2))
                ops = switch(sending, branches(store, None), ops, axis_name, (4,))
        count = optax.safe_increment(state.count)
        return ops[0], StreamingDilocoState(*ops[1:], count=count)

    return _params_sync("streaming_diloco", axis_name, init, step)


# Bytes an entry of an outer gradient on the wire, per outer_dtype (the scales aside).
_BYTES = {"float32": 4.0, "bfloat16": 2.0, "e3m0": 0.5}


def _pattern(options: Mapping[str, Any], s: perfmodel.Setting) -> list[perfmodel.Collective]:
    """One fragment (1/P of the model) every H/P steps: on average DiLoCo's bytes over H
    steps; in float32 an all-reduce, else an all-to-all and an all-gather of the codes."""
    if not s.amortize:
        return []
    fragments, size = options["fragments"], s.params * _BYTES[options["outer_dtype"]]
    share = fragments / options["every"]
    if options["outer_dtype"] == "float32":
        return [perfmodel.Collective("allreduce", s.nodes, size / fragments, share)]
    kinds = ("alltoall", "allgather")
    return [perfmodel.Collective(k, s.nodes, size / fragments, share) for k in kinds]


def _window(options: Mapping[str, Any]) -> perfmodel.Window:
    """With a delay (or eager updates) the exchange runs beside the next steps' compute."""
    return "step" if options["eager"] or options["delay"] != 0 else "none"


registry.register(registry.Method(
    streaming_diloco, "params", title="Streaming DiLoCo", paper="Douillard et al., 2025",
    page="diloco", collectives=_pattern, window=_window, per_device=True,
))  # fmt: skip
