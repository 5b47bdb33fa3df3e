"""Shared plumbing: axis names, argument checks, and collectives with the right types.

Every gradcomm transformation runs inside `jax.shard_map`, `jax.pmap` or a named `jax.vmap`
and talks to the other devices through `jax.lax` collectives over a named axis. The helpers
here are the one place that validates those names and wraps the few collectives whose
behaviour differs between those contexts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

AxisName = str | tuple[str, ...]


def check_axis_name(axis_name: Any, arg: str = "axis_name") -> AxisName:
    """Validates an axis name at construction time: a non-empty str or tuple of them."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            f"{arg} must be a non-empty string or a tuple of them naming mesh axes, "
            f"got {axis_name!r}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{arg} names an axis twice: {axis_name!r}")
    return axis_name


def axis_names(axis_name: AxisName) -> tuple[str, ...]:
    """The axis name as a tuple of names."""
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def check_disjoint(first: AxisName, second: AxisName, first_arg: str, second_arg: str) -> None:
    """Raises if two axis arguments share a mesh axis."""
    shared = set(axis_names(first)) & set(axis_names(second))
    if shared:
        raise ValueError(
            f"{second_arg}={second!r} must name different mesh axes from "
            f"{first_arg}={first!r}; both name {sorted(shared)}"
        )


def axis_size(axis_name: AxisName) -> int:
    """Static size of a bound named axis, with a clear error when it is not bound."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"axis {axis_name!r} is not bound here: call gradcomm transformations inside "
            f"jax.shard_map, jax.pmap or jax.vmap over a mesh axis named {axis_name!r} "
            f"({e})"
        ) from None


def axis_index(axis_name: AxisName) -> jax.Array:
    """This device's index along a named axis (row-major over a tuple of axes)."""
    axis_size(axis_name)  # for the error message
    return lax.axis_index(axis_name)


def _is_manual(axis_name: AxisName) -> bool:
    """True inside `shard_map` (and `pmap`), where collectives carry varying/invariant types."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return all(n in manual for n in axis_names(axis_name))


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The mesh axes over which a traced value may differ between devices (under shard_map)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def vary(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Types a value as varying over the axes (a no-op where it already is, or under vmap)."""
    if not _is_manual(axis_name):
        return x
    missing = tuple(n for n in axis_names(axis_name) if n not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def all_gather_invariant(x: jax.Array, axis_name: AxisName, *, tiled: bool = False) -> jax.Array:
    """`lax.all_gather` whose result is typed as identical on every device.

    Under `shard_map` with `check_vma=True` this lets a result that every device provably
    holds bit for bit leave the map with `out_specs=P()`. Under `vmap` the type system has
    no such notion and the plain gather is used.
    """
    to = "invarying" if _is_manual(axis_name) else "varying"
    return lax.all_gather(x, axis_name, tiled=tiled, to=to)


def ppermute(x: jax.Array, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> jax.Array:
    """`lax.ppermute` where destinations nobody sends to receive zeros, in every context.

    Under `shard_map` and `pmap` a partial permutation sends only the listed pairs. `vmap`
    accepts only complete permutations, so there the missing pairs are added and their
    destinations zeroed afterwards (no real wire exists under `vmap`).
    """
    if _is_manual(axis_name):
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


def check_float_leaves(tree: Any, who: str) -> None:
    """Raises a `ValueError` naming the first leaf that is not a floating-point array."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{who} needs floating-point leaves, but leaf "
                f"{jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}"
            )


def require_params(params: Any, who: str) -> None:
    """Raises a `ValueError` when a transformation that reads params was given none."""
    if params is None:
        raise ValueError(f"{who} needs params: call tx.update(updates, state, params)")


def leaf_names(paths: Sequence[tuple[Any, ...]]) -> list[str]:
    """'Dense_1/kernel' style names for pytree key paths."""

    def part(key: Any) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    return ["/".join(part(k) for k in path) for path in paths]


def match_names(entries: Sequence[str], names: Sequence[str], arg: str) -> list[str | None]:
    """For each leaf name, the first entry equal to it or a '/'-prefix of it (else None).

    Raises a `ValueError` naming `arg` for entries that match no leaf.
    """

    def match(entry: str, name: str) -> bool:
        return name == entry or name.startswith(entry + "/")

    unknown = [e for e in entries if not any(match(e, name) for name in names)]
    if unknown:
        raise ValueError(f"{arg} names {unknown} match no leaf; the leaves are {list(names)}")
    return [next((e for e in entries if match(e, name)), None) for name in names]


def compute_dtype(dtype: Any) -> np.dtype:
    """The accumulation dtype for a floating dtype: at least float32."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


def exact_pow2(e: jax.Array, dtype: np.dtype) -> jax.Array:
    """2**e for integer e in the normal range of `dtype`, built from bits (exact)."""
    info = jnp.finfo(dtype)
    itype = jnp.int32 if info.bits == 32 else jnp.int64
    bits = (e.astype(itype) + (info.maxexp - 1)) << info.nmant
    return lax.bitcast_convert_type(bits, dtype)


def pow2_scale(m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Power-of-two scales for maxima `m >= 0`, and their exact reciprocals.

    `scale >= m` is the smallest such power of two, clamped so that both it and its
    reciprocal are normal numbers. A zero maximum gets scale 0 (it adds nothing to a
    group) and reciprocal 1; a non-finite one gets 1 and 1, so the inf or NaN reaches the
    dot products and poisons the leaf.
    """
    info = jnp.finfo(m.dtype)
    _, e = jnp.frexp(m)
    e = jnp.clip(e, info.minexp, info.maxexp - 2)
    finite = jnp.isfinite(m)
    scale = jnp.where(m == 0, 0, jnp.where(finite, exact_pow2(e, m.dtype), 1))
    inverse = jnp.where((m == 0) | ~finite, 1, exact_pow2(-e, m.dtype))
    return scale.astype(m.dtype), inverse.astype(m.dtype)


class ParamsAveraging(NamedTuple):
    """A marker inside a transformation's state: average the params over the devices now.

    Averaging params through an additive update cannot make every device's copy the same
    bits (p + (a - p) rounds differently for different p), so transformations that
    average params defer the assignment to `gradcomm.parallel.train_step`, which passes
    `defer_params_averaging=True` and sets the params to their exact mean when `due`.
    """

    due: jax.Array  # bool scalar


DEFER_AVERAGING = "defer_params_averaging"


def averaging_due(count: jax.Array, every: int | None) -> jax.Array:
    """Whether the step that increments `count` is an averaging step: steps every, 2 every, ..."""
    if every is None:
        return jnp.zeros([], bool)
    return (count + 1) % every == 0


def zero_count() -> jax.Array:
    """The initial step counter of every gradcomm state."""
    return jnp.zeros([], jnp.int32)


def dtype_groups(leaves: Sequence[jax.Array]) -> list[list[int]]:
    """Indices of the non-empty leaves, grouped by dtype in first-seen order."""
    groups: dict[np.dtype, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if leaf.size:
            groups.setdefault(np.dtype(leaf.dtype), []).append(i)
    return list(groups.values())
