"""Simulates 8 CPU devices before JAX starts (helpers.py holds the shared test helpers), with
XLA's CPU code generation at its cheapest; the `build_once` fixture.

The tests' shapes are small, so they spend most of their time compiling: LLVM's
optimizations off (`jax_disable_most_optimizations`) and XLA:CPU's older fusion emitters
halve the suite (tests/methods: 242 s against 105 s on two cores); the scripts the tests
run get the same (`test_experiments.script_env`). The HLO passes are the same, and so
are the collectives that `gradcomm.wire` reads from the compiled program; the arithmetic
may round differently where the optimized code would fuse a multiply-add (the golden test
allows for that). Benchmarks and users get XLA's defaults.
"""

import fcntl
import os
import shutil
import subprocess
import sys

import pytest

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def xla_takes(flag):
    """Whether this jaxlib's XLA knows `flag` (an unknown flag in XLA_FLAGS aborts XLA), in a
    process of its own; asked once per test session (the xdist workers inherit the answer)."""
    code = "import jax; jax.jit(lambda x: x + 1)(1.0)"
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    return done.returncode == 0


if "GRADCOMM_TEST_EMITTERS" not in os.environ:
    os.environ["GRADCOMM_TEST_EMITTERS"] = OLD_EMITTERS if xla_takes(OLD_EMITTERS) else ""
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""),
    "--xla_force_host_platform_device_count=8",
    os.environ["GRADCOMM_TEST_EMITTERS"],
]).strip()  # fmt: skip
os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
os.environ["JAX_PLATFORMS"] = "cpu"


@pytest.fixture(scope="session")
def build_once(tmp_path_factory):
    """`build_once(name, build)`: the folder that `build(folder)` filled, built once per test
    session however many pytest-xdist workers ask (the first builds, under a file lock, and
    the others wait for it, then reuse the folder); a failed build is retried by the next
    caller. For artifacts that take long to make and that the tests only read: a wheel, a
    built site."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the session's workers

    def build_once(name, build):
        folder = root / f"built-{name}"
        with open(root / f"built-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / ".built").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                build(folder)
                (folder / ".built").touch()
        return folder

    return build_once
