"""Stochastic Gradient Push (Assran et al., ICML 2019) and D-PSGD: gossip instead of all-reduce.

PushSum (section 2): each device holds a numerator x and a weight w; every step it keeps one
share of both, sends an equal share to each of the step's out-peers, and adds what arrives.
The mixing matrices are column stochastic, so sum_i x_i and sum_i w_i never change, and
z_i = x_i / w_i tends to the average of the x_i. SGP (Algorithm 1) interleaves a local
optimizer step with one PushSum step:

    x = w z + u;   x' = sum_j P_ij x_j;   w' = sum_j P_ij w_j;   z' = x' / w'.

In gradcomm the params the user holds are the de-biased z (so the optimizer's gradient is
taken at z, line 3), the state holds w, and the update returned is z' - z. With
`overlap=tau` what is sent at step k is mixed in at step k + tau (tau-OSGP); the mass in
flight is missing from x and w alike, so z stays unbiased. `biased=True` drops w (the
ablation of Table 4). D-PSGD is the special case of a symmetric, doubly stochastic graph,
where w stays 1.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _axes, _checks, _flat, _numeric, _transform, perfmodel, registry, wire
from gradcomm import topology as topologies
from gradcomm.gossip import _pushsum
from gradcomm.gossip._pushsum import TopologySpec


class SgpState(NamedTuple):
    """State of `sgp`: step counter, push-sum weight, and tau messages in flight.

    The messages received but not yet mixed in stay as they travelled: `in_flight` holds
    tau slots, each a tuple of flat arrays, one per dtype of the params (the zero-padded
    fused buffers of `gradcomm._flat.FlatBuffers`), and `in_flight_weight` their weights,
    shape `(tau,)`; slot 0 is mixed in next. With `overlap=0` nothing is ever in flight
    and both are empty tuples `()`, leafless pytree nodes that checkpoints (orbax) save
    and restore, where zero-size arrays would not save.

    The buffers are not shaped like the params, so `optax.tree_map_params` leaves them as
    they are. It builds a state from leafless placeholder params and needs it to be a
    prefix of the real one: for params with no elements, each slot is a zero scalar.

    Example:
      >>> import jax.numpy as jnp, gradcomm
      >>> gradcomm.sgp("data").init(jnp.zeros(3)).in_flight
      ()
      >>> params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3), "h": jnp.zeros(4, jnp.bfloat16)}
      >>> state = gradcomm.sgp("data", overlap=2).init(params)
      >>> [[(x.shape, x.dtype.name) for x in slot] for slot in state.in_flight]
      [[((9,), 'float32'), ((4,), 'bfloat16')], [((9,), 'float32'), ((4,), 'bfloat16')]]
      >>> state.in_flight_weight.shape
      (2,)
    """

    count: jax.Array
    weight: jax.Array
    in_flight: tuple[tuple[jax.Array, ...] | jax.Array, ...]
    in_flight_weight: jax.Array | tuple[()]


class DpsgdState(NamedTuple):
    """State of `dpsgd`: only a step counter (weights stay 1 on a doubly stochastic graph)."""

    count: jax.Array


def _weight_dtype(params: Any) -> jax.typing.DTypeLike:
    """The push-sum weight's dtype: the widest accumulation dtype of the params (float64
    params keep a float64 weight; float32, bfloat16 and float16 ones a float32 one)."""
    dtypes = [_numeric.compute_dtype(jnp.result_type(p)) for p in jax.tree.leaves(params)]
    return functools.reduce(jnp.promote_types, dtypes, jnp.dtype(jnp.float32))


def sgp(
    axis_name: _axes.AxisName = "data",
    *,
    topology: TopologySpec = "exponential",
    overlap: int = 0,
    biased: bool = False,
    allreduce_steps: int = 0,
    exchange: _axes.Exchange = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Stochastic Gradient Push: each device mixes its parameters with a few peers per step.

    Place it last, after the optimizer, with params kept per device:
    `optax.chain(optax.sgd(0.1, momentum=0.9, nesterov=True), gradcomm.sgp("data"))` and
    `gradcomm.parallel.train_step(..., params_per_device=True)`. The params are the
    de-biased z; each step sends one share of `x = w z + update` (and of w) to each of the
    step's out-peers, in one collective per peer of the whole model, and returns
    `x' / w' - z`.

    Args:
      axis_name: the mesh axis (or tuple of axes) of the gossiping devices.
      topology: a name from `gradcomm.topology.TOPOLOGIES` ("exponential", the 1-peer
        time-varying directed exponential graph, by default), a `Topology`, or a factory
        `n -> Topology`. The step's peers are chosen inside the jitted step from the count.
      overlap: tau >= 0; messages sent at step k are mixed in at step k + tau (tau-OSGP).
      biased: ignore the push-sum weight, mixing x as if w were 1 (Table 4's biased
        1-OSGP); unbiased only when nothing is in flight on a doubly stochastic graph.
      allreduce_steps: average exactly (an all-reduce) for the first K steps, then gossip
        (the hybrids of Table 3).
      exchange: how a move that swaps devices i and i ^ 2^r pairwise is sent (every
        phase at N = 2, the i + N/2 phase at any N; hypercube phases). "permute": a
        `ppermute`. "pairwise": a reduce-scatter whose replica groups are the pairs, the
        same bits and bytes, which gloo runs at full speed both ways (a phase that is only
        that swap, without overlap, adds the pair's values after it); needs a power-of-two
        N, and `shard_map` or `pmap`. "auto": in a `train_step` across processes, whichever
        its first call timed faster for the whole step (`TrainStep.probe`); elsewhere the
        faster on this link where `gradcomm.parallel.calibrate` probed it, else
        "pairwise" on CPU devices in several processes (gloo) and "permute" elsewhere.
        Other moves are always `ppermute`s. The result is the same bits either way.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is an `SgpState`.

    Raises:
      ValueError: for an unknown topology, a negative overlap or allreduce_steps at
        construction; at trace time without params, or for a topology of the wrong size.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.sgp("data")  # two devices: one exchange averages exactly
      >>> params = jnp.array([[1.0, 0.0], [3.0, 2.0]])  # one row per device
      >>> state = tx.init(params[0])
      >>> step = lambda p: p + tx.update(jnp.zeros(2), state, p)[0]
      >>> jax.jit(jax.vmap(step, axis_name="data"))(params)
      Array([[2., 1.],
             [2., 1.]], dtype=float32)

    References:
      Assran et al., "Stochastic Gradient Push for Distributed Deep Learning", ICML 2019:
      section 2 (PushSum), Algorithm 1, tau-OSGP (section 3, Appendix B), Tables 3-4.
    """
    _axes.check_axis_name(axis_name)
    _axes.check_exchange(exchange)
    topologies.check_topology(topology)
    _checks.check_int(overlap, "overlap", minimum=0)
    _checks.check_int(allreduce_steps, "allreduce_steps", minimum=0)

    def init_fn(params: Any) -> SgpState:
        dtype = _weight_dtype(params)
        if overlap:
            flat = _flat.FlatBuffers.of(params)
            sizes = [layout.padded_size for layout in flat.layouts]

            def slot() -> Any:
                if not flat.groups:  # nothing to send: a scalar stands in (see SgpState)
                    return jnp.zeros([], dtype)
                return tuple(jnp.zeros(s, d) for s, d in zip(sizes, flat.dtypes, strict=True))

            slots = tuple(slot() for _ in range(overlap))
            slots_w = jnp.zeros([overlap], dtype)
        else:  # nothing in flight: no arrays (zero-size ones do not checkpoint)
            slots, slots_w = (), ()
        return SgpState(
            count=_transform.zero_count(),
            weight=jnp.ones([], dtype),
            in_flight=slots,
            in_flight_weight=slots_w,
        )

    def step(
        updates: Any, state: SgpState, params: Any, graph: topologies.Topology, pairwise: bool
    ) -> tuple[Any, SgpState]:
        w = jnp.ones([], state.weight.dtype) if biased else state.weight

        def scaled(z: jax.Array, u: jax.Array) -> jax.Array:
            ct = _numeric.compute_dtype(z.dtype)
            return (z.astype(ct) * w.astype(ct) + u.astype(ct)).astype(z.dtype)

        x = jax.tree.map(scaled, params, updates)
        flat = _flat.FlatBuffers.of(x)
        buffers = flat.pack(x)

        def gossip() -> tuple[list[jax.Array], jax.Array, Any, jax.Array]:
            if not overlap:
                mixed, mixed_w = _pushsum.mix(
                    buffers, w, graph, state.count, axis_name, pairwise, True
                )
                return mixed, mixed_w, state.in_flight, state.in_flight_weight
            kept, received, kept_w, received_w = _pushsum.mix(
                buffers, w, graph, state.count, axis_name, pairwise, False
            )
            # Slot 0 arrives, and what was just received joins the back of the queue, both
            # as the flat buffers they travel as; the other slots move up unchanged.
            mixed, queue = [], state.in_flight  # without buffers (see SgpState)
            if flat.groups:
                arriving = state.in_flight[0]
                mixed = [k + a.reshape(k.shape) for k, a in zip(kept, arriving, strict=True)]
                queue = (*state.in_flight[1:], tuple(r.reshape(-1) for r in received))
            mixed_w = kept_w + state.in_flight_weight[0]
            queue_w = jnp.concatenate([state.in_flight_weight[1:], received_w[None]])
            return mixed, mixed_w, queue, queue_w

        def exact() -> tuple[list[jax.Array], jax.Array, Any, jax.Array]:
            mixed = [_axes.vary(b, axis_name) for b in lax.pmean(buffers, axis_name)]
            return (
                mixed,
                _axes.vary(lax.pmean(w, axis_name), axis_name),
                state.in_flight,
                state.in_flight_weight,
            )

        if allreduce_steps:
            mixed, new_w, queue, queue_w = lax.cond(
                state.count < allreduce_steps,
                wire.branch("all-reduce", first=allreduce_steps)(exact),
                wire.branch("gossip")(gossip),
            )
        else:
            mixed, new_w, queue, queue_w = gossip()
        x_new = flat.unpack(mixed)
        divisor = jnp.ones([], new_w.dtype) if biased else new_w

        def unscaled(v: jax.Array) -> jax.Array:
            ct = _numeric.compute_dtype(v.dtype)
            return (v.astype(ct) / divisor.astype(ct)).astype(v.dtype)

        z_new = jax.tree.map(unscaled, x_new)
        delta = jax.tree.map(jnp.subtract, z_new, params)
        new_state = SgpState(
            count=optax.safe_increment(state.count),
            weight=state.weight if biased else new_w,
            in_flight=queue,
            in_flight_weight=queue_w,
        )
        return delta, new_state

    return _pushsum.transformation("sgp", axis_name, topology, exchange, init_fn, step)


def dpsgd(
    axis_name: _axes.AxisName = "data",
    *,
    topology: TopologySpec = "exponential-bidirectional",
    exchange: _axes.Exchange = "auto",
) -> optax.GradientTransformationExtraArgs:
    """D-PSGD (Lian et al., 2017): gossip on a symmetric, doubly stochastic graph, weights 1.

    The baseline SGP is compared against: each device averages its parameters (after its
    optimizer step) with its neighbours' under symmetric mixing weights, which is SGP on an
    undirected graph, where the push-sum weights stay exactly 1 and need not be kept.

    Args:
      axis_name: the mesh axis (or tuple of axes) of the gossiping devices.
      topology: a symmetric topology; the default sends to i + 2^r and i - 2^r at step k
        (r = k mod m), "hypercube" exchanges pairwise with one peer (power-of-two n),
        "ring-bidirectional" is the classic ring.
      exchange: "auto", "permute" or "pairwise": how pairwise swaps i <-> i ^ 2^r (the
        i +- N/2 phase, hypercube phases) are sent; see `sgp`.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `DpsgdState`.

    Raises:
      ValueError: for an unknown topology; at trace time for a directed one or missing
        params.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.dpsgd("data", topology="hypercube")
      >>> params = jnp.array([[1.0], [3.0]])  # one row per device
      >>> step = lambda p: p + tx.update(jnp.zeros(1), tx.init(p), p)[0]
      >>> jax.jit(jax.vmap(step, axis_name="data"))(params)[:, 0]
      Array([2., 2.], dtype=float32)

    References:
      Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?",
      NeurIPS 2017, as the baseline of Assran et al., ICML 2019 (sections 5-6).
    """
    _axes.check_axis_name(axis_name)
    _axes.check_exchange(exchange)
    topologies.check_topology(topology)

    def init_fn(params: Any) -> DpsgdState:
        del params
        return DpsgdState(count=_transform.zero_count())

    def step(
        updates: Any, state: DpsgdState, params: Any, graph: topologies.Topology, pairwise: bool
    ) -> tuple[Any, DpsgdState]:
        if not (graph.is_symmetric() and graph.is_doubly_stochastic()):
            raise ValueError(f"dpsgd needs a symmetric topology, got {graph.name}")
        x = jax.tree.map(jnp.add, params, updates)
        flat = _flat.FlatBuffers.of(x)
        one = jnp.ones([], jnp.float32)
        mixed, _ = _pushsum.mix(flat.pack(x), one, graph, state.count, axis_name, pairwise, True)
        mixed = flat.unpack(mixed)
        delta = jax.tree.map(jnp.subtract, mixed, params)
        return delta, DpsgdState(count=optax.safe_increment(state.count))

    return _pushsum.transformation("dpsgd", axis_name, topology, exchange, init_fn, step)


def consensus_distance(params: Any, axis_name: _axes.AxisName = "data") -> jax.Array:
    """This device's distance to the average model, |z_i - mean_j z_j|_2 (SGP Fig. 2).

    Call inside `shard_map` (or a named `vmap`) with per-device params; it costs one
    all-reduce of the model.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> params = jnp.array([[0.0, 0.0], [3.0, 4.0]])
      >>> jax.jit(jax.vmap(lambda p: gradcomm.consensus_distance(p, "d"), axis_name="d"))(params)
      Array([2.5, 2.5], dtype=float32)
    """
    mean = lax.pmean(params, axis_name)

    def square(p: jax.Array, m: jax.Array) -> jax.Array:
        ct = _numeric.compute_dtype(p.dtype)
        return jnp.sum(jnp.square(p.astype(ct) - m.astype(ct)))

    squares = jax.tree.map(square, params, mean)
    return jnp.sqrt(sum(jax.tree.leaves(squares)))


def _pattern(options: Mapping[str, Any], s: perfmodel.Setting) -> list[perfmodel.Collective]:
    """Per phase of the graph, the model and the push-sum weight to each peer: a swap
    where the peers send to each other, and a lone swap whose sum is all that is mixed
    (no overlap) a pair's sum."""
    graph = topologies.resolve(options["topology"], s.nodes)
    share = 1 / graph.num_phases
    out = []
    for moves in graph.phases:
        kinds = [
            "swap" if all(move[j] == i for i, j in enumerate(move)) else "permute" for move in moves
        ]
        if kinds == ["swap"] and not options.get("overlap"):
            kinds = ["pair_sum"]
        out += [
            perfmodel.Collective(k, s.nodes if k == "permute" else 2, s.size + 4, share)
            for k in kinds
        ]
    return out


registry.register(registry.Method(
    sgp, "after", title="Stochastic Gradient Push", paper="Assran et al., ICML 2019",
    page="gossip", collectives=_pattern, per_device=True,
    window=lambda options: "step" if options["overlap"] > 0 else "none",
))  # fmt: skip

registry.register(registry.Method(
    dpsgd, "after", title="D-PSGD", paper="Lian et al., NeurIPS 2017", page="gossip",
    collectives=_pattern, per_device=True,
))  # fmt: skip
