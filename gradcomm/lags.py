"""LAGS-SGD: layer-wise adaptive top-k sparsification with residuals (Shi et al., ECAI 2020).

Each device adds the leaf's update to its residual, sends the k(l) entries of largest
magnitude, keeps the rest, and the devices average what was sent (eq. 5, Algorithm 1):

    acc = residual + update;   residual' = acc - TopK(acc, k(l));
    update' = (1/P) sum_p TopK(acc_p, k(l)).

The density k(l)/d(l) may differ per leaf; `lags_plan` picks it so that each leaf's
communication hides behind the backward pass of the leaves after it (eq. 18).
`slgs` is the single-layer baseline: one top-k over the whole flattened model.
Diagnostics: `lags_delta` (Assumption 1, eq. 20) and `lags_speedup_bound` (eq. 19).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _axes, _checks, _packing, sparse


class LagsState(NamedTuple):
    """State of `lags`: per leaf, what this device has not sent (the residual)."""

    residual: Any


class SlgsState(NamedTuple):
    """State of `slgs`: per leaf, what this device has not sent (the residual)."""

    residual: Any


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


Density = float | Mapping[str, float] | LagsPlan


def _check_density_spec(density: Density) -> None:
    if isinstance(density, LagsPlan):
        density = density.densities
    if isinstance(density, Mapping):
        if not density:
            raise ValueError("density mapping is empty")
        for name, value in density.items():
            sparse.check_density(value, f"density[{name!r}]")
    else:
        sparse.check_density(density)


def _leaf_densities(density: Density, names: list[str]) -> list[float]:
    """The density of each leaf; a mapping matches leaf names or '/'-prefixes of them."""
    if isinstance(density, LagsPlan):
        density = density.densities
    if not isinstance(density, Mapping):
        return [float(density)] * len(names)
    matched = _checks.match_names(list(density), names, "density")
    missing = [name for name, m in zip(names, matched, strict=True) if m is None]
    if missing:
        raise ValueError(f"density gives no value for leaves {missing}")
    return [float(density[m]) for m in matched]


def _zeros_like(params: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, params)


def lags(
    axis_name: _axes.AxisName = "data",
    *,
    density: Density = 0.001,
    selector: sparse.Selector = "sampled",
) -> optax.GradientTransformationExtraArgs:
    """LAGS-SGD: each leaf's top-k entries, with residuals, averaged over the devices.

    Place it after `optax.sgd` (eq. 5 sparsifies learning-rate-scaled updates):
    `optax.chain(optax.sgd(0.1), gradcomm.lags("data", density=0.001))`; before an optimizer
    it sparsifies gradients. Per device and leaf: `acc = residual + update`, send
    `TopK(acc, k)` with `k = round(density * size)` (at least 1), keep `acc - TopK(acc, k)`
    as the new residual, bit for bit. Every device gets the same average.

    Leaves whose (value, index) pairs would outweigh them dense (small biases at moderate
    densities) are sent dense; all other leaves of one dtype are merged into one
    fixed-capacity all-gather (the paper merges small tensors the same way).

    Args:
      axis_name: the mesh axis (or tuple of axes) to average over.
      density: k/d in (0, 1]: one float for every leaf, a mapping from leaf names (or
        '/'-prefixes, like 'Dense_1') to densities covering every leaf, or a `LagsPlan`.
        The paper uses 0.001 (compression ratio 1000) for CNNs.
      selector: "sampled" (a block-sampled threshold refined to exactly k without a sort:
        the same entries as `lax.top_k`, several times faster on a CPU for large k; see
        `gradcomm.sparse`) or "exact" (`lax.top_k`).

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `LagsState`.

    Raises:
      ValueError: for a density outside (0, 1] or an unknown selector at construction;
        at trace time for density names that match no leaf or leaves with no density,
        an unbound axis or a non-floating leaf.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.lags("data", density=0.5)
      >>> updates = jnp.array([[4.0, 1.0], [0.0, -2.0]])  # one row per device
      >>> state = tx.init(updates[0])
      >>> out, state = jax.vmap(lambda u: tx.update(u, state), axis_name="data")(updates)
      >>> out[0], state.residual
      (Array([ 2., -1.], dtype=float32), Array([[0., 1.],
             [0., 0.]], dtype=float32))

    References:
      Shi et al., "Layer-wise Adaptive Gradient Sparsification for Distributed Deep
      Learning with Convergence Guarantees", ECAI 2020: eq. 5 and Algorithm 1.
    """
    _axes.check_axis_name(axis_name)
    _check_density_spec(density)
    sparse.check_selector(selector)

    def init_fn(params: Any) -> LagsState:
        return LagsState(residual=_zeros_like(params))

    @jax.named_scope("gradcomm.lags")
    def update_fn(
        updates: Any, state: LagsState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LagsState]:
        del params, extra_args
        _checks.check_updates(updates, axis_name, "lags")
        n = _axes.axis_size(axis_name)
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
        leaves = [leaf for _, leaf in paths_leaves]
        densities = _leaf_densities(density, _checks.leaf_names([p for p, _ in paths_leaves]))
        residuals = jax.tree.leaves(state.residual)
        out, new_residuals = list(leaves), list(residuals)
        ids = [i for i, leaf in enumerate(leaves) if leaf.size]
        sent, sizes = [], []
        for i in ids:
            acc = sparse.accumulate(residuals[i], leaves[i])
            values, indices = sparse.topk(acc, sparse.num_kept(acc.size, densities[i]), selector)
            sent.append((values, indices))
            sizes.append(acc.size)
            new_residuals[i] = sparse.unsent(acc, indices, residuals[i])
        means = sparse.sum_sparse(sent, sizes, axis_name, divide_by=n)
        for i, mean in zip(ids, means, strict=True):
            out[i] = mean.astype(leaves[i].dtype).reshape(leaves[i].shape)
        new_state = LagsState(
            residual=jax.tree.unflatten(jax.tree.structure(state.residual), new_residuals),
        )
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def slgs(
    axis_name: _axes.AxisName = "data",
    *,
    density: float = 0.001,
    selector: sparse.Selector = "sampled",
) -> optax.GradientTransformationExtraArgs:
    """SLGS-SGD, the single-layer baseline of LAGS: one top-k over the whole flattened model.

    Like `lags`, but the k = round(density * D) entries (D the model's size) are chosen
    across all leaves at once, so a leaf may send many entries or none. Leaves are joined in
    their common dtype.

    Args:
      axis_name: the mesh axis (or tuple of axes) to average over.
      density: k/D in (0, 1].
      selector: "exact" or "sampled", as for `lags`.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is an `SlgsState`.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.slgs("data", density=0.25)
      >>> updates = {"a": jnp.array([[4.0, 1.0], [0.0, 0.0]]),  # one row per device
      ...            "b": jnp.array([[0.5, 0.0], [3.0, 0.0]])}
      >>> state = tx.init({"a": jnp.zeros(2), "b": jnp.zeros(2)})
      >>> out = jax.vmap(lambda u: tx.update(u, state)[0], axis_name="data")(updates)
      >>> out["a"][0], out["b"][0]
      (Array([2., 0.], dtype=float32), Array([1.5, 0. ], dtype=float32))

    References:
      Shi et al., ECAI 2020: the SLGS-SGD baseline of sections 3 and 6.
    """
    _axes.check_axis_name(axis_name)
    sparse.check_density(density)
    sparse.check_selector(selector)

    def init_fn(params: Any) -> SlgsState:
        return SlgsState(residual=_zeros_like(params))

    @jax.named_scope("gradcomm.slgs")
    def update_fn(
        updates: Any, state: SlgsState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, SlgsState]:
        del params, extra_args
        _checks.check_updates(updates, axis_name, "slgs")
        n = _axes.axis_size(axis_name)
        leaves, treedef = jax.tree.flatten(updates)
        residuals = jax.tree.leaves(state.residual)
        dtype = jnp.result_type(*leaves)
        accs = [
            sparse.accumulate(r, u).astype(dtype) for r, u in zip(residuals, leaves, strict=True)
        ]
        acc = _packing.concatenate(accs)
        values, indices = sparse.topk(acc, sparse.num_kept(acc.size, density), selector)
        sizes = [a.size for a in accs]
        means = sparse.sum_sparse_segments((values, indices), sizes, axis_name, divide_by=n)
        out, new_residuals, start = [], [], 0
        for leaf, r, a, mean in zip(leaves, residuals, accs, means, strict=True):
            # The leaf's acc with its sent entries zeroed: no model-sized slicing.
            segment = sparse.segment(indices, start, a.size)
            out.append(mean.astype(leaf.dtype).reshape(leaf.shape))
            new_residuals.append(sparse.unsent(a, segment, r, unique_indices=False))
            start += a.size
        new_state = SlgsState(
            residual=jax.tree.unflatten(jax.tree.structure(state.residual), new_residuals),
        )
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def lags_delta(
    acc: Any,
    density: Density,
    axis_name: _axes.AxisName = "data",
    *,
    selector: sparse.Selector = "sampled",
) -> Any:
    """Assumption 1's check, eq. 20, per leaf: delta(l) <= 1 means the assumption holds.

        delta = |sum_p x_p - sum_p TopK(x_p, k)|^2 / E|sum_p x_p - RandK(sum_p x_p, k)|^2,

    with `x_p = residual + update` on device p (what `lags` selects from) and the
    denominator's expectation `(1 - k/d) |sum_p x_p|^2`. Call inside `shard_map` (or a named
    `vmap`) over `axis_name`; it sums dense vectors, so it is a diagnostic, not a fast path.

    Args:
      acc: this device's pytree of accumulated updates.
      density: as for `lags`.
      axis_name: the axis the devices are on.
      selector: as for `lags`.

    Returns:
      A pytree of float32 scalars like `acc` (0 where k = d).

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> x = jnp.array([[3.0, 0.1, 0.2, 0.0], [2.5, 0.0, -0.1, 0.1]])
      >>> delta = jax.vmap(lambda a: gradcomm.lags_delta(a, 0.25, "d"), axis_name="d")(x)
      >>> bool(delta[0] < 1)
      True

    References:
      Shi et al., ECAI 2020: Assumption 1 and eq. 20.
    """
    _check_density_spec(density)
    sparse.check_selector(selector)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(acc)
    leaves = [leaf for _, leaf in paths_leaves]
    densities = _leaf_densities(density, _checks.leaf_names([p for p, _ in paths_leaves]))
    deltas = []
    for leaf, d in zip(leaves, densities, strict=True):
        x = leaf.ravel().astype(_axes.compute_dtype(leaf.dtype))
        k = sparse.num_kept(x.size, d)
        values, indices = sparse.topk(x, k, selector)
        total, sent = lax.psum((x, sparse.densify(values, indices, x.size)), axis_name)
        missed = jnp.sum(jnp.square(total - sent))
        expected = (1 - k / x.size) * jnp.sum(jnp.square(total))
        deltas.append(jnp.where(expected > 0, missed / expected, 0.0).astype(jnp.float32))
    return jax.tree.unflatten(treedef, deltas)


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
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = _checks.leaf_names([p for p, _ in paths_leaves])
    leaves = [leaf for _, leaf in paths_leaves]

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
