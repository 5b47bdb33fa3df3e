"""`parallel.calibrate`, the probe of the link that `exchange="auto"` follows, and a
`TrainStep`'s probe of its own step (`StepProbe`).

Across processes (gloo) tests/suites/test_multiprocess.py runs them, where both processes
choose alike; here one process stands in for several (`spans_processes`).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_of

import gradcomm
from gradcomm import _axes, parallel
from gradcomm.parallel import _calibrate, _step


def test_probe_times_both_swaps_records_the_faster_and_is_cached(monkeypatch):
    monkeypatch.setattr(_axes, "_PROBES", {})
    mesh = parallel.make_mesh({"data": 4, "model": 2})
    probe = parallel.calibrate(mesh, "data", nbytes=1 << 14, repeats=2)
    assert probe.axes == ("data",) and probe.nbytes == 1 << 14
    assert probe.permute_s > 0 and probe.pairwise_s > 0
    faster = "pairwise" if probe.pairwise_s < probe.permute_s else "permute"
    assert probe.exchange == faster
    assert _axes._PROBES == {(jax.default_backend(), 1): faster}
    assert parallel.calibrate(mesh, "data", nbytes=1 << 14) is probe  # once per mesh


def test_probe_needs_pairs():
    with pytest.raises(ValueError, match=r"power-of-two number of devices.*got 6"):
        parallel.calibrate(mesh_of(6))
    with pytest.raises(ValueError, match="nbytes >= 4 and repeats >= 1"):
        parallel.calibrate(mesh_of(2), nbytes=2)


def _adasum_step(monkeypatch, spans: bool, tx: optax.GradientTransformation | None = None):
    """An Adasum (or `tx`) step on 4 devices, run once: the step, the new params, and
    whether its compiled program swaps by reduce-scatters."""
    monkeypatch.setattr(_step, "spans_processes", lambda mesh: spans)
    mesh = mesh_of(4)
    tx = tx or optax.chain(optax.sgd(0.1), gradcomm.adasum("data"))
    w = np.linspace(-1.0, 1.0, 64, dtype=np.float32)
    params = parallel.replicate({"w": w}, mesh)
    batch = np.arange(8 * 64, dtype=np.float32).reshape(8, 64) / 512.0
    step = parallel.train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx, mesh)
    state = parallel.init_state(tx, params, mesh)
    new_params, _, _ = step(params, state, batch)
    swaps = "reduce-scatter(" in step.lower(params, state, batch).compile().as_text()
    return step, parallel.host_copy(new_params)["w"], swaps


def test_step_probe_times_the_step_both_ways_and_follows_the_faster(monkeypatch):
    """Across processes the first call times the step with each exchange for "auto" and
    compiles the faster: the program that exchange names; one process has no link. Each
    timed run trains on from the params and state the previous one returned, so a method
    whose phases cycle (gossip's peers) is timed over its phases."""
    time_both, runs_out, rounds = _calibrate.time_both, {}, []

    def spy(runs, repeats):  # the real timing, each run's new params kept
        rounds.append(repeats)

        def kept(kind, run):
            def wrapped():
                out = run()
                runs_out.setdefault(kind, []).append(out[0])
                return out

            return wrapped

        return time_both({kind: kept(kind, run) for kind, run in runs.items()}, repeats)

    monkeypatch.setattr(_calibrate, "time_both", spy)
    step, probed, swaps = _adasum_step(monkeypatch, spans=True)
    probe = step.probe
    assert isinstance(probe, parallel.StepProbe)
    assert probe.permute_s > 0 and probe.pairwise_s > 0
    faster = "pairwise" if probe.pairwise_s < probe.permute_s else "permute"
    assert probe.exchange == faster and swaps == (faster == "pairwise")
    outs = {k: [parallel.host_copy(p)["w"] for p in v] for k, v in runs_out.items()}
    assert set(outs) == {"permute", "pairwise"}
    for trained in outs.values():  # a warm-up run, then one per repeat, each from the last
        assert len(trained) == rounds[0] + 1 >= 3
        assert all(not np.array_equal(a, b) for a, b in itertools.pairwise(trained))
    # Each kind's first run steps from the same params as `step`'s first call: the
    # exchanges agree (the programs around them may fuse the gradient's sums apart), and
    # the step compiled the faster one's program.
    first = {kind: trained[0] for kind, trained in outs.items()}
    np.testing.assert_allclose(first["pairwise"], first["permute"], rtol=1e-6)
    np.testing.assert_array_equal(probed, first[faster])
    step, alone, swaps = _adasum_step(monkeypatch, spans=False)
    assert step.probe is None and not swaps  # one process: "auto" keeps the ppermute
    np.testing.assert_array_equal(alone, first["permute"])
    # Whichever is timed faster is compiled: the other exchange, as if it had won.
    other = "permute" if faster == "pairwise" else "pairwise"
    times = (other, 2.0, 1.0) if other == "pairwise" else (other, 1.0, 2.0)
    fake = lambda lower, args: parallel.StepProbe(*times)  # noqa: E731
    monkeypatch.setattr(_step, "probe_step", fake)
    step, forced, swaps = _adasum_step(monkeypatch, spans=True)
    assert step.probe == parallel.StepProbe(*times)
    assert swaps == (other == "pairwise")
    np.testing.assert_array_equal(forced, first[other])


def test_step_without_swaps_is_not_probed(monkeypatch):
    permute = optax.chain(gradcomm.adasum("data", exchange="permute"), optax.sgd(0.1))
    for tx in (optax.chain(gradcomm.allreduce(), optax.sgd(0.1)), permute):
        step, _, _ = _adasum_step(monkeypatch, spans=True, tx=tx)
        assert step.probe is None  # both ways lower alike: nothing to time
