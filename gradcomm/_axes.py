"""Mesh axes and their types: names, sizes, and which values vary across devices.

Every gradcomm transformation runs inside `jax.shard_map`, `jax.pmap` or a named `jax.vmap`
and talks to the other devices over a named axis. This module validates those names, reads
their sizes with a clear error where they are not bound, and reads and sets JAX's
varying/invariant types (the `check_vma` system of `shard_map`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import jax
from jax import lax

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


def bound_axes() -> tuple[Any, ...]:
    """The axis names bound where this runs, outermost first: the mesh axes that an
    enclosing `jax.shard_map` maps over, and the axes of an enclosing `jax.pmap` or named
    `jax.vmap`; empty outside them. For error messages."""
    try:  # JAX's axis environment: shard_map's, pmap's and vmap's axes alike
        from jax.extend.core import unsafe_get_axis_names_DO_NOT_USE as env_names

        bound = list(env_names())
    except (ImportError, AttributeError):  # gone from a later JAX: shard_map's axes still say
        bound = []
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return tuple(dict.fromkeys([*manual, *bound]))


def unbound_error(axis_name: AxisName) -> ValueError:
    """The error for a named axis that is not bound here, naming the axes that are."""
    bound = bound_axes()
    missing = [n for n in axis_names(axis_name) if n not in bound] or list(axis_names(axis_name))
    what = f"axis {missing[0]!r}" + (f" of {axis_name!r}" if missing[0] != axis_name else "")
    if not bound:
        return ValueError(
            f"{what} is not bound here, and no axis is: call gradcomm transformations inside "
            f"jax.shard_map, jax.pmap or a named jax.vmap over a mesh axis named "
            f"{missing[0]!r} (as parallel.train_step and parallel.init_state do)"
        )
    unmapped = set(missing) & set(jax.sharding.get_abstract_mesh().axis_names)
    note = (
        f" (the mesh's axes {sorted(unmapped)} are not mapped by this shard_map)"
        if unmapped
        else ""
    )
    example = f"for example gradcomm.allreduce({bound[0]!r})" if len(bound) == 1 else "one of those"
    return ValueError(
        f"{what} is not bound here; the axes bound here are {bound}{note}. Pass the mesh's "
        f"data axis name to the gradcomm method's factory ({example}), or map over an axis "
        f"named {missing[0]!r}"
    )


def axis_size(axis_name: AxisName) -> int:
    """Static size of a bound named axis, with a clear error when it is not bound."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        raise unbound_error(axis_name) from None


def axis_index(axis_name: AxisName) -> jax.Array:
    """This device's index along a named axis (row-major over a tuple of axes)."""
    axis_size(axis_name)  # for the error message
    return lax.axis_index(axis_name)


def is_manual(axis_name: AxisName) -> bool:
    """True inside `shard_map` (and `pmap`), where collectives carry varying/invariant types."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return all(n in manual for n in axis_names(axis_name))


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The mesh axes over which a traced value may differ between devices (under shard_map)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def vary(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Types a value as varying over the axes (a no-op where it already is, or under vmap)."""
    if not is_manual(axis_name):
        return x
    missing = tuple(n for n in axis_names(axis_name) if n not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def check_exchange(exchange: Any, choices: tuple[str, ...] = EXCHANGES) -> str:
    """Validates an `exchange` argument at construction time: one of `choices`."""
    if exchange not in choices:
        raise ValueError(f"exchange must be one of {choices}, got {exchange!r}")
    return exchange


def _platform() -> str:
    """The platform of the mesh being mapped over (the default backend outside one)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def use_pairwise(axis_name: AxisName, exchange: Exchange, who: str) -> bool:
    """Whether pairwise swaps over `axis_name` go through `exchange` rather than `ppermute`.

    "permute" never does; "pairwise" does under `shard_map` or `pmap`, and needs a
    power-of-two number of devices over `axis_name` (the pairs are replica groups of one
    collective, `gradcomm._collectives.swap`). Under a named `vmap` there is no link, and
    the permutes give the same bits. "auto" takes the exchange of an enclosing
    `forced_exchange` (a `gradcomm.parallel.TrainStep` traces its step under the one its
    probe found faster), else keeps `ppermute` within one process (no link); across
    processes it follows the link's probe where one was taken
    (`gradcomm.parallel.calibrate`, `record_probe`). Without one it pairs on CPU devices
    in more than one process, where the collectives go over the network through gloo,
    which runs a `ppermute` in which two devices send to each other at half the link's
    speed and a two-member reduce-scatter at full speed both ways; NCCL and TPU ICI have
    no such penalty, and within one process there is no link.
    """
    n = axis_size(axis_name)
    power = n > 1 and not n & (n - 1)
    if exchange == "pairwise" and not power and n > 1:
        raise ValueError(
            f"{who}: exchange='pairwise' needs a power-of-two number of devices over "
            f"axis_name, got {n}; use exchange='permute' (or 'auto')"
        )
    if not power or not is_manual(axis_name) or exchange == "permute":
        return False
    if exchange == "pairwise":
        return True
    if _FORCED:
        return _FORCED[-1] == "pairwise"
    if jax.process_count() == 1:  # no link between the devices: nothing to probe
        return False
    probed = _PROBES.get(link_key())
    return probed == "pairwise" if probed is not None else on_gloo(axis_name)


_PROBES: dict[tuple[str, int], str] = {}  # link_key -> the exchange the probe found faster
_FORCED: list[str] = []  # the innermost `forced_exchange` last


@contextlib.contextmanager
def forced_exchange(exchange: Literal["permute", "pairwise"] | None) -> Iterator[None]:
    """While tracing in this context, `exchange="auto"` swaps by `exchange` (None: as it
    would outside). Explicit "permute" and "pairwise" are kept."""
    if exchange is None:
        yield
        return
    _FORCED.append(exchange)
    try:
        yield
    finally:
        _FORCED.pop()


def link_key() -> tuple[str, int]:
    """What identifies a link for `record_probe`: the platform (of the mesh being mapped
    over) and the process count. One probe serves every axis of the run (a hierarchical
    method's node axis too): its pairs cross the same links."""
    return (_platform(), jax.process_count())


def record_probe(key: tuple[str, int], exchange: Literal["permute", "pairwise"]) -> None:
    """Records the exchange that `gradcomm.parallel.calibrate` found faster on the link
    `key` (`link_key`): "auto" then uses it."""
    _PROBES[key] = exchange


def on_gloo(axis_name: AxisName) -> bool:
    """Whether collectives over `axis_name` go through gloo over the network.

    They do under `shard_map` or `pmap` on CPU devices in more than one process (XLA:CPU's
    cross-process collectives); within one process, or under a named `vmap`, there is
    no link.
    """
    return _platform() == "cpu" and jax.process_count() > 1 and is_manual(axis_name)
