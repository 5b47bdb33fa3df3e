"""The Adasum pair operator (eq. 8) on fused buffers, with its numerics.

`pair` computes AS(a, b) leaf by leaf on two `(rows, blocks, block)` buffers of a
`FlatLayout`: one pass for per-leaf dot products and squared norms, a merge over the
devices that hold slices of the pair (`gradcomm.adasum._rvhdd` supplies them), the
coefficients, and a second pass that combines. `gradcomm.adasum` holds the public API
and the design notes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm import _numeric
from gradcomm._flat import FlatLayout

NUM_STATS = 5  # scale_a, scale_b, a.b, a.a, b.b per leaf


def local_stats(own: jax.Array, other: jax.Array, layout: FlatLayout, ct: np.dtype) -> jax.Array:
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


def merge_stats(stats: jax.Array) -> tuple[jax.Array, ...]:
    """Per-leaf totals (Sa, Sb, a.b, a.a, b.b) over members `(members, 5, leaves)`.

    Rescales each member's products to the group's largest scale; the ratios of powers of
    two are exact and the sum runs in member order, so every member of a group computes
    the same bits.
    """
    scale_a, scale_b, ab, aa, bb = (stats[:, i] for i in range(NUM_STATS))
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


def coefficients(totals: tuple[jax.Array, ...]) -> jax.Array:
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
def pair(
    own: jax.Array,
    other: jax.Array,
    layout: FlatLayout,
    own_is_b: jax.Array | bool = False,
    group: Callable[[jax.Array], jax.Array] | None = None,
    halves: bool = False,
    shards: tuple[str, ...] = (),
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
        device order, `(members, 5, leaves)` (`gradcomm.adasum._rvhdd.group_stats`).
      halves: return the result's first and second halves of rows as two arrays.
      shards: mesh axes over which the leaves are split (tensor parallelism,
        `gradcomm._shards`): every device of them holds a piece of each leaf, and their
        stats join the members', so the coefficients are the whole tensors'.
    """
    ct = _numeric.compute_dtype(own.dtype)
    stats = local_stats(own, other, layout, ct)
    stats = jnp.where(own_is_b, stats[_SWAP_STATS], stats)
    members = stats[None] if group is None else group(stats)
    if shards:
        members = lax.all_gather(members, shards).reshape(-1, *members.shape[1:])
    coef = coefficients(merge_stats(members))
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
