"""TernGrad: stochastic ternary gradients (Wen et al., NeurIPS 2017), sent as packed codes.

Each device clips each leaf at `clip * sigma` (eq. 21, sigma the leaf's standard deviation
on that device), ternarizes it with a scalar shared by all devices, the maximum of their
per-leaf maxima (eqs. 1-4),

    g~ = s * sign(g) * b,   b_k ~ Bernoulli(|g_k| / s),   s = max_i max|g_i|,

and the devices average g~. E[g~] = g: the mean is an unbiased estimate of the mean of the
clipped gradients.

What is sent: the codes, packed in base 3 (5 to a byte, 1.6 bits each), and integer sums
of N codes, in [-N, N], packed in base 2N + 1 into uint32 words (about log2(2N + 1) bits
each); plus one float per leaf for the shared scales. `exchange` names the collective
that carries the codes:

* "all_gather": gather the packed codes and sum them everywhere, (N - 1) * 1.6 bits per
  element sent per device;
* "all_to_all": hand device j chunk j of everyone's packed codes to sum, then
  `all_gather` the packed sums, (N - 1) / N * (1.6 + 32 / k) bits, k the sums per word.

The first is cheaper for N <= 2, the second from N = 3 on, so "auto" (the default) picks
by N. At N = 8 the second sends about 1/10 of the bytes of a float32 ring all-reduce
(2 (N - 1) / N * 32 bits per element).

`exchange="psum"` sends floats, with no compression: each device dequantizes its codes
and the devices average the floats with `lax.psum`, as the authors' code did. It is
there to check that the packed exchanges give the same bits. The shared scale is rounded
up to nmant + 1 - ceil(log2(N + 1)) significant bits, so that every sum of up to N terms
+-s is exact in any order; every exchange therefore gives the same bits, and the
estimate stays unbiased (any s >= max|g| does).

The random bits are a counter-based hash of each element's index, keyed per device and
step by `jax.random`; each leaf is packed on its own, so that drawing, clipping and
packing are one pass over the leaf. The codes, their packing and their exchanges are
`gradcomm.terngrad._ternary`'s, the scales (clipping, the shared maximum) `_scales`', the
mean over the devices `_mean`'s; this module holds the transformation.

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
bits per element sent per device, about (N - 1) / N of the packed codes, whichever of
"auto", "all_gather" and "all_to_all" `exchange` is (an all-gather would send N - 1
times the codes): 1/20 of a float32 reduce-scatter's bytes at any N, 1/40 of a float32
ring all-reduce's. `exchange="psum"` reduce-scatters the dequantized floats
(`lax.psum_scatter`), with the same bits; leaves kept `dense` are reduce-scattered in
float, as `gradcomm.allreduce(specs=...)` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _axes, _checks, _numeric, _packing, _shards, _transform, perfmodel, registry
from gradcomm.terngrad import _mean, _scales, _ternary

# The codes' pieces that experiments/benchmarks/bench_collectives.py times one by one, by
# these names.
_clip_bound, _local_scale = _scales.clip_bound, _scales.local_scale

Exchange = Literal["auto", "all_gather", "all_to_all", "psum"]
EXCHANGES: tuple[str, ...] = get_args(Exchange)
# The values of `wire=`, the argument's name before `exchange=` (ARCHITECTURE.md, "One
# vocabulary"): given to `exchange`, they raise with the new name.
_RENAMED = {"packed": "auto", "simulate": "psum"}
Dense = Sequence[str] | str | int | Callable[[str, jax.Array], bool] | None


class TernGradState(NamedTuple):
    """State of `terngrad`: a step counter and the key every step's random bits derive from."""

    count: jax.Array
    key: jax.Array  # uint32 key data of jax.random.key(seed)


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
      >>> ternarize = jax.jit(gradcomm.ternarize)  # one compilation, not one per operation
      >>> codes, scale = ternarize(jnp.array([0.5, -1.0, 0.0]), jax.random.key(0))
      >>> codes.dtype, float(scale), int(codes[1]), int(codes[2])
      (dtype('int8'), 1.0, -1, 0)

    References:
      Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
      Learning", NeurIPS 2017, eqs. 1-3 and 21.
    """
    _scales.check_clip(clip)
    _checks.check_float_leaves(g, "ternarize")
    g = jnp.asarray(g).astype(_numeric.compute_dtype(g.dtype))
    bound = _scales.clip_bound(g, clip)
    scale = _scales.local_scale(g, bound)
    return _ternary.codes(g, bound, scale, _ternary.key_words(_as_key(key))).astype(jnp.int8), scale


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
    exchange: Exchange = "auto",
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
      exchange: how the codes travel: "auto" (packed codes, by an all-gather for
        N <= 2 and an all-to-all then an all-gather of the sums from N = 3, whichever
        sends fewer bytes), "all_gather" or "all_to_all" to force one, or "psum"
        (dequantize, then `lax.psum` the floats: no compression, a float all-reduce's
        bytes; it checks that the packed exchanges give the same bits). FSDP leaves
        (`specs`) go by a reduce-scatter: an all-to-all of their packed codes for every
        packed exchange, `lax.psum_scatter` of the floats with "psum".
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
      ValueError: for a non-positive clip, a bad seed, dense or exchange at construction
        (the former `wire=` values "packed" and "simulate" name their new ones);
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
      >>> jax.jit(jax.vmap(lambda g: tx.update(g, state)[0], axis_name="data"))(grads)[0]
      Array([1., 0.], dtype=float32)

      With FSDP, device j keeps row j of the same mean:

      >>> from jax.sharding import PartitionSpec as P
      >>> fsdp = gradcomm.terngrad("data", clip=None, specs=P("data"))
      >>> jax.jit(jax.vmap(lambda g: fsdp.update(g, state)[0], axis_name="data"))(grads)
      Array([[1.],
             [0.]], dtype=float32)

    References:
      Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
      Learning", NeurIPS 2017: eqs. 1-4, 21, Algorithm 1, sections 3.1-3.3.
    """
    _axes.check_axis_name(axis_name)
    _scales.check_clip(clip)
    _check_dense(dense)
    _checks.check_int(seed, "seed")
    if isinstance(exchange, str) and exchange in _RENAMED:
        raise ValueError(f"exchange={exchange!r} is now exchange={_RENAMED[exchange]!r}")
    _axes.check_exchange(exchange, EXCHANGES)

    def init_fn(params: Any) -> TernGradState:
        del params
        key = jax.random.key_data(jax.random.key(seed))
        return TernGradState(count=_transform.zero_count(), key=key)

    def step(updates: Any, state: TernGradState, params: Any) -> tuple[Any, TernGradState]:
        del params
        n = _axes.axis_size(axis_name)
        leaves, names, treedef = _checks.named_leaves(updates)
        leaf_specs = _shards.leaf_specs(specs, updates, "terngrad")
        axes = [_shards.shard_axes(leaf, axis_name, "terngrad") for leaf in leaves]
        sizes = [leaf.size * _shards.num_shards(a) for leaf, a in zip(leaves, axes, strict=True)]
        fsdp = [
            _shards.scattered(spec, axis_name, "terngrad", name)
            for spec, name in zip(leaf_specs, names, strict=True)
        ]
        for leaf, split in zip(leaves, fsdp, strict=True):
            if split:
                _mean.check_fsdp(leaf, n)
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
            averaged = _mean.scatter_mean([leaves[i] for i in split_dense], axis_name, n)
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
            averaged = _mean.ternary_mean(
                [leaves[i] for i in ids],
                key,
                axis_name,
                n,
                clip,
                exchange,
                [axes[i] for i in ids],
                indices,
                [sizes[i] for i in ids],
                [fsdp[i] for i in ids],
            )
            for i, leaf in zip(ids, averaged, strict=True):
                out[i] = leaf
        new_state = TernGradState(count=optax.safe_increment(state.count), key=state.key)
        return jax.tree.unflatten(treedef, out), new_state

    return _transform.transformation("terngrad", axis_name, init_fn, step)


def _pattern(options: Mapping[str, Any], s: perfmodel.Setting) -> list[perfmodel.Collective]:
    """The shared scales, then codes (1.6 bits) gathered, or summed in base 2n + 1; with
    "psum", the dequantized floats all-reduced."""
    n, params, coll = s.nodes, s.params, perfmodel.Collective
    exchange = options["exchange"]
    out = [coll("allreduce", n, 0.0)]  # the shared scales
    if exchange == "psum":
        return [*out, coll("allreduce", n, s.size)]
    if exchange == "auto":
        exchange = _ternary.auto_exchange(n)
    if exchange == "all_gather":
        return [*out, coll("allgather", n, n * params * 0.2)]
    sum_bits = 32 / _packing.values_per_word(2 * n + 1)
    return [*out, coll("alltoall", n, params * 0.2), coll("allgather", n, params * sum_bits / 8)]


registry.register(
    registry.Method(
        terngrad,
        "before",
        title="TernGrad",
        paper="Wen et al., NeurIPS 2017",
        page="terngrad",
        collectives=_pattern,
        window="backward",
    )
)
