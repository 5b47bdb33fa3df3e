"""`calibrate`: a one-time probe of the link, which `exchange="auto"` then follows."""

from __future__ import annotations

import math
import time
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
    between devices i and i ^ N/2 both ways, interleaved, `repeats` times after a warm-up
    on a few bytes (which opens the connections); every process takes the slowest
    process's medians, so all choose alike. The choice is recorded for this platform and
    process count (`gradcomm._axes.record_probe`), and every `exchange="auto"` follows it.
    `train_step` calls this once per mesh when the mesh spans processes; call it yourself
    before a hand-written `shard_map`. A collective: every process must call it. Cached
    per mesh, axes and size.

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

    kinds = ("permute", "pairwise")
    warm, x = ones(16), ones(nbytes // 4)
    for kind in kinds:  # opens the connections, on a few bytes
        jax.block_until_ready(program(kind, warm)(warm))
    programs = {kind: program(kind, x) for kind in kinds}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(repeats):
        for kind, fn in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(x))
            times[kind].append(time.perf_counter() - start)
    local_medians = np.array([np.median(times[kind]) for kind in kinds], np.float64)
    medians = np.asarray(multihost_utils.process_allgather(local_medians)).reshape(-1, 2).max(0)
    exchange: Literal["permute", "pairwise"] = "pairwise" if medians[1] < medians[0] else "permute"
    _axes.record_probe(keys[0], exchange)
    probe = LinkProbe(exchange, float(medians[0]), float(medians[1]), nbytes // 4 * 4, names)
    _CACHE[(mesh, names, nbytes)] = probe
    return probe


def calibrate_once(mesh: Mesh, names: tuple[str, ...]) -> LinkProbe | None:
    """`calibrate(mesh, names)` where the mesh spans processes and pairs can form (a
    power-of-two number of data devices); None elsewhere (one process has no link)."""
    n = math.prod(mesh.shape[a] for a in names)
    if jax.process_count() == 1 or n < 2 or n & (n - 1):
        return None
    return calibrate(mesh, names)
