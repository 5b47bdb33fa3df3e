"""What the micro-benchmarks share: a jitted function's median time, the median of
interleaved rounds (`studies/compare.py`'s step times), and sparse pairs to decode
(`benchmarks/bench_scaling.py`, `benchmarks/bench_decode.py`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def median_seconds(fn: Callable[..., Any], args: tuple[Any, ...], repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(
    timers: dict[str, Callable[[], float]], rounds: int
) -> dict[str, list[float]]:
    """Each timer's result in `rounds` interleaved rounds, in alternating order.

    A round calls every timer once (each returns its seconds, say the median of a burst
    of steps), forwards in even rounds and backwards in odd ones, so that a drift in the
    machine's load hits every timer alike. Take the median of each list.

    Args:
      timers: name -> a function that times one burst and returns seconds.
      rounds: rounds to run (at least 1).

    Returns:
      name -> its `rounds` results, in round order.

    Example:
      >>> calls = []
      >>> timers = {k: (lambda k=k: calls.append(k) or 1.0) for k in "ab"}
      >>> interleaved_medians(timers, 3), "".join(calls)
      ({'a': [1.0, 1.0, 1.0], 'b': [1.0, 1.0, 1.0]}, 'abbaab')
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: need at least 1")
    names = list(timers)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            out[k].append(timers[k]())
    return out


def device_pairs(
    n: int, size: int, k: int, overlap: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """`(n, k)` float32 values and int32 indices, distinct within each device's row."""
    common = rng.choice(size, min(k, round(overlap * k)), replace=False)
    rows = []
    for _ in range(n):
        drawn = rng.choice(size, min(size, 2 * k + common.size), replace=False)
        others = np.setdiff1d(drawn, common)
        rows.append(rng.permutation(np.concatenate([common, others[: k - common.size]])))
    return rng.standard_normal((n, k)).astype(np.float32), np.stack(rows).astype(np.int32)
