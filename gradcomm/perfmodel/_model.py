"""The alpha-beta model: backends, each method's collectives per step, and the step time.

    step   = compute_s + cost_per_byte * model_bytes + comm - hidden
    comm   = sum over the step's collectives of
             share * factor(kind, n) * (latency * messages + 8 * bytes_sent / bandwidth)
    hidden = overlap * min(comm, window)

`bytes_sent` per device is `gradcomm.wire`'s count: all-reduce of S sends 2(n-1)/n S, an
all-gather with output S, a reduce-scatter or an all-to-all of S (n-1)/n S, a permute S.
`messages` is 2(n-1) for the ring all-reduce, n-1 for the other collectives, 1 for a permute.
`share` is how often a collective runs (1/k for an average every k steps, 1/m for one of m
gossip phases): parameter averaging (`local_sgd`, DiLoCo's outer step, or a `sync` such as
`periodic_average` beside a transformation) is an all-reduce of the params every k steps.
PowerSGD is two all-reduces, of the P factors (with the leaves it sends dense) and of the
Q factors; a 16-bit all-reduce (`low_precision`) is one all-reduce of 2 bytes per
parameter, or an all-to-all and an all-gather of them (its bits exchange), or n - 1
permutes of 1/n and an all-gather (its ring), or two-member reduce-scatters of a half, a
quarter, ... and back up (its pairwise exchange). `factor` is the
backend's time against that ideal: 1 on NCCL; on gloo it is measured per pattern, and a
swap (two processes sending to each other) runs at half speed.
`window` is the backward pass (`BACKWARD` of the compute) for methods whose exchange can
start layer by layer (allreduce, adasum, terngrad, lags, gradient_dropping), the whole step
for 1-overlap SGP (its message is mixed in a step later), nothing for the methods that
exchange once all gradients are in (slgs, powersgd, low_precision's one flat buffer) and
for sgp, dpsgd, local_sgd and diloco. On the CPU path (gloo) every collective runs after
the backward pass: overlap is 0, so osgp gains nothing over sgp there. Units: bandwidth in
Gbit/s, latency and times in seconds, model size in parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import numpy as np

from gradcomm import powersgd as _powersgd

Window = Literal["backward", "step", "none"]
BACKWARD = 2 / 3  # the backward pass's share of a step's compute (twice the forward pass)
# Per collective, its rounds of n - 1 messages; 0: one message, the whole operand (a swap is
# a permute in which pairs send to each other).
_ROUNDS = {
    "allreduce": 2,
    "allgather": 1,
    "reduce_scatter": 1,
    "alltoall": 1,
    "permute": 0,
    "swap": 0,
    "pair_sum": 0,
    "doubling_gather": 1,
}
_LAYERWISE = frozenset({"allreduce", "adasum", "terngrad", "lags", "gradient_dropping"})

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


def _sent(kind: str, n: int) -> float:
    """Bytes one device sends per byte of the operand, over `n` members."""
    rounds = _ROUNDS[kind]
    return rounds * (n - 1) / n if rounds else 1.0


class Collective(NamedTuple):
    """One collective of a step: kind, group size n, operand size S in bytes, and share."""

    kind: str
    n: int
    size: float
    share: float = 1.0

    def sent(self) -> float:
        """Bytes one device sends, per step on average (`gradcomm.wire`'s count)."""
        return self.share * _sent(self.kind, self.n) * self.size

    def seconds(self, bandwidth: float, latency: float = 0.0) -> float:
        """The alpha-beta time per step on average, before the backend's factor."""
        messages = _ROUNDS[self.kind] * (self.n - 1) or 1
        wire = 8 * _sent(self.kind, self.n) * self.size / (bandwidth * 1e9)
        return self.share * (latency * messages + wire)


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
    factors = {(k, n): t / (_sent(k, n) * one_way) for (k, n), t in GLOO_MEASURED.items()}
    swap = factors.pop(("swap", 2))
    return Backend("gloo", factors, swap_factor=swap, overlap=0.0, native_bf16=False, gloo=True)


GLOO = _gloo()
GLOO_PAIRWISE = dataclasses.replace(GLOO, name="gloo-pairwise", swaps="pairwise")
NCCL = Backend("nccl")


def _values_per_word(base: int) -> int:
    """Base-`base` digits per uint32 word, as gradcomm packs them."""
    return int(32 * math.log(2) / math.log(base) + 1e-9)


def _phases(topology: str, n: int) -> list[list[str]]:
    """Per gossip phase, its messages: "swap" where i + s and i - s are the same device."""
    rounds = max((n - 1).bit_length(), 1)
    if topology == "hypercube":
        return [["swap"] for _ in range(rounds)]
    if topology.startswith("exponential"):
        shifts = [1 << r for r in range(rounds)]
    elif topology.startswith("ring"):
        shifts = [1]
    else:
        raise ValueError(f"unknown topology {topology!r}")
    both = topology.endswith("bidirectional")
    peers = [dict.fromkeys((s % n, -s % n) if both else (s % n,)) for s in shifts]
    return [["swap" if 2 * s % n == 0 else "permute" for s in p if s] for p in peers]


# The `gradcomm.ParamsSync` factories, run after the step, and their default periods: each
# an all-reduce of the params every `every` steps (gradcomm's defaults).
SYNCS = {"periodic_average": 20, "local_sgd": 20, "diloco": 500}


def _averaging(
    sync: Mapping[str, Any] | None, n: int, size: float, amortize: bool
) -> list[Collective]:
    """A sync's collectives per step: the params' all-reduce, 1/every of the steps."""
    if sync is None or not amortize:
        return []
    name = sync.get("name")
    if name not in SYNCS:
        raise ValueError(f"unknown sync {sync!r}: name one of {tuple(SYNCS)}")
    return [Collective("allreduce", n, size, 1 / sync.get("every", SYNCS[name]))]


def _sixteen_bit(
    dtype: str,
    n: int,
    params: int,
    native_bf16: bool,
    exchange: str = "auto",
    gloo: bool = False,
) -> list[Collective]:
    """`low_precision`'s exchange: 2 bytes per parameter, as it moves them."""
    if exchange == "auto" and gloo:
        exchange = "pairwise" if n == 2 else "ring"
    if exchange == "ring":  # n - 1 one-way shifts of 1/n (a swap at n = 2), an all-gather
        shift = Collective("swap" if n == 2 else "permute", n, 2.0 * params / n)
        return [shift] * (n - 1) + [Collective("allgather", n, 2.0 * params)]
    if exchange == "pairwise":  # two-member reduce-scatters on every backend
        levels = max(n.bit_length() - 1, 1)  # recursive halving: half, a quarter, ...
        sent = [params / 2**b for b in range(levels)]  # bytes: 2 params / 2^(b + 1)
        sent += [2.0 * params * 2**b / n for b in range(levels)]  # the doubling gather
        return [Collective("reduce_scatter", 2, 2 * s) for s in sent]  # 2 members: s of 2 s
    bits = exchange == "bits" or (exchange == "auto" and dtype == "bfloat16" and not native_bf16)
    if bits:  # a reduce-scatter by hand (all-to-all), float32 sums, a gather
        return [Collective("alltoall", n, 2.0 * params), Collective("allgather", n, 2.0 * params)]
    return [Collective("allreduce", n, 2.0 * params)]


def _low_rank(o: Mapping[str, Any], n: int, params: int, itemsize: int) -> list[Collective]:
    """PowerSGD's two all-reduces: the P factors with the dense leaves, then the Q factors.

    The leaves are `o["shapes"]` where given, else one square matrix of `params` entries.
    """
    rank = o.get("rank", 2)
    rate = o.get("min_compression_rate", 2.0)
    side = max(math.isqrt(params), 1)
    p = q = dense = 0
    for shape in o.get("shapes") or [(side, side)]:
        matrix = _powersgd.matrix_shape(shape)
        if matrix is not None and _powersgd.compresses(shape, rank, rate):
            p, q = p + rank * matrix[0], q + rank * matrix[1]
        else:
            dense += math.prod(shape)
    return [
        Collective("allreduce", n, float((p + dense) * itemsize)),
        Collective("allreduce", n, float(q * itemsize)),
    ]


def pattern(
    method: str,
    params: int,
    nodes: int,
    *,
    options: Mapping[str, Any] | None = None,
    sync: Mapping[str, Any] | None = None,
    itemsize: int = 4,
    amortize: bool = True,
    native_bf16: bool = False,
    gloo: bool = False,
) -> list[Collective]:
    """The collectives of one step of a gradcomm method across `nodes` hosts.

    Args:
      method: a factory's name: "allreduce", "adasum", "terngrad", "lags", "slgs",
        "gradient_dropping", "local_sgd", "sgp", "dpsgd", "powersgd", "low_precision"
        or "diloco".
      params: the model's parameter count.
      nodes: the hosts on the link (a hierarchical Adasum's local mean stays in a host).
      options: the factory's keyword arguments; density, drop_ratio, every (local_sgd's
        and diloco's), topology, dtype and exchange (low_precision's), rank and
        min_compression_rate (powersgd's) matter, the others are ignored. PowerSGD also
        reads `shapes`, the leaves' shapes (default: one square matrix of `params`).
      sync: the `gradcomm.ParamsSync` run after each step beside the method, as its
        factory's name and keyword arguments: `{"name": "periodic_average", "every": 50}`
        is an all-reduce of the params every 50 steps (gradient dropping's model
        averaging); None for none.
      itemsize: bytes per parameter.
      amortize: count periodic averaging at 1/k per step; False leaves it out.
      native_bf16: whether the backend adds bfloat16 natively (`Backend.native_bf16`).
      gloo: whether the backend is gloo (`Backend.gloo`), where `low_precision`'s "auto"
        exchange is "pairwise" at N = 2 and "ring" above.

    Returns:
      A list of `Collective`s; time-varying gossip is averaged over its phases.

    Raises:
      ValueError: for an unknown method, topology or sync, or an `average_every` option
        (gradient dropping's averaging is a sync now).

    Example:
      >>> from gradcomm import perfmodel
      >>> [c.kind for c in perfmodel.pattern("adasum", 1000, 4)]
      ['swap', 'allgather', 'swap', 'allgather', 'doubling_gather']
      >>> sync = {"name": "periodic_average", "every": 50}
      >>> perfmodel.pattern("gradient_dropping", 1000, 4, sync=sync)[-1].share
      0.02
      >>> [c.size for c in perfmodel.pattern("powersgd", 10_000, 2, options={"rank": 2})]
      [800.0, 800.0]
      >>> [c.kind for c in perfmodel.pattern("low_precision", 1000, 4)]
      ['alltoall', 'allgather']
    """
    o, n, size = dict(options or {}), nodes, float(params * itemsize)
    if "average_every" in o:
        raise ValueError(
            f"{method} has no average_every option: periodic parameter averaging is a sync, "
            f"sync={{'name': 'periodic_average', 'every': {o['average_every']}}}"
        )
    out: list[Collective] = []
    if n < 2:
        return out
    if method in ("allreduce", "low_precision"):
        default = "bfloat16" if method == "low_precision" else None
        dtype = o.get("dtype", default)
        if dtype is None:
            out.append(Collective("allreduce", n, size))
        else:
            exchange = o.get("exchange", "auto")
            name = np.dtype(dtype).name  # "bfloat16" for jnp.bfloat16 too
            out += _sixteen_bit(name, n, params, native_bf16, exchange, gloo)
    elif method == "powersgd":
        out += _low_rank(o, n, params, itemsize)
    elif method == "adasum":  # fold to P = 2^m, m halving swaps (+ dot products), all-gather
        p = 1 << (n.bit_length() - 1)
        if n > p:
            out.append(Collective("permute", n, size))
        for level in range(p.bit_length() - 1):
            out += [Collective("swap", 2, size / 2 ** (level + 1)), Collective("allgather", n, 0)]
        out.append(Collective("doubling_gather", n, n * size / p))
    elif method == "terngrad":  # base-3 codes (1.6 bits), sums of n codes in base 2n + 1
        sum_bits = 32 / _values_per_word(2 * n + 1)
        out.append(Collective("allreduce", n, 0.0))  # the shared scales
        if (n - 1) * 1.6 <= (n - 1) / n * (1.6 + sum_bits):  # terngrad's own choice
            out.append(Collective("allgather", n, n * params * 0.2))
        else:
            out.append(Collective("alltoall", n, params * 0.2))
            out.append(Collective("allgather", n, params * sum_bits / 8))
    elif method in ("lags", "slgs", "gradient_dropping"):
        dropping = method == "gradient_dropping"
        density = 1 - o.get("drop_ratio", 0.99) if dropping else o.get("density", 0.001)
        k = max(1, round(density * params))
        out.append(Collective("allgather", n, n * k * (itemsize + 4)))
    elif method in ("local_sgd", "diloco"):  # its ParamsSync is the whole method
        out += _averaging({"name": method, **o}, n, size, amortize)
    elif method in ("sgp", "dpsgd"):
        default = "exponential" if method == "sgp" else "exponential-bidirectional"
        phases = _phases(o.get("topology", default), n)
        if not o.get("overlap"):  # a lone swap is mixed as it arrives: only its sum matters
            phases = [["pair_sum"] if kinds == ["swap"] else kinds for kinds in phases]
        for kinds in phases:  # the model and the push-sum weight
            out += [
                Collective(k, n if k == "permute" else 2, size + 4, 1 / len(phases)) for k in kinds
            ]
    else:
        raise ValueError(f"unknown method {method!r}")
    return out + _averaging(sync, n, size, amortize)


def window(method: str, options: Mapping[str, Any] | None = None) -> Window:
    """Where a method's communication can hide: "backward", "step" (osgp) or "none"."""
    if method == "sgp" and (options or {}).get("overlap", 0) > 0:
        return "step"
    if method == "allreduce" and (options or {}).get("dtype") is not None:
        return "none"  # `low_precision`'s one buffer
    return "backward" if method in _LAYERWISE else "none"


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
        amortize=amortize, native_bf16=backend.native_bf16, gloo=backend.gloo,
    )  # fmt: skip
    if (options or {}).get("exchange") in ("permute", "pairwise"):
        backend = dataclasses.replace(backend, swaps=options["exchange"])
    comm = sum(backend.factor(c.kind, c.n) * c.seconds(bandwidth, latency) for c in colls)
    compute = max(compute_s + cost_per_byte * params * itemsize, 0.0)
    span = {"backward": BACKWARD * compute_s, "step": compute, "none": 0.0}
    hidden = backend.overlap * min(comm, span[window(method, options)])
    return Prediction(compute + comm - hidden, compute, comm, hidden, sum(c.sent() for c in colls))
