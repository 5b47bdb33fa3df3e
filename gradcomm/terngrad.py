"""TernGrad: stochastic ternary gradients (Wen et al., NeurIPS 2017), with a real wire format.

Each device clips each leaf at `clip * sigma` (eq. 21, sigma the leaf's standard deviation
on that device), ternarizes it with a scalar shared by all devices, the maximum of their
per-leaf maxima (eqs. 1-4),

    g~ = s * sign(g) * b,   b_k ~ Bernoulli(|g_k| / s),   s = max_i max|g_i|,

and the devices average g~. E[g~] = g: the mean is an unbiased estimate of the mean of the
clipped gradients.

What is sent (`wire="packed"`): the codes, packed in base 3 (20 to a uint32, 1.6 bits
each), and integer sums of N codes, in [-N, N], packed in base 2N + 1 (about
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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gradcomm import _base, _packing

WIRES = ("packed", "all_gather", "all_to_all", "simulate")
Dense = Sequence[str] | str | int | Callable[[str, jax.Array], bool] | None


class TernGradState(NamedTuple):
    """State of `terngrad`: a step counter and the key every step's random bits derive from."""

    count: jax.Array
    key: jax.Array  # uint32 key data of jax.random.key(seed)


def _check_clip(clip: float | None) -> None:
    if clip is not None and not (
        isinstance(clip, int | float) and math.isfinite(clip) and clip > 0
    ):
        raise ValueError(f"clip must be a positive number (or None for no clipping), got {clip!r}")


def _clip(g: jax.Array, clip: float | None) -> jax.Array:
    """Eq. 21: clips g to [-clip * sigma, clip * sigma]; a leaf with sigma = 0 is left as is.

    sigma is computed on g scaled by an exact power of two, so 1e30 gradients do not
    overflow it.
    """
    if clip is None:
        return g
    _, inverse = _base.pow2_scale(jnp.max(jnp.abs(g)))
    sigma = jnp.std(g * inverse)
    bound = jnp.where(sigma > 0, clip * sigma / inverse, jnp.inf)
    return jnp.clip(g, -bound, bound)


def _draw(g: jax.Array, scale: jax.Array, key: jax.Array) -> jax.Array:
    """Eqs. 1 and 3: int8 codes sign(g) * b with b ~ Bernoulli(|g| / scale).

    Each 32-bit random word gives two elements a 16-bit uniform at the midpoints
    u = (r + 1/2) / 2^16, so P(b = 1) is |g| / scale rounded to the nearest multiple of
    2^-16 (off by at most 2^-17), at half the cost of one word per element.
    """
    words = jax.random.bits(key, (-(-g.size // 2),), jnp.uint32)
    r = jnp.stack([words & 0xFFFF, words >> 16], axis=-1).reshape(-1)[: g.size].reshape(g.shape)
    u = (r.astype(g.dtype) + 0.5) * (scale * 2.0**-16)
    return jnp.where(u < jnp.abs(g), jnp.sign(g), 0).astype(jnp.int8)  # never for scale 0


def _as_key(key: jax.Array) -> jax.Array:
    return key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)


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
    _base.check_float_leaves(g, "ternarize")
    g = _clip(jnp.asarray(g).astype(_base.compute_dtype(g.dtype)), clip)
    scale = jnp.max(jnp.abs(g), initial=0)
    return _draw(g, scale, _as_key(key)), scale


def _round_up_scale(scale: jax.Array, n: int) -> jax.Array:
    """Rounds normal scales up to nmant + 1 - ceil(log2(n + 1)) significant bits.

    Then k * scale is exact for every integer |k| <= n, so however a sum of n terms
    +-scale is ordered, it is exact.
    """
    info = jnp.finfo(scale.dtype)
    bits = info.nmant + 1 - n.bit_length()
    mantissa, exponent = jnp.frexp(scale)  # mantissa in [0.5, 1)
    mantissa = jnp.ceil(mantissa * 2.0**bits) * 2.0 ** (1 - bits)  # in [1, 2]
    rounded = mantissa * _base.exact_pow2(exponent - 1, scale.dtype)
    normal = jnp.isfinite(scale) & (scale >= info.tiny)
    return jnp.where(normal, rounded, scale)


def _strategy(n: int) -> str:
    """The packed exchange that sends fewer bits per element at this axis size."""
    code_bits = 32 / _packing.values_per_word(3)
    sum_bits = 32 / _packing.values_per_word(2 * n + 1)
    gather = (n - 1) * code_bits
    scatter = (n - 1) / n * (code_bits + sum_bits)
    return "all_gather" if gather <= scatter else "all_to_all"


def _summed_codes(codes: jax.Array, axis_name: _base.AxisName, n: int, strategy: str) -> jax.Array:
    """The sum over devices of int8 codes `(M,)`, sent packed: int32 `(M,)`, the same everywhere."""
    size = codes.shape[0]
    per_code = _packing.values_per_word(3)
    if strategy == "all_gather":
        padded = jnp.pad(codes, (0, -size % per_code))
        words = _packing.pack((padded + 1).astype(jnp.uint32), 3)
        gathered = _base.all_gather_invariant(words, axis_name)
        sums = _packing.unpack(gathered, 3).astype(jnp.int32).sum(0) - n
        return sums[:size]
    per_sum = _packing.values_per_word(2 * n + 1)
    chunk = -(-size // n)
    chunk += -chunk % math.lcm(per_code, per_sum)
    padded = jnp.pad(codes, (0, n * chunk - size))
    words = _packing.pack((padded + 1).astype(jnp.uint32), 3)
    mine = lax.all_to_all(words, axis_name, 0, 0, tiled=True).reshape(n, chunk // per_code)
    partial = _packing.unpack(mine, 3).sum(0)  # chunk j of every device, offset by n
    gathered = _base.all_gather_invariant(_packing.pack(partial, 2 * n + 1), axis_name, tiled=True)
    return _packing.unpack(gathered, 2 * n + 1).astype(jnp.int32)[:size] - n


def _ternary_mean(
    leaves: list[jax.Array],
    key: jax.Array,
    axis_name: _base.AxisName,
    n: int,
    clip: float | None,
    wire: str,
) -> list[jax.Array]:
    """The mean over the devices of the ternarized leaves (eqs. 1-4), sent as `wire` says."""
    ct = _base.compute_dtype(jnp.result_type(*leaves))
    clipped = [_clip(leaf.astype(ct), clip) for leaf in leaves]
    local = jnp.stack([jnp.max(jnp.abs(g)) for g in clipped])
    # A max-reduction need not propagate NaN; +inf it does, and an infinite scale makes
    # every element of the leaf non-finite (0 * inf or +-inf).
    local = jnp.where(jnp.isfinite(local), local, jnp.inf)
    scales = _round_up_scale(lax.pmax(local, axis_name), n)
    codes = [
        _draw(g, s, jax.random.fold_in(key, i))
        for i, (g, s) in enumerate(zip(clipped, scales, strict=True))
    ]
    if wire == "simulate":
        totals = lax.psum([c.astype(ct) * s for c, s in zip(codes, scales, strict=True)], axis_name)
    else:
        strategy = _strategy(n) if wire == "packed" else wire
        sums = _summed_codes(jnp.concatenate([c.ravel() for c in codes]), axis_name, n, strategy)
        ends = np.cumsum([c.size for c in codes])
        totals = [
            sums[end - c.size : end].reshape(c.shape).astype(ct) * s
            for end, c, s in zip(ends, codes, scales, strict=True)
        ]
    return [(t / n).astype(leaf.dtype) for t, leaf in zip(totals, leaves, strict=True)]


def _dense_mask(names: list[str], leaves: list[jax.Array], dense: Dense) -> list[bool]:
    """Which leaves stay in float: by name (or name prefix), size threshold or predicate."""
    if dense is None:
        return [False] * len(leaves)
    if isinstance(dense, int):
        return [leaf.size <= dense for leaf in leaves]
    if callable(dense):
        return [bool(dense(name, leaf)) for name, leaf in zip(names, leaves, strict=True)]
    entries = [dense] if isinstance(dense, str) else list(dense)
    return [entry is not None for entry in _base.match_names(entries, names, "dense")]


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
    axis_name: _base.AxisName = "data",
    *,
    clip: float | None = 2.5,
    seed: int = 0,
    dense: Dense = None,
    wire: str = "packed",
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
        predicate `(name, leaf) -> bool`. Names are '/'-joined key paths.
      wire: "packed" (real packed codes; all-gather for N <= 2, all-to-all then
        all-gather from N = 3, whichever sends fewer bytes), "all_gather" or "all_to_all"
        to force one, or "simulate" (dequantize, then psum floats), which gives the same
        bits as the packed modes.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `TernGradState`.

    Raises:
      ValueError: for a non-positive clip, a bad seed, dense or wire at construction;
        at trace time for dense names that match no leaf, an unbound axis or a
        non-floating leaf.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.terngrad("data", clip=None)
      >>> grads = jnp.array([[1.0, -1.0], [1.0, 1.0]])  # one row per device
      >>> state = tx.init(grads[0])
      >>> jax.vmap(lambda g: tx.update(g, state)[0], axis_name="data")(grads)[0]
      Array([1., 0.], dtype=float32)

    References:
      Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
      Learning", NeurIPS 2017: eqs. 1-4, 21, Algorithm 1, sections 3.1-3.3.
    """
    _base.check_axis_name(axis_name)
    _check_clip(clip)
    _check_dense(dense)
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {WIRES}, got {wire!r}")

    def init_fn(params: Any) -> TernGradState:
        del params
        key = jax.random.key_data(jax.random.key(seed))
        return TernGradState(count=_base.zero_count(), key=key)

    def update_fn(
        updates: Any, state: TernGradState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, TernGradState]:
        del params, extra_args
        _base.check_float_leaves(updates, "terngrad")
        n = _base.axis_size(axis_name)
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
        paths = [p for p, _ in paths_leaves]
        leaves = [leaf for _, leaf in paths_leaves]
        keep_dense = _dense_mask(_base.leaf_names(paths), leaves, dense)
        out = list(leaves)
        dense_ids = [i for i, d in enumerate(keep_dense) if d or not leaves[i].size]
        if dense_ids:
            averaged = lax.pmean([leaves[i] for i in dense_ids], axis_name)
            for i, leaf in zip(dense_ids, averaged, strict=True):
                out[i] = leaf
        ids = [i for i in range(len(leaves)) if i not in set(dense_ids)]
        if ids:
            key = jax.random.fold_in(_as_key(state.key), state.count)
            key = jax.random.fold_in(key, _base.axis_index(axis_name))
            averaged = _ternary_mean([leaves[i] for i in ids], key, axis_name, n, clip, wire)
            for i, leaf in zip(ids, averaged, strict=True):
                out[i] = leaf
        new_state = TernGradState(count=optax.safe_increment(state.count), key=state.key)
        return jax.tree_util.tree_unflatten(treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
