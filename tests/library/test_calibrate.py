"""`parallel.calibrate`: the probe of the link that `exchange="auto"` follows.

Across processes (gloo) it is exercised by tests/suites/test_multiprocess.py, where
`train_step` takes it and both processes choose alike.
"""

import jax
import pytest
from helpers import mesh_of

from gradcomm import _axes, parallel


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


def test_train_step_probes_only_across_processes(monkeypatch):
    """One process has no link: `train_step` leaves "auto" to its default there."""
    calls = []
    monkeypatch.setattr(parallel._calibrate, "calibrate", lambda *a, **k: calls.append(a))
    mesh = mesh_of(4)
    assert parallel._calibrate.calibrate_once(mesh, ("data",)) is None and not calls
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    parallel._calibrate.calibrate_once(mesh, ("data",))
    assert calls == [(mesh, ("data",))]
    assert parallel._calibrate.calibrate_once(mesh_of(6), ("data",)) is None  # no pairs
