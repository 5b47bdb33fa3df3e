"""Collectives with the right types in every context, and the pairwise exchange for gloo.

`lax.ppermute` and `lax.all_gather` behave differently under `shard_map`, `pmap` and a named
`vmap`; the wrappers here give one behaviour everywhere. `swap` and
`all_gather_pairwise` are the swap and the gather written as two-member reduce-scatters (and
`reduce_scatter_pairwise` a summing reduce-scatter, `pair_sum` a pair's sum), which gloo runs
at full speed both ways (see `gradcomm._axes.use_pairwise`); `reduce_scatter_ring` is a
summing reduce-scatter of one-way shifts, which gloo also runs at full speed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from gradcomm._axes import (
    AxisName,
    axis_names,
    axis_size,
    is_manual,
    vary,
    varying_axes,
)
from gradcomm._numeric import compute_dtype


def all_gather_invariant(x: jax.Array, axis_name: AxisName, *, tiled: bool = False) -> jax.Array:
    """`lax.all_gather` whose result is typed as identical on every device.

    Under `shard_map` with `check_vma=True` this lets a result that every device provably
    holds bit for bit leave the map with `out_specs=P()`. Under `vmap` the type system has
    no such notion and the plain gather is used.
    """
    to = "invarying" if is_manual(axis_name) else "varying"
    return lax.all_gather(x, axis_name, tiled=tiled, to=to)


def ppermute(x: jax.Array, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> jax.Array:
    """`lax.ppermute` where destinations nobody sends to receive zeros, in every context.

    Under `shard_map` and `pmap` a partial permutation sends only the listed pairs. `vmap`
    accepts only complete permutations, so there the missing pairs are added and their
    destinations zeroed afterwards (no real wire exists under `vmap`).
    """
    if is_manual(axis_name):
        return lax.ppermute(x, axis_name, perm)
    n = axis_size(axis_name)
    sources = [s for s, _ in perm]
    targets = [t for _, t in perm]
    idle_sources = [i for i in range(n) if i not in sources]
    idle_targets = [i for i in range(n) if i not in targets]
    full = list(perm) + list(zip(idle_sources, idle_targets, strict=True))
    received = lax.ppermute(x, axis_name, full)
    listed = jnp.isin(lax.axis_index(axis_name), jnp.asarray(targets, jnp.int32))
    return jnp.where(listed, received, jnp.zeros_like(received))


def _levels(axis_name: AxisName) -> int:
    """log2 of the number of devices over `axis_name`, a power of two."""
    n = axis_size(axis_name)
    if n & (n - 1):
        raise ValueError(f"pairwise exchanges need a power-of-two number of devices, got {n}")
    return n.bit_length() - 1


def pair_groups(n: int, distance: int) -> list[list[int]]:
    """The pairs {i, i ^ distance} of n devices, lower first: two-member replica groups."""
    if distance != 1 << (distance.bit_length() - 1) or distance >= n:
        raise ValueError(f"no pairs of {n} devices {distance} apart (a power of two below n)")
    return [[i, i ^ distance] for i in range(n) if not i & distance]


def is_upper(axis_name: AxisName, distance: int) -> jax.Array:
    """Whether this device is the upper one of its pair {i, i ^ distance}: bit log2(d) of i."""
    return lax.axis_index(axis_name) & distance != 0


def _unsigned(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"uint{np.dtype(dtype).itemsize * 8}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def swap(x: jax.Array, axis_name: AxisName, distance: int) -> jax.Array:
    """Device i receives x of device i ^ distance, exactly, through a 2-member reduce-scatter.

    Each pair {i, i ^ distance} is one replica group of a reduce-scatter over `axis_name`
    (`pair_groups`), so the pairs need no mesh axes of their own: one axis of any
    power-of-two size will do, as will size-2 axes (`gradcomm.parallel.pairwise_axes`).
    Each device lays out two slots, its own bits (as unsigned integers) in its partner's
    slot and zeros in its own, and the reduce-scatter hands each device the sum of its
    slot: the partner's bits plus zeros, so -0.0, NaN payloads, bf16 and fp16 come
    through unchanged. Each device sends the bytes of `x` once, like the swap
    `ppermute(x, [(i, i ^ distance)])` it replaces; gloo runs that swap at half speed and
    this at full speed both ways.

    An all-reduce of the bits less the device's own is cheaper, but it needs the device
    to subtract the very bits it sent. XLA:CPU may fuse the producer of `x` into the
    all-reduce's operand and into the subtraction separately and contract a product into
    an FMA in one of them only; then the two differ in the last bit and the difference is
    garbage (Adasum at N = 4 returned NaN that way; `tests/suites/test_pairwise.py`). Here
    nobody needs the bits it sent. Needs `distance` a power of two below the number of
    devices, itself a power of two. A named `vmap` takes no replica groups and has no
    link: there it is the `ppermute`. Its gradient is the same swap of the cotangent.
    """
    groups = pair_groups(1 << _levels(axis_name), distance)
    if not is_manual(axis_name):
        return ppermute(x, axis_name, [(i, j) for pair in groups for i, j in (pair, pair[::-1])])
    x = vary(x, axis_name)  # typed like a ppermute's result over the whole axis_name
    bits = lax.bitcast_convert_type(x, _unsigned(x.dtype))
    upper = is_upper(axis_name, distance)
    zeros = jnp.zeros_like(bits)
    slots = jnp.stack([jnp.where(upper, bits, zeros), jnp.where(upper, zeros, bits)])
    received = lax.psum_scatter(
        slots, axis_name, scatter_dimension=0, tiled=False, axis_index_groups=groups
    )
    return lax.bitcast_convert_type(received, x.dtype)


def _swap_fwd(x: jax.Array, axis_name: AxisName, distance: int) -> tuple[jax.Array, None]:
    return swap(x, axis_name, distance), None


def _swap_bwd(axis_name: AxisName, distance: int, _: None, ct: jax.Array) -> tuple[Any]:
    return (swap(ct, axis_name, distance),)  # a swap is its own transpose


swap.defvjp(_swap_fwd, _swap_bwd)


def pair_sum(x: jax.Array, axis_name: AxisName, distance: int) -> jax.Array:
    """x of device i plus x of device i ^ distance, the lower's first: the same bits on both.

    One `swap` and an add, where a two-member `psum` would need replica groups that
    `shard_map` does not take. Each device sends x once, at full speed both ways on gloo.
    """
    x = vary(x, axis_name)
    received = swap(x, axis_name, distance)
    return jnp.where(is_upper(axis_name, distance), received + x, x + received)


def all_gather_pairwise(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """`all_gather_invariant(x, axis_name)` as one `swap` per bit of the device index.

    Reverse doubling: at step j each device swaps the 2^j rows it holds with device
    i ^ 2^j, so each device sends (N - 1) rows in all, like an all-gather, and every
    step runs at full speed both ways on gloo. The rows are the same bits on every
    device, which the result's type then says (`assume_invariant`).
    """
    # Each step reads `held` in the exchange and twice in the select. Without the barrier
    # XLA:CPU fused its producer (Adasum's last combine) into the select and recomputed
    # it for each read; with it (expanded away later, but after fusion) the select reads
    # one materialized copy. Measured: hierarchical Adasum's step 1.49x -> 1.37x allreduce.
    held = lax.optimization_barrier(x)[None]
    for level in range(_levels(axis_name)):
        received = swap(held, axis_name, 1 << level)
        upper = is_upper(axis_name, 1 << level)  # this device's rows come second
        held = jnp.concatenate([jnp.where(upper, received, held), jnp.where(upper, held, received)])
    return assume_invariant(held, axis_name)


def reduce_scatter_pairwise(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """The sum over the devices of row i of `x` (N rows), on device i: recursive halving.

    One `swap` per bit of the device index: at level b each device keeps the rows whose index
    shares its bit b, sends the other half to device i ^ 2^b, and adds what it receives,
    in float32 at least, rounded back to `x`'s dtype (a 16-bit sum of two per level, as a
    16-bit ring all-reduce rounds each partial sum). Each device sends (N - 1) / N of `x`,
    like a reduce-scatter, at full speed both ways on gloo. The tree is fixed, so the
    result is deterministic; the two partners' sums agree, a float addition commuting.
    """
    levels = _levels(axis_name)
    if x.shape[0] != 1 << levels:
        raise ValueError(f"reduce_scatter_pairwise: {x.shape[0]} rows over axes of {axis_name!r}")
    wide = compute_dtype(x.dtype)
    held = x
    for level in range(levels):
        rows = held.reshape(-1, 2, *x.shape[1:])  # by the row index's bit `level`
        upper = is_upper(axis_name, 1 << level)
        keep = jnp.where(upper, rows[:, 1], rows[:, 0])
        received = swap(jnp.where(upper, rows[:, 0], rows[:, 1]), axis_name, 1 << level)
        held = (keep.astype(wide) + received.astype(wide)).astype(x.dtype)
    return held[0]


def reduce_scatter_ring(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """The sum over the devices of row i of `x` (N rows), on device i: a one-way ring.

    N - 1 shifts, each device sending to device i + 1 (mod N) only. Device i starts the
    partial sum of row i - 1 with its own row and sends it on; each device adds its own
    row to the partial sum it receives, in float32 at least, rounded back to `x`'s dtype
    (as a 16-bit ring all-reduce rounds each partial sum), and sends that on; after N - 1
    shifts the partial sum that reaches device i has passed every device and is row i's.
    Each device sends (N - 1) / N of `x`, like a reduce-scatter, and no pair sends to each
    other for N > 2, so gloo runs every shift at full speed (at N = 2 the shift is a
    swap: `reduce_scatter_pairwise` is the full-speed one there). The partial sums travel
    as their bits (unsigned integers): XLA:CPU would send a bfloat16 permute as float32.
    Row i is summed in the order i + 1, i + 2, ..., i (mod N), on one device: the result
    is deterministic.
    """
    n = axis_size(axis_name)
    if x.shape[0] != n:
        raise ValueError(f"reduce_scatter_ring: {x.shape[0]} rows over {n} devices")
    wide = compute_dtype(x.dtype)
    i = lax.axis_index(axis_name)
    ring = [(j, (j + 1) % n) for j in range(n)]
    held = lax.dynamic_index_in_dim(x, (i - 1) % n, keepdims=False)
    bits = _unsigned(x.dtype)  # XLA:CPU would widen a bfloat16 permute to float32
    for shift in range(2, n + 1):  # the row whose partial sum arrives: i - shift (mod N)
        sent = lax.bitcast_convert_type(held, bits)
        received = lax.bitcast_convert_type(ppermute(sent, axis_name, ring), x.dtype)
        own = lax.dynamic_index_in_dim(x, (i - shift) % n, keepdims=False)
        held = (received.astype(wide) + own.astype(wide)).astype(x.dtype)
    return held


# A no-op that types a value as invariant over mesh axes: what `psum` does to its result,
# without the communication. JAX 0.10.2 offers no public cast from varying to invariant
# (lax.pcast goes the other way), so this is the one place that builds on the abstract
# value's `mat` (manual axis type) attribute; checked against JAX 0.10.2.
_assume_invariant_p = Primitive("gradcomm_assume_invariant")
_assume_invariant_p.def_abstract_eval(
    lambda aval, *, axes: aval.update(
        manual_axis_type=aval.mat.update(varying=aval.mat.varying - frozenset(axes))
    )
)
mlir.register_lowering(_assume_invariant_p, lambda ctx, x, *, axes: [x])
batching.primitive_batchers[_assume_invariant_p] = lambda args, dims, *, axes: (
    _assume_invariant_p.bind(args[0], axes=axes),
    dims[0],
)
# The value is every device's, so each device's copy takes an equal share of the
# cotangent: the gradient all_gather_invariant would give (exact, N being 2^k).
ad.deflinear2(
    _assume_invariant_p,
    lambda ct, x, *, axes: (vary(ct, axes) / math.prod(axis_size(a) for a in axes),),
)


def assume_invariant(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Types `x` as identical on every device of the axes, which the caller guarantees.

    For values that an algorithm makes bit-identical without a collective whose type
    says so (`all_gather_pairwise`), so that they may leave `shard_map` with
    `out_specs=P()`.
    """
    axes = tuple(n for n in axis_names(axis_name) if n in varying_axes(x))
    return _assume_invariant_p.bind(x, axes=axes) if axes else x
