"""What the micro-benchmarks share: a jitted function's median time, and sparse pairs to
decode (`benchmarks/bench_scaling.py`, `benchmarks/bench_decode.py`)."""

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
