"""The optax contract, for every factory of the README's method table.

Each case is one row of the table that is an optax transformation, Adasum twice (flat,
and hierarchical with `local_axis`), SGP twice (no overlap, and overlap 1: "osgp") and
gradient dropping twice (plain, `local="compensated"`). 1-bit Adam is the whole optimizer
(`Case.optimizer`): its chain is the method alone, and its first update the warm-up's
Adam step on the mean gradient. Local SGD and periodic averaging
are `gradcomm.ParamsSync` rules on the params, not transformations: `test_sync.py` holds
them to the same contexts. Every case meets every check:

* extra keyword arguments to `update` are accepted and ignored, and three jitted
  `parallel.train_step` steps trace once;
* `optax.tree_map_params` maps the param-shaped state and leaves the rest;
* an update inside `lax.cond` type-checks in the README's `shard_map` loop and keeps the
  state's structure and dtypes and the params' dtype (the cases take turns over float16,
  bfloat16, float32 and float64 params, float64 under a scoped `jax.enable_x64`);
* zero gradients give finite, method-appropriate results on scalar, size-1, odd-length
  and bfloat16 leaves (the cases take turns over the contexts below; allreduce runs on
  1 device, SGP on 8);
* under a jitted `jax.shard_map` (the README's loop), `jax.pmap` and a named `jax.vmap`,
  the first update matches a float64 NumPy reference (every case in every context;
  hierarchical Adasum under `pmap` maps nodes with `pmap` and the local axis with `vmap`,
  JAX having no nested `pmap`);
* `optax.MultiSteps`, `gradcomm.apply_if_finite` and `optax.inject_hyperparams`: every
  case with every wrapper (`optax.apply_if_finite`, which decides per device, is
  refused), the loop alternating between `parallel.init_state` +
  `parallel.train_step` and a hand-written `shard_map` loop;
* an orbax round trip continues bit for bit;
* on a mesh with a `'model'` axis beside the data axes, a leaf split over it (tensor
  parallelism) gives the float64 reference's first update on the whole tensors, or, for a
  method whose codes are scaled over a whole tensor it cannot see (1-bit Adam,
  `Case.split_error`), a ValueError that says what to do; leaves replicated over 'model'
  then give the reference.

Devices: N = 4 unless said otherwise. The gradient of `_loss` is the batch itself (the
mean of the device's rows), so each device's gradient is whatever its batch shard holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import reference
from helpers import mesh_of, restore, save
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel, topology

N = 4  # devices, unless a case says otherwise
LR = 0.5
SHAPES = {"w": (2, 4), "b": (5,), "s": ()}  # odd-length and scalar leaves
# Scalar, size-1, odd-length and bfloat16 leaves, for the zero-gradient check.
MIXED = {"s": (), "one": (1,), "odd": (7,), "half": (5,)}
MIXED_DTYPES = {"half": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the method table: its factory and where it sits."""

    make: Callable[..., optax.GradientTransformationExtraArgs]
    before: bool  # sits before the optimizer (acts on gradients); else after it
    per_device: bool = False  # params kept per device (`params_per_device=True`)
    synced: bool = True  # every device ends with the same update
    hierarchical: bool = False  # mesh {"node": n // 2, "local": 2}
    rtol: float = 1e-5  # against the float64 reference's first update
    specs: bool = False  # takes the params' PartitionSpecs (`make(specs=...)`)
    optimizer: bool = False  # the whole optimizer: no SGD beside it (`make(learning_rate)`)
    split_error: str | None = None  # raises this on leaves split over 'model' (why: its doc)


CASES = {
    "allreduce": Case(lambda: gradcomm.allreduce("data"), before=True),
    "adasum": Case(lambda: gradcomm.adasum("data"), before=False),
    "adasum_hierarchical": Case(
        lambda: gradcomm.adasum("node", local_axis="local"), before=False, hierarchical=True
    ),
    "terngrad": Case(lambda **kw: gradcomm.terngrad("data", seed=1, **kw), before=True, specs=True),
    "lags": Case(lambda: gradcomm.lags("data", density=0.25), before=False),
    "slgs": Case(lambda: gradcomm.slgs("data", density=0.25), before=False),
    "sgp": Case(lambda: gradcomm.sgp("data"), before=False, per_device=True, synced=False),
    "osgp": Case(
        lambda: gradcomm.sgp("data", overlap=1), before=False, per_device=True, synced=False
    ),
    "dpsgd": Case(lambda: gradcomm.dpsgd("data"), before=False, per_device=True, synced=False),
    "gradient_dropping": Case(
        lambda: gradcomm.gradient_dropping("data", drop_ratio=0.75, warmup_steps=1),
        before=True,
    ),
    "gradient_dropping_local": Case(
        lambda: gradcomm.gradient_dropping(
            "data", drop_ratio=0.75, local="compensated", warmup_steps=0
        ),
        before=True,
        per_device=True,  # each device adds its own local gradient
        synced=False,
    ),
    # rank 1 and rate 1: the (2, 4) leaf is compressed (the defaults would send it dense)
    "powersgd": Case(
        lambda **kw: gradcomm.powersgd("data", rank=1, min_compression_rate=1.0, **kw),
        before=True,
        specs=True,
    ),
    "low_precision": Case(lambda: gradcomm.low_precision("data"), before=True, rtol=2**-8),
    # warm-up 1: the steps after the first send the momentum as signs. Its scales are per
    # tensor and per slice of the flattened tensor, which no device of a split leaf sees.
    "onebit_adam": Case(
        lambda learning_rate=LR: gradcomm.onebit_adam("data", learning_rate, warmup_steps=1),
        before=False,
        optimizer=True,
        split_error=r"onebit_adam scales its codes .* split over mesh axes \('model',\)",
    ),
}
NAMES = list(CASES)


def _rotate(options: list[Any]) -> list[tuple[str, Any]]:
    """(case, option) pairs, a fixed assignment: case i takes option i mod len(options)."""
    return [(name, options[i % len(options)]) for i, name in enumerate(NAMES)]


# ------------------------------------------------------------------------------------------
# Meshes, data, steps


@functools.cache
def _mesh(name: str, n: int = N) -> Mesh:
    if CASES[name].hierarchical:
        return parallel.make_mesh({"node": n // 2, "local": 2}, devices=jax.devices()[:n])
    return mesh_of(n)


def _loss(params: Any, batch: Any) -> jax.Array:
    """sum(p * mean(batch rows)): each device's gradient is its batch shard's mean row."""
    terms = [
        jnp.sum(p * jnp.mean(b, 0).astype(p.dtype)).astype(jnp.float32)
        for p, b in zip(jax.tree.leaves(params), jax.tree.leaves(batch), strict=True)
    ]
    return sum(terms)


def _rows(seed: int, n: int, shapes: dict = SHAPES, dtype: Any = np.float32) -> dict:
    """Per-device rows `(n, *shape)`: multiples of 1/8, distinct magnitudes within a row.

    Dyadic values keep every sum and halving below exact, and distinct magnitudes keep the
    top-k selections free of ties. `dtype` is one dtype, or a dict of some leaves' dtypes
    (float32 for the rest).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for key, shape in shapes.items():
        leaf_dtype = dtype.get(key, np.float32) if isinstance(dtype, dict) else dtype
        size = int(np.prod(shape))
        rows = [(rng.permutation(size) + 1) * rng.choice([-1, 1], size) / 8 for _ in range(n)]
        out[key] = np.stack(rows).reshape(n, *shape).astype(leaf_dtype)
    return out


def _params_rows(name: str, n: int, shapes: dict = SHAPES, dtype: Any = np.float32) -> dict:
    """Initial params, one row per device: alike unless the case keeps them per device."""
    rows = _rows(100, n, shapes, dtype)
    if not CASES[name].per_device:
        rows = jax.tree.map(lambda x: np.broadcast_to(x[:1], x.shape).copy(), rows)
    return rows


def _place(name: str, mesh: Mesh, rows: dict) -> Any:
    """Params as `parallel.train_step` takes them: replicated, or one row per device."""
    if CASES[name].per_device:
        return jax.device_put(rows, NamedSharding(mesh, parallel.device_spec(mesh)))
    return parallel.replicate(jax.tree.map(lambda x: x[0], rows), mesh)


def _host_rows(name: str, params: Any, n: int) -> dict:
    """Params as NumPy rows `(n, *shape)`, whichever way they were laid out."""
    if CASES[name].per_device:
        return jax.tree.map(np.asarray, params)
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))), params)


def _chain(name: str, learning_rate: float = LR) -> optax.GradientTransformation:
    """The method with SGD, on the side of the optimizer where the method belongs."""
    if CASES[name].optimizer:
        return CASES[name].make(learning_rate)
    return _with_sgd(CASES[name], CASES[name].make(), learning_rate)


def _with_sgd(case: Case, method: Any, learning_rate: float = LR) -> Any:
    """`method` with SGD on the side where it belongs; alone where it is the optimizer."""
    if case.optimizer:
        return method
    sgd = optax.sgd(learning_rate)
    return optax.chain(method, sgd) if case.before else optax.chain(sgd, method)


def _shapes_of_state(tx: optax.GradientTransformation, params_rows: dict) -> Any:
    local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params_rows)
    return jax.eval_shape(tx.init, local)


def _hand_step(
    name: str,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    state: Any,
    params_rows: dict,
    update: Callable[..., tuple[Any, Any]],
    extra_args: int = 0,
) -> Callable[..., tuple[Any, Any]]:
    """A hand-written loop's step, as the README writes it: jitted `shard_map`, params
    typed per device with `lax.pcast` before differentiating, `update(grads, state,
    params, *extra)` giving new params and state. State leaves live per device (leading
    device axis) where `parallel.init_state` put them there.
    """
    case = CASES[name]
    names = mesh.axis_names
    spec = parallel.device_spec(mesh)
    local = jax.tree.leaves(_shapes_of_state(tx, params_rows))
    leaves, treedef = jax.tree.flatten(state)
    flags = [np.ndim(x) == len(s.shape) + 1 for x, s in zip(leaves, local, strict=True)]
    state_specs = jax.tree.unflatten(treedef, [spec if f else P() for f in flags])
    param_spec = spec if case.per_device else P()

    def body(params: Any, state: Any, batch: Any, *extra: Any) -> tuple[Any, Any]:
        if case.per_device:
            params = jax.tree.map(lambda x: x[0], params)
        leaves = jax.tree.leaves(state)
        state = jax.tree.unflatten(
            treedef, [x[0] if f else x for x, f in zip(leaves, flags, strict=True)]
        )
        local = params if case.per_device else lax.pcast(params, names, to="varying")
        grads = jax.grad(_loss)(local, batch)
        params, state = update(grads, state, params, *extra)
        if case.per_device:
            params = jax.tree.map(lambda x: x[None], params)
        leaves = jax.tree.leaves(state)
        state = jax.tree.unflatten(
            treedef, [x[None] if f else x for x, f in zip(leaves, flags, strict=True)]
        )
        return params, state

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(param_spec, state_specs, spec, *([P()] * extra_args)),
        out_specs=(param_spec, state_specs),
    )
    return jax.jit(mapped)


def _plain_update(
    tx: optax.GradientTransformation, name: str, dtypes: list | None = None
) -> Callable[..., Any]:
    """`update(grads, state, params) -> (params, state)`, noting the updates' dtypes."""

    def update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        updates, state = tx.update(grads, state, params)
        if dtypes is not None:
            dtypes.extend(x.dtype for x in jax.tree.leaves(updates))
        return optax.apply_updates(params, updates), state

    return update


def _batch(mesh: Mesh, rows: dict) -> Any:
    return parallel.shard_batch(rows, mesh)


def _assert_finite(tree: Any) -> None:
    for leaf in jax.tree.leaves(tree):
        assert np.isfinite(np.asarray(leaf, np.float64)).all()


def _assert_rows_equal(tree: Any) -> None:
    """Every device's row holds the same bits."""
    for leaf in jax.tree.leaves(tree):
        leaf = np.asarray(leaf)
        for row in leaf[1:]:
            np.testing.assert_array_equal(row, leaf[0])


# ------------------------------------------------------------------------------------------
# Float64 references: the first update from a fresh state, one row per device


def _mixing(name: str, n: int) -> np.ndarray:
    graph = "exponential-bidirectional" if name == "dpsgd" else "exponential"
    return topology.resolve(graph, n).mixing_matrix(0)


def _reference(name: str, params: dict, grads: dict) -> dict | None:
    """What the method outputs at its first step, per device, from float64 NumPy.

    `params` and `grads` are rows `(n, *shape)`; None where the result is random (TernGrad).
    """
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    g = {k: np.asarray(v, np.float64) for k, v in grads.items()}
    n = len(next(iter(g.values())))

    def per_leaf(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> dict:
        return {k: fn(p[k].reshape(n, -1), g[k].reshape(n, -1)).reshape(g[k].shape) for k in g}

    def same(row: np.ndarray) -> np.ndarray:
        return np.broadcast_to(row, (n, *row.shape))

    if name in ("allreduce", "low_precision"):  # low_precision: within bfloat16's rounding
        return per_leaf(lambda _, x: same(x.mean(0)))
    if name == "onebit_adam":  # the warm-up: Adam's first step on the mean gradient
        return per_leaf(lambda _, x: same(reference.adam_first_update(x.mean(0), LR, 1e-8)))
    if name == "powersgd":  # e = 0: P = normalize(mean(G) Q0), update = P P^T mean(G)
        out = {k: same(x.mean(0)) for k, x in g.items()}
        if "w" in g:  # the one matrix leaf
            [q] = CASES[name].make().init({k: v[0] for k, v in params.items()}).q
            mean = g["w"].mean(0)
            col = mean @ np.asarray(q, np.float64)
            col = col / np.linalg.norm(col) if np.any(col) else col
            out["w"] = same(col @ col.T @ mean)
        return out
    if name == "adasum":
        return per_leaf(lambda _, x: same(reference.adasum(list(x))))
    if name == "adasum_hierarchical":  # the node means, then Adasum across nodes
        return per_leaf(lambda _, x: same(reference.adasum(list(x.reshape(n // 2, 2, -1).mean(1)))))
    if name == "lags":

        def lags(_: np.ndarray, x: np.ndarray) -> np.ndarray:
            k = gradcomm.sparse.num_kept(x.shape[1], 0.25)
            return same(reference.lags_step([np.zeros_like(x[0])] * n, list(x), k)[0])

        return per_leaf(lags)
    if name == "slgs":  # one top-k over the whole model, leaves joined in tree order
        keys = sorted(g)
        joined = np.concatenate([g[k].reshape(n, -1) for k in keys], axis=1)
        k = gradcomm.sparse.num_kept(joined.shape[1], 0.25)
        out = reference.lags_step([np.zeros_like(joined[0])] * n, list(joined), k)[0]
        sizes = np.cumsum([g[key][0].size for key in keys])[:-1]
        return {
            key: same(part.reshape(g[key].shape[1:]))
            for key, part in zip(keys, np.split(out, sizes), strict=True)
        }
    if name.startswith("gradient_dropping"):
        local = "compensated" if name == "gradient_dropping_local" else None

        def dropping(_: np.ndarray, x: np.ndarray) -> np.ndarray:
            k = gradcomm.sparse.num_kept(x.shape[1], 0.25)
            zeros = [np.zeros_like(x[0])] * n
            return np.stack(reference.gradient_dropping_step(zeros, list(x), k, local)[0])

        return per_leaf(dropping)
    if name == "sgp":  # push-sum from weight 1: z' = M(z + u) / M 1
        m = _mixing(name, n)
        return per_leaf(lambda z, x: (m @ (z + x)) / (m @ np.ones(n))[:, None] - z)
    if name == "osgp":  # what was sent is still in flight: z' = (z + u) / 2 / (1 / 2)
        return per_leaf(lambda _, x: x)
    if name == "dpsgd":
        m = _mixing(name, n)
        return per_leaf(lambda z, x: m @ (z + x) - z)
    assert name == "terngrad"
    return None


# ------------------------------------------------------------------------------------------
# The method alone in a context: its first update from a fresh state

CONTEXTS = ["shard_map", "pmap", "vmap"]


def _run(name: str, context: str, n: int, params: dict, grads: list[dict]) -> list[dict]:
    """The method's first update from a fresh state, for each set of gradient rows.

    Returns NumPy rows `(n, *shape)` per set; one program is compiled and run on each.
    `params` are rows. Under `shard_map` params enter replicated (or per device) and each
    device differentiates `_loss` of its own batch shard, as in the README's loop; under
    `pmap` and `vmap` every input is per device. "train_step" reports the change of the
    params, the method being the whole transformation.
    """
    case = CASES[name]
    tx = case.make()

    def body(p: Any, g: Any, local: Any) -> Any:
        """One device's update; `local` is what it differentiates."""
        grads = jax.grad(_loss)(local, jax.tree.map(lambda x: x[None], g))
        return tx.update(grads, tx.init(p), p)[0]

    if context == "train_step":
        mesh = _mesh(name, n)
        step = parallel.train_step(_loss, tx, mesh, params_per_device=case.per_device)
        placed = _place(name, mesh, params)
        state = parallel.init_state(tx, placed, mesh, params_per_device=case.per_device)
        before = _host_rows(name, placed, n)
        out = []
        for g in grads:
            after = _host_rows(name, jax.block_until_ready(step(placed, state, g)[0]), n)
            out.append(jax.tree.map(lambda a, b: a.astype(np.float64) - b, after, before))
        return out
    if context == "shard_map":
        mesh = _mesh(name, n)
        names, spec = mesh.axis_names, parallel.device_spec(mesh)

        def mapped(p: Any, g: Any) -> Any:
            p = jax.tree.map(lambda x: x[0], p) if case.per_device else p
            local = p if case.per_device else lax.pcast(p, names, to="varying")
            out = body(p, jax.tree.map(lambda x: x[0], g), local)
            return jax.tree.map(lambda x: x[None], out)

        in_specs = (spec if case.per_device else P(), spec)
        fn = jax.jit(jax.shard_map(mapped, mesh=mesh, in_specs=in_specs, out_specs=spec))
        placed = _place(name, mesh, params)
        put = lambda g: jax.device_put(g, NamedSharding(mesh, spec))  # noqa: E731
        runs = [jax.block_until_ready(fn(placed, put(g))) for g in grads]
    else:
        fn = lambda p, g: body(p, g, p)  # noqa: E731
        axis = "node" if case.hierarchical else "data"
        if case.hierarchical:  # nodes outside, the local axis inside
            fn = jax.vmap(fn, axis_name="local")
        fn = (
            jax.pmap(fn, axis_name=axis)
            if context == "pmap"
            else jax.jit(jax.vmap(fn, axis_name=axis))
        )

        def nest(tree: Any) -> Any:  # rows (n, ...) as (nodes, 2, ...) where hierarchical
            if not case.hierarchical:
                return tree
            return jax.tree.map(lambda x: x.reshape(n // 2, 2, *x.shape[1:]), tree)

        def flat(tree: Any) -> Any:  # and back
            if not case.hierarchical:
                return tree
            return jax.tree.map(lambda x: x.reshape(n, *x.shape[2:]), tree)

        runs = [flat(jax.block_until_ready(fn(nest(params), nest(g)))) for g in grads]
    return [jax.tree.map(np.asarray, r) for r in runs]


# ------------------------------------------------------------------------------------------
# A model axis beside the data axes (tensor parallelism): "w" split over it by columns

MODEL_SPECS = {"w": P(None, "model"), "b": P(), "s": P()}


def _model_axis_run(name: str, mesh: Mesh, specs: dict, params: dict, grads: dict) -> dict:
    """The method's first update in a jitted `shard_map` over every axis of `mesh`."""
    case = CASES[name]
    split = any(p != P() for p in specs.values())
    tx = case.make(specs=specs if split else None) if case.specs else case.make()
    data = tuple(a for a in mesh.axis_names if a != "model")
    in_specs = {k: P(data if len(data) > 1 else data[0], *specs[k]) for k in SHAPES}

    def body(p: Any, g: Any) -> Any:
        p, g = (jax.tree.map(lambda x: x[0], t) for t in (p, g))
        return jax.tree.map(lambda x: x[None], tx.update(g, tx.init(p), p)[0])

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(in_specs,) * 2, out_specs=in_specs))
    put = lambda t: {k: jax.device_put(v, NamedSharding(mesh, in_specs[k])) for k, v in t.items()}  # noqa: E731
    return jax.tree.map(np.asarray, fn(put(params), put(grads)))


@pytest.mark.parametrize("name", NAMES)
def test_a_model_axis_gives_the_whole_tensor_reference(name):
    data = {"node": 2, "local": 2} if CASES[name].hierarchical else {"data": N}
    mesh = parallel.make_mesh({**data, "model": 2}, devices=jax.devices()[: 2 * N])
    params, grads = _params_rows(name, N), _rows(7, N)
    if CASES[name].split_error:  # a ValueError, and leaves replicated over 'model' are right
        with pytest.raises(ValueError, match=CASES[name].split_error):
            _model_axis_run(name, mesh, MODEL_SPECS, params, grads)
        got = _model_axis_run(name, mesh, {k: P() for k in SHAPES}, params, grads)
    else:
        got = _model_axis_run(name, mesh, MODEL_SPECS, params, grads)
    want = _reference(name, params, grads)
    if want is None:  # random codes: the same as on the whole tensors with the same seed
        whole = parallel.make_mesh(data, devices=jax.devices()[:N])
        want = _model_axis_run(name, whole, {k: P() for k in SHAPES}, params, grads)
    rtol = CASES[name].rtol
    for key in SHAPES:
        np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=rtol / 10, err_msg=key)


# Each case's zero-gradient check runs in one context, the cases taking turns (allreduce on 1
# device, SGP on 8); there the tree also holds scalar, size-1, odd-length and bfloat16
# leaves (`MIXED`). The other contexts check zero gradients on the plain tree: one program
# per case and context runs both the random and the zero gradients.
ZERO_RUNS = {
    "allreduce": ("shard_map", 1),
    "sgp": ("pmap", 8),
}
ZERO_CONTEXTS = {name: ZERO_RUNS.get(name, (c, N)) for name, c in _rotate(CONTEXTS)}


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("name", NAMES)
def test_contexts_give_the_reference(name, context):
    """shard_map (the README's loop), pmap and a named vmap: the float64 reference's first
    update in the params' dtype, the same bits on every device where the method
    synchronises (TernGrad, random: within the gradients' range, not all zero). Zero
    gradients give the method's value (zero for the synchronising methods, the gossip's
    own move for per-device params), finite and in each leaf's dtype."""
    mixed = ZERO_CONTEXTS[name][0] == context
    n = ZERO_CONTEXTS[name][1] if mixed else N
    shapes, dtypes = ({**SHAPES, **MIXED}, MIXED_DTYPES) if mixed else (SHAPES, np.float32)
    params, grads = _params_rows(name, n, shapes, dtypes), _rows(1, n, shapes, dtypes)
    zeros = jax.tree.map(np.zeros_like, params)
    updates, first = _run(name, context, n, params, [grads, zeros])
    for out in (updates, first):
        _assert_finite(out)
        for key in params:
            assert out[key].shape == params[key].shape, key
            assert out[key].dtype == params[key].dtype, key
    if CASES[name].synced:
        _assert_rows_equal(updates)
    assert any(np.any(u) for u in updates.values())

    # Random gradients: against the float64 reference (the bfloat16 leaf: zeros below).
    want = _reference(name, params, grads)
    if want is None:  # TernGrad: each entry a mean of N values in {-s, 0, s}, s <= max |g|
        for key in grads:
            bound = np.abs(grads[key].astype(np.float64)).max() * (1 + 2**-16)
            assert np.abs(updates[key].astype(np.float64)).max() <= bound
    else:
        rtol = CASES[name].rtol
        for key in grads:
            if params[key].dtype != jnp.bfloat16:
                np.testing.assert_allclose(
                    updates[key], want[key], rtol=rtol, atol=rtol / 10, err_msg=key
                )

    # Zero gradients.
    if name == "terngrad":  # all-zero gradients give zeros
        assert all(not np.any(u) for u in first.values())
    else:
        want = _reference(name, params, zeros)
        for key in params:
            atol = 2**-7 if params[key].dtype == jnp.bfloat16 else 1e-6
            np.testing.assert_allclose(first[key].astype(np.float64), want[key], atol=atol)
    if not CASES[name].per_device:
        assert all(not np.any(u) for u in first.values())


# ------------------------------------------------------------------------------------------
# optax.tree_map_params


TREE_MAP_XFAILS: dict[str, str] = {}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=TREE_MAP_XFAILS[n])])
        if n in TREE_MAP_XFAILS
        else n
        for n in NAMES
    ],
)
def test_tree_map_params_maps_the_param_shaped_state(name):
    """`optax.tree_map_params(tx, f, state, params)` calls f on the param-shaped state
    (residuals) with leaves shaped like the params, and leaves every other leaf as it was."""
    tx = CASES[name].make()
    params = jax.tree.map(lambda x: jnp.asarray(x[0]), _params_rows(name, 1))
    state = tx.init(params)
    seen = []

    def f(leaf: jax.Array, param: jax.Array) -> jax.Array:
        seen.append((np.shape(leaf), np.shape(param)))
        return leaf + param

    mapped = optax.tree_map_params(tx, f, state, params)
    assert jax.tree.structure(mapped) == jax.tree.structure(state)
    assert all(leaf == param for leaf, param in seen), seen
    shaped = [jax.tree_util.GetAttrKey(k) for k in ("residual", "mu", "nu", "errors")]
    param_like = [getattr(state, k.name, None) for k in shaped]  # sgp's slots are packed
    assert len(seen) == len(jax.tree.leaves(param_like))
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(mapped), jax.tree.leaves(state), strict=True
    ):
        if any(k in path for k in shaped):  # zeros + params
            np.testing.assert_array_equal(got, params[path[-1].key])
        else:
            np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------------------
# parallel.train_step: extra arguments, trace counts, checkpoints

BATCHES = [_rows(10 + t, N) for t in range(3)]  # one gradient row per device and step
EXTRA = {"loss_value": jnp.ones(()), "note": "unused"}  # keyword arguments no method knows


def _counting_loss(traces: list[int]) -> Callable[..., jax.Array]:
    def loss(params: Any, batch: Any) -> jax.Array:
        traces.append(1)  # runs once per trace, never when a compiled step runs
        return _loss(params, batch)

    return loss


def _with_extra_args(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Passes EXTRA to `tx.update` on top of what the caller passes."""

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return tx.update(updates, state, params, **extra, **EXTRA)

    return optax.GradientTransformationExtraArgs(tx.init, update)


@dataclasses.dataclass
class Run:
    """Three steps of the chain under `parallel.train_step`, its method handed EXTRA."""

    step: parallel.TrainStep
    params: list[Any]  # placed, before the first step and after each
    states: list[Any]
    rows: list[dict]  # the params as NumPy rows, likewise
    traces: int


@functools.cache
def _plain(name: str) -> Run:
    case, mesh = CASES[name], _mesh(name)
    tx = _with_sgd(case, _with_extra_args(case.make()))
    traces: list[int] = []
    step = parallel.train_step(_counting_loss(traces), tx, mesh, params_per_device=case.per_device)
    params = [_place(name, mesh, _params_rows(name, N))]
    states = [parallel.init_state(tx, params[0], mesh, params_per_device=case.per_device)]
    for batch in BATCHES:
        new_params, new_state, _ = step(params[-1], states[-1], batch)
        params.append(jax.block_until_ready(new_params))
        states.append(new_state)
    rows = [_host_rows(name, p, N) for p in params]
    return Run(step, params, states, rows, len(traces))


def _update_jaxpr(name: str, extra: dict) -> str:
    """The jaxpr of one update of the method alone, under `shard_map`, given `extra`."""
    case, mesh = CASES[name], _mesh(name)
    tx, spec = case.make(), parallel.device_spec(mesh)

    def body(params: Any, grads: Any) -> Any:
        params = jax.tree.map(lambda x: x[0], params) if case.per_device else params
        grads = jax.tree.map(lambda x: x[0], grads)
        out = tx.update(grads, tx.init(params), params, **extra)
        return jax.tree.map(lambda x: x[None], out)

    params = _place(name, mesh, _params_rows(name, N))
    grads = jax.device_put(BATCHES[0], NamedSharding(mesh, spec))
    in_specs = (spec if case.per_device else P(), spec)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec)
    return str(jax.make_jaxpr(mapped)(params, grads))


@pytest.mark.parametrize("name", NAMES)
def test_extra_args_are_ignored_and_steps_trace_once(name):
    """`update(..., loss_value=..., note=...)` (optax's extra-args contract) is accepted and
    ignored: the traced update is the same program as without them, and three jitted
    `train_step` steps with them trace once and move the params."""
    assert _update_jaxpr(name, EXTRA) == _update_jaxpr(name, {})
    run = _plain(name)
    assert run.traces == 1
    _assert_finite(run.rows[-1])
    assert any(
        np.any(a != b)
        for a, b in zip(jax.tree.leaves(run.rows[-1]), jax.tree.leaves(run.rows[0]), strict=True)
    )


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip_continues_bit_for_bit(tmp_path, name):
    """Params and state saved with orbax after one step and restored onto the shardings
    they had take the same second step as the run that never stopped, bit for bit."""
    run = _plain(name)
    saved = {"params": run.params[1], "state": run.states[1]}
    save(tmp_path / "ckpt", saved)
    restored = restore(tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, saved))
    params, state, _ = run.step(restored["params"], restored["state"], BATCHES[1])
    jax.tree.map(np.testing.assert_array_equal, (params, state), (run.params[2], run.states[2]))


# ------------------------------------------------------------------------------------------
# optax wrappers, under parallel.train_step and in a hand-written loop

WRAPPERS = ["multisteps", "apply_if_finite", "inject_hyperparams"]
LOOPS = ["train_step", "hand_loop"]
PENDING = "wrapper fix pending"
WRAPPER_XFAILS: dict[tuple[str, str], str] = {}  # (case, wrapper): why it fails


def _wrapper_matrix() -> list[Any]:
    """Every case with every wrapper; the loop alternates."""
    out = []
    for i, name in enumerate(NAMES):
        for j, wrapper in enumerate(WRAPPERS):
            loop = LOOPS[(i + j) % 2]
            reason = WRAPPER_XFAILS.get((name, wrapper))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(name, wrapper, loop, marks=marks))
    return out


def _wrapped(name: str, wrapper: str) -> optax.GradientTransformation:
    if wrapper == "multisteps":
        return optax.MultiSteps(_chain(name), every_k_schedule=2).gradient_transformation()
    if wrapper == "apply_if_finite":
        return gradcomm.apply_if_finite(_chain(name), 2, _mesh(name).axis_names)
    return optax.inject_hyperparams(functools.partial(_chain, name))(learning_rate=LR)


COLLECTIVES = ("psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all", "reduce_scatter")


def _split_decisions(jaxpr: Any, varying: bool = False) -> list[str]:
    """The collectives that run under a `lax.cond` whose predicate may differ per device.

    Where devices take different branches, some enter a collective that the others never
    join: under `shard_map` on CPU that blocks until XLA's rendezvous timeout aborts the
    process. So the wrapper checks assert this list is empty before they run a step.
    """
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if varying and name.startswith(COLLECTIVES):
            found.append(name)
        inner = varying
        if name == "cond":
            mat = getattr(eqn.invars[0].aval, "manual_axis_type", None)
            inner = varying or bool(mat is not None and mat.varying)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else [value]:
                if isinstance(sub, ClosedJaxpr):
                    found += _split_decisions(sub.jaxpr, inner)
                elif isinstance(sub, Jaxpr):
                    found += _split_decisions(sub, inner)
    return found


def _scalar_rows(x: Any) -> np.ndarray:
    """A scalar state leaf as one value per device, whether replicated or per device."""
    return np.atleast_1d(np.asarray(x))


@pytest.mark.parametrize(("name", "wrapper", "loop"), _wrapper_matrix())
def test_wrappers(name, wrapper, loop):
    """MultiSteps: no step after one micro-batch, the plain step on their mean after two.
    apply_if_finite: a NaN on one device alone skips the step on every device (no branch
    decided per device around a collective), and the next step is the plain one.
    inject_hyperparams: the plain step, and a new learning rate takes effect without a
    retrace. Under `parallel.train_step`, or in the README's `shard_map` loop with the
    state `parallel.init_state` lays out."""
    case, mesh = CASES[name], _mesh(name)
    tx = _wrapped(name, wrapper)
    rows = _params_rows(name, N)
    params = _place(name, mesh, rows)
    state = parallel.init_state(tx, params, mesh, params_per_device=case.per_device)
    hand_traces: list[int] = []
    plain = _plain_update(tx, name)

    def update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        hand_traces.append(1)
        return plain(grads, state, params)

    hand = _hand_step(name, tx, mesh, state, rows, update)
    split = _split_decisions(hand.trace(params, state, _batch(mesh, BATCHES[0])).jaxpr.jaxpr)
    assert not split, f"collectives {split} under a lax.cond that may differ per device"
    traces = hand_traces  # the hand loop's step runs the program just traced
    if loop == "train_step":
        traces = []
        train = parallel.train_step(
            _counting_loss(traces), tx, mesh, params_per_device=case.per_device
        )

        def step(params: Any, state: Any, batch: dict) -> tuple[Any, Any]:
            params, state, _ = train(params, state, batch)
            return jax.block_until_ready(params), state
    else:

        def step(params: Any, state: Any, batch: dict) -> tuple[Any, Any]:
            params, state = hand(params, state, _batch(mesh, batch))
            return jax.block_until_ready(params), state

    run = _plain(name)

    def rows_of(params: Any) -> dict:
        return _host_rows(name, params, N)

    def close_to_plain(params: Any) -> None:  # the plain run's params after BATCHES[0]
        for got, want in zip(
            jax.tree.leaves(rows_of(params)), jax.tree.leaves(run.rows[1]), strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    if wrapper == "multisteps":  # two micro-batches whose mean is BATCHES[0], exactly
        half = jax.tree.map(lambda x: np.full_like(x, 0.25), BATCHES[0])
        params, state = step(params, state, jax.tree.map(np.add, BATCHES[0], half))
        jax.tree.map(np.testing.assert_array_equal, rows_of(params), run.rows[0])
        params, state = step(params, state, jax.tree.map(np.subtract, BATCHES[0], half))
        close_to_plain(params)
        # The accumulator holds each device's own sum, on every device.
        assert all(x.shape[0] == N for x in jax.tree.leaves(state.acc_grads))
    elif wrapper == "apply_if_finite":  # device 1 alone has a NaN: every device skips
        bad = jax.tree.map(np.copy, BATCHES[0])
        bad["w"][1, 0, 0] = np.nan
        params, state = step(params, state, bad)
        jax.tree.map(np.testing.assert_array_equal, rows_of(params), run.rows[0])
        assert (_scalar_rows(state.notfinite_count) == 1).all()
        params, state = step(params, state, BATCHES[0])
        close_to_plain(params)
        assert (_scalar_rows(state.notfinite_count) == 0).all()
        assert (_scalar_rows(state.total_notfinite) == 1).all()
    else:  # the injected learning rate is a traced value
        params, state = step(params, state, BATCHES[0])
        close_to_plain(params)
        rate = state.hyperparams["learning_rate"]  # a new value, placed like the old one
        zero = jax.device_put(jnp.zeros_like(rate), rate.sharding)
        moved, _ = step(params, state, BATCHES[1])
        still, _ = step(params, state._replace(hyperparams={"learning_rate": zero}), BATCHES[1])
        assert any(
            np.any(a != b)
            for a, b in zip(
                jax.tree.leaves(rows_of(moved)), jax.tree.leaves(rows_of(still)), strict=True
            )
        )
        if case.before or case.optimizer:  # a zero learning rate leaves the params
            jax.tree.map(np.testing.assert_array_equal, rows_of(still), rows_of(params))
    assert len(traces) == 1


@pytest.mark.parametrize("name", NAMES)
def test_optax_apply_if_finite_is_refused_with_the_fix(name):
    """optax's own tests this device's updates, a per-device cond around the collectives
    that stalls when devices disagree: init_state refuses it and names gradcomm's."""
    case, mesh = CASES[name], _mesh(name)
    tx = optax.apply_if_finite(_chain(name), max_consecutive_errors=2)
    params = _place(name, mesh, _params_rows(name, N))
    with pytest.raises(ValueError, match=r"gradcomm\.apply_if_finite"):
        parallel.init_state(tx, params, mesh, params_per_device=case.per_device)


# ------------------------------------------------------------------------------------------
# lax.cond and dtypes

DTYPES = ["bfloat16", "float16", "float64", "float32"]
COND_XFAILS: dict[tuple[str, str], str] = {}  # adasum's index constants are int32


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        pytest.param(n, d, marks=[pytest.mark.xfail(strict=True, reason=COND_XFAILS[n, d])])
        if (n, d) in COND_XFAILS
        else (n, d)
        for n, d in _rotate(DTYPES)
    ],
)
def test_update_under_cond_keeps_types(name, dtype):
    """`lax.cond(pred, step, identity)` around the update type-checks in the README's loop
    (state laid out by `parallel.init_state`): the update keeps the params' dtype, the state
    its structure and dtypes; pred False changes no bit, pred True moves the params. Float64
    runs under a scoped `jax.enable_x64`, after the method ran in float32 (as in a suite)."""
    if dtype == "float64":
        _plain(name)
    scope = jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()
    with scope:
        case, mesh = CASES[name], _mesh(name)
        tx = case.make()
        rows = _params_rows(name, N, dtype=jnp.dtype(dtype))
        params = _place(name, mesh, rows)
        state = parallel.init_state(tx, params, mesh, params_per_device=case.per_device)
        update_dtypes: list[Any] = []
        plain = _plain_update(tx, name, update_dtypes)

        def update(grads: Any, state: Any, params: Any, pred: jax.Array) -> tuple[Any, Any]:
            def step(operand: tuple[Any, Any]) -> tuple[Any, Any]:
                return plain(grads, operand[1], operand[0])

            return lax.cond(pred, step, lambda operand: operand, (params, state))

        jitted = _hand_step(name, tx, mesh, state, rows, update, extra_args=1)
        batch = _batch(mesh, _rows(1, N, dtype=jnp.dtype(dtype)))
        same, same_state = jitted(params, state, batch, jnp.asarray(False))
        moved, moved_state = jitted(params, state, batch, jnp.asarray(True))
        jax.block_until_ready((same, moved))
        for tree in (same, moved):
            assert all(x.dtype == dtype for x in jax.tree.leaves(tree))
        assert update_dtypes and all(d == dtype for d in update_dtypes)
        for new in (same_state, moved_state):
            assert jax.tree.structure(new) == jax.tree.structure(state)
            for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state), strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
        jax.tree.map(np.testing.assert_array_equal, (same, same_state), (params, state))
        _assert_finite(moved)
        assert any(
            np.any(np.asarray(a) != np.asarray(b))
            for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(params), strict=True)
        )
