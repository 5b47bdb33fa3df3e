"""Shared plumbing: axis names, argument checks, and collectives with the right types.

Every gradcomm transformation runs inside `jax.shard_map`, `jax.pmap` or a named `jax.vmap`
and talks to the other devices through `jax.lax` collectives over a named axis. The helpers
here are the one place that validates those names and wraps the few collectives whose
behaviour differs between those contexts.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

AxisName = str | tuple[str, ...]
Exchange = Literal["auto", "permute", "pairwise"]
EXCHANGES: tuple[str, ...] = ("auto", "permute", "pairwise")


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


def check_exchange(exchange: Any) -> Exchange:
    """Validates an `exchange` argument at construction time."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    return exchange


def _platform() -> str:
    """The platform of the mesh being mapped over (the default backend outside one)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def use_pairwise(axis_name: AxisName, exchange: Exchange, who: str) -> bool:
    """Whether pairwise swaps over `axis_name` go through `exchange` rather than `ppermute`.

    "permute" never does; "pairwise" always does, and needs every axis of `axis_name` to
    have size 2 (or 1; see `gradcomm.parallel.pairwise_axes`); "auto" does where that
    holds, under `shard_map` or `pmap`, on CPU devices in more than one process. There
    the collectives go over the network through gloo, which runs a `ppermute` in which
    two devices send to each other at half the link's speed and a two-member reduce-scatter
    at full speed both ways. NCCL and TPU ICI have no such penalty, and within one
    process there is no link, so "auto" keeps `ppermute` there.
    """
    sizes = {name: axis_size(name) for name in axis_names(axis_name)}
    factored = all(size <= 2 for size in sizes.values())
    if exchange == "pairwise" and not factored:
        raise ValueError(
            f"{who}: exchange='pairwise' needs axis_name to name mesh axes of size 2 only "
            f"(build them with gradcomm.parallel.pairwise_axes), got sizes {sizes}"
        )
    if exchange == "auto":
        on_gloo = _platform() == "cpu" and jax.process_count() > 1
        return factored and on_gloo and _is_manual(axis_name)
    return exchange == "pairwise"


def _bit_axes(axis_name: AxisName) -> tuple[str, ...]:
    """The size-2 axes of `axis_name`, least significant first (size-1 axes add no bit)."""
    sizes = {name: axis_size(name) for name in axis_names(axis_name)}
    if any(size > 2 for size in sizes.values()):
        raise ValueError(f"pairwise exchanges need mesh axes of size 2, got sizes {sizes}")
    return tuple(name for name in reversed(sizes) if sizes[name] == 2)


def pair_axis(axis_name: AxisName, distance: int) -> str:
    """The size-2 axis in which device i and device i ^ distance differ.

    The index over a tuple of axes is row-major, so over axes of size 2 (or 1), bit j of
    the index is the index along the j-th size-2 axis from the end.
    """
    bit_axes = _bit_axes(axis_name)
    level = distance.bit_length() - 1
    if distance != 1 << level or level >= len(bit_axes):
        raise ValueError(f"no size-2 axis of {axis_name!r} pairs devices {distance} apart")
    return bit_axes[level]


def _unsigned(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"uint{np.dtype(dtype).itemsize * 8}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def exchange(x: jax.Array, axis_name: AxisName, distance: int) -> jax.Array:
    """Device i receives x of device i ^ distance, exactly, through a 2-member reduce-scatter.

    Over the one size-2 axis that separates the pair, each device lays out two slots, its
    own bits (as unsigned integers) in its partner's slot and zeros in its own, and a
    reduce-scatter hands each device the sum of its slot: the partner's bits plus zeros,
    so -0.0, NaN payloads, bf16 and fp16 come through unchanged. Each device sends the
    bytes of `x` once, like the swap `ppermute(x, [(i, i ^ distance)])` it replaces;
    gloo runs that swap at half speed and this at full speed both ways.

    An all-reduce of the bits less the device's own is cheaper, but it needs the device
    to subtract the very bits it sent. XLA:CPU may fuse the producer of `x` into the
    all-reduce's operand and into the subtraction separately and contract a product into
    an FMA in one of them only; then the two differ in the last bit and the difference is
    garbage (Adasum at N = 4 returned NaN that way; `tests/test_pairwise.py`). Here
    nobody needs the bits it sent. Needs `axis_name` to be size-2 axes (`use_pairwise`)
    and `distance` a power of two below the axis size. Its gradient is the same swap of
    the cotangent.
    """
    axis = pair_axis(axis_name, distance)
    x = vary(x, axis_name)  # typed like a ppermute's result over the whole axis_name
    bits = lax.bitcast_convert_type(x, _unsigned(x.dtype))
    upper = lax.axis_index(axis) == 1
    zeros = jnp.zeros_like(bits)
    slots = jnp.stack([jnp.where(upper, bits, zeros), jnp.where(upper, zeros, bits)])
    received = lax.psum_scatter(slots, axis, scatter_dimension=0, tiled=False)
    return lax.bitcast_convert_type(received, x.dtype)


def _exchange_fwd(x: jax.Array, axis_name: AxisName, distance: int) -> tuple[jax.Array, None]:
    return exchange(x, axis_name, distance), None


def _exchange_bwd(axis_name: AxisName, distance: int, _: None, ct: jax.Array) -> tuple[Any]:
    return (exchange(ct, axis_name, distance),)  # a swap is its own transpose


exchange.defvjp(_exchange_fwd, _exchange_bwd)


def all_gather_pairwise(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """`all_gather_invariant(x, axis_name)` over size-2 axes, as one `exchange` per axis.

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
    for level, name in enumerate(_bit_axes(axis_name)):
        received = exchange(held, axis_name, 1 << level)
        upper = lax.axis_index(name) == 1  # this device's rows come second
        held = jnp.concatenate([jnp.where(upper, received, held), jnp.where(upper, held, received)])
    return assume_invariant(held, axis_name)


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


def static_hint(value: Any, arg: str) -> str:
    """For the error about a structural argument: what to do where it arrived as an array.

    `optax.inject_hyperparams` turns every numeric argument, defaults included, into an
    array (traced under jit); those that shape the program (density, drop ratio, seed,
    overlap, periods) must stay static.
    """
    if isinstance(value, jax.Array):
        return (
            f" ({arg} shapes the program, so it must be static: with "
            f"optax.inject_hyperparams, pass static_args=({arg!r},))"
        )
    return ""


def check_int(value: Any, arg: str, *, minimum: int | None = None, optional: bool = False) -> None:
    """Raises a `ValueError` unless `value` is an int (not a bool) of at least `minimum`.

    `optional` also accepts None. The message says what to do where `value` arrived as an
    array (`static_hint`).
    """
    if optional and value is None:
        return
    low = minimum is not None and isinstance(value, int | np.integer) and value < minimum
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or low:
        kinds = {None: "an int", 0: "a non-negative int", 1: "a positive int"}
        kind = kinds.get(minimum, f"an int >= {minimum}")
        raise ValueError(
            f"{arg} must be {kind}{' or None' if optional else ''}, got {value!r}"
            + static_hint(value, arg)
        )


def check_float_leaves(tree: Any, who: str) -> None:
    """Raises a `ValueError` naming the first leaf that is not a floating-point array."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{who} needs floating-point leaves, but leaf "
                f"{jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}"
            )


_SHAPES_ONLY = contextvars.ContextVar("gradcomm_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Within: `check_updates` skips the reduced-input check.

    For tracing that probes types rather than training: `parallel.init_state` traces one
    update with every state leaf replicated at first, and a wrapper such as
    `optax.MultiSteps` then hands the method its replicated accumulator (in an
    `eval_shape`), which would read as summed gradients.
    """
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def check_updates(tree: Any, axis_name: AxisName, who: str) -> None:
    """The checks every method runs on its input: float leaves, and not already reduced.

    Under `shard_map` with `check_vma=True` (its default) JAX types each value with the
    mesh axes over which it may vary. Gradients of parameters that entered the map
    replicated (`in_specs=P()`) come out invariant: JAX has already summed them over the
    axis, so every device holds the total and the per-device gradients are gone. A
    method would then average N copies of the sum (N times too large for allreduce, a
    no-op for Adasum); no division can recover them, so this raises. Where the types say
    nothing (`check_vma=False`, `vmap`, where `lax.axis_index` itself reads as
    invariant) the check is skipped, never guessed. It raises only where every float
    leaf is invariant over one of the axes: a lone invariant leaf (say, zeros for a
    frozen parameter) is not a sum.

    Raises:
      ValueError: naming the leaf that is not floating point, or the fix for gradients
        that are already reduced.
    """
    check_float_leaves(tree, who)
    leaves = [leaf for leaf in jax.tree.leaves(tree) if jnp.size(leaf)]
    if not leaves or _SHAPES_ONLY.get() or not _is_manual(axis_name):
        return
    for name in axis_names(axis_name):
        if name not in varying_axes(lax.axis_index(name)):
            continue  # no type checking here: every value reads as invariant
        if all(name not in varying_axes(leaf) for leaf in leaves):
            raise ValueError(
                f"{who} got updates that are already identical on every device of axis "
                f"{name!r}: JAX summed the gradients over the axis because the parameters "
                f"entered shard_map replicated (in_specs=P()). Differentiate with respect "
                f"to per-device parameters, `params = jax.lax.pcast(params, {name!r}, "
                f"to='varying')` before `jax.grad`, or use gradcomm.parallel.train_step, "
                f"which does this. (If they come from optimizer state that entered "
                f"replicated, such as optax.MultiSteps' accumulator, that state differs per "
                f"device: lay it out with gradcomm.parallel.init_state and train_step.)"
            )


def require_params(params: Any, who: str) -> None:
    """Raises a `ValueError` when a transformation that reads params was given none."""
    if params is None:
        raise ValueError(f"{who} needs params: call tx.update(updates, state, params)")


def leaf_names(paths: Sequence[tuple[Any, ...]]) -> list[str]:
    """'Dense_1/kernel' style names for pytree key paths."""
    return [jax.tree_util.keystr(path, simple=True, separator="/") for path in paths]


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


_AVERAGING_PERIODS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "gradcomm_averaging_periods", default=None
)


@contextlib.contextmanager
def averaging_periods() -> Iterator[list[int]]:
    """Within: `averaging_due` adds each period it is traced with to the list it yields.

    `parallel.train_step` traces the update within, so that it can name its averaging
    branch with its period for `gradcomm.wire` (the `ParamsAveraging` marker carries
    only the traced flag).
    """
    periods: list[int] = []
    token = _AVERAGING_PERIODS.set(periods)
    try:
        yield periods
    finally:
        _AVERAGING_PERIODS.reset(token)


def averaging_due(count: jax.Array, every: int | None) -> jax.Array:
    """Whether the step that increments `count` is an averaging step: steps every, 2 every, ..."""
    if every is None:
        return jnp.zeros([], bool)
    periods = _AVERAGING_PERIODS.get()
    if periods is not None:
        periods.append(every)
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
