"""Probes of the two ways to swap: `calibrate` times the link once, and `exchange="auto"`
then follows it; a `TrainStep` times its own step both ways (`probe_step`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomm import _axes, _collectives
from gradcomm.parallel._placement import data_axes

# Per device and swap. gloo's swap penalty needs a message larger than the sockets'
# buffers (4 MiB by Linux's defaults): at 1 MiB a swapping ppermute ran at full speed over
# 100 Mbit and the probe chose it, at 8 MiB and up it runs at half speed (Adasum's 8 MiB
# halves at N = 2, docs/bench/network.md). Three rounds at 100 Mbit take about 6 s.
PROBE_BYTES = 8 << 20


class LinkProbe(NamedTuple):
    """What `calibrate` measured, and the exchange "auto" now takes on this mesh.

    Attributes:
      exchange: "pairwise" or "permute", whichever swapped faster.
      permute_s: seconds for one swap of devices N/2 apart (on a mesh whose data axes
        cross hosts last, a pair across the link) as a `ppermute`, the slowest process's
        median.
      pairwise_s: the same swap as a two-member reduce-scatter (`gradcomm._collectives.swap`).
      nbytes: the bytes each device sent per swap.
      axes: the data axes probed.
    """

    exchange: Literal["permute", "pairwise"]
    permute_s: float
    pairwise_s: float
    nbytes: int
    axes: tuple[str, ...]


class StepProbe(NamedTuple):
    """What a `TrainStep` measured of its own step on its first call across processes
    (`TrainStep.probe`), and the exchange its "auto" swaps take from then on.

    Attributes:
      exchange: "pairwise" or "permute", whichever step ran faster.
      permute_s: seconds per step with `ppermute` swaps, the slowest process's median.
      pairwise_s: the same with two-member reduce-scatters.
    """

    exchange: Literal["permute", "pairwise"]
    permute_s: float
    pairwise_s: float


KINDS: tuple[Literal["permute"], Literal["pairwise"]] = ("permute", "pairwise")


def time_both(
    runs: dict[str, Callable[[], Any]], repeats: int
) -> tuple[Literal["permute", "pairwise"], float, float]:
    """Runs the "permute" and "pairwise" programs once each (which opens the connections),
    then `repeats` rounds of one run each, the order alternating; the faster by the
    slowest process's medians (every process gets the same, so all choose alike: a
    collective) and the two medians. Every timed run starts at a barrier across the
    processes: without one, a run starts while its partners still finish the previous
    program, and the program timed second pays for the first one's skew (a swapping
    `ppermute` on gloo leaves the processes apart)."""
    for kind in KINDS:
        jax.block_until_ready(runs[kind]())
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for r in range(repeats):
        for kind in KINDS[:: 1 if r % 2 == 0 else -1]:
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("gradcomm.parallel probe")
            start = time.perf_counter()
            jax.block_until_ready(runs[kind]())
            times[kind].append(time.perf_counter() - start)
    local_medians = np.array([np.median(times[kind]) for kind in KINDS], np.float64)
    medians = np.asarray(multihost_utils.process_allgather(local_medians)).reshape(-1, 2).max(0)
    exchange: Literal["permute", "pairwise"] = "pairwise" if medians[1] < medians[0] else "permute"
    return exchange, float(medians[0]), float(medians[1])


def spans_processes(mesh: Mesh) -> bool:
    """Whether the mesh's devices belong to more than one process (a link between them)."""
    return len({d.process_index for d in mesh.devices.flat}) > 1


def probe_step(
    lower: Callable[[Literal["permute", "pairwise"]], Any], args: tuple[Any, ...],
    repeats: int = 3,
) -> StepProbe | None:  # fmt: skip
    """Times a step both ways: `lower(kind)` lowers it with its "auto" swaps as `kind`;
    each compiled program trains on from `args` (`(params, state, batch)`: each run takes
    the params and state the previous one returned, so a method whose phases cycle, as
    gossip's peers do, is timed over its phases, not in its first one again and again),
    and its outputs are then dropped. None where the two lower alike (no swap that
    "auto" decides). A collective across processes."""
    lowered = {kind: lower(kind) for kind in KINDS}
    if lowered["permute"].as_text() == lowered["pairwise"].as_text():
        return None
    compiled = {kind: low.compile() for kind, low in lowered.items()}

    def training(fn: Callable[..., Any]) -> Callable[[], Any]:
        carry = list(args)

        def run() -> Any:
            out = fn(*carry)
            carry[:2] = out[:2]
            return out

        return run

    return StepProbe(*time_both({k: training(f) for k, f in compiled.items()}, repeats))


_CACHE: dict[tuple[Any, ...], LinkProbe] = {}


def calibrate(
    mesh: Mesh,
    axes: _axes.AxisName | None = None,
    *,
    nbytes: int = PROBE_BYTES,
    repeats: int = 3,
) -> LinkProbe:
    """Times both ways of swapping over the data axes once, so that "auto" picks the faster.

    Pairwise swaps (Adasum's halving and gathering, SGP's and D-PSGD's i <-> i ^ 2^r moves)
    can run as `ppermute`s or as two-member reduce-scatters. Which is faster depends on
    the link: across processes over gloo, a swapping `ppermute` runs at half the link's
    speed, so on a slow link the reduce-scatter wins by up to 2x; on a fast one (the
    loopback, a fast LAN) its extra pass over memory can lose. This swaps `nbytes`
    between devices i and i ^ N/2 both ways, interleaved, `repeats` times after one
    warm-up swap each (which opens the connections); every process takes the slowest
    process's medians, so all choose alike. The choice is recorded for this platform and
    process count (`gradcomm._axes.record_probe`), and every `exchange="auto"` outside a
    `train_step` follows it: call this before a hand-written `shard_map` that spans
    processes. (A `train_step` times its own step both ways instead, `StepProbe`: which
    swap wins can differ by method on one link.) A collective: every process must call
    it. Cached per mesh, axes and size.

    Args:
      mesh: the mesh.
      axes: the data axes (default: all mesh axes), a power-of-two number of devices.
      nbytes: bytes per device and swap.
      repeats: timed runs of each program.

    Returns:
      A `LinkProbe`: the exchange chosen and the two times.

    Example:
      >>> import jax
      >>> from gradcomm import parallel
      >>> mesh = parallel.make_mesh(devices=jax.devices()[:4])
      >>> probe = parallel.calibrate(mesh, nbytes=4096, repeats=1)
      >>> probe.exchange in ("permute", "pairwise"), probe.axes
      (True, ('data',))
    """
    names = data_axes(mesh, axes)
    n = math.prod(mesh.shape[a] for a in names)
    if n < 2 or n & (n - 1):
        raise ValueError(
            f"calibrate needs a power-of-two number of devices (at least 2) over the data "
            f"axes {names}, got {n}; 'auto' swaps with ppermute there without a probe"
        )
    if nbytes < 4 or repeats < 1:
        raise ValueError(f"calibrate needs nbytes >= 4 and repeats >= 1, got {nbytes}, {repeats}")
    cached = _CACHE.get((mesh, names, nbytes))
    if cached is not None:
        return cached
    spec = P(names)
    keys: list[tuple[str, int]] = []
    d = n // 2

    def program(kind: str, x: jax.Array) -> Any:
        def body(v: jax.Array) -> jax.Array:
            keys.append(_axes.link_key())
            if kind == "pairwise":
                return _collectives.swap(v, names, d)
            return _collectives.ppermute(v, names, [(i, i ^ d) for i in range(n)])

        fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
        return jax.jit(fn).lower(x).compile()

    def ones(words: int) -> jax.Array:
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(
            (n * words,), sharding, lambda i: np.ones(n * words, np.float32)[i]
        )

    x = ones(nbytes // 4)
    programs = {kind: program(kind, x) for kind in KINDS}
    exchange, permute_s, pairwise_s = time_both(
        {kind: lambda fn=fn: fn(x) for kind, fn in programs.items()}, repeats
    )
    _axes.record_probe(keys[0], exchange)
    probe = LinkProbe(exchange, permute_s, pairwise_s, nbytes // 4 * 4, names)
    _CACHE[(mesh, names, nbytes)] = probe
    return probe
