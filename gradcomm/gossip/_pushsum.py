"""The PushSum step over a topology, and the optax skeleton of the gossip methods.

`mix` runs one phase of a `gradcomm.topology.Topology` on fused flat buffers (one
collective per move and dtype); `transformation` wraps a method's step in the frame
(`gradcomm._transform`), resolving the graph and the exchange mode that `gradcomm.sgp` and
`gradcomm.dpsgd` share. The methods are in `gradcomm.gossip`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _axes, _collectives, _transform, wire
from gradcomm import topology as topologies

TopologySpec = topologies.Name | topologies.Topology | Callable[[int], topologies.Topology]


@jax.named_scope("exchange")
def mix(
    x: list[jax.Array], w: jax.Array, graph: topologies.Topology, count: jax.Array,
    axis_name: _axes.AxisName, pairwise: bool, summed: bool,
) -> tuple[Any, ...]:  # fmt: skip
    """One PushSum step of the graph's phase for `count`.

    Returns the (kept, received) shares of x and w, `(kept, received, kept_w, received_w)`,
    or with `summed` only their sums, `(mixed, mixed_w)`. With `pairwise`, a move that
    swaps every device i with i ^ d is a two-member `_collectives.swap` (see
    `_axes.use_pairwise`), and a phase that is that one move and whose sum is all that is
    wanted is the pair's sum (`_collectives.pair_sum`), the same bits on both devices. The
    rest are `ppermute`s.
    """

    def send(v: jax.Array, move: topologies.Move) -> jax.Array:
        distance = topologies.swap_distance(move) if pairwise else None
        if distance is not None:
            return _collectives.swap(v, axis_name, distance)
        return _collectives.ppermute(v, axis_name, list(enumerate(move)))

    def phase(moves: tuple[topologies.Move, ...]) -> tuple[Any, ...]:
        share = 1.0 / (len(moves) + 1)
        kept = [v * share for v in x]
        distance = topologies.swap_distance(moves[0]) if pairwise and len(moves) == 1 else None
        if summed and distance is not None:

            def pair_sum(v: jax.Array) -> jax.Array:
                return _collectives.pair_sum(v, axis_name, distance)

            return [pair_sum(v) for v in kept], pair_sum(w * share)
        received = [jnp.zeros_like(v) for v in x]
        received_w = jnp.zeros_like(w)
        for move in moves:
            for j, v in enumerate(kept):
                received[j] = received[j] + send(v, move)
            received_w = received_w + send(w * share, move)
        if summed:
            return [k + r for k, r in zip(kept, received, strict=True)], w * share + received_w
        return kept, received, w * share, received_w

    num = graph.num_phases
    if num == 1:
        return phase(graph.phases[0])
    branches = [
        wire.branch(f"phase {k}", every=num)(functools.partial(phase, moves))
        for k, moves in enumerate(graph.phases)
    ]
    return lax.switch(count % num, branches)


Step = Callable[[Any, Any, Any, topologies.Topology, bool], tuple[Any, Any]]


def transformation(
    who: str, axis_name: _axes.AxisName, topology: TopologySpec, exchange: _axes.Exchange,
    init_fn: Callable[[Any], Any], step: Step,
) -> optax.GradientTransformationExtraArgs:  # fmt: skip
    """The optax transformation of a gossip method: `_transform.transformation`, which
    requires params and checks the updates, around a step that resolves the graph for the
    axis size and the exchange mode and calls `step(updates, state, params, graph,
    pairwise)`."""

    def gossip_step(updates: Any, state: Any, params: Any) -> tuple[Any, Any]:
        graph = topologies.resolve(topology, _axes.axis_size(axis_name))
        pairwise = _axes.use_pairwise(axis_name, exchange, who)
        return step(updates, state, params, graph, pairwise)

    return _transform.transformation(who, axis_name, init_fn, gossip_step, needs_params=True)
