"""LAGS's planner (Shi et al., ECAI 2020, eqs. 18-19): per-leaf densities whose
communication hides behind the backward pass, from measured or costed backward times.

`lags_profile` measures each leaf's backward time, `lags_plan` turns the times into the
densities of eq. 18 (pass the `LagsPlan` to `gradcomm.lags`), and `lags_speedup_bound`
is eq. 19's ceiling on what overlapping can gain. `gradcomm.lags` re-exports them.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from gradcomm import _checks


@dataclasses.dataclass(frozen=True)
class LagsPlan:
    """Per-leaf densities from eq. 18, with what the model predicted.

    Attributes:
      densities: leaf name -> density k/d, the input `lags(density=plan)` takes.
      backward_seconds: leaf name -> the leaf's backward time, in backprop order.
      comm_seconds: leaf name -> the predicted all-gather time at the chosen density.
      budget_seconds: leaf name -> the backward time its communication may hide behind.
      hidden: leaf name -> whether the communication fits within that budget.
    """

    densities: dict[str, float]
    backward_seconds: dict[str, float]
    comm_seconds: dict[str, float]
    budget_seconds: dict[str, float]
    hidden: dict[str, bool]

    def table(self) -> str:
        """A Markdown table of the plan, one row per leaf in backprop order."""
        rows = ["| leaf | backward (ms) | budget (ms) | density | comm (ms) | hidden |"]
        rows.append("| --- | ---: | ---: | ---: | ---: | --- |")
        for name, density in self.densities.items():
            rows.append(
                f"| {name} | {1e3 * self.backward_seconds[name]:.3f} "
                f"| {1e3 * self.budget_seconds[name]:.3f} | {density:.4g} "
                f"| {1e3 * self.comm_seconds[name]:.3f} | {'yes' if self.hidden[name] else 'no'} |"
            )
        return "\n".join(rows)


def lags_speedup_bound(forward: float, backward: float, comm: float) -> float:
    """Eq. 19: the largest speedup of LAGS over SLGS from overlapping comm with backward.

        S_max = 1 + 1 / (t_f / min(t_c, t_b) + max(r, 1/r)),   r = t_c / t_b,

    which is (t_f + t_b + t_c) / (t_f + t_b + t_c - min(t_b, t_c)) and peaks at
    1 + t_b / (t_f + t_b) when t_c = t_b.

    Args:
      forward: t_f, the forward time of one iteration (>= 0).
      backward: t_b, the backward time (> 0).
      comm: t_c, the gradient communication time (>= 0).

    Returns:
      S_max (1 when nothing can be hidden).

    Example:
      >>> from gradcomm import lags_speedup_bound
      >>> round(lags_speedup_bound(1.0, 2.0, 2.0), 6)  # t_c = t_b: the bound 1 + 2 / 3
      1.666667
    """
    if forward < 0 or backward <= 0 or comm < 0:
        raise ValueError(
            f"need forward >= 0, backward > 0 and comm >= 0, got {forward}, {backward}, {comm}"
        )
    if comm == 0:
        return 1.0
    r = comm / backward
    return 1 + 1 / (forward / min(comm, backward) + max(r, 1 / r))


def lags_plan(
    backward_seconds: Mapping[str, float],
    sizes: Mapping[str, int],
    *,
    num_devices: int,
    latency: float,
    bandwidth: float,
    max_ratio: float = 1000.0,
    sparsify_seconds: float | Mapping[str, float] = 0.0,
    bytes_per_entry: int = 8,
) -> LagsPlan:
    """Eq. 18: per-leaf densities whose communication hides behind the backward pass.

    Backprop computes leaves from the output back; leaf l's gradient can be sent while the
    next leaves (closer to the input) are computed, so its budget is the next leaf's
    backward time (the last leaf has none). Its all-gather of k (value, index) pairs is
    modelled as `latency * (N - 1) + (N - 1) * k * bytes_per_entry / bandwidth`. The
    compression ratio c = d / k is the smallest that fits the budget after
    `sparsify_seconds`, capped at `max_ratio` (the paper's c_u = 1000):

        c(l) = min(c_u, min{c : t_comm(c) + t_spar(l) <= t_comp(l - 1)}).

    A leaf whose communication cannot hide even at c_u gets density 1 / c_u.

    Args:
      backward_seconds: leaf name -> backward time, in backprop order (the leaf nearest the
        output first), e.g. from `lags_profile`.
      sizes: leaf name -> number of elements.
      num_devices: N.
      latency: alpha, seconds per message of the all-gather's ring.
      bandwidth: beta^-1, bytes per second per link.
      max_ratio: c_u >= 1.
      sparsify_seconds: the top-k's own time, one number or per leaf.
      bytes_per_entry: bytes of one (value, index) pair (8 for float32 and int32).

    Returns:
      A `LagsPlan`; pass it as `lags(density=plan)`.

    Example:
      >>> from gradcomm import lags_plan
      >>> plan = lags_plan({"out": 1e-3, "hidden": 4e-3, "in": 2e-3},
      ...                  {"out": 10_000, "hidden": 100_000, "in": 50_000},
      ...                  num_devices=8, latency=1e-5, bandwidth=1e9)
      >>> plan.densities
      {'out': 1.0, 'hidden': 0.34464, 'in': 0.001}

    References:
      Shi et al., ECAI 2020: eq. 18 and section 5.
    """
    if num_devices < 1 or latency < 0 or bandwidth <= 0 or max_ratio < 1:
        raise ValueError(
            "need num_devices >= 1, latency >= 0, bandwidth > 0 and max_ratio >= 1; got "
            f"{num_devices}, {latency}, {bandwidth}, {max_ratio}"
        )
    names = list(backward_seconds)
    if set(names) != set(sizes):
        raise ValueError(
            f"backward_seconds and sizes name different leaves: {names} vs {list(sizes)}"
        )
    n = num_devices
    densities, comm, budget, hidden = {}, {}, {}, {}
    for i, name in enumerate(names):
        size = int(sizes[name])
        spar = sparsify_seconds[name] if isinstance(sparsify_seconds, Mapping) else sparsify_seconds
        budget[name] = backward_seconds[names[i + 1]] if i + 1 < len(names) else 0.0
        if n == 1:
            k = size
        else:
            room = budget[name] - spar - latency * (n - 1)
            fits = math.floor(room * bandwidth / ((n - 1) * bytes_per_entry)) if room > 0 else 0
            k = min(size, max(fits, math.ceil(size / max_ratio), 1))
        densities[name] = k / size
        comm[name] = (
            0.0 if n == 1 else latency * (n - 1) + (n - 1) * k * bytes_per_entry / bandwidth
        )
        hidden[name] = comm[name] + spar <= budget[name] or n == 1
    return LagsPlan(densities, dict(backward_seconds), comm, budget, hidden)


def lags_profile(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batch: Any,
    *,
    method: str = "cost",
    repeats: int = 5,
) -> dict[str, float]:
    """Per-leaf backward times of `loss_fn` on one device, in backprop order, for `lags_plan`.

    The gradient with respect to one leaf needs the backward pass from the loss down to
    that leaf, so its cost grows as the leaf lies further from the output. Sorting the
    leaves by that cost gives the backprop order, and successive differences give each
    leaf's own backward time (the first leaf's minus the forward pass).

    Args:
      loss_fn: `loss_fn(params, batch) -> scalar`.
      params: the params pytree.
      batch: one device's batch.
      method: "cost" (FLOPs from XLA's cost analysis, deterministic, turned into seconds
        by the measured time of the full gradient) or "time" (the median measured time of
        each gradient; noisier).
      repeats: timed runs per measurement.

    Returns:
      Leaf name -> seconds, in backprop order (nearest the output first).

    Example:
      >>> import jax.numpy as jnp, gradcomm
      >>> loss = lambda p, x: jnp.sum(jnp.tanh(x @ p["a"]) @ p["b"])
      >>> params = {"a": jnp.ones((64, 128)), "b": jnp.ones((128, 10))}
      >>> list(gradcomm.lags_profile(loss, params, jnp.ones((32, 64))))
      ['b', 'a']
    """
    if method not in ("cost", "time"):
        raise ValueError(f"method must be 'cost' or 'time', got {method!r}")
    leaves, names, treedef = _checks.named_leaves(params)

    def measure(fn: Callable[..., Any], *args: Any) -> float:
        compiled = jax.jit(fn).lower(*args).compile()
        if method == "cost":
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            return float(cost.get("flops", 0.0))
        return _median_seconds(compiled, args, repeats)

    def grad_of(i: int) -> Callable[..., Any]:
        def fn(leaf: jax.Array, batch: Any) -> jax.Array:
            def loss_of_leaf(value: jax.Array) -> jax.Array:
                return loss_fn(
                    jax.tree.unflatten(treedef, [*leaves[:i], value, *leaves[i + 1 :]]), batch
                )

            return jax.grad(loss_of_leaf)(leaf)

        return fn

    forward = measure(loss_fn, params, batch)
    cumulative = {name: measure(grad_of(i), leaves[i], batch) for i, name in enumerate(names)}
    order = sorted(names, key=lambda name: cumulative[name])
    scale = 1.0
    if method == "cost":
        full = _median_seconds(
            jax.jit(jax.grad(loss_fn)).lower(params, batch).compile(), (params, batch), repeats
        )
        scale = full / max(cumulative[order[-1]], 1.0)
    seconds, previous = {}, forward
    for name in order:
        seconds[name] = max(cumulative[name] - previous, 0.0) * scale
        previous = max(previous, cumulative[name])
    return seconds


def _median_seconds(compiled: Any, args: tuple[Any, ...], repeats: int) -> float:
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
