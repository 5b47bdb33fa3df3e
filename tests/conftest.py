"""Simulates 8 CPU devices before JAX starts (helpers.py holds the shared test helpers); the
`build_once` fixture."""

import fcntl
import os
import shutil

import pytest

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
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
