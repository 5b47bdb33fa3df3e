"""Every method on a tensor-parallel mesh: leaves sharded over a model axis.

A `('data'=4, 'model'=2)` mesh, `jax.shard_map` over both axes, the method over `'data'`:
a (64, 48) leaf split over `'model'` by rows, a (40, 32) one by columns, a (6, 10, 4) one
by its middle dimension, and a (48,) one replicated over `'model'`. Each method must give
what it gives on the whole tensors over `'data'` alone (a 1-D mesh of 4 devices): the same
bits where the order of operations allows, else within a relative tolerance of the
largest entry. With `check_vma=False` the leaves' shard axes cannot be read, and a method
that needs whole-tensor statistics raises a `ValueError` instead of a per-shard result.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np
import optax
import pytest
from helpers import FSDP_SPECS, mlp_loss, mlp_problem, run_on_mesh
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import gradcomm

SPECS = {
    "rows": P("model", None),
    "cols": P(None, "model"),
    "mid": P(None, "model", None),
    "bias": P(),
}
SHAPES = {"rows": (64, 48), "cols": (40, 32), "mid": (6, 10, 4), "bias": (48,)}
STEPS = 2


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[..., optax.GradientTransformationExtraArgs]  # make(specs) -> tx
    rtol: float = 1e-6
    whole_tensor: bool = True  # needs whole-tensor statistics (raises without types)


CASES = {
    "allreduce": Case(lambda specs: gradcomm.allreduce("data"), rtol=0, whole_tensor=False),
    "low_precision": Case(lambda specs: gradcomm.low_precision("data"), rtol=0, whole_tensor=False),
    "adasum": Case(lambda specs: gradcomm.adasum("data")),
    "terngrad": Case(lambda specs: gradcomm.terngrad("data", seed=3, specs=specs)),
    "powersgd": Case(
        lambda specs: gradcomm.powersgd("data", rank=2, min_compression_rate=1.0, specs=specs),
        rtol=1e-5,
    ),
    "lags": Case(lambda specs: gradcomm.lags("data", density=0.05)),
    "slgs": Case(lambda specs: gradcomm.slgs("data", density=0.05)),
    "gradient_dropping": Case(
        lambda specs: gradcomm.gradient_dropping("data", drop_ratio=0.95, warmup_steps=0)
    ),
    "gradient_dropping_local": Case(
        lambda specs: gradcomm.gradient_dropping(
            "data", drop_ratio=0.95, warmup_steps=0, local="compensated"
        )
    ),
    "sgp": Case(lambda specs: gradcomm.sgp("data"), rtol=0, whole_tensor=False),
    "osgp": Case(lambda specs: gradcomm.sgp("data", overlap=1), rtol=0, whole_tensor=False),
    "dpsgd": Case(lambda specs: gradcomm.dpsgd("data"), rtol=0, whole_tensor=False),
    "onebit_adam": Case(lambda specs: gradcomm.onebit_adam("data", 0.1, warmup_steps=1)),
}


@functools.cache
def _meshes():
    explicit = (AxisType.Explicit,) * 2
    two = jax.make_mesh((4, 2), ("data", "model"), axis_types=explicit)
    one = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=explicit[:1])
    return one, two


def _grads(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((STEPS, 4, *s)).astype(dtype) for k, s in SHAPES.items()}


def _relative(got, want):
    scale = np.abs(want).max()
    return float(np.abs(got - want).max() / scale) if scale else float(np.abs(got).max())


# Not repeated here: where a method's own test file holds it to the whole leaves on
# 'model'-split leaves (rows, columns, a middle dimension; several steps; float32 and 16-bit:
# test_powersgd's test_sharded_leaves_give_the_whole_leaves_result, test_lags's and
# test_dropping's test_sharded_leaves_in_bf16_and_fp16_give_the_whole_leaves_bits and
# test_ties_on_split_leaves_go_as_on_the_whole_leaves_with_specs, test_low_precision's
# test_leaves_sharded_over_a_model_axis), and Adasum, whose per-leaf sums are the same over
# any split dimension and which keeps no state: test_contract's
# test_a_model_axis_gives_the_whole_tensor_reference holds every method (flat and
# hierarchical Adasum too) to the float64 reference on a column-split leaf.
# 1-bit Adam raises on split leaves: test_contract and
# test_compressed_codes_on_split_params_say_what_to_do below.
ELSEWHERE = {
    "onebit_adam",
    "adasum",
    "low_precision",
    "powersgd",
    "lags",
    "slgs",
    "gradient_dropping",
    "gradient_dropping_local",
}


@pytest.mark.parametrize("name", [n for n in CASES if n not in ELSEWHERE])
def test_whole_tensor_semantics_on_a_model_axis(name):
    case = CASES[name]
    one, two = _meshes()
    grads = _grads()
    want = run_on_mesh(case.make(None), grads, one, {k: P() for k in SPECS})
    got = run_on_mesh(case.make(SPECS), grads, two, SPECS)
    for k in SHAPES:
        assert got[k].shape == want[k].shape
        assert np.isfinite(got[k]).all()
        err = _relative(got[k], want[k])
        assert err <= case.rtol, f"{name} on leaf {k!r}: relative error {err:.3g}"


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.whole_tensor])
def test_unchecked_types_raise_instead_of_a_per_shard_result(name):
    _, two = _meshes()
    with pytest.raises(ValueError, match="check_vma"):
        run_on_mesh(CASES[name].make(SPECS), _grads(), two, SPECS, check_vma=False)


# ------------------------------------------------------------------------------------------
# Tensor parallelism in parallel.train_step: a Megatron-style MLP, column- then row-split.

MLP_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model"), "b2": P()}


@dataclasses.dataclass(frozen=True)
class TpCase:
    make: Callable[..., optax.GradientTransformation] | None  # make(specs); None: no method
    before: bool = True  # the method acts on gradients, before Adam
    per_device: bool = False  # params kept per device
    sync: Callable[[], object] | None = None


# Every method of the README's table (but 1-bit Adam, whose scales raise on split leaves:
# test_compressed_codes_on_split_params_say_what_to_do) in train_step on the split MLP:
# train_step lays out and steps params and state by what the chain's state holds
# (replicated state, state leaves per device on replicated params, per-device params before
# and after Adam, a ParamsSync), and each method's own whole-tensor results are checked
# above and in its own file; here each goes through the step's own path on a model axis.
TP_CASES = {
    "allreduce": TpCase(lambda specs: gradcomm.allreduce("data")),
    "low_precision": TpCase(lambda specs: gradcomm.low_precision("data")),
    "adasum": TpCase(lambda specs: gradcomm.adasum("data"), before=False),
    "terngrad": TpCase(lambda specs: gradcomm.terngrad("data", seed=2, specs=specs)),
    "powersgd": TpCase(
        lambda specs: gradcomm.powersgd("data", rank=2, min_compression_rate=1.0, specs=specs)
    ),
    "gradient_dropping": TpCase(
        lambda specs: gradcomm.gradient_dropping("data", drop_ratio=0.9, warmup_steps=2)
    ),
    # lags and slgs before Adam: after it (the paper's placement) their top k is of Adam's
    # near-tied first updates, which the row-parallel psum's last-bit changes to the
    # gradients reorder (test_lags checks Adam before lags, bit for bit, on a model whose
    # split gradients keep their bits).
    "lags": TpCase(lambda specs: gradcomm.lags("data", density=0.1, specs=specs)),
    "slgs": TpCase(lambda specs: gradcomm.slgs("data", density=0.1, specs=specs)),
    "gradient_dropping_local": TpCase(
        lambda specs: gradcomm.gradient_dropping(
            "data", drop_ratio=0.9, warmup_steps=0, local="compensated"
        ),
        per_device=True,
    ),
    "sgp": TpCase(lambda specs: gradcomm.sgp("data"), before=False, per_device=True),
    "dpsgd": TpCase(lambda specs: gradcomm.dpsgd("data"), before=False, per_device=True),
    "local_sgd": TpCase(None, per_device=True, sync=lambda: gradcomm.local_sgd("data", every=2)),
    "diloco": TpCase(
        None, per_device=True, sync=lambda: gradcomm.diloco("data", optax.sgd(0.7), every=2)
    ),
    # One fragment: with several, train_step's state layout raises on split params (its
    # message says to use one, or a hand-written shard_map loop).
    "streaming_diloco": TpCase(
        None,
        per_device=True,
        sync=lambda: gradcomm.streaming_diloco(
            "data", every=2, fragments=1, delay=1, outer_dtype="bfloat16"
        ),
    ),
    # Eager updates: the anchor and outer state per device (and split like the params);
    # bfloat16 outer gradients, rounded entry by entry (E3M0's scales raise, below).
    "streaming_diloco_eager": TpCase(
        None,
        per_device=True,
        sync=lambda: gradcomm.streaming_diloco(
            "data", every=2, fragments=1, outer_dtype="bfloat16", eager=True
        ),
    ),
}


def _train(tx, mesh, params, batches, loss, case=TpCase(None)):
    from gradcomm import parallel

    kwargs = {"params_per_device": case.per_device, "axes": "data"}
    sync = case.sync() if case.sync else None
    kwargs.update({"sync": sync} if sync else {})
    state = parallel.init_state(tx, params, mesh, **kwargs)
    step = parallel.train_step(loss, tx, mesh, **kwargs)
    for batch in batches:
        params, state, _ = step(params, state, batch)
        jax.block_until_ready(params)
    return jax.tree.map(np.asarray, params), state


@pytest.mark.parametrize("name", TP_CASES)
def test_train_step_keeps_params_split_over_the_model_axis(name):
    """A Megatron-style MLP, column- then row-split over 'model', trains as the whole model
    does on the data axis alone: 5 Adam steps, params within 1e-6 relative."""
    from gradcomm import parallel

    case = TP_CASES[name]

    def chain(specs):
        adam = optax.adam(1e-2)
        if case.make is None:
            return adam
        method = case.make(specs)
        return optax.chain(method, adam) if case.before else optax.chain(adam, method)

    one, two = _meshes()
    params, batches = mlp_problem()
    whole = parallel.per_device(params, one) if case.per_device else parallel.replicate(params, one)
    want, _ = _train(chain(None), one, whole, batches, mlp_loss, case)
    placed = parallel.shard_params(params, two, MLP_SPECS, per_device=case.per_device)
    loss = functools.partial(mlp_loss, model_axis="model")
    got, state = _train(chain(MLP_SPECS), two, placed, batches, loss, case)
    for k in params:
        err = _relative(got[k], want[k])
        assert err <= 1e-6, f"{name}: param {k} off by {err:.3g} relative"
        assert not np.allclose(got[k], params[k])  # it trained
    # The state mirrors the params' split: Adam's moments are split like them (after a
    # leading device axis where each device runs its own Adam).
    adam = next(s for s in jax.tree.leaves(state, is_leaf=_is_adam) if _is_adam(s))
    mirrors = [adam.mu]
    if name == "streaming_diloco_eager":  # and its per-device anchor and outer momentum
        is_trace = lambda x: isinstance(x, optax.TraceState)  # noqa: E731
        trace = next(x for x in jax.tree.leaves(state.sync, is_leaf=is_trace) if is_trace(x))
        mirrors += [state.sync.anchor, trace.trace]
    for k, spec in MLP_SPECS.items():
        for tree in mirrors:
            tail = _spec(tree[k])[len(_spec(tree[k])) - len(spec) :] if len(spec) else ()
            assert P(*tail) == spec, (k, _spec(tree[k]))


SPLIT_ERRORS = {  # name: (options of streaming_diloco, or None for onebit_adam; message)
    "e3m0": ({"fragments": 1}, r"outer_dtype='e3m0'.*split over mesh axes \('model',\)"),
    "fragments": ({"fragments": 2, "outer_dtype": "bfloat16"}, r"use fragments=1 there"),
    "onebit_adam": (None, r"onebit_adam scales .* \('model',\).* replicated over the model"),
}


@pytest.mark.parametrize("name", SPLIT_ERRORS)
def test_compressed_codes_on_split_params_say_what_to_do(name):
    """In train_step on the MLP split over 'model': E3M0 and 1-bit Adam scale their codes
    over slices (and tensors) of the whole leaf, which no device holds; with several
    fragments each fragment's outer state holds some leaves, which train_step cannot lay
    out over 'model'. Each raises a ValueError that names what works."""
    from gradcomm import parallel

    _, two = _meshes()
    params, _ = mlp_problem()
    options, message = SPLIT_ERRORS[name]
    per_device = options is not None
    placed = parallel.shard_params(params, two, MLP_SPECS, per_device=per_device)
    kwargs = {"params_per_device": per_device, "axes": "data"}
    if per_device:
        tx = optax.sgd(0.1)
        kwargs["sync"] = gradcomm.streaming_diloco("data", every=2, **options)
    else:
        tx = gradcomm.onebit_adam("data", 0.1, warmup_steps=1)
    with pytest.raises(ValueError, match=message):
        parallel.init_state(tx, placed, two, **kwargs)


def _spec(x):
    """An array's PartitionSpec without trailing Nones."""
    entries = list(x.sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _is_adam(x):
    return isinstance(x, optax.ScaleByAdamState)


# ------------------------------------------------------------------------------------------
# FSDP (ZeRO-3) in parallel.train_step: params and optimizer state split over 'data'.

# name: make(specs) -> the method, which sits before Adam. low_precision's, terngrad's,
# lags's and gradient_dropping's runs of this check are in their own test files
# (test_fsdp_train_step_matches_the_replicated_one).
FSDP_CASES = {
    "allreduce": lambda specs: gradcomm.allreduce("data", specs=specs),
}


@pytest.mark.parametrize("name", FSDP_CASES)
def test_fsdp_train_step_matches_the_replicated_one(name):
    from gradcomm import parallel

    one, _ = _meshes()
    params, batches = mlp_problem()
    adam = optax.adam(1e-2)
    want, _ = _train(
        optax.chain(FSDP_CASES[name](None), adam), one, parallel.replicate(params, one),
        batches, mlp_loss,
    )  # fmt: skip
    placed = parallel.shard_params(params, one, FSDP_SPECS)
    tx = optax.chain(FSDP_CASES[name](FSDP_SPECS), adam)
    got, state = _train(tx, one, placed, batches, mlp_loss)
    for k in params:
        err = _relative(got[k], want[k])
        assert err <= 1e-6, f"{name}: param {k} off by {err:.3g} relative"
    adam_state = next(s for s in jax.tree.leaves(state, is_leaf=_is_adam) if _is_adam(s))
    assert _spec(adam_state.mu["w1"]) == P("data")  # the moments split like the params
    assert adam_state.mu["w1"].addressable_shards[0].data.shape == (2, 16)


def test_fsdp_needs_a_method_that_reduce_scatters():
    from gradcomm import parallel

    one, _ = _meshes()
    params, batches = mlp_problem()
    placed = parallel.shard_params(params, one, FSDP_SPECS)
    tx = optax.chain(gradcomm.allreduce("data"), optax.adam(1e-2))  # no specs
    with pytest.raises(ValueError, match="FSDP"):
        _train(tx, one, placed, batches[:1], mlp_loss)


def test_fsdp_memory_and_wire():
    """Per device, params and Adam's state take 1/N of the replicated step's bytes (read
    from `compiled.memory_analysis()`), and the gradient leaves as a reduce-scatter of
    (N - 1)/N of its bytes (read from the compiled program)."""
    from gradcomm import parallel, wire

    one, _ = _meshes()
    n = one.size
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.standard_normal((64, 256)).astype(np.float32),
        "w2": rng.standard_normal((256, 64)).astype(np.float32),
        "b": np.zeros(64, np.float32),
    }
    specs = {"w1": P("data"), "w2": P("data"), "b": P()}
    batch = {"x": np.ones((8, 64), np.float32), "y": np.ones((8, 64), np.float32)}

    def loss(p, b):
        return jax.numpy.mean((jax.nn.relu(b["x"] @ p["w1"]) @ p["w2"] + p["b"] - b["y"]) ** 2)

    def compiled(placed, method):
        tx = optax.chain(method, optax.adam(1e-3))
        state = parallel.init_state(tx, placed, one)
        step = parallel.train_step(loss, tx, one)
        lowered = step.lower(placed, state, batch)
        return lowered.compile().memory_analysis(), wire.measure(step, placed, state, batch)

    whole, whole_wire = compiled(parallel.replicate(params, one), gradcomm.allreduce("data"))
    split, split_wire = compiled(
        parallel.shard_params(params, one, specs), gradcomm.allreduce("data", specs=specs)
    )
    batch_bytes = sum(x.nbytes for x in batch.values()) / n
    ratio = (split.argument_size_in_bytes - batch_bytes) / (
        whole.argument_size_in_bytes - batch_bytes
    )
    assert ratio <= 1 / n + 0.01, ratio  # only the bias and counts stay whole
    kernel_bytes = params["w1"].nbytes + params["w2"].nbytes
    kinds = split_wire.by_kind()
    assert kinds["reduce-scatter"] == (n - 1) / n * kernel_bytes
    assert kinds["all-gather"] == (n - 1) / n * kernel_bytes  # the forward's gather
    assert whole_wire.by_kind()["all-reduce"] >= 2 * (n - 1) / n * kernel_bytes


def test_fsdp_with_per_device_params_says_why_not():
    from gradcomm import parallel

    one, _ = _meshes()
    params, _ = mlp_problem()
    with pytest.raises(ValueError, match="one copy of the params per device"):
        parallel.shard_params(params, one, FSDP_SPECS, per_device=True, axes="data")
