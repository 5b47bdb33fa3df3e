"""LAGS-SGD: layer-wise adaptive top-k sparsification with residuals (Shi et al., ECAI 2020).

Each device adds the leaf's update to its residual, sends the k(l) entries of largest
magnitude, keeps the rest, and the devices average what was sent (eq. 5, Algorithm 1):

    acc = residual + update;   residual' = acc - TopK(acc, k(l));
    update' = (1/P) sum_p TopK(acc_p, k(l)).

The density k(l)/d(l) may differ per leaf; `lags_plan` picks it so that each leaf's
communication hides behind the backward pass of the leaves after it (eq. 18).
`slgs` is the single-layer baseline: one top-k over the whole flattened model.
Diagnostics: `lags_delta` (Assumption 1, eq. 20) and `lags_speedup_bound` (eq. 19).

Re-exported here: the planner (`lags_plan`, `lags_profile`, `lags_speedup_bound`,
`LagsPlan`) is `gradcomm.lags._plan`'s, `slgs` and `SlgsState` are
`gradcomm.lags._slgs`'s; what both methods do with `specs` (FSDP flags, tie orders) is
`gradcomm.lags._specs`'s. The top-k, the exchange and error feedback are
`gradcomm.sparse`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _axes, _checks, _numeric, _shards, registry, sparse
from gradcomm.lags import _specs
from gradcomm.lags._plan import LagsPlan, lags_plan, lags_profile, lags_speedup_bound
from gradcomm.lags._slgs import SlgsState, slgs

__all__ = [
    "Density",
    "LagsPlan",
    "LagsState",
    "SlgsState",
    "lags",
    "lags_delta",
    "lags_plan",
    "lags_profile",
    "lags_speedup_bound",
    "slgs",
]


class LagsState(NamedTuple):
    """State of `lags`: per leaf, what this device has not sent (the residual)."""

    residual: Any


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


def lags(
    axis_name: _axes.AxisName = "data",
    *,
    density: Density = 0.001,
    selector: sparse.Selector = "sampled",
    specs: Any = None,
    fsdp_topk: sparse.FsdpTopK = "whole",
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

    Inside `shard_map` over a mesh with axes beyond `axis_name` (tensor parallelism), a
    leaf sharded over them is a piece of its tensor: k, the size test and the top k are
    the whole tensor's (`sparse.topk_over_shards`), each piece sends about 1/S of the
    pairs over `axis_name`, and the result is the whole tensor's, bit for bit. Ties at
    the threshold (Adam's first updates before lags are nearly all of one magnitude) go
    to lower positions in the whole tensor's row-major order where `specs` gives the
    leaf's `PartitionSpec` (`_shards.global_index`), which selects the whole tensor's
    entries in every layout; without it, to lower positions in shard-major order (piece
    s's element j at `s * piece + j`), which is the row-major order only where the leaf
    is split along its leading dimension: a leaf split along another one (a
    column-split kernel, `P(None, "model")`) may then send other tied entries than the
    whole tensor would.

    With FSDP (ZeRO-3, `specs`: a param split along its leading dimension over
    `axis_name`, `P("data", ...)`, as `gradcomm.parallel.shard_params` places it), the
    update of such a leaf comes in whole (the gradient of the gathered param) and leaves
    as this device's shard of the mean, the same bits as the slice of the mean without
    FSDP: each device selects from its whole accumulator as above (same k, same pairs,
    same residual), the pairs go in the same all-gather, and each device decodes only its
    shard (`sparse.sum_scattered`). That is (N - 1) k pairs per device, as without FSDP:
    no fixed-capacity exchange can send the (N - 1) / N k of a reduce-scatter exactly
    (see `gradcomm.sparse`). `fsdp_topk="per_shard"` sends that: each of an FSDP leaf's
    N shards is a layer of its own, its top `round(density * size / N)` entries chosen
    on every device (`sparse.topk_per_shard`), and one all-to-all sends device j the
    pairs of shard j, (N - 1) / N of the leaf's k per device: a reduce-scatter of the
    compressed vector. The entries differ from the whole leaf's top k where a shard
    holds more or fewer of them than its share. The residual is this device's unsent
    part of its own whole gradient, so it stays whole-sized and per device: `init`
    builds it, `(1, rows, ...)`, from the shard it is given inside the map
    (`parallel.init_state`; outside a map, from the whole param), and
    `parallel.train_step` keeps it `(N, rows, ...)`, one per device. Params and the
    optimizer's state after lags are 1/N per device; the residual is not. Place lags
    before the optimizer, or after a stateless one (`optax.chain(optax.sgd(0.1),
    lags)`): an optimizer before it would see whole gradients with state shaped like
    the shards (Adam's moments would have to be whole and per device, N times FSDP's),
    which `parallel.init_state` rejects.

    Args:
      axis_name: the mesh axis (or tuple of axes) to average over.
      density: k/d in (0, 1]: one float for every leaf, a mapping from leaf names (or
        '/'-prefixes, like 'Dense_1') to densities covering every leaf, or a `LagsPlan`.
        The paper uses 0.001 (compression ratio 1000) for CNNs.
      selector: "sampled" (a block-sampled threshold refined to exactly k without a sort:
        the same entries as `lax.top_k`, several times faster on a CPU for large k; see
        `gradcomm.sparse`) or "exact" (`lax.top_k`).
      specs: None, or the params' `PartitionSpec`s (a pytree like them; None for a
        leaf whose spec is not given). A leaf whose spec splits its leading dimension
        over `axis_name`, `P("data", ...)`, is FSDP-split: its update comes in whole and
        leaves as this device's shard of the mean, its leading dimension divided by N
        (which must divide it); an FSDP leaf must not also be split over another mesh
        axis. A leaf split over other mesh axes (known by its type) breaks ties by its
        spec in the whole tensor's row-major order (see above), so its spec must name
        those axes.
      fsdp_topk: "whole" (an FSDP leaf's whole top k, the entries chosen without FSDP,
        (N - 1) k pairs per device) or "per_shard" (each shard's own top entries at the
        same density, (N - 1) / N k pairs per device: a reduce-scatter); needs `specs`.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `LagsState`.

    Raises:
      ValueError: for a density outside (0, 1], an unknown selector or fsdp_topk, or
        fsdp_topk="per_shard" without specs at construction;
        at trace time for density names that match no leaf or leaves with no density,
        an unbound axis, a non-floating leaf, or a mesh with axes beyond `axis_name`
        under `shard_map(check_vma=False)` (which hides which leaves are sharded); with
        `specs`, for specs not shaped like the updates, an FSDP leaf whose leading
        dimension N does not divide, that is split over other mesh axes too, or whose
        residual is not whole-sized, or a leaf split over other mesh axes than its spec
        names.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.lags("data", density=0.5)
      >>> updates = jnp.array([[4.0, 1.0], [0.0, -2.0]])  # one row per device
      >>> state = tx.init(updates[0])
      >>> out, state = jax.jit(jax.vmap(lambda u: tx.update(u, state), axis_name="data"))(updates)
      >>> out[0], state.residual
      (Array([ 2., -1.], dtype=float32), Array([[0., 1.],
             [0., 0.]], dtype=float32))

      With FSDP, device j keeps element j of the mean (its shard of a leaf split over
      "data"), and its whole-sized residual:

      >>> from jax.sharding import PartitionSpec as P
      >>> tx = gradcomm.lags("data", density=0.5, specs=P("data"))
      >>> state = tx.init(updates[0])  # outside a map: from the whole param, (1, 2)
      >>> out, state = jax.jit(jax.vmap(lambda u: tx.update(u, state), axis_name="data"))(updates)
      >>> out, state.residual.shape
      (Array([[ 2.],
             [-1.]], dtype=float32), (2, 1, 2))

    References:
      Shi et al., "Layer-wise Adaptive Gradient Sparsification for Distributed Deep
      Learning with Convergence Guarantees", ECAI 2020: eq. 5 and Algorithm 1.
    """
    _axes.check_axis_name(axis_name)
    _check_density_spec(density)
    sparse.check_selector(selector)
    sparse.check_fsdp_topk(fsdp_topk, specs, "lags")

    def init_fn(params: Any) -> LagsState:
        return LagsState(residual=sparse.zero_residuals(params, specs, axis_name, "lags"))

    def step(inputs: _specs.Inputs) -> tuple[list[jax.Array], list[jax.Array]]:
        leaves, names, residuals, fsdp, leaf_specs = inputs
        n = _axes.axis_size(axis_name)
        densities = _leaf_densities(density, names)
        out, new_residuals = list(leaves), list(residuals)
        for i in (i for i, split in enumerate(fsdp) if split):
            sparse.check_whole_residual(residuals[i], leaves[i], n, "lags", names[i])
            out[i] = _shard_shaped(leaves[i], n)  # an empty leaf's (empty) shard
        ids = [i for i, leaf in enumerate(leaves) if leaf.size]
        sent, sizes, shards = [], [], []
        for i in ids:
            acc = sparse.accumulate(residuals[i], leaves[i])
            axes = _shards.shard_axes(acc, axis_name, "lags")
            if fsdp[i]:
                sparse.check_fsdp_axes(axes, "lags", names[i])
            k = sparse.num_kept(acc.size * _shards.num_shards(axes), densities[i])
            if axes:  # a piece of the leaf: the whole leaf's top k
                spec = leaf_specs[i]  # given: ties in the whole leaf's row-major order
                order = None
                if spec is not None:
                    order = [_specs.whole_order(leaves[i], spec, axes, axis_name, "lags", names[i])]
                picked = sparse.topk_over_shards([acc], [axes], k, selector, order)[0]
                sent.append(picked)
                kept = sparse.unsent(acc, picked.indices, residuals[i], unique_indices=False)
            elif fsdp[i] and fsdp_topk == "per_shard":
                c = sparse.num_kept(acc.size // n, densities[i])
                sent.append(sparse.topk_per_shard(acc, n, c, selector))
                kept = sparse.unsent(acc, sent[-1].indices, residuals[i])
            else:
                values, indices = sparse.topk(acc, k, selector)
                sent.append((values, indices))
                kept = sparse.unsent(acc, indices, residuals[i])
            sizes.append(acc.size)
            shards.append(axes)
            new_residuals[i] = kept
        scatter = [fsdp[i] for i in ids] if any(fsdp) else None
        means = sparse.sum_sparse(
            sent, sizes, axis_name, divide_by=n, shards=shards, scatter=scatter
        )
        for i, mean in zip(ids, means, strict=True):
            out[i] = mean.astype(leaves[i].dtype).reshape(out[i].shape)
        return out, new_residuals

    return _specs.with_specs("lags", axis_name, LagsState, init_fn, specs, step)


def _shard_shaped(leaf: jax.Array, n: int) -> jax.Array:
    """The leading-dimension slice 0 of n of a whole FSDP leaf: its shard's shape and
    dtype (n divides the leading dimension: `sparse.check_whole_residual` checked)."""
    return leaf[: leaf.shape[0] // n]


def lags_delta(
    acc: Any,
    density: Density,
    axis_name: _axes.AxisName = "data",
    *,
    selector: sparse.Selector = "sampled",
    specs: Any = None,
) -> Any:
    """Assumption 1's check, eq. 20, per leaf: delta(l) <= 1 means the assumption holds.

        delta = |sum_p x_p - sum_p TopK(x_p, k)|^2 / E|sum_p x_p - RandK(sum_p x_p, k)|^2,

    with `x_p = residual + update` on device p (what `lags` selects from) and the
    denominator's expectation `(1 - k/d) |sum_p x_p|^2`. Call inside `shard_map` (or a named
    `vmap`) over `axis_name`; it sums dense vectors, so it is a diagnostic, not a fast path.
    A leaf sharded over other mesh axes (tensor parallelism) gives its whole tensor's
    delta, with its top k's ties at the threshold broken as `lags` breaks them: in the
    whole tensor's row-major order where `specs` gives its `PartitionSpec`, else in
    shard-major order.

    Args:
      acc: this device's pytree of accumulated updates.
      density: as for `lags`.
      axis_name: the axis the devices are on.
      selector: as for `lags`.
      specs: None, or the `PartitionSpec`s of `acc`'s leaves (a pytree like it; None for
        a leaf whose spec is not given), as for `lags`.

    Returns:
      A pytree of float32 scalars like `acc` (0 where k = d).

    Raises:
      ValueError: for density names that match no leaf or leaves with no density, an
        unknown selector, specs not shaped like `acc`, or a leaf split over other mesh
        axes than its spec names.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> x = jnp.array([[3.0, 0.1, 0.2, 0.0], [2.5, 0.0, -0.1, 0.1]])
      >>> delta = jax.jit(jax.vmap(lambda a: gradcomm.lags_delta(a, 0.25, "d"), axis_name="d"))(x)
      >>> bool(delta[0] < 1)
      True

    References:
      Shi et al., ECAI 2020: Assumption 1 and eq. 20.
    """
    _check_density_spec(density)
    sparse.check_selector(selector)
    leaves, names, treedef = _checks.named_leaves(acc)
    densities = _leaf_densities(density, names)
    leaf_specs = _shards.leaf_specs(specs, acc, "lags_delta")
    deltas = []
    for leaf, d, spec, name in zip(leaves, densities, leaf_specs, names, strict=True):
        x = leaf.ravel().astype(_numeric.compute_dtype(leaf.dtype))
        axes = _shards.shard_axes(x, axis_name, "lags_delta")
        whole = x.size * _shards.num_shards(axes)
        k = sparse.num_kept(whole, d)
        if axes:  # a piece of a sharded leaf: the whole leaf's top k, norms summed
            order = None
            if spec is not None:
                order = [_specs.whole_order(leaf, spec, axes, axis_name, "lags_delta", name)]
            picked = sparse.topk_over_shards([x], [axes], k, selector, order)[0]
            mine = jnp.zeros_like(x).at[picked.indices].set(picked.values, mode="drop")
        else:
            mine = sparse.densify(*sparse.topk(x, k, selector), x.size)
        total, sent = lax.psum((x, mine), axis_name)
        missed, norm = jnp.sum(jnp.square(total - sent)), jnp.sum(jnp.square(total))
        if axes:
            missed, norm = lax.psum((missed, norm), axes)
        expected = (1 - k / whole) * norm
        deltas.append(jnp.where(expected > 0, missed / expected, 0.0).astype(jnp.float32))
    return jax.tree.unflatten(treedef, deltas)


registry.register(registry.Method(
    lags, "after", title="LAGS-SGD", paper="Shi et al., ECAI 2020", page="lags",
    collectives=sparse.collectives, window="backward",
))  # fmt: skip
