"""The experiment scripts run end to end (tiny settings) and write what they promise."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
SCRIPTS = ["train.py", "bench_collectives.py"]


def run(script, *args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    return subprocess.run(
        [sys.executable, str(ROOT / "experiments" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    result = run(script, "--help")
    assert result.returncode == 0, result.stderr
    assert "--devices" in result.stdout and "--out" in result.stdout


@pytest.mark.slow
def test_train_writes_json_png_and_markdown(tmp_path):
    result = run(
        "train.py", "--devices", "2", "--epochs", "2", "--no-progress", "--out", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads((tmp_path / "train.json").read_text())["runs"]
    assert [r["method"] for r in runs] == [
        "allreduce",
        "adasum",
        "terngrad",
        "lags",
        "slgs",
        "dropping",
        "dropping-local",
        "local-sgd",
        "sgp",
        "osgp",
        "dpsgd",
    ]
    for r in runs:
        assert 0.5 < r["test_accuracy"] <= 1 and r["bytes_per_step"] > 0
        assert r["losses"][-1] < r["losses"][0]
    assert (tmp_path / "train.png").stat().st_size > 0
    assert "| adasum |" in (tmp_path / "train.md").read_text()


@pytest.mark.slow
def test_bench_collectives_writes_ratios(tmp_path):
    result = run(
        "bench_collectives.py",
        "--devices",
        "4",
        "--sizes",
        "4KiB,64KiB",
        "--repeats",
        "2",
        "--no-progress",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_collectives.json").read_text())["rows"]
    assert [r["bytes"] for r in rows] == [4096, 65536]
    for r in rows:
        assert r["ratio_to_psum"]["psum"] == 1 and r["ratio_to_psum"]["adasum"] > 0
        assert r["wire_bytes"]["adasum"] <= 1.2 * r["wire_bytes"]["psum"]


def test_bad_arguments_fail_clearly(tmp_path):
    result = run("train.py", "--method", "nope", "--out", str(tmp_path))
    assert result.returncode != 0 and "unknown method" in result.stderr
