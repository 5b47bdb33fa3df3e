"""A `lax.switch` over Streaming DiLoCo's per-fragment branches, typed for `shard_map`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

from gradcomm import _axes, wire
from gradcomm.diloco import _joined


def switch(
    index: jax.Array,
    branches: list[Callable],
    operands: tuple[Any, ...],
    axis_name: _axes.AxisName,
    writes: Sequence[int],
    every: int | None = None,
) -> tuple[Any, ...]:
    """`lax.switch(index, [identity, *branches], operands)`, which changes only the
    operands at `writes` (the branches read the others); with `every`, the branches are
    named for `gradcomm.wire` (each one in P of the steps that run any) and run on one
    step in `every`.

    Only those pass through the conditional: XLA:CPU copies a conditional's operands into
    its results on every step, the identity's included, so a sync that carried its whole
    state (params, anchor, outer states, pending and own outer gradients) through each
    switch spent longer on the steps between its syncs than the inner step itself. The
    identity is a predicate around the switch, for the same reason: an indexed switch with
    an identity branch copied the operands (XLA:CPU).

    Under `shard_map` every branch must give each output the same varying axes: each
    operand is first typed as varying over its own axes and every branch's result for it
    (`gradcomm.diloco._joined`), until no type grows.
    """

    def part(branch: Callable) -> Callable:
        def run(written: tuple[Any, ...]) -> tuple[Any, ...]:
            out = branch(_put(operands, writes, written))
            return tuple(out[i] for i in writes)

        return run

    parts = [part(b) for b in branches]
    written = tuple(operands[i] for i in writes)
    if _axes.is_manual(axis_name):
        while True:
            joined = written
            for branch in parts:
                joined = _joined(joined, branch)
            if _types(joined) == _types(written):
                break
            written = joined

    def chosen(ops: tuple[Any, ...]) -> tuple[Any, ...]:
        return parts[0](ops) if len(parts) == 1 else lax.switch(index - 1, parts, ops)

    if every is not None:
        chosen = wire.branch("fragment exchange", every=every)(chosen)
    written = lax.cond(index > 0, chosen, lambda ops: ops, written)
    return _put(operands, writes, written)


def _put(operands: tuple[Any, ...], writes: Sequence[int], written: tuple[Any, ...]) -> tuple:
    out = list(operands)
    for i, x in zip(writes, written, strict=True):
        out[i] = x
    return tuple(out)


def _types(tree: Any) -> list[frozenset[str]]:
    return [_axes.varying_axes(x) for x in jax.tree.leaves(tree)]
