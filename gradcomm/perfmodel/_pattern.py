"""What one step sends: collectives, the setting they run in, and each method's pattern.

A method's pattern is its registry entry's (`gradcomm.registry.Method.collectives`): the
method's own module says what its step sends. This module holds the vocabulary they share
(`Collective`, `Setting`, `averaging`) and looks the patterns up (`pattern`, `window`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from gradcomm import registry

Window = Literal["backward", "step", "none"]
# Per collective, its rounds of n - 1 messages; 0: one message, the whole operand (a swap is
# a permute in which pairs send to each other).
ROUNDS = {
    "allreduce": 2,
    "allgather": 1,
    "reduce_scatter": 1,
    "alltoall": 1,
    "permute": 0,
    "swap": 0,
    "pair_sum": 0,
    "doubling_gather": 1,
}


def sent_per_byte(kind: str, n: int) -> float:
    """Bytes one device sends per byte of the operand, over `n` members."""
    rounds = ROUNDS[kind]
    return rounds * (n - 1) / n if rounds else 1.0


class Collective(NamedTuple):
    """One collective of a step: kind, group size n, operand size S in bytes, and share."""

    kind: str
    n: int
    size: float
    share: float = 1.0

    def sent(self) -> float:
        """Bytes one device sends, per step on average (`gradcomm.wire`'s count)."""
        return self.share * sent_per_byte(self.kind, self.n) * self.size

    def seconds(self, bandwidth: float, latency: float = 0.0) -> float:
        """The alpha-beta time per step on average, before the backend's factor."""
        messages = ROUNDS[self.kind] * (self.n - 1) or 1
        wire = 8 * sent_per_byte(self.kind, self.n) * self.size / (bandwidth * 1e9)
        return self.share * (latency * messages + wire)


class Setting(NamedTuple):
    """Where a step runs, as a method's pattern needs to know it.

    Attributes:
      nodes: the hosts on the link (a hierarchical Adasum's local mean stays in a host).
      params: the model's parameter count.
      itemsize: bytes per parameter.
      amortize: count periodic averaging at 1/k per step; False leaves it out.
      native_bf16: whether the backend adds bfloat16 natively (`Backend.native_bf16`).
      gloo: whether the backend is gloo (`Backend.gloo`).
      shapes: the leaves' shapes, where a pattern depends on them (PowerSGD's factors);
        None: one square matrix of `params` entries.
    """

    nodes: int
    params: int
    itemsize: int = 4
    amortize: bool = True
    native_bf16: bool = False
    gloo: bool = False
    shapes: tuple[tuple[int, ...], ...] | None = None

    @property
    def size(self) -> float:
        """The model's bytes."""
        return float(self.params * self.itemsize)


def averaging(options: Mapping[str, Any], setting: Setting) -> list[Collective]:
    """The pattern of a `ParamsSync` that averages the params every `options["every"]`
    steps: an all-reduce of the model at 1/every per step (none where not amortized)."""
    if not setting.amortize:
        return []
    return [Collective("allreduce", setting.nodes, setting.size, 1 / options["every"])]


def _entry(method: str) -> registry.Method:
    if method not in registry.METHODS:
        raise ValueError(f"unknown method {method!r}: one of {', '.join(registry.METHODS)}")
    return registry.METHODS[method]


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
    shapes: Any = None,
) -> list[Collective]:
    """The collectives of one step of a gradcomm method across `nodes` hosts.

    Args:
      method: a registered factory's name (`gradcomm.registry.METHODS`): "allreduce",
        "adasum", "terngrad", "lags", "slgs", "gradient_dropping", "sgp", "dpsgd",
        "powersgd", "low_precision", "local_sgd", "periodic_average" or "diloco".
      params: the model's parameter count.
      nodes: the hosts on the link.
      options: the factory's keyword arguments (the others take their defaults).
      sync: the `gradcomm.ParamsSync` run after each step beside the method, as its
        factory's name and keyword arguments: `{"name": "periodic_average", "every": 50}`
        is an all-reduce of the params every 50 steps (gradient dropping's model
        averaging); None for none.
      itemsize: bytes per parameter.
      amortize: count periodic averaging at 1/k per step; False leaves it out.
      native_bf16: whether the backend adds bfloat16 natively (`Backend.native_bf16`).
      gloo: whether the backend is gloo (`Backend.gloo`), where `low_precision`'s "auto"
        exchange is "pairwise" at N = 2 and "ring" above.
      shapes: the leaves' shapes, which PowerSGD's factors depend on (default: one square
        matrix of `params` entries).

    Returns:
      A list of `Collective`s; time-varying gossip is averaged over its phases.

    Raises:
      ValueError: for an unknown method or sync, an option the factory does not take, or
        a sync that is not a `ParamsSync`.

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
    entry = _entry(method)
    setting = Setting(
        nodes, params, itemsize, amortize, native_bf16, gloo,
        None if shapes is None else tuple(map(tuple, shapes)),
    )  # fmt: skip
    given = entry.options(options)
    syncs: list[Collective] = []
    if sync is not None:
        name = sync.get("name")
        sync_entry = registry.METHODS.get(name)
        if sync_entry is None or sync_entry.placement != "params":
            known = [m for m, e in registry.METHODS.items() if e.placement == "params"]
            raise ValueError(f"unknown sync {sync!r}: name one of {tuple(known)}")
        kwargs = {k: v for k, v in sync.items() if k != "name"}
        syncs = sync_entry.collectives(sync_entry.options(kwargs), setting)
    if nodes < 2:
        return []
    return entry.collectives(given, setting) + syncs


def window(method: str, options: Mapping[str, Any] | None = None) -> Window:
    """Where a method's communication can hide: "backward", "step" (osgp) or "none"."""
    return _entry(method).hides_in(options)
