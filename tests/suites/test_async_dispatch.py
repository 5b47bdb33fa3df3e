"""XLA:CPU collectives under async dispatch: the README's quick start (`helpers.quick_start`)
in a loop that blocks every step runs hundreds of steps on 8 devices to the end.

Without blocking, a few hundred steps dispatched at once can abort the whole process after
XLA:CPU's 40 s collective rendezvous timeout, at random. So the run goes in a subprocess
with a time limit: a hang or an abort fails this test instead of the suite.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

LOOP = textwrap.dedent(
    """
    import numpy as np
    from helpers import quick_start
    from gradcomm import parallel

    mesh = parallel.make_mesh()
    assert mesh.size == 8
    params, state, step = quick_start(mesh)
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    batch = parallel.shard_batch({"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}, mesh)
    for i in range(300):
        params, state, metrics = step(params, state, batch)
        metrics["loss"].block_until_ready()  # the README's advice: block every step
    print("steps", i + 1, float(metrics["loss"]))
    """
)


def test_blocking_loop_runs_300_steps_on_8_devices():
    tests = str(pathlib.Path(__file__).resolve().parents[1])  # where helpers.py is
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-c", LOOP], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-2000:]
    steps, loss = result.stdout.split()[-2:]
    assert steps == "300" and float(loss) < 0.5
