"""Peer schedules for gossip: which device sends to which, at every step, as plain data.

A `Topology` is a cycle of phases; at step k the phase `k % len(phases)` runs. A phase is a
tuple of moves, each a permutation `dest` (device i sends a share to `dest[i]`). Every
device keeps one share and sends one to each move's destination, all shares equal, so each
step's mixing matrix is column stochastic (each device's mass is conserved) and has no
self-loops. Print one to read its schedule; `mixing_matrix(k)` gives the matrix for tests
and plots.

Example:
  >>> from gradcomm import topology
  >>> print(topology.exponential(8))
  exponential(8, peers=1): 3 phases
    step k = 0 mod 3: i -> i + 1
    step k = 1 mod 3: i -> i + 2
    step k = 2 mod 3: i -> i + 4
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from gradcomm import _checks

Move = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Topology:
    """A time-varying gossip graph on `num_devices` devices.

    Attributes:
      name: a description, e.g. "exponential(8, peers=1)".
      num_devices: n.
      phases: per phase, the moves (permutations `dest`, device i -> dest[i]).
      labels: per phase, a human-readable rule ("i -> i + 2").
    """

    name: str
    num_devices: int
    phases: tuple[tuple[Move, ...], ...]
    labels: tuple[str, ...]

    def __post_init__(self) -> None:
        n = self.num_devices
        for phase in self.phases:
            for move in phase:
                if sorted(move) != list(range(n)):
                    raise ValueError(f"{self.name}: {move} is not a permutation of {n} devices")
                if any(dest == i for i, dest in enumerate(move)):
                    raise ValueError(f"{self.name}: {move} has a self-loop")

    @property
    def num_phases(self) -> int:
        return len(self.phases)

    def peers(self, step: int) -> int:
        """How many devices each device sends to at `step`."""
        return len(self.phases[step % self.num_phases])

    def mixing_matrix(self, step: int) -> np.ndarray:
        """P(step), shape (n, n): column i holds the shares device i sends (P[j, i] to j)."""
        n = self.num_devices
        phase = self.phases[step % self.num_phases]
        share = 1.0 / (len(phase) + 1)
        matrix = np.eye(n) * share
        for move in phase:
            for i, dest in enumerate(move):
                matrix[dest, i] += share
        return matrix

    def is_doubly_stochastic(self) -> bool:
        """Whether every phase's matrix also has rows summing to 1 (so weights stay 1)."""
        return all(np.allclose(self.mixing_matrix(k).sum(1), 1) for k in range(self.num_phases))

    def is_symmetric(self) -> bool:
        """Whether every phase's matrix is symmetric (undirected, as D-PSGD needs)."""
        return all(
            np.allclose(self.mixing_matrix(k), self.mixing_matrix(k).T)
            for k in range(self.num_phases)
        )

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.num_phases} phase{'s' if self.num_phases > 1 else ''}"]
        for k, label in enumerate(self.labels):
            lines.append(f"  step k = {k} mod {self.num_phases}: {label}")
        return "\n".join(lines)


def swap_distance(move: Move) -> int | None:
    """d where a move pairs every device i with i XOR d (d a power of two), else None.

    Such a move is a set of pairwise swaps, which `gradcomm.sgp` and `gradcomm.dpsgd` can
    run as two-member exchanges (`exchange="pairwise"`).

    Example:
      >>> from gradcomm import topology
      >>> topology.swap_distance((2, 3, 0, 1)), topology.swap_distance((1, 2, 3, 0))
      (2, None)
    """
    d = move[0] if move else 0
    if d < 1 or d & (d - 1) or any(dest != i ^ d for i, dest in enumerate(move)):
        return None
    return d


def _check_n(n: int) -> None:
    _checks.check_int(n, "the number of devices", minimum=1)


def _shift_phase(n: int, shifts: Sequence[int]) -> tuple[tuple[Move, ...], str]:
    """Circulant moves i -> i + s (mod n) for the distinct nonzero shifts."""
    distinct = list(dict.fromkeys(s % n for s in shifts if s % n))
    moves = tuple(tuple((i + s) % n for i in range(n)) for s in distinct)
    label = ", ".join(f"i -> i + {s}" for s in distinct) or "no messages"
    return moves, label


def _from_shifts(name: str, n: int, phases: Sequence[Sequence[int]]) -> Topology:
    built = [_shift_phase(n, shifts) for shifts in phases]
    return Topology(name, n, tuple(m for m, _ in built), tuple(label for _, label in built))


def exponential(n: int, *, peers: int = 1, both_directions: bool = False) -> Topology:
    """The time-varying directed exponential graph (SGP's topology; NPDDE in its code).

    With p peers, at step k device i sends to i + j (p + 1)^r for j = 1..p, with
    r = k mod m and m the smallest integer with (p + 1)^m >= n; for one peer, to
    i + 2^(k mod m) with m = bit_length(n - 1). Shifts that wrap to 0 are skipped, so
    there are no self-loops. `both_directions` adds i - s for every i + s: the graph is
    then undirected and its matrices doubly stochastic.

    Example:
      >>> from gradcomm import topology
      >>> topology.exponential(6, peers=2).phases[1]
      ((3, 4, 5, 0, 1, 2),)
    """
    _check_n(n)
    _checks.check_int(peers, "peers", minimum=1)
    base = peers + 1
    rounds = 1 if n == 1 else math.ceil(math.log(n) / math.log(base) - 1e-12)
    phases = []
    for r in range(max(rounds, 1)):
        shifts = [j * base**r for j in range(1, peers + 1)]
        phases.append(shifts + [-s for s in shifts] if both_directions else shifts)
    kind = ", both directions" if both_directions else ""
    return _from_shifts(f"exponential({n}, peers={peers}{kind})", n, phases)


def ring(n: int, *, both_directions: bool = False) -> Topology:
    """The ring: i -> i + 1 (and i -> i - 1 with `both_directions`), every step.

    Args:
      n: the number of devices.
      both_directions: also send to i - 1 (the symmetric ring of D-PSGD).

    Returns:
      A one-phase `Topology`; each move maps device i to its destination.

    Example:
      >>> from gradcomm import topology
      >>> topology.ring(4).phases
      (((1, 2, 3, 0),),)
    """
    _check_n(n)
    shifts = [1, -1] if both_directions else [1]
    kind = ", both directions" if both_directions else ""
    return _from_shifts(f"ring({n}{kind})", n, [shifts])


def complete(n: int) -> Topology:
    """Every device sends to every other, every step: exact averaging (all-reduce).

    Args:
      n: the number of devices.

    Returns:
      A one-phase `Topology` with the n - 1 shifts as its moves.

    Example:
      >>> from gradcomm import topology
      >>> topology.complete(3).phases
      (((1, 2, 0), (2, 0, 1)),)
    """
    _check_n(n)
    return _from_shifts(f"complete({n})", n, [list(range(1, n))])


def hypercube(n: int) -> Topology:
    """Pairwise exchange i <-> i XOR 2^(k mod log2 n): symmetric, one peer; n a power of two.

    Args:
      n: the number of devices, a power of two.

    Returns:
      A `Topology` of log2 n phases, each one swap.

    Raises:
      ValueError: where n is not a power of two.

    Example:
      >>> from gradcomm import topology
      >>> topology.hypercube(4).labels
      ('i <-> i xor 1', 'i <-> i xor 2')
    """
    _check_n(n)
    if n & (n - 1):
        raise ValueError(f"hypercube needs a power-of-two number of devices, got {n}")
    phases = [(tuple(i ^ (1 << r) for i in range(n)),) for r in range(max(n.bit_length() - 1, 1))]
    if n == 1:
        phases = [()]
    labels = tuple(f"i <-> i xor {1 << r}" if n > 1 else "no messages" for r in range(len(phases)))
    return Topology(f"hypercube({n})", n, tuple(phases), labels)


Name = Literal[
    "exponential",
    "exponential-2peer",
    "exponential-bidirectional",
    "hypercube",
    "ring",
    "ring-bidirectional",
    "complete",
]
TOPOLOGIES: dict[Name, Callable[[int], Topology]] = {
    "exponential": exponential,
    "exponential-2peer": lambda n: exponential(n, peers=2),
    "exponential-bidirectional": lambda n: exponential(n, both_directions=True),
    "hypercube": hypercube,
    "ring": ring,
    "ring-bidirectional": lambda n: ring(n, both_directions=True),
    "complete": complete,
}


def resolve(topology: Name | Topology | Callable[[int], Topology], n: int) -> Topology:
    """The topology for n devices, from a name in `TOPOLOGIES`, a factory or a `Topology`.

    Args:
      topology: a name (`Name`), a factory `n -> Topology`, or a `Topology`.
      n: the number of devices.

    Returns:
      The `Topology`, checked to be for n devices.

    Raises:
      ValueError: for an unknown name, or a topology for another number of devices.

    Example:
      >>> from gradcomm import topology
      >>> topology.resolve("ring", 3).name
      'ring(3)'
    """
    if isinstance(topology, Topology):
        built = topology
    elif isinstance(topology, str):
        if topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {topology!r}: choose from {sorted(TOPOLOGIES)}")
        built = TOPOLOGIES[topology](n)
    elif callable(topology):
        built = topology(n)
    else:
        raise ValueError(f"topology must be a name, a Topology or a factory, got {topology!r}")
    if not isinstance(built, Topology) or built.num_devices != n:
        raise ValueError(f"topology {getattr(built, 'name', built)!r} is not for {n} devices")
    return built


def check_topology(topology: object) -> None:
    """Construction-time check of a topology argument (the size is known only later)."""
    if isinstance(topology, str) and topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}: choose from {sorted(TOPOLOGIES)}")
    if not isinstance(topology, str | Topology) and not callable(topology):
        raise ValueError(f"topology must be a name, a Topology or a factory, got {topology!r}")
