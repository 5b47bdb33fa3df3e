"""Adasum: adaptive summation of per-device updates (Maleki et al., MLSys 2021).

The pairwise operator (eq. 8), for two vectors `a` and `b`:

    AS(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b,

adds orthogonal vectors, averages parallel ones, and is applied per leaf (layer-wise, 3.5).
Across N devices it is applied as the balanced binary tree in device-index order (eq. 9),
computed by recursive vector-halving distance-doubling (Algorithm 1) over `lax.ppermute`.

How gradcomm computes it:

* Leaves of one dtype are fused into one buffer (`gradcomm._flat.FlatBuffers`), each leaf
  split into P = 2^floor(log2 N) rows, so a level of the tree costs one `ppermute` (plus
  a small exchange of per-leaf dot products) whatever the number of leaves.
* Level j pairs device i with i ^ 2^j; each keeps the half of the rows whose bit j matches
  its own and sends the other half. After log2 P levels device i holds row i of the result,
  and one `all_gather` gives every device the same bits. Bytes sent per device: (P-1)/P of
  the buffer in the halving phase and (N-1)/P in the gather, like a ring all-reduce.
* Every swap is between two devices, i and i ^ 2^j, so it can be a reduce-scatter whose
  replica groups are the pairs (`exchange="pairwise"`, `_collectives.swap`), which gloo runs
  at full speed both ways; the final gather is then reverse doubling, one exchange per
  level. Same bits, same bytes.
* Per level, one pass computes per-leaf dot products and norms, the group (the 2^(j+1)
  devices that hold slices of the pair) gathers and sums them, and a second pass
  combines. Only the group exchanges them (recursive doubling within it, or one
  all-gather whose replica groups are the groups), so level j sends 2^(j+1) - 1 members' statistics
  per device, whatever N.
* For N = P + r (0 < r < P), device P + i first sends its vector to device i, which holds
  AS(g_i, g_{P+i}); the P devices then run the tree. N = 1 is the identity.
* Dot products and norms are accumulated in at least float32 (float64 for float64 input,
  as Horovod does in double), on operands scaled per leaf by exact powers of two taken
  from each device's maximum, so leaves of magnitude 1e-30 or 1e30 neither underflow nor
  overflow. Scaling both operands leaves the coefficients unchanged.
* A leaf whose |a|^2 is zero gets coefficient 1 for `a`, so AS(0, b) = b. A leaf with a
  non-finite value on any device is NaN on every device.

The code: `gradcomm.adasum._pair` (the operator on fused buffers and its numerics),
`gradcomm.adasum._rvhdd` (the tree across devices), this module (the public API).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _axes, _checks, _flat, _numeric, _shards, _transform, perfmodel, registry
from gradcomm.adasum import _rvhdd
from gradcomm.adasum._pair import pair

__all__ = ["AdasumState", "adasum", "adasum_pair", "adasum_reduce", "orthogonality"]


class AdasumState(NamedTuple):
    """State of `adasum`: empty; Adasum is stateless."""


def adasum_reduce(
    tree: Any,
    axis_name: _axes.AxisName = "data",
    *,
    local_axis: _axes.AxisName | None = None,
    exchange: _axes.Exchange = "auto",
) -> Any:
    """Adasum of each leaf of `tree` across a named axis: the collective behind `adasum`.

    Call it inside `jax.shard_map`, `jax.pmap` or `jax.vmap` over `axis_name`. Every device
    returns the same bits; under `shard_map` the result is typed as replicated, so it may
    leave the map with `out_specs=P()`.

    Args:
      tree: a pytree of floating-point arrays, this device's values.
      axis_name: the mesh axis (or tuple of axes) to combine over.
      local_axis: optional fast intra-node axis: Adasum of the node means (see `adasum`);
        each of a node's devices carries 1/L of the traffic across nodes.
      exchange: how partners swap halves. "permute": `lax.ppermute`, and one
        `all_gather` at the end. "pairwise": every swap and the final gather (as reverse
        doubling) are two-member exchanges (a reduce-scatter of the bits whose replica
        groups are the pairs, each device's in its partner's slot: the same data bit for
        bit, the same bytes); needs a power-of-two number of devices, and `shard_map` or
        `pmap` (under a named `vmap` it is "permute"). "auto": in a `train_step`
        across processes, whichever its first call timed faster for the whole step
        (`TrainStep.probe`); elsewhere the faster on this link where
        `gradcomm.parallel.calibrate` probed it, else "pairwise" on CPU devices in several
        processes (gloo, which runs a swapping `ppermute` at half speed) and "permute"
        elsewhere (GPU, TPU, one process). The result is the same bits.

    Returns:
      A pytree like `tree` holding, per leaf, the Adasum over devices: the balanced tree
      in device-index order for a power-of-two axis size, with the fold described in the
      module docstring otherwise.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> g = jnp.array([[3.0, 0.0], [0.0, 4.0]])  # two devices, orthogonal rows
      >>> jax.jit(jax.vmap(lambda x: gradcomm.adasum_reduce(x, "d"), axis_name="d"))(g)[0]
      Array([3., 4.], dtype=float32)

    References:
      Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021:
      eq. 8 (operator), eq. 9 (recursion), Algorithm 1 (ADASUM_RVHDD), section 3.5.
    """
    _axes.check_exchange(exchange)
    _checks.check_updates(tree, _every_axis(axis_name, local_axis), "adasum")
    return _combine(tree, axis_name, local_axis, exchange)


def _every_axis(axis_name: _axes.AxisName, local_axis: _axes.AxisName | None) -> tuple[str, ...]:
    """The axes the updates are combined over: `axis_name`, then `local_axis`'s."""
    return _axes.axis_names(axis_name) + _axes.axis_names(local_axis or ())


def _combine(
    tree: Any,
    axis_name: _axes.AxisName,
    local_axis: _axes.AxisName | None,
    exchange: _axes.Exchange,
) -> Any:
    """`adasum_reduce` of updates already checked (by it, or by `adasum`'s frame)."""
    every_axis = _every_axis(axis_name, local_axis)
    in_tree = 1 << (_axes.axis_size(axis_name).bit_length() - 1)
    per_node = 1 if local_axis is None else _axes.axis_size(local_axis)
    index = _axes.axis_index(axis_name)
    pairwise = _axes.use_pairwise(axis_name, exchange, "adasum")
    flat = _flat.FlatBuffers.of(tree, rows=in_tree * per_node)
    leaves = jax.tree.leaves(tree)
    shards = [_shards.shard_axes(leaves[ids[0]], every_axis, "adasum") for ids in flat.groups]
    results = [
        _rvhdd.reduce_buffer(x, layout, axis_name, index, pairwise, local_axis, axes)
        for x, layout, axes in zip(flat.pack(tree), flat.layouts, shards, strict=True)
    ]
    return flat.unpack(results)  # empty leaves are zeros


def adasum_pair(a: Any, b: Any) -> Any:
    """The pairwise Adasum operator, leaf by leaf, on two pytrees (eq. 8).

    `AS(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b` for each pair of leaves,
    with the same numerics as `adasum_reduce` (float32 or wider accumulation, power-of-two
    scaling, coefficient 1 for a zero operand, NaN for a non-finite leaf).

    Args:
      a: a pytree of floating-point arrays (the lower-index operand).
      b: a pytree with the same structure, shapes and dtypes.

    Returns:
      The pytree of AS(a_leaf, b_leaf).

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> pair = jax.jit(gradcomm.adasum_pair)  # one compilation, not one per operation
      >>> pair(jnp.array([2.0, 0.0]), jnp.array([4.0, 0.0]))  # parallel
      Array([3., 0.], dtype=float32)

    References:
      Maleki et al., MLSys 2021, eq. 8 and section 3.5.
    """
    _checks.check_float_leaves((a, b), "adasum_pair")
    a_leaves, treedef = jax.tree_util.tree_flatten(a)
    b_leaves, b_treedef = jax.tree_util.tree_flatten(b)
    if treedef != b_treedef:
        raise ValueError(f"adasum_pair needs matching pytrees, got {treedef} and {b_treedef}")
    for x, y in zip(a_leaves, b_leaves, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(
                f"adasum_pair needs leaves of equal shape and dtype, got "
                f"{x.dtype}{list(x.shape)} and {y.dtype}{list(y.shape)}"
            )
    flat = _flat.FlatBuffers.of(a)
    buffers = zip(flat.pack(a), flat.pack(b), flat.layouts, strict=True)
    return flat.unpack([pair(x, y, layout) for x, y, layout in buffers])


def orthogonality(
    tree: Any, axis_name: _axes.AxisName = "data", *, combined: Any | None = None
) -> Any:
    """Per-leaf orthogonality of the devices' values, `|AS(g)|^2 / sum_i |g_i|^2` (5.1.3).

    1 when the devices' leaves are mutually orthogonal (Adasum sums them), 1/N when they
    are equal (Adasum averages them); in between, how close Adasum is to a sum. Call it
    inside `shard_map`, `pmap` or a named `vmap`, like `adasum_reduce`.

    Args:
      tree: this device's pytree of floating-point arrays.
      axis_name: the axis the values are combined over.
      combined: `adasum_reduce(tree, axis_name)` if already computed, to save a pass.

    Returns:
      A pytree like `tree` of float32 scalars (NaN for a leaf that is zero everywhere),
      of the whole tensors where leaves are split over other mesh axes (`adasum_reduce`).

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> g = jnp.array([[1.0, 0.0], [0.0, 1.0]])
      >>> jax.jit(jax.vmap(lambda x: gradcomm.orthogonality(x, "d"), axis_name="d"))(g)[0]
      Array(1., dtype=float32)

    References:
      Maleki et al., MLSys 2021, section 5.1.3 and Fig. 2.
    """
    if combined is None:
        combined = adasum_reduce(tree, axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    sums = jax.tree_util.tree_leaves(combined)
    shards = [_shards.shard_axes(x, axis_name, "orthogonality") for x in leaves]
    wide = [x.astype(_numeric.compute_dtype(x.dtype)) for x in leaves]
    ct = jnp.result_type(*wide) if wide else jnp.float32
    maxima = jnp.stack([jnp.max(jnp.abs(x), initial=0).astype(ct) for x in wide])
    maxima = _shards.reduce_per_leaf(lax.pmax(maxima, axis_name), shards, lax.pmax)
    _, inverse = _numeric.pow2_scale(maxima)
    squares = [jnp.sum(jnp.square(x * s)) for x, s in zip(wide, inverse.astype(ct), strict=True)]
    total = _shards.reduce_per_leaf(lax.psum(jnp.stack(squares), axis_name), shards)
    combined_squares = jnp.stack(
        [jnp.sum(jnp.square(c.astype(ct) * s)) for c, s in zip(sums, inverse, strict=True)]
    )
    result = list(_shards.reduce_per_leaf(combined_squares, shards) / total)
    return jax.tree_util.tree_unflatten(treedef, [r.astype(jnp.float32) for r in result])


def adasum(
    axis_name: _axes.AxisName = "data",
    *,
    local_axis: _axes.AxisName | None = None,
    exchange: _axes.Exchange = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Adasum of the incoming updates across devices, leaf by leaf.

    Place it after the optimizer, so that every device runs its own optimizer on its own
    gradients and Adasum combines the resulting updates (paper section 4 and A.6; Horovod's
    DistributedOptimizer does the same); the optimizer's state then differs per device
    (see `gradcomm.parallel.init_state`). Placed before an optimizer it combines gradients.

    Args:
      axis_name: the mesh axis (or tuple of axes) across which updates are combined with
        Adasum; with `local_axis`, the axis across nodes.
      local_axis: optional fast intra-node axis. Updates are first averaged over it, then
        combined with Adasum across `axis_name` (Horovod's hierarchical mode; exact since
        AS(c a, c b) = c AS(a, b)). The node mean is reduce-scattered, so each of the L
        devices of a node runs Adasum on 1/L of it and the traffic across nodes is the
        same as with one device per node.
      exchange: "auto", "permute" or "pairwise": how partners swap (see
        `adasum_reduce`); "auto" takes the faster on the link. The result is the same
        bits.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is an `AdasumState`.

    Raises:
      ValueError: at construction for a malformed axis name or a `local_axis` that shares
        an axis with `axis_name`; at trace time for an axis that is not bound or a leaf
        that is not floating point.

    Example:
      >>> import jax, jax.numpy as jnp, optax, gradcomm
      >>> tx = optax.chain(optax.sgd(0.5), gradcomm.adasum("data"))
      >>> grads = jnp.array([[1.0, 0.0], [0.0, 1.0]])  # one row per device
      >>> state = tx.init(grads[0])
      >>> step = lambda g: tx.update(g, state)[0]
      >>> jax.jit(jax.vmap(step, axis_name="data"))(grads)[0]
      Array([-0.5, -0.5], dtype=float32)

    References:
      Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021.
    """
    _axes.check_axis_name(axis_name)
    _axes.check_exchange(exchange)
    if local_axis is not None:
        _axes.check_axis_name(local_axis, "local_axis")
        _axes.check_disjoint(axis_name, local_axis, "axis_name", "local_axis")

    def init_fn(params: Any) -> AdasumState:
        del params
        return AdasumState()

    def step(updates: Any, state: AdasumState, params: Any) -> tuple[Any, AdasumState]:
        del state, params
        return _combine(updates, axis_name, local_axis, exchange), AdasumState()

    checked = _every_axis(axis_name, local_axis)
    return _transform.transformation("adasum", axis_name, init_fn, step, checked_axes=checked)


def _pattern(options: Mapping[str, Any], s: perfmodel.Setting) -> list[perfmodel.Collective]:
    """Fold to P = 2^m devices, m halving swaps (and their dot products), then a gather."""
    del options
    n, size, coll = s.nodes, s.size, perfmodel.Collective
    p = 1 << (n.bit_length() - 1)
    out = [coll("permute", n, size)] if n > p else []
    for level in range(p.bit_length() - 1):
        out += [coll("swap", 2, size / 2 ** (level + 1)), coll("allgather", n, 0)]
    return [*out, coll("doubling_gather", n, n * size / p)]


registry.register(registry.Method(
    adasum, "after", title="Adasum", paper="Maleki et al., MLSys 2021", page="adasum",
    collectives=_pattern, window="backward",
))  # fmt: skip
