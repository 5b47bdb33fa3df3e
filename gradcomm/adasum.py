"""Adasum: adaptive summation of per-device updates (Maleki et al., MLSys 2021).

The pairwise operator (eq. 8), for two vectors `a` and `b`:

    AS(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b,

adds orthogonal vectors, averages parallel ones, and is applied per leaf (layer-wise, 3.5).
Across N devices it is applied as the balanced binary tree in device-index order (eq. 9),
computed by recursive vector-halving distance-doubling (Algorithm 1) over `lax.ppermute`.

How gradcomm computes it:

* Leaves of one dtype are fused into one buffer, each leaf split into P = 2^floor(log2 N)
  rows, so a level of the tree costs one `ppermute` (plus one small `all_gather` of per-leaf
  dot products) whatever the number of leaves.
* Level j pairs device i with i ^ 2^j; each keeps the half of the rows whose bit j matches
  its own and sends the other half. After log2 P levels device i holds row i of the result,
  and one `all_gather` gives every device the same bits. Bytes sent per device: (P-1)/P of
  the buffer in the halving phase and (N-1)/P in the gather, like a ring all-reduce.
* Every swap is between two devices, i and i ^ 2^j. Over a mesh axis factored into size-2
  axes they differ in one axis, and the swap can be a two-member reduce-scatter over it
  (`exchange="pairwise"`, `_collectives.exchange`), which gloo runs at full speed both ways; the
  final gather is then reverse doubling, one exchange per axis. Same bits, same bytes.
* Per level, one pass computes per-leaf dot products and norms, the group (the 2^(j+1)
  devices that hold slices of the pair) sums them, and a second pass combines.
* For N = P + r (0 < r < P), device P + i first sends its vector to device i, which holds
  AS(g_i, g_{P+i}); the P devices then run the tree. N = 1 is the identity.
* Dot products and norms are accumulated in at least float32 (float64 for float64 input,
  as Horovod does in double), on operands scaled per leaf by exact powers of two taken
  from each device's maximum, so leaves of magnitude 1e-30 or 1e30 neither underflow nor
  overflow. Scaling both operands leaves the coefficients unchanged.
* A leaf whose |a|^2 is zero gets coefficient 1 for `a`, so AS(0, b) = b. A leaf with a
  non-finite value on any device is NaN on every device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gradcomm import _axes, _checks, _collectives, _flat, _numeric
from gradcomm._flat import FlatLayout

_NUM_STATS = 5  # scale_a, scale_b, a.b, a.a, b.b per leaf


class AdasumState(NamedTuple):
    """State of `adasum`: empty; Adasum is stateless."""


def _local_stats(own: jax.Array, other: jax.Array, layout: FlatLayout, ct: np.dtype) -> jax.Array:
    """Per-leaf (scale_own, scale_other, own.other, own.own, other.other) here: `(5, leaves)`.

    One pass sums the products and the L1 norms. Where every squared norm is zero or
    within 2^(minexp/2) .. 2^(maxexp-28) of the compute dtype, nothing overflowed and what
    underflowed is negligible, so the scales are 1 (0 for a zero leaf). Otherwise (tiny,
    huge or non-finite values) a second pass divides by exact powers of two taken from
    the per-leaf maxima.
    """
    info = jnp.finfo(ct)
    x, y = own.astype(ct), other.astype(ct)
    sums = layout.segment_sum([x * y, x * x, y * y, jnp.abs(x), jnp.abs(y)])
    zero = sums[3:] == 0
    squares = sums[1:3]
    in_range = (squares >= 2.0 ** (info.minexp // 2)) & (squares <= 2.0 ** (info.maxexp - 28))

    def unscaled() -> jax.Array:
        return jnp.concatenate([jnp.where(zero, 0, 1).astype(ct), sums[:3]])

    def scaled() -> jax.Array:
        scale, inverse = _numeric.pow2_scale(layout.segment_max([jnp.abs(x), jnp.abs(y)]))
        xs = x * layout.per_block(inverse[0])
        ys = y * layout.per_block(inverse[1])
        return jnp.concatenate([scale, layout.segment_sum([xs * ys, xs * xs, ys * ys])])

    return lax.cond(jnp.all(zero | in_range), unscaled, scaled)


def _merge_stats(stats: jax.Array) -> tuple[jax.Array, ...]:
    """Per-leaf totals (Sa, Sb, a.b, a.a, b.b) over members `(members, 5, leaves)`.

    Rescales each member's products to the group's largest scale; the ratios of powers of
    two are exact and the sum runs in member order, so every member of a group computes
    the same bits.
    """
    scale_a, scale_b, ab, aa, bb = (stats[:, i] for i in range(_NUM_STATS))
    group_a, group_b = scale_a.max(0), scale_b.max(0)
    wa = jnp.where(group_a > 0, scale_a / group_a, 0)
    wb = jnp.where(group_b > 0, scale_b / group_b, 0)
    return (
        group_a,
        group_b,
        (wa * wb * ab).sum(0),
        (wa * wa * aa).sum(0),
        (wb * wb * bb).sum(0),
    )


def _coefficients(totals: tuple[jax.Array, ...]) -> jax.Array:
    """Per leaf (D_a, f_a, k_a, D_b, f_b, k_b, S): AS(a, b) = S (t_a + t_b), where with
    a_s = a / D_a the term is t_a = a_s - k_a a_s if f_a else -(k_a a_s).

    eq. 8's `a` term is a (1 - c_a) for the coefficient c_a = a.b / (2|a|^2). With a' =
    a / Sa and b' = b / Sb the scaled operands (Sa, Sb exact powers of two), c_a = q_a
    (Sb / Sa) for q_a = a'.b' / (2|a'|^2), a number of order one at most 2 size. As
    Horovod does, the coefficients come first and the scale last: both terms are formed
    at the scale of S = max(Sa, Sb) (D_a = S, k_a = c_a), summed, and only the sum is
    multiplied by S. So an intermediate that would fall below the normal range (the
    correction term of a pair near the float minimum) is never formed, and only a result
    that is itself subnormal can flush. Where c_a exceeds 2^64 (b larger than a by as
    much), a (1 - c_a) / S is -q_a (a / Sa) to within 2^-64: D_a = Sa, k_a = q_a.

    The division by an exact power of two is exact, and unlike a product it cannot be
    contracted into a fused multiply-add: each term has one product (XLA:CPU contracts
    `a_s - k a_s` into one FMA, the only one possible) and their sum has none. So every
    device, and every compilation of the same step, computes the same bits. q_a = 0
    where a is zero; everything is NaN for a leaf whose sums are not finite.
    """
    scale_a, scale_b, ab, aa, bb = totals
    bad = jnp.where(jnp.isfinite(ab) & jnp.isfinite(aa) & jnp.isfinite(bb), 0, jnp.nan)
    scale = jnp.maximum(scale_a, scale_b)

    def positive(s: jax.Array) -> jax.Array:  # a divisor: a power of two, or 1 for zero
        return jnp.where(s > 0, s, 1)

    def term(q: jax.Array, own: jax.Array, other: jax.Array) -> list[jax.Array]:
        c = q * other / positive(own)
        first = jnp.abs(c) <= 2.0**64
        return [
            jnp.where(first, positive(scale), positive(own)),
            jnp.where(first, 1, 0),
            jnp.where(first, c, q) + bad,
        ]

    qa = jnp.where(aa > 0, ab / (2 * aa), 0)
    qb = jnp.where(bb > 0, ab / (2 * bb), 0)
    return jnp.stack([*term(qa, scale_a, scale_b), *term(qb, scale_b, scale_a), scale])


# Index maps between (own, other) and (a, b) order, for the device whose own part is b.
_SWAP_STATS = np.array([1, 0, 2, 4, 3], np.int32)
_SWAP_COEFFICIENTS = np.array([3, 4, 5, 0, 1, 2, 6], np.int32)


@jax.named_scope("combine")
def _pair(
    own: jax.Array,
    other: jax.Array,
    layout: FlatLayout,
    own_is_b: jax.Array | bool = False,
    group: Callable[[jax.Array], jax.Array] | None = None,
    halves: bool = False,
) -> Any:
    """AS(a, b) leaf by leaf (eq. 8), where a group of devices may each hold a slice.

    Args:
      own, other: `(rows, blocks, block)` slices in the layout: this device's part, and the
        part it received. Which of them is `a` (the lower-index operand) is `own_is_b`;
        swapping per-leaf scalars rather than the slices keeps large selects off the path.
      layout: the fused layout.
      own_is_b: whether `own` is the `b` operand.
      group: None when a and b are whole on this device; else a function from this
        device's stats to those of every device that holds a slice of the pair, in
        device order, `(members, 5, leaves)` (`_group_stats`).
      halves: return the result's first and second halves of rows as two arrays.
    """
    ct = _axes.compute_dtype(own.dtype)
    stats = _local_stats(own, other, layout, ct)
    stats = jnp.where(own_is_b, stats[_SWAP_STATS], stats)
    members = stats[None] if group is None else group(stats)
    coef = _coefficients(_merge_stats(members))
    coef = layout.per_block(jnp.where(own_is_b, coef[_SWAP_COEFFICIENTS], coef).T)

    def combine(x: jax.Array, y: jax.Array) -> jax.Array:
        x, y = x.astype(ct), y.astype(ct)
        d_x, f_x, k_x, d_y, f_y, k_y, scale = (coef[..., i] for i in range(7))

        def term(v: jax.Array, d: jax.Array, first: jax.Array, k: jax.Array) -> jax.Array:
            v = v / d
            return jnp.where(first > 0, v - k * v, -(k * v))

        # The sum commutes bit for bit: both members of a pair compute the same result.
        out = (term(x, d_x, f_x, k_x) + term(y, d_y, f_y, k_y)) * scale
        return out.astype(own.dtype)

    if not halves:
        return combine(own, other)
    # The next level keeps the first half of the rows and sends the second: computing
    # them as two arrays lets the send buffer go to ppermute without a copy.
    half = own.shape[0] // 2
    return combine(own[:half], other[:half]), combine(own[half:], other[half:])


def _bit_reversed(width: int) -> np.ndarray:
    """i with its `width` low bits reversed, for i < 2**width."""
    return np.array([int(f"{i:0{width}b}"[::-1], 2) if width else 0 for i in range(1 << width)])


def _group_stats(
    axis_name: _axes.AxisName,
    size: int,
    in_tree: int,
    index: jax.Array,
    pairwise: bool,
    local_axis: _axes.AxisName | None = None,
) -> Callable[[jax.Array], jax.Array]:
    """Stats of the aligned group of `size` devices that holds one pair, in device order.

    Over size-2 axes the group spans the pair axes of the distances below `size`, and one
    all-gather over them collects it; otherwise all devices gather and each picks its group.
    With `local_axis`, each group device's node-mates hold slices of the pair too: the
    members are every (local device, group device), local-major, gathered in the same
    all-gather where the axes are size-2 ones.
    """
    local = () if local_axis is None else _axes.axis_names(local_axis)
    if pairwise:
        axes = tuple(
            _collectives.pair_axis(axis_name, 1 << j) for j in range(size.bit_length() - 1)
        )
        return lambda stats: lax.all_gather(stats, local + axes[::-1])

    def gather(stats: jax.Array) -> jax.Array:
        gathered = lax.all_gather(stats, axis_name)[:in_tree]
        grouped = gathered.reshape(in_tree // size, size, *stats.shape)
        members = lax.dynamic_index_in_dim(grouped, index // size, keepdims=False)
        if not local:
            return members
        return lax.all_gather(members, local).reshape(-1, *stats.shape)

    return gather


def _adasum_fused(
    leaves: list[jax.Array],
    axis_name: _axes.AxisName,
    n: int,
    index: jax.Array,
    pairwise: bool,
    local_axis: _axes.AxisName | None = None,
) -> list[jax.Array]:
    """Adasum across the axis of same-dtype leaves, fused into one buffer (Algorithm 1).

    Level j pairs device i with i ^ 2^j, which differ in bit j. Each device stores its
    rows in the order p -> row i ^ bitreverse(p): at every level the rows it keeps are the
    first half of its buffer and the rows it sends the second half, in the order its
    partner keeps them; after the last level it holds row i. With `pairwise`, every swap
    and the final gather are `_collectives.exchange`s over the size-2 axes.

    With `local_axis` (L devices per node), the buffer has L times the rows: a
    reduce-scatter over the node leaves each local device the node's mean of 1/L of
    every leaf, the tree runs on those slices with per-leaf statistics gathered over the
    local devices too, and an all-gather within the node reassembles the result. So
    each of a node's L devices sends 1/L of the Adasum traffic across nodes.
    """
    in_tree = 1 << (n.bit_length() - 1)
    levels = in_tree.bit_length() - 1
    folded = n - in_tree
    per_node = 1 if local_axis is None else _axes.axis_size(local_axis)
    layout = FlatLayout.of([leaf.shape for leaf in leaves], rows=in_tree * per_node)
    x = layout.pack(leaves, leaves[0].dtype)
    if local_axis is not None:
        x = lax.psum_scatter(x, local_axis, scatter_dimension=0, tiled=True) / per_node
    if folded:
        partner = _collectives.ppermute(x, axis_name, [(in_tree + i, i) for i in range(folded)])
        whole = None if local_axis is None else lambda stats: lax.all_gather(stats, local_axis)
        x = lax.cond(index < folded, lambda: _pair(x, partner, layout, group=whole), lambda: x)
    if levels:
        rows = (index % in_tree) ^ jnp.asarray(_bit_reversed(levels), index.dtype)
        own, send = (jnp.take(x, r, axis=0, mode="clip") for r in jnp.split(rows, 2))
    for level in range(levels):
        distance = 1 << level
        own_is_b = (index >> level) & 1 == 1
        with jax.named_scope("exchange"):
            if pairwise:
                received = _collectives.exchange(send, axis_name, distance)
            else:
                pairs = [(i, i ^ distance) for i in range(in_tree)]
                received = _collectives.ppermute(send, axis_name, pairs)
        group = _group_stats(axis_name, 2 * distance, in_tree, index, pairwise, local_axis)
        if level + 1 < levels:
            own, send = _pair(own, received, layout, own_is_b, group, halves=True)
        else:
            x = _pair(own, received, layout, own_is_b, group)
    with jax.named_scope("gather"):
        if pairwise:
            rows = _collectives.all_gather_pairwise(x[0], axis_name)
        else:
            rows = _collectives.all_gather_invariant(x[0], axis_name)[:in_tree]
        if local_axis is not None:
            rows = _collectives.all_gather_invariant(rows, local_axis, tiled=True)
    return layout.unpack(rows)


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
        doubling) are two-member exchanges (a reduce-scatter of the bits over one size-2
        axis, each device's in its partner's slot: the same data bit for bit, the same
        bytes); needs
        `axis_name` to be a tuple of size-2 mesh axes (`gradcomm.parallel.pairwise_axes`)
        or one axis of size 2. "auto": "pairwise" where the axes allow it on CPU devices
        in several processes (gloo, which runs a swapping `ppermute` at half speed),
        "permute" elsewhere (GPU, TPU, one process). gloo's reduce-scatter costs more CPU
        than a swap: on links faster than a few Gbit/s "permute" steps faster (README,
        "Does it save time?"). The result is the same bits.

    Returns:
      A pytree like `tree` holding, per leaf, the Adasum over devices: the balanced tree
      in device-index order for a power-of-two axis size, with the fold described in the
      module docstring otherwise.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> g = jnp.array([[3.0, 0.0], [0.0, 4.0]])  # two devices, orthogonal rows
      >>> jax.vmap(lambda x: gradcomm.adasum_reduce(x, "d"), axis_name="d")(g)[0]
      Array([3., 4.], dtype=float32)

    References:
      Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021:
      eq. 8 (operator), eq. 9 (recursion), Algorithm 1 (ADASUM_RVHDD), section 3.5.
    """
    _axes.check_exchange(exchange)
    every_axis = _axes.axis_names(axis_name) + _axes.axis_names(local_axis or ())
    _checks.check_updates(tree, every_axis, "adasum")
    n = _axes.axis_size(axis_name)
    index = _axes.axis_index(axis_name)
    pairwise = _axes.use_pairwise(axis_name, exchange, "adasum")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = [jnp.zeros(leaf.shape, leaf.dtype) for leaf in leaves]  # empty leaves stay empty
    for ids in _flat.dtype_groups(leaves):
        group = [leaves[i] for i in ids]
        results = _adasum_fused(group, axis_name, n, index, pairwise, local_axis)
        for i, result in zip(ids, results, strict=True):
            out[i] = result
    return jax.tree_util.tree_unflatten(treedef, out)


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
      >>> import jax.numpy as jnp, gradcomm
      >>> gradcomm.adasum_pair(jnp.array([2.0, 0.0]), jnp.array([4.0, 0.0]))  # parallel
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
    out = list(a_leaves)
    for ids in _flat.dtype_groups(a_leaves):
        layout = FlatLayout.of([a_leaves[i].shape for i in ids], rows=1)
        dtype = a_leaves[ids[0]].dtype
        x = layout.pack([a_leaves[i] for i in ids], dtype)
        y = layout.pack([b_leaves[i] for i in ids], dtype)
        for i, result in zip(ids, layout.unpack(_pair(x, y, layout)), strict=True):
            out[i] = result
    return jax.tree_util.tree_unflatten(treedef, out)


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
      A pytree like `tree` of float32 scalars (NaN for a leaf that is zero everywhere).

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> g = jnp.array([[1.0, 0.0], [0.0, 1.0]])
      >>> jax.vmap(lambda x: gradcomm.orthogonality(x, "d"), axis_name="d")(g)[0]
      Array(1., dtype=float32)

    References:
      Maleki et al., MLSys 2021, section 5.1.3 and Fig. 2.
    """
    if combined is None:
        combined = adasum_reduce(tree, axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    sums = jax.tree_util.tree_leaves(combined)
    wide = [x.astype(_axes.compute_dtype(x.dtype)) for x in leaves]
    ct = jnp.result_type(*wide) if wide else jnp.float32
    maxima = jnp.stack([jnp.max(jnp.abs(x), initial=0).astype(ct) for x in wide])
    _, inverse = _numeric.pow2_scale(lax.pmax(maxima, axis_name))
    squares = [jnp.sum(jnp.square(x * s)) for x, s in zip(wide, inverse.astype(ct), strict=True)]
    total = lax.psum(jnp.stack(squares), axis_name)
    result = [
        jnp.sum(jnp.square(c.astype(ct) * s)) / t
        for c, s, t in zip(sums, inverse, total, strict=True)
    ]
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
        `adasum_reduce`). Across CPU processes (gloo), factor the data axis into size-2
        axes (`gradcomm.parallel.pairwise_axes`) and pass them all as `axis_name`: "auto"
        then makes every exchange full duplex. The result is the same bits.

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
      >>> jax.vmap(step, axis_name="data")(grads)[0]
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

    @jax.named_scope("gradcomm.adasum")
    def update_fn(
        updates: Any, state: AdasumState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, AdasumState]:
        del state, params, extra_args
        updates = adasum_reduce(updates, axis_name, local_axis=local_axis, exchange=exchange)
        return updates, AdasumState()

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
