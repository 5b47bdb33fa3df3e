"""Two JAX processes on 127.0.0.1 (gloo), 4 devices each, agree with one 8-device process,
bit for bit: Adasum on one axis, and Adasum and SGP over size-2 axes, where the two
processes exchange pairwise (gloo reduce-scatters) and one process uses `ppermute`; then
an Adasum `train_step` times its step both ways and chooses alike in both."""

import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
from multiprocess_case import adasum_of_case, pairwise_of_case

HERE = pathlib.Path(__file__).resolve().parents[1]  # tests/, where the worker is


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    port = free_port()
    outs = [tmp_path / f"out{i}.npy" for i in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "multiprocess_worker.py"),
                str(port),
                "2",
                str(i),
                "4",
                str(outs[i]),
            ],
            cwd=HERE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:  # meanwhile, this process: 8 simulated devices, ppermutes
        pairwise, text = pairwise_of_case()
        single = np.concatenate([adasum_of_case(), pairwise])
    except BaseException:
        for p in procs:
            p.kill()
        raise
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-3000:]
    assert "reduce-scatter(" not in text and "collective-permute(" in text
    for out in outs:
        np.testing.assert_array_equal(np.load(out), single)
    # Both processes took the slowest one's times, so chose alike, and "auto" followed.
    probes = {pathlib.Path(f"{out}.probe").read_text() for out in outs}
    assert probes in ({"pairwise True"}, {"permute False"}), probes
