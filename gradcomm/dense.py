"""The dense baseline: the mean of the updates over the data-parallel axis, by `lax.pmean`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import optax
from jax import lax

from gradcomm import _axes, _checks, _flat, _shards, _transform, perfmodel, registry
from gradcomm.low_precision import low_precision


class AllReduceState(NamedTuple):
    """State of `allreduce`: empty; an all-reduce is stateless."""


def allreduce(
    axis_name: _axes.AxisName = "data", dtype: Any = None, *, specs: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Replaces each update by its mean over the devices of `axis_name` (`lax.pmean`).

    This is synchronous data-parallel SGD's all-reduce, the baseline every other gradcomm
    method is measured against. Place it before the optimizer to average gradients
    (`optax.chain(gradcomm.allreduce(), optax.adam(1e-3))`), or after it to average updates.

    With FSDP (ZeRO-3: params split along their leading dimension over the data axes,
    `specs`), each device receives only its shard of the mean: one reduce-scatter per
    dtype (`lax.psum_scatter`), which sends (N - 1) / N of the gradient's bytes per device,
    half an all-reduce's. Leaves split over other mesh axes (tensor parallelism) need
    nothing: the mean is elementwise.

    Args:
      axis_name: the mesh axis, or tuple of axes, to average over.
      dtype: None sends the updates as they are; `jnp.bfloat16` or `jnp.float16` sends
        them as 16-bit floats, half the bytes: that is `gradcomm.low_precision(axis_name,
        dtype)`, which this returns.
      specs: None, or the params' `PartitionSpec`s (a pytree like them). A leaf whose spec
        splits its leading dimension over `axis_name`, `P("data", ...)`, is FSDP-sharded:
        its update comes in whole (the gradient of the gathered param) and leaves as this
        device's shard of the mean.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is an `AllReduceState` (a
      `LowPrecisionState` with a `dtype`).

    Raises:
      ValueError: for a malformed axis name or a `dtype` other than None, bfloat16 and
        float16 at construction, and at trace time for an axis that is not bound or a
        leaf that is not floating point.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.allreduce("data")
      >>> grads = jnp.array([[1.0, 2.0], [3.0, 6.0]])  # one row per device
      >>> jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")(grads)[0]
      Array([2., 4.], dtype=float32)
    """
    _axes.check_axis_name(axis_name)
    if dtype is not None:
        return low_precision(axis_name, dtype, specs=specs)

    def init_fn(params: Any) -> AllReduceState:
        del params
        return AllReduceState()

    def step(updates: Any, state: AllReduceState, params: Any) -> tuple[Any, AllReduceState]:
        del state, params
        n = _axes.axis_size(axis_name)
        leaves, names, treedef = _checks.named_leaves(updates)
        scatter = [
            _shards.scattered(spec, axis_name, "allreduce", name)
            for spec, name in zip(
                _shards.leaf_specs(specs, updates, "allreduce"), names, strict=True
            )
        ]
        whole = [i for i, s in enumerate(scatter) if not s]
        out = list(leaves)
        means = lax.pmean([leaves[i] for i in whole], axis_name)
        for i, mean in zip(whole, means, strict=True):
            out[i] = mean
        split = [i for i, s in enumerate(scatter) if s]
        for group in _flat.dtype_groups([leaves[i] for i in split]):
            ids = [split[j] for j in group]
            rows = _shards.to_rows([leaves[i] for i in ids], n, "allreduce")
            mine = lax.psum_scatter(rows, axis_name, scatter_dimension=0, tiled=True)[0] / n
            pieces = _shards.from_rows(mine, [leaves[i].shape for i in ids], n)
            for i, piece in zip(ids, pieces, strict=True):
                out[i] = piece.astype(leaves[i].dtype)
        return jax.tree.unflatten(treedef, out), AllReduceState()

    return _transform.transformation("allreduce", axis_name, init_fn, step)


def _pattern(options: Mapping[str, Any], s: perfmodel.Setting) -> list[perfmodel.Collective]:
    """One all-reduce of the model; with a `dtype`, `low_precision`'s exchange."""
    if options["dtype"] is None:
        return [perfmodel.Collective("allreduce", s.nodes, s.size)]
    sixteen = registry.METHODS["low_precision"]
    return sixteen.collectives(sixteen.options({"dtype": options["dtype"]}), s)


registry.register(registry.Method(
    allreduce, "either", title="All-reduce", paper="baseline", page="dense",
    collectives=_pattern, window=lambda options: "backward" if options["dtype"] is None else "none",
))  # fmt: skip
