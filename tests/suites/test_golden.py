"""Every method's params after four `parallel.train_step` steps, against recorded outputs.

For each row of `CASES` (a method, its sync, mesh, device count and params dtype), the
per-device params after each of four steps must match those in `tests/data/golden.npz`,
each leaf bit for bit or within `ULPS` (4) eps of its largest recorded magnitude (eps the
dtype's machine epsilon); a leaf outside that fails under its `name/step/leaf/dtype`. The
file was written by `tests/suites/make_golden.py` on commit 2e9d998, so the test holds today's
code to that commit's arithmetic. Two rows changed API since: periodic averaging was
`gradient_dropping(average_every=2)` and the `local_sgd(every=2)` transformation, and is
now `sync=gradcomm.periodic_average(...)` / `sync=gradcomm.local_sgd(...)`; the maker
uses the old API on the old code.

Why a tolerance: XLA:CPU generates code for the CPU it runs on (vector width, fused
multiply-adds), so on another CPU the same program may round differently. On an AMD EPYC
the float32 rows differed by up to 1.5 eps of each leaf's largest entry after four steps,
and an AVX-512 Xeon moved one float16 entry of `lags_f16` by one unit; 4 eps leaves room
for that, and a change of the arithmetic beyond rounding still fails.

To regenerate, run the maker with that commit's gradcomm, from a worktree of it (the maker
writes the file it is given): `git worktree add ../before 2e9d998`, then from the worktree
`JAX_NUM_CPU_DEVICES=8 PYTHONPATH=. python CHECKOUT/tests/suites/make_golden.py
CHECKOUT/tests/data/golden.npz`, CHECKOUT being this checkout.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradcomm
from gradcomm import parallel

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "data" / "golden.npz"
STEPS = 4
ULPS = 4  # the tolerance across CPUs, in eps of each leaf's largest magnitude
SHAPES = {"w": (6, 4), "b": (4,), "s": ()}


def loss_fn(params: dict, batch: dict) -> jax.Array:
    out = batch["x"] @ params["w"].astype(jnp.float32) + params["b"].astype(jnp.float32)
    return jnp.mean((out - batch["y"]) ** 2) + params["s"].astype(jnp.float32) ** 2


def _sgd_after(method: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: optax.chain(optax.sgd(0.1), method())


def _sgd_before(method: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: optax.chain(method(), optax.sgd(0.1))


def _dropping(**options: Any) -> Callable[[], Any]:
    return _sgd_before(
        lambda: gradcomm.gradient_dropping("data", drop_ratio=0.75, warmup_steps=2, **options)
    )


class Row(NamedTuple):
    """One method's run: its transformation, its sync, and where it runs."""

    tx: Callable[[], Any]
    n: int = 4
    sync: Callable[[], Any] | None = None
    axes: dict | None = None  # the mesh; default {"data": n}
    per_device: bool = False  # params kept per device
    dtype: Any = np.float32  # the params'


CASES: dict[str, Row] = {
    "allreduce": Row(_sgd_before(lambda: gradcomm.allreduce("data"))),
    "adasum": Row(_sgd_after(lambda: gradcomm.adasum("data"))),
    "adasum_fold": Row(_sgd_after(lambda: gradcomm.adasum("data")), n=7),
    "adasum_8_bf16": Row(_sgd_after(lambda: gradcomm.adasum("data")), 8, dtype=jnp.bfloat16),
    "adasum_hierarchical": Row(
        _sgd_after(lambda: gradcomm.adasum("node", local_axis="local")),
        axes={"node": 2, "local": 2},
    ),
    "terngrad": Row(_sgd_before(lambda: gradcomm.terngrad("data", seed=3))),
    "lags": Row(_sgd_after(lambda: gradcomm.lags("data", density=0.25))),
    "lags_f16": Row(_sgd_after(lambda: gradcomm.lags("data", density=0.25)), 5, dtype=np.float16),
    "slgs": Row(_sgd_after(lambda: gradcomm.slgs("data", density=0.25))),
    "sgp": Row(_sgd_after(lambda: gradcomm.sgp("data")), per_device=True),
    "osgp": Row(_sgd_after(lambda: gradcomm.sgp("data", overlap=1)), 8, per_device=True),
    "dpsgd": Row(_sgd_after(lambda: gradcomm.dpsgd("data")), per_device=True),
    "dropping": Row(_dropping()),
    "dropping_local": Row(_dropping(local="compensated"), 6, per_device=True),
    "dropping_local_average": Row(
        _dropping(local="sum"),
        sync=lambda: gradcomm.periodic_average("data", every=2),
        per_device=True,
    ),
    "local_sgd": Row(
        lambda: optax.sgd(0.1), sync=lambda: gradcomm.local_sgd("data", every=2), per_device=True
    ),
}


def batches(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.standard_normal((2 * n, 6)).astype(np.float32),
            "y": rng.standard_normal((2 * n, 4)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]


def run(name: str, tx: Any, sync: Any) -> list[dict]:
    """The params as host rows after each step (one row per device where per device)."""
    row = CASES[name]
    mesh = parallel.make_mesh(row.axes or {"data": row.n}, devices=jax.devices()[: row.n])
    rng = np.random.default_rng(1)
    params = {k: rng.standard_normal(s).astype(row.dtype) for k, s in SHAPES.items()}
    place = parallel.per_device if row.per_device else parallel.replicate
    params = place(params, mesh)
    kwargs = {"params_per_device": row.per_device, **({"sync": sync} if sync else {})}
    state = parallel.init_state(tx, params, mesh, **kwargs)
    step = parallel.train_step(loss_fn, tx, mesh, **kwargs)
    out = []
    for batch in batches(row.n):
        params, state, _ = step(params, state, batch)
        out.append({k: np.asarray(v) for k, v in jax.block_until_ready(params).items()})
    return out


def flatten(name: str, history: list[dict]) -> dict[str, np.ndarray]:
    """`name/step/leaf/dtype` to the leaf's bytes."""
    return {
        f"{name}/{t}/{k}/{v.dtype.name}": np.atleast_1d(v).view(np.uint8)
        for t, p in enumerate(history)
        for k, v in p.items()
    }


@pytest.mark.parametrize("name", list(CASES))
def test_the_same_bits_as_before_the_redesign(name):
    row = CASES[name]
    got = flatten(name, run(name, row.tx(), row.sync() if row.sync else None))
    with np.load(GOLDEN) as golden:
        want = {k: golden[k] for k in golden.files if k.startswith(name + "/")}
    assert sorted(got) == sorted(want)  # the same steps, leaves and dtypes
    for key, value in got.items():
        if np.array_equal(value, want[key]):
            continue
        dtype = np.dtype(getattr(jnp, key.rsplit("/", 1)[1]))
        value, expected = (x.view(dtype).astype(np.float64) for x in (value, want[key]))
        bound = ULPS * float(jnp.finfo(dtype).eps) * np.abs(expected).max()
        np.testing.assert_allclose(value, expected, rtol=0, atol=bound, err_msg=key)
