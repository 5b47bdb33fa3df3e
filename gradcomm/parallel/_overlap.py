"""Communication overlapped with the backward pass: one exchange per layer, in the backward.

A layer is a top-level entry of the params tree (`{"dense_0": {...}, "dense_1": {...}}`
has two; a single array is one layer). `layerwise(tx)` runs `tx` once per layer, each with
its own state, on a tree that holds that layer's leaves and `None` in place of the others,
so leaf names ('/'-joined key paths, which options such as LAGS's per-leaf density read)
are those of the whole tree. `overlapped_update` then moves each layer's `tx.update` into
the backward pass: the layer's params go through an identity whose custom VJP runs the
update on the layer's gradient as soon as backprop has it, and hands back the update as
the params' cotangent and the new state as the cotangent of a "carrier" input. The layers
below are still to be differentiated at that point, so the layer's collectives can run
while they compute (whether they do is the compiler's and the runtime's choice: see
`docs/site/guide/overlap.md`).

A state leaf travels as float32: a float leaf as itself, an integer, bool or PRNG-key leaf
as its 32-bit words split into 16-bit halves, each exactly a float32 (no bit pattern that
arithmetic could flush or canonicalise), and rebuilt bit for bit.

Per layer is exact only for a transformation that acts layer by layer. `check_layerwise`
raises for those known not to (a gradcomm method whose registry entry does not hide in
the backward, such as SLGS's global top-k; a method whose state holds a random key, which
every layer's state would repeat, such as TernGrad's; optax's global-norm clipping and
finite checks); a custom transformation that reads the whole tree cannot be detected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradcomm import _axes, registry

# optax transformations that read the whole tree (a global norm, one finite check, a line
# search): per layer they would compute something else. Matched on the update function's
# qualified name.
_WHOLE_TREE_OPTAX = (
    "clip_by_global_norm",
    "apply_if_finite",
    "skip_not_finite",
    "skip_large_updates",
    "normalize_by_update_norm",
    "scale_by_lbfgs",
    "scale_by_zoom_linesearch",
    "scale_by_backtracking_linesearch",
    "scale_by_polyak",
)


def _top(tree: Any) -> tuple[list[Any], Any]:
    """The top-level entries of `tree` (`None` ones are empty) and the treedef that puts
    them back."""
    return jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree and x is not None)


def num_layers(params: Any) -> int:
    """How many layers `layerwise` splits `params` into: its top-level entries."""
    return len(_top(params)[0])


def _layer(tree: Any, i: int) -> Any:
    """Layer `i` of `tree`: the tree with `None` in place of the other top-level entries."""
    entries, treedef = _top(tree)
    if len(entries) == 1:
        return tree
    return jax.tree_util.tree_unflatten(
        treedef, [x if j == i else None for j, x in enumerate(entries)]
    )


def _join(tree: Any, layers: list[Any]) -> Any:
    """`tree`'s structure with layer `i`'s entries taken from `layers[i]`."""
    entries, treedef = _top(tree)
    if len(entries) == 1:
        return layers[0]
    return jax.tree_util.tree_unflatten(treedef, [_top(x)[0][0] for x in layers])


def _check_layers(layers: int, state: Any) -> None:
    if not isinstance(state, tuple) or len(state) != layers:
        raise ValueError(
            f"this state is not a per-layer state for params of {layers} layers; a step "
            "built with overlap=True takes the state of init_state(..., overlap=True)"
        )


def layerwise(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`tx` applied to each top-level entry of the params on its own, with its own state.

    Args:
      tx: the transformation (it must act layer by layer: see `check_layerwise`).

    Returns:
      A transformation whose state is a tuple of `tx`'s states, one per layer.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from gradcomm.parallel._overlap import layerwise
      >>> tx = layerwise(optax.adam(1e-3))
      >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
      >>> state = tx.init(params)
      >>> len(state), state[1][0].mu
      (2, {'a': None, 'b': Array([0., 0., 0.], dtype=float32)})
    """
    tx = optax.with_extra_args_support(tx)

    def init_fn(params: Any) -> tuple[Any, ...]:
        return tuple(tx.init(_layer(params, i)) for i in range(num_layers(params)))

    def update_fn(
        updates: Any, state: tuple[Any, ...], params: Any = None, **extra: Any
    ) -> tuple[Any, tuple[Any, ...]]:
        n = num_layers(updates)
        _check_layers(n, state)
        outs = [
            tx.update(
                _layer(updates, i), state[i], None if params is None else _layer(params, i),
                **extra,
            )
            for i in range(n)
        ]  # fmt: skip
        return _join(updates, [u for u, _ in outs]), tuple(s for _, s in outs)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _update_names(fn: Any, seen: set[int], depth: int = 0) -> list[str]:
    """Qualified names of the functions reachable from `fn` through closures (bounded)."""
    if depth > 8 or id(fn) in seen:
        return []
    seen.add(id(fn))
    names = []
    if callable(fn) and hasattr(fn, "__qualname__"):
        names.append(fn.__qualname__)
    values: list[Any] = []
    if isinstance(fn, list | tuple):
        values = list(fn)
    elif isinstance(fn, optax.GradientTransformation):
        values = [fn.update]
    elif getattr(fn, "__closure__", None):
        for cell in fn.__closure__:
            try:
                values.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    for value in values:
        if callable(value) or isinstance(value, list | tuple):
            names += _update_names(value, seen, depth + 1)
    return names


def _method_of(state_type: type) -> registry.Method | None:
    for method in registry.METHODS.values():
        if method.factory.__module__ == state_type.__module__:
            return method
    return None


def _nodes(tree: Any) -> list[Any]:
    """Every tuple (NamedTuple states included), list and dict in `tree`, outermost first."""
    if isinstance(tree, dict):
        return [tree] + [n for v in tree.values() for n in _nodes(v)]
    if isinstance(tree, list | tuple):
        return [tree] + [n for v in tree for n in _nodes(v)]
    return []


def check_layerwise(tx: optax.GradientTransformation, shapes: Any) -> None:
    """Raises where `tx` is known not to act layer by layer (see the module docstring).

    Args:
      tx: the transformation.
      shapes: its state (or the state's shapes), for the gradcomm methods it holds.

    Raises:
      ValueError: naming the method or optax function and what to do instead.
    """
    hint = "build the step with overlap=False, which runs it once after the whole backward"
    for node in _nodes(shapes):
        kind = type(node)
        if not kind.__module__.startswith("gradcomm.") or not hasattr(kind, "_fields"):
            continue
        method = _method_of(kind)
        if "key" in kind._fields:
            raise ValueError(
                f"{kind.__name__} holds a random key: one state per layer would start every "
                f"layer from the same key, so the layers would draw the same random bits; {hint}"
            )
        if method is None or method.hides_in() != "backward":
            what = f"gradcomm.{method.name}" if method else kind.__name__
            raise ValueError(
                f"{what} does not act layer by layer (its registry entry says its "
                f"communication cannot hide in the backward pass), so overlap=True would "
                f"compute a per-layer result instead of its own; {hint}"
            )
    for name in _update_names(tx.update, set()):
        bad = [f for f in _WHOLE_TREE_OPTAX if name.split(".")[0] == f]
        if bad:
            raise ValueError(
                f"optax.{bad[0]} reads the whole tree (one norm or decision for all "
                f"leaves), so overlap=True would apply it per layer; {hint}, or use a "
                f"per-leaf alternative (optax.clip, optax.adaptive_grad_clip)"
            )


def _to_carrier(x: jax.Array) -> jax.Array:
    """A state leaf as float32 (see the module docstring)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x
    if x.dtype.itemsize > 4:
        raise ValueError(f"overlap=True carries state leaves of up to 32 bits, not {x.dtype}")
    words = x.astype(jnp.uint32) if x.dtype.itemsize < 4 or x.dtype == bool else x
    words = jax.lax.bitcast_convert_type(words, jnp.uint32)
    return jnp.stack([words >> 16, words & 0xFFFF]).astype(jnp.float32)


def _from_carrier(c: jax.Array, like: Any) -> jax.Array:
    """The state leaf `like` (a value or shape) back from its carrier, bit for bit."""
    dtype = like.dtype
    key = jnp.issubdtype(dtype, jax.dtypes.prng_key)
    raw = jax.eval_shape(jax.random.key_data, like).dtype if key else dtype
    if jnp.issubdtype(raw, jnp.floating):
        out = c
    else:
        halves = c.astype(jnp.uint32)
        words = (halves[0] << 16) | halves[1]
        if np.dtype(raw).itemsize == 4 and np.dtype(raw) != np.bool_:
            out = jax.lax.bitcast_convert_type(words, raw)
        else:
            out = words.astype(raw)
    return jax.random.wrap_key_data(out, impl=jax.random.key_impl(like)) if key else out


def _after(tree: Any, earlier: Any) -> Any:
    """`tree`, bit for bit, but computed after `earlier` exists (a data dependency).

    Each leaf loses the sum of `|e| * 0` over one finite scalar `e` of each leaf of
    `earlier`: +0, which leaves every float (-0 included) as it is. XLA cannot fold it away
    without fast math, so the collective that reads the leaf cannot be merged with, or
    moved before, the one that made `earlier` (an optimization barrier does not stop
    XLA:CPU's all-reduce combiner).
    """
    firsts = [x.reshape(-1)[:1].astype(jnp.float32) for x in jax.tree.leaves(earlier)]
    zero = sum(jnp.abs(jnp.where(jnp.isfinite(e), e, 0.0)) * 0.0 for e in firsts)
    return jax.tree.map(lambda x: x - zero.astype(x.dtype).reshape(()), tree)


def _match(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """`ct` typed as varying over the same axes as `primal` (a cotangent must be)."""
    extra = _axes.varying_axes(ct) - _axes.varying_axes(primal)
    if extra:
        raise ValueError(
            f"params are replicated, but after this transformation a param differs across "
            f"axes {sorted(extra)}; end the chain with a synchronising method "
            f"(gradcomm.allreduce, gradcomm.adasum) or pass params_per_device=True"
        )
    missing = tuple(sorted(_axes.varying_axes(primal) - _axes.varying_axes(ct)))
    return _axes.vary(ct, missing) if missing else ct


def overlapped_update(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    params: Any,
    varied: Any,
    state: tuple[Any, ...],
    batch: Any,
    has_aux: bool,
) -> tuple[Any, Any, tuple[Any, ...]]:
    """Inside the map: the loss, the updates and the new per-layer state, each layer's
    `tx.update` run in the backward pass as soon as that layer's gradient exists.

    Args:
      loss_fn: `loss_fn(params, batch)`, or `(loss, aux)` with `has_aux`.
      tx: the transformation of one layer; `state` holds its state for each layer.
      params: this device's params, as `tx.update` receives them.
      varied: the same params typed as varying over the data axes (differentiated).
      state: the per-layer states.
      batch: this device's batch.
      has_aux: whether `loss_fn` returns `(loss, aux)`.

    Returns:
      `(loss output, updates, new state)`.
    """
    tx = optax.with_extra_args_support(tx)
    n = num_layers(params)
    _check_layers(n, state)
    carriers = [jax.tree.map(_to_carrier, s) for s in state]
    # The update of the layer before (in backprop order), which the next layer's exchange
    # waits for: XLA merges independent collectives into one at the end of the backward
    # (the all-reduce combiner), which would leave nothing to overlap.
    previous: list[Any] = []

    def hook(i: int) -> Callable[..., Any]:
        @jax.custom_vjp
        def through(p: Any, carrier: Any, raw: Any) -> Any:
            del carrier, raw
            return p

        def fwd(p: Any, carrier: Any, raw: Any) -> tuple[Any, Any]:
            return p, (carrier, raw)

        def bwd(res: Any, g: Any) -> tuple[None, Any, Any]:
            carrier, raw = res
            old = jax.tree.map(_from_carrier, carrier, state[i])
            if previous:
                g = _after(g, previous[-1])
            updates, new = tx.update(g, old, raw)
            if jax.tree.leaves(updates):
                previous.append(updates)
            paths = jax.tree_util.tree_leaves_with_path(raw)
            for (path, x), u in zip(paths, jax.tree.leaves(updates), strict=True):
                if u.dtype != x.dtype or u.shape != x.shape:
                    raise ValueError(
                        f"overlap=True returns each layer's update as its params' "
                        f"cotangent, which must match the param ({x.dtype}{list(x.shape)}); "
                        f"this transformation returned {u.dtype}{list(u.shape)} for param "
                        f"{jax.tree_util.keystr(path)}: build the step with overlap=False"
                    )
            updates = jax.tree.map(_match, updates, raw)
            new = jax.tree.map(_match, jax.tree.map(_to_carrier, new), carrier)
            return None, new, updates

        through.defvjp(fwd, bwd)
        return through

    # The update leaves as the cotangent of `params` (typed as they are: replicated ones
    # are invariant), not of `varied`, whose cotangent is typed as varying.
    def wrapped(carriers: list[Any], params: Any) -> Any:
        layers = [hook(i)(_layer(varied, i), carriers[i], _layer(params, i)) for i in range(n)]
        return loss_fn(_join(varied, layers), batch)

    grad_fn = jax.value_and_grad(wrapped, argnums=(0, 1), has_aux=has_aux)
    out, (new_carriers, updates) = grad_fn(carriers, params)
    new_state = tuple(
        jax.tree.map(_from_carrier, c, s) for c, s in zip(new_carriers, state, strict=True)
    )
    return out, updates, new_state
