"""Argument and input validation shared by every method: one message per mistake.

Construction-time checks (`check_int`, `static_hint`, `match_names`) name the argument and
the allowed range; trace-time checks (`check_updates`, `require_params`) say what to do.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm._axes import AxisName, axis_names, is_manual, varying_axes


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
    if not leaves or _SHAPES_ONLY.get() or not is_manual(axis_name):
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


def named_leaves(tree: Any) -> tuple[list[Any], list[str], Any]:
    """`tree`'s leaves, their '/'-joined names (`leaf_names`) and its treedef."""
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = leaf_names([path for path, _ in paths_leaves])
    return [leaf for _, leaf in paths_leaves], names, treedef


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
