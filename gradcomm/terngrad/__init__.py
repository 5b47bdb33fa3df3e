"""TernGrad: stochastic ternary gradients (Wen et al., NeurIPS 2017), with a real wire format.

Each device clips each leaf at `clip * sigma` (eq. 21, sigma the leaf's standard deviation
on that device), ternarizes it with a scalar shared by all devices, the maximum of their
per-leaf maxima (eqs. 1-4),

    g~ = s * sign(g) * b,   b_k ~ Bernoulli(|g_k| / s),   s = max_i max|g_i|,

and the devices average g~. E[g~] = g: the mean is an unbiased estimate of the mean of the
clipped gradients.

What is sent (`wire="packed"`): the codes, packed in base 3 (5 to a byte, 1.6 bits each),
and integer sums of N codes, in [-N, N], packed in base 2N + 1 into uint32 words (about
log2(2N + 1) bits each); plus one float per leaf for the shared scales. Two strategies:

* `all_gather` the packed codes and sum them everywhere: (N - 1) * 1.6 bits per element
  sent per device;
* `all_to_all` the packed codes so that device j sums chunk j of everyone's codes, then
  `all_gather` the packed sums: (N - 1) / N * (1.6 + 32 / k) bits, k the sums per word.

The first is cheaper for N <= 2, the second from N = 3 on, so `"packed"` picks by N;
`"all_gather"` and `"all_to_all"` force one. At N = 8 the second sends about 1/10 of the
bytes of a float32 ring all-reduce (2 (N - 1) / N * 32 bits per element).

`wire="simulate"` dequantizes on each device and averages floats with `lax.psum`, as the
authors' code did. The shared scale is rounded up to nmant + 1 - ceil(log2(N + 1))
significant bits, so that every sum of up to N terms +-s is exact in any order; the two
modes therefore give the same bits, and the estimate stays unbiased (any s >= max|g|
does).

The random bits are a counter-based hash of each element's index, keyed per device and
step by `jax.random`; each leaf is packed on its own, so that drawing, clipping and
packing are one pass over the leaf. The codes and their wire are `gradcomm.terngrad._ternary`'s;
this module holds the scales (clipping, the shared maximum) and the transformation.

On a mesh with other axes than the data axes (tensor parallelism, `gradcomm._shards`), a
leaf sharded over them is ternarized as the whole tensor is: its sigma, its maximum and
its scale are reduced over its shard axes, and each element's random bits are drawn from
its index in the whole tensor (numbered as if no leaf were sharded), so the codes do not
depend on the layout. Each device packs and sends the codes of its own piece: over the
data axis, a piece's share of the whole tensor's bytes. Leaves are exchanged in one group
per set of shard axes, so that a replicated leaf's result stays typed replicated.

With FSDP (ZeRO-3: a param split along its leading dimension over the data axes, its
spec `P("data", ...)` in `specs`), each device gets the whole gradient and keeps only its
shard of the mean, slice j of n along the leading dimension: the same codes and scales as
without FSDP (the same seed gives the same shard of the same result), sent as a
reduce-scatter of the packed codes. Each leaf's codes are packed shard by shard, numbered
by their place in the whole leaf; one `all_to_all` hands device j shard j of every
device's codes, which it sums and unpacks, and no sums travel back: (N - 1) / N * 1.6
bits per element sent per device, about (N - 1) / N of the packed codes, whatever
`wire`'s packed strategy (an all-gather would send N - 1 times the codes): 1/20 of a
float32 reduce-scatter's bytes at any N, 1/40 of a float32 ring all-reduce's.
`wire="simulate"` reduce-scatters the dequantized floats (`lax.psum_scatter`), with the
same bits; leaves kept `dense` are reduce-scattered in float, as
`gradcomm.allreduce(specs=...)` does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gradcomm import _axes, _checks, _flat, _leafwise, _numeric, _schedule, _shards
from gradcomm.terngrad import _ternary

Wire = Literal["packed", "all_gather", "all_to_all", "simulate"]
WIRES: tuple[str, ...] = get_args(Wire)
Dense = Sequence[str] | str | int | Callable[[str, jax.Array], bool] | None

# The codes' pieces that experiments/bench_collectives.py times one by one, by these names.


class TernGradState(NamedTuple):
    """State of `terngrad`: a step counter and the key every step's random bits derive from."""

    count: jax.Array
    key: jax.Array  # uint32 key data of jax.random.key(seed)


def _check_clip(clip: float | jax.Array | None) -> None:
    """A positive finite number, None, or a traced float scalar (`optax.inject_hyperparams`
    passes hyperparameters as traced values; those are used as they come)."""
    if isinstance(clip, jax.core.Tracer) and jnp.ndim(clip) == 0:
        if not jnp.issubdtype(clip.dtype, jnp.floating):
            raise ValueError(f"clip must be a float, got a traced {clip.dtype}")
        return
    if isinstance(clip, jax.Array | np.ndarray) and np.ndim(clip) == 0:
        clip = float(clip)
    if clip is not None and not (
        isinstance(clip, int | float) and math.isfinite(clip) and clip > 0
    ):
        raise ValueError(f"clip must be a positive number (or None for no clipping), got {clip!r}")


def _clip_bound(g: jax.Array, clip: float | None) -> jax.Array:
    """Eq. 21: the clipping bound `clip * sigma` of a leaf; inf where sigma is 0 or clip None.

    sigma is computed on g scaled by an exact power of two, so 1e30 gradients do not
    overflow it. A non-finite sigma (from an inf or NaN in g) also gives inf.
    """
    if clip is None:
        return jnp.asarray(jnp.inf, g.dtype)
    _, inverse = _numeric.pow2_scale(jnp.max(jnp.abs(g)))
    sigma = jnp.std(g * inverse)
    return jnp.where(sigma > 0, clip * sigma / inverse, jnp.inf)


def _sharded_clip_bounds(
    gs: list[jax.Array], clip: float | jax.Array, axes: _shards.Axes
) -> list[jax.Array]:
    """`_clip_bound` of the whole tensors of which `gs` are the pieces, sharded over `axes`.

    The same steps over the whole tensor: the power of two from the maximum over the
    pieces (`lax.pmax`), then the mean and the mean squared deviation from it, each a sum
    over the pieces (`lax.psum`): two passes, as `jnp.std`, so a constant leaf keeps a
    sigma of about 0 instead of the cancellation of a one-pass sum of squares.
    """
    count = np.asarray([g.size * _shards.num_shards(axes) for g in gs], gs[0].dtype)
    top = lax.pmax(jnp.stack([jnp.max(jnp.abs(g)) for g in gs]), axes)
    _, inverse = _numeric.pow2_scale(top)
    xs = [g * inverse[i] for i, g in enumerate(gs)]
    mean = lax.psum(jnp.stack([jnp.sum(x) for x in xs]), axes) / count
    squares = jnp.stack([jnp.sum(jnp.square(x - mean[i])) for i, x in enumerate(xs)])
    sigma = jnp.sqrt(lax.psum(squares, axes) / count)
    return list(jnp.where(sigma > 0, clip * sigma / inverse, jnp.inf))


def _clip_bounds(gs: list[jax.Array], clip: float | None, axes: _shards.Axes) -> list[jax.Array]:
    """The clipping bounds of leaves sharded over `axes` (none: each leaf is whole)."""
    if clip is None or not axes:
        return [_clip_bound(g, clip) for g in gs]
    return _sharded_clip_bounds(gs, clip, axes)


def _local_scale(g: jax.Array, bound: jax.Array) -> jax.Array:
    """`max|clip(g, -bound, bound)|`, which is `min(max|g|, bound)`: no pass over the clip.

    An inf or NaN in g gives +inf: the maximum over devices then need not propagate NaN.
    """
    top = jnp.max(jnp.abs(g), initial=0)
    return jnp.where(jnp.isfinite(top), jnp.minimum(top, bound), jnp.inf)


def _as_key(key: jax.Array) -> jax.Array:
    return key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)


@jax.named_scope("compress")
def ternarize(
    g: jax.Array, key: jax.Array, *, clip: float | None = 2.5
) -> tuple[jax.Array, jax.Array]:
    """Stochastic ternarization of one leaf (eqs. 1-3), after clipping (eq. 21).

    Args:
      g: a floating-point array.
      key: a `jax.random.key` (or its uint32 key data).
      clip: clip at `clip` standard deviations of `g` (the paper's c = 2.5); None turns
        clipping off, as in the paper's no-clipping ablation. A leaf whose standard
        deviation is 0 (a constant leaf, any size-1 leaf) is not clipped, so it is not
        zeroed.

    Returns:
      `(codes, scale)`: int8 codes in {-1, 0, 1} shaped like `g`, and the float scale
      `s = max|clipped g|` (float32 or wider), such that `scale * codes` is an unbiased
      estimate of the clipped `g`. Non-finite `g` gives a non-finite scale.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> codes, scale = gradcomm.ternarize(jnp.array([0.5, -1.0, 0.0]), jax.random.key(0))
      >>> codes.dtype, float(scale), int(codes[1]), int(codes[2])
      (dtype('int8'), 1.0, -1, 0)

    References:
      Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
      Learning", NeurIPS 2017, eqs. 1-3 and 21.
    """
    _check_clip(clip)
    _checks.check_float_leaves(g, "ternarize")
    g = jnp.asarray(g).astype(_axes.compute_dtype(g.dtype))
    bound = _clip_bound(g, clip)
    scale = _local_scale(g, bound)
    return _ternary.codes(g, bound, scale, _ternary.key_words(_as_key(key))).astype(jnp.int8), scale


def _round_up_scale(scale: jax.Array, n: int) -> jax.Array:
    """Rounds normal scales up to nmant + 1 - ceil(log2(n + 1)) significant bits.

    Then k * scale is exact for every integer |k| <= n, so however a sum of n terms
    +-scale is ordered, it is exact.
    """
    info = jnp.finfo(scale.dtype)
    bits = info.nmant + 1 - n.bit_length()
    mantissa, exponent = jnp.frexp(scale)  # mantissa in [0.5, 1)
    mantissa = jnp.ceil(mantissa * 2.0**bits) * 2.0 ** (1 - bits)  # in [1, 2]
    rounded = mantissa * _numeric.exact_pow2(exponent - 1, scale.dtype)
    normal = jnp.isfinite(scale) & (scale >= info.tiny)
    return jnp.where(normal, rounded, scale)


def _ternary_mean(
    leaves: list[jax.Array],
    key: jax.Array,
    axis_name: _axes.AxisName,
    n: int,
    clip: float | None,
    wire: Wire,
    axes: list[_shards.Axes],
    indices: list[jax.Array | None],
    sizes: list[int],
    fsdp: list[bool],
) -> list[jax.Array]:
    """The mean over the devices of the ternarized leaves (eqs. 1-4), sent as `wire` says.

    `axes` are each leaf's shard axes, `indices` its elements' indices in the whole tensor
    (None where it is whole) and `sizes` the whole tensors' sizes. The leaves go in one
    group per set of shard axes, each with its own reductions and exchange. Where `fsdp`
    is set, the leaf's result is this device's shard of the mean (its slice along the
    leading dimension), by a reduce-scatter of the codes; the others' is the whole mean.
    """
    ct = _axes.compute_dtype(jnp.result_type(*leaves))
    gs = [leaf.astype(ct) for leaf in leaves]
    starts = _flat.offsets(sizes)
    key_words = _ternary.key_words(key)
    groups: dict[_shards.Axes, list[int]] = {}
    for i, shard in enumerate(axes):
        groups.setdefault(shard, []).append(i)
    totals: list[jax.Array | None] = [None] * len(gs)
    for shard, ids in groups.items():
        group = [gs[i] for i in ids]
        bounds = _clip_bounds(group, clip, shard)
        local = jnp.stack([_local_scale(g, b) for g, b in zip(group, bounds, strict=True)])
        if shard:
            local = lax.pmax(local, shard)
        scales = _round_up_scale(lax.pmax(local, axis_name), n)
        scale = dict(zip(ids, scales, strict=True))
        draws = {
            i: (g, b, scale[i], key_words, starts[i], indices[i])
            for g, b, i in zip(group, bounds, ids, strict=True)
        }
        whole = [i for i in ids if not fsdp[i]]
        split = [i for i in ids if fsdp[i]]
        sums: dict[int, jax.Array] = {}
        if wire == "simulate":
            terms = {i: _ternary.codes(*draw).astype(ct) * scale[i] for i, draw in draws.items()}
            if whole:
                totals_whole = lax.psum([terms[i] for i in whole], axis_name)
                sums.update(zip(whole, totals_whole, strict=True))
            if split:
                rows = _shards.to_rows([terms[i] for i in split], n, "terngrad")
                mine = lax.psum_scatter(rows, axis_name, scatter_dimension=0, tiled=True)[0]
                pieces = _shards.from_rows(mine, [gs[i].shape for i in split], n)
                sums.update(zip(split, pieces, strict=True))
        else:
            if whole:
                packed = [_ternary.pack_leaf(*draws[i]) for i in whole]
                strategy = _ternary.pick_strategy(n) if wire == "packed" else wire
                rows = _ternary.code_sums(packed, axis_name, n, strategy)
                sums.update(
                    (i, _unpack_sums(digits, scale[i], n, ct, gs[i].shape))
                    for i, digits in zip(whole, rows, strict=True)
                )
            if split:  # FSDP: a reduce-scatter of the codes, shard j summed on device j
                packed = [_ternary.pack_shards(*draws[i][:-1], n, indices[i]) for i in split]
                rows = _ternary.shard_code_sums(packed, axis_name, n)
                sums.update(
                    (i, _unpack_sums(digits, scale[i], n, ct, _shard_shape(gs[i].shape, n)))
                    for i, digits in zip(split, rows, strict=True)
                )
        for i in ids:
            totals[i] = sums[i]
    return [(t / n).astype(leaf.dtype) for t, leaf in zip(totals, leaves, strict=True)]


def _shard_shape(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The shape of one of n FSDP shards of a leaf: its leading dimension split n ways."""
    return (shape[0] // n, *shape[1:])


def _unpack_sums(
    digits: list[jax.Array], scale: jax.Array, n: int, ct: Any, shape: tuple[int, ...]
) -> jax.Array:
    """Digit rows of code sums plus n (`_ternary.code_sums`) to the sum of the terms, `shape`."""
    size = math.prod(shape)
    return _ternary.unpack_leaf([(r.astype(ct) - n) * scale for r in digits], size).reshape(shape)


def _check_fsdp(leaf: jax.Array, n: int) -> None:
    """Raises where an FSDP leaf's leading dimension does not split into n shards (the
    reshape that `_shards.to_rows` traces to check it is left unused)."""
    _shards.to_rows([leaf], n, "terngrad")


def _scatter_mean(leaves: list[jax.Array], axis_name: _axes.AxisName, n: int) -> list[jax.Array]:
    """This device's shard of the mean of each whole leaf, in float: a reduce-scatter per
    dtype, as `gradcomm.allreduce` with FSDP specs. Empty leaves give empty shards."""
    out = [jnp.zeros(_shard_shape(leaf.shape, n), leaf.dtype) for leaf in leaves]
    for group in _flat.dtype_groups(leaves):
        rows = _shards.to_rows([leaves[i] for i in group], n, "terngrad")
        mine = lax.psum_scatter(rows, axis_name, scatter_dimension=0, tiled=True)[0] / n
        pieces = _shards.from_rows(mine, [leaves[i].shape for i in group], n)
        for i, piece in zip(group, pieces, strict=True):
            out[i] = piece.astype(leaves[i].dtype)
    return out


def _dense_mask(
    names: list[str], leaves: list[jax.Array], sizes: list[int], dense: Dense
) -> list[bool]:
    """Which leaves stay in float: by name (or name prefix), size threshold or predicate.

    `sizes` are the whole tensors' sizes, which the threshold applies to.
    """
    if dense is None:
        return [False] * len(leaves)
    if isinstance(dense, int):
        return [size <= dense for size in sizes]
    if callable(dense):
        return [bool(dense(name, leaf)) for name, leaf in zip(names, leaves, strict=True)]
    entries = [dense] if isinstance(dense, str) else list(dense)
    return [entry is not None for entry in _checks.match_names(entries, names, "dense")]


def _check_dense(dense: Dense) -> None:
    if dense is None or callable(dense) or isinstance(dense, str):
        return
    if isinstance(dense, bool) or (isinstance(dense, int) and dense < 0):
        raise ValueError(f"dense as a size threshold must be a non-negative int, got {dense!r}")
    if isinstance(dense, int):
        return
    if not isinstance(dense, Sequence) or not all(isinstance(e, str) and e for e in dense):
        raise ValueError(
            "dense must be None, a leaf name or sequence of leaf names (like 'Dense_1' or "
            f"'Dense_1/kernel'), a size threshold, or a predicate (name, leaf) -> bool; got "
            f"{dense!r}"
        )


def terngrad(
    axis_name: _axes.AxisName = "data",
    *,
    clip: float | None = 2.5,
    seed: int = 0,
    dense: Dense = None,
    wire: Wire = "packed",
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """TernGrad: averages ternarized gradients over the devices, sending packed ternary codes.

    Place it before the optimizer (`optax.chain(gradcomm.terngrad("data"), optax.sgd(0.01,
    momentum=0.9))`). Each leaf is ternarized separately (layer-wise ternarizing, 3.3)
    with a scale shared by all devices (scalar sharing, eq. 4). Every device draws its own
    random bits, different at every step, all derived from `seed`, the step count and the
    device index; the result is the same on every device.

    Args:
      axis_name: the mesh axis (or tuple of axes) to average over.
      clip: clip each leaf at `clip` standard deviations before ternarizing (eq. 21, the
        paper's c = 2.5); None turns clipping off (the paper's no-clipping ablation).
      seed: seed of the random bits.
      dense: leaves to average in float instead: None (none), leaf names or name prefixes
        ('Dense_1' for a flax layer's kernel and bias, as the paper keeps the last layer in
        float), an int (leaves with at most that many elements, such as biases), or a
        predicate `(name, leaf) -> bool`. Names are '/'-joined key paths. On a leaf
        sharded over other mesh axes, the threshold applies to the whole tensor's size
        and the predicate gets this device's piece.
      wire: "packed" (real packed codes; all-gather for N <= 2, all-to-all then
        all-gather from N = 3, whichever sends fewer bytes), "all_gather" or "all_to_all"
        to force one, or "simulate" (dequantize, then psum floats), which gives the same
        bits as the packed modes. FSDP leaves (`specs`) go by a reduce-scatter: an
        all-to-all of their packed codes in every packed mode, `lax.psum_scatter` of the
        floats with "simulate".
      specs: the params' `PartitionSpec`s (the `in_specs` of `jax.shard_map`), a pytree
        shaped like the updates, or None. Needed inside a `shard_map` over mesh axes
        besides `axis_name` (tensor parallelism), for leaves sharded over them: each
        such leaf is then ternarized as its whole tensor is, with the same codes as on
        one unsharded device per `axis_name` index, whatever the layout. And for FSDP: a
        leaf whose spec splits its leading dimension over `axis_name`, `P("data", ...)`,
        comes in whole (the gradient of the gathered param) and leaves as this device's
        shard of the mean, by a reduce-scatter of its packed codes; its leading
        dimension must divide by the number of devices. Other data axes in a spec are
        ignored; None (or a None entry) stands for no spec.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `TernGradState`.

    Raises:
      ValueError: for a non-positive clip, a bad seed, dense or wire at construction;
        at trace time for dense names that match no leaf, an unbound axis, a
        non-floating leaf, specs that do not match the updates, a leaf sharded over other
        mesh axes without a spec, other mesh axes under `shard_map(check_vma=False)`
        (which hides which leaves are sharded), or an FSDP leaf whose leading dimension
        does not divide by the number of devices.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.terngrad("data", clip=None)
      >>> grads = jnp.array([[1.0, -1.0], [1.0, 1.0]])  # one row per device
      >>> state = tx.init(grads[0])
      >>> jax.vmap(lambda g: tx.update(g, state)[0], axis_name="data")(grads)[0]
      Array([1., 0.], dtype=float32)

      With FSDP, device j keeps row j of the same mean:

      >>> from jax.sharding import PartitionSpec as P
      >>> fsdp = gradcomm.terngrad("data", clip=None, specs=P("data"))
      >>> jax.vmap(lambda g: fsdp.update(g, state)[0], axis_name="data")(grads)
      Array([[1.],
             [0.]], dtype=float32)

    References:
      Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
      Learning", NeurIPS 2017: eqs. 1-4, 21, Algorithm 1, sections 3.1-3.3.
    """
    _axes.check_axis_name(axis_name)
    _check_clip(clip)
    _check_dense(dense)
    _checks.check_int(seed, "seed")
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {WIRES}, got {wire!r}")

    def init_fn(params: Any) -> TernGradState:
        del params
        key = jax.random.key_data(jax.random.key(seed))
        return TernGradState(count=_schedule.zero_count(), key=key)

    def step(
        leaf_specs: list[Any], leaves: list[jax.Array], names: list[str], state: TernGradState
    ) -> tuple[list[jax.Array], TernGradState]:
        n = _axes.axis_size(axis_name)
        axes = [_shards.shard_axes(leaf, axis_name, "terngrad") for leaf in leaves]
        sizes = [leaf.size * _shards.num_shards(a) for leaf, a in zip(leaves, axes, strict=True)]
        fsdp = [
            _shards.scattered(spec, axis_name, "terngrad", name)
            for spec, name in zip(leaf_specs, names, strict=True)
        ]
        for leaf, split in zip(leaves, fsdp, strict=True):
            if split:
                _check_fsdp(leaf, n)
        keep_dense = _dense_mask(names, leaves, sizes, dense)
        out = list(leaves)
        dense_ids = [i for i, d in enumerate(keep_dense) if d or not leaves[i].size]
        whole_dense = [i for i in dense_ids if not fsdp[i]]
        if whole_dense:
            averaged = lax.pmean([leaves[i] for i in whole_dense], axis_name)
            for i, leaf in zip(whole_dense, averaged, strict=True):
                out[i] = leaf
        split_dense = [i for i in dense_ids if fsdp[i]]
        if split_dense:
            averaged = _scatter_mean([leaves[i] for i in split_dense], axis_name, n)
            for i, leaf in zip(split_dense, averaged, strict=True):
                out[i] = leaf
        ids = [i for i in range(len(leaves)) if i not in set(dense_ids)]
        if ids:
            indices = [
                _shards.global_index(
                    leaves[i], leaf_specs[i], axes[i], axis_name, "terngrad", names[i]
                )
                for i in ids
            ]
            key = jax.random.fold_in(_as_key(state.key), state.count)
            key = jax.random.fold_in(key, _axes.axis_index(axis_name))
            averaged = _ternary_mean(
                [leaves[i] for i in ids],
                key,
                axis_name,
                n,
                clip,
                wire,
                [axes[i] for i in ids],
                indices,
                [sizes[i] for i in ids],
                [fsdp[i] for i in ids],
            )
            for i, leaf in zip(ids, averaged, strict=True):
                out[i] = leaf
        return out, TernGradState(count=optax.safe_increment(state.count), key=state.key)

    def update_fn(
        updates: Any, state: TernGradState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, TernGradState]:
        leaf_specs = _shards.leaf_specs(specs, updates, "terngrad")
        step_with_specs = functools.partial(step, leaf_specs)
        tx = _leafwise.transformation("terngrad", axis_name, init_fn, step_with_specs)
        return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
