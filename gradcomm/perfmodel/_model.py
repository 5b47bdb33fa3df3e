"""The alpha-beta model: backends and the step time.

    step   = compute_s + cost_per_byte * model_bytes + comm - hidden
    comm   = sum over the step's collectives of
             share * factor(kind, n) * (latency * messages + 8 * bytes_sent / bandwidth)
    hidden = overlap * min(comm, window)

`bytes_sent` per device is `gradcomm.wire`'s count: all-reduce of S sends 2(n-1)/n S, an
all-gather with output S, a reduce-scatter or an all-to-all of S (n-1)/n S, a permute S.
`messages` is 2(n-1) for the ring all-reduce, n-1 for the other collectives, 1 for a permute.
`share` is how often a collective runs (1/k for an average every k steps, 1/m for one of m
gossip phases). Each method's collectives (`pattern`) and its `window` are its registry
entry's, written in the method's own module (`gradcomm.registry`). `factor` is the
backend's time against the alpha-beta ideal: 1 on NCCL; on gloo it is measured per
pattern, and a swap (two processes sending to each other) runs at half speed. `window` is
the backward pass (`BACKWARD` of the compute) for methods whose exchange can start layer
by layer, the whole step for 1-overlap SGP (its message is mixed in a step later), and
nothing for the rest. On the CPU path (gloo) every collective runs after
the backward pass: overlap is 0, so osgp gains nothing over sgp there. Units: bandwidth in
Gbit/s, latency and times in seconds, model size in parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from gradcomm.perfmodel._pattern import pattern, sent_per_byte, window

BACKWARD = 2 / 3  # the backward pass's share of a step's compute (twice the forward pass)

# One collective on gloo, 16 MiB per device, one CPU device per process, links shaped to
# 95.8 Mbit/s (DESIGN.md, "Time on a real link"): median seconds by (kind, group size).
GLOO_MEASURED = {
    ("allreduce", 2): 1.57,
    ("allreduce", 4): 2.18,
    ("reduce_scatter", 2): 0.75,
    ("reduce_scatter", 4): 2.63,
    ("allgather", 2): 1.06,
    ("allgather", 4): 1.14,
    ("alltoall", 2): 1.40,
    ("alltoall", 4): 1.76,
    ("permute", 2): 1.40,
    ("permute", 4): 1.53,  # a ring shift i -> i + 1
    ("swap", 2): 2.80,  # i <-> i ^ 1, at N = 2 and at N = 4
}


class Prediction(NamedTuple):
    """A predicted step: its time and parts in seconds, and the bytes one device sends."""

    step_s: float
    compute_s: float
    comm_s: float
    hidden_s: float
    wire_bytes: float


@dataclasses.dataclass(frozen=True)
class Backend:
    """How a collective library runs each pattern.

    Attributes:
      name: a label.
      factors: (kind, group size) -> time against the alpha-beta ideal. A size not listed
        takes the largest listed one below it (else the smallest); a kind not listed, 1.
      swap_factor: a permute in which pairs send to each other (gloo 2, NCCL 1).
      swaps: "permute" (a swap costs `swap_factor`) or "pairwise" (swaps run as 2-member
        reduce-scatters over size-2 mesh axes, at the reduce-scatter's factor for n = 2,
        and a swap of which only the pair's sum is wanted, a "pair_sum", as a 2-member
        all-reduce, at the all-reduce's factor for n = 2).
      overlap: the fraction of a method's window in which communication hides: 0 where
        every collective runs after the backward pass (this CPU path), 1 on GPUs.
      native_bf16: whether its all-reduce adds bfloat16 as bfloat16 (NCCL). Where it does
        not (XLA:CPU over gloo), `low_precision` moves bfloat16 as bits: an all-to-all
        and an all-gather.
      gloo: whether it is XLA:CPU's gloo across processes, where `low_precision`'s "auto"
        exchange is its pairwise scheme at N = 2 and its ring above.
    """

    name: str
    factors: Mapping[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    swap_factor: float = 1.0
    swaps: Literal["permute", "pairwise"] = "permute"
    overlap: float = 1.0
    native_bf16: bool = True
    gloo: bool = False

    def factor(self, kind: str, n: int) -> float:
        """The time factor of one collective of `kind` over `n` members."""
        if kind in ("swap", "pair_sum") and self.swaps == "pairwise":
            return self.factor("reduce_scatter" if kind == "swap" else "allreduce", 2)
        if kind in ("swap", "pair_sum"):
            return self.swap_factor
        if kind == "doubling_gather":  # pairwise: one swap per level; else an all-gather
            pairwise = self.swaps == "pairwise"
            return self.factor("swap", 2) if pairwise else self.factor("allgather", n)
        sizes = sorted(m for k, m in self.factors if k == kind)
        if not sizes:
            return 1.0
        return self.factors[kind, max((m for m in sizes if m <= n), default=sizes[0])]


def _gloo() -> Backend:
    one_way = 8 * 2**24 / 95.8e6  # 16 MiB at 95.8 Mbit/s, in seconds
    factors = {(k, n): t / (sent_per_byte(k, n) * one_way) for (k, n), t in GLOO_MEASURED.items()}
    swap = factors.pop(("swap", 2))
    return Backend("gloo", factors, swap_factor=swap, overlap=0.0, native_bf16=False, gloo=True)


GLOO = _gloo()
GLOO_PAIRWISE = dataclasses.replace(GLOO, name="gloo-pairwise", swaps="pairwise")
NCCL = Backend("nccl")


def predict(
    method: str,
    params: int,
    nodes: int,
    bandwidth: float,
    latency: float = 0.0,
    *,
    options: Mapping[str, Any] | None = None,
    sync: Mapping[str, Any] | None = None,
    backend: Backend = NCCL,
    compute_s: float = 0.0,
    cost_per_byte: float = 0.0,
    itemsize: int = 4,
    amortize: bool = True,
    shapes: Any = None,
) -> Prediction:
    """The time of one training step of `method`.

    Args:
      method: a gradcomm factory's name (see `pattern`).
      params: the model's parameter count.
      nodes: hosts on the link.
      bandwidth: each host's link, in Gbit/s.
      latency: seconds per message.
      options: the factory's keyword arguments; an `exchange` of "permute" or "pairwise"
        overrides the backend's `swaps`.
      sync: the `ParamsSync` beside the method (see `pattern`); its all-reduce hides in
        the method's window like the method's own collectives.
      backend: `NCCL` (ideal patterns, overlap 1), `GLOO` or `GLOO_PAIRWISE`.
      compute_s: an allreduce step's compute (forward, backward, optimizer), in seconds.
      cost_per_byte: the method's extra compute, seconds per byte of the model.
      itemsize: bytes per parameter.
      amortize: see `pattern`.
      shapes: the leaves' shapes (see `pattern`).

    Returns:
      A `Prediction`.

    Example:
      >>> from gradcomm import perfmodel
      >>> p = perfmodel.predict("sgp", 4_194_304, 2, 0.0958, backend=perfmodel.GLOO)
      >>> round(p.comm_s, 2)  # at N = 2 the gossip peer is a swap: 2.80 s on gloo
      2.8
    """
    colls = pattern(
        method, params, nodes, options=options, sync=sync, itemsize=itemsize,
        amortize=amortize, native_bf16=backend.native_bf16, gloo=backend.gloo, shapes=shapes,
    )  # fmt: skip
    if (options or {}).get("exchange") in ("permute", "pairwise"):
        backend = dataclasses.replace(backend, swaps=options["exchange"])
    comm = sum(backend.factor(c.kind, c.n) * c.seconds(bandwidth, latency) for c in colls)
    compute = max(compute_s + cost_per_byte * params * itemsize, 0.0)
    span = {"backward": BACKWARD * compute_s, "step": compute, "none": 0.0}
    hidden = backend.overlap * min(comm, span[window(method, options)])
    return Prediction(compute + comm - hidden, compute, comm, hidden, sum(c.sent() for c in colls))
