"""The experiment scripts run end to end (tiny settings) and write what they promise."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "experiments"))
import _methods  # noqa: E402

SCRIPTS = sorted(p.name for p in (ROOT / "experiments").glob("[!_]*.py"))
# Each study at its smallest: the script runs end to end and writes JSON, PNG and Markdown.
STUDIES = {
    "adasum_large_batch.py": [
        "--sizes",
        "1,2",
        "--epochs",
        "1",
        "--seeds",
        "0",
        "--batch-size",
        "32",
        "--probe-every",
        "20",
    ],
    "terngrad_workers.py": ["--sizes", "2", "--epochs", "1"],
    "lags_sparsity.py": [
        "--densities",
        "0.01",
        "--epochs",
        "1",
        "--batch-size",
        "64",
        "--probe-every",
        "40",
    ],
    "sgp_gossip.py": ["--epochs", "1", "--seeds", "0", "--batch-size", "64", "--devices", "4"],
    "local_gradients.py": [
        "--seeds",
        "0",
        "--epochs",
        "1",
        "--train-size",
        "512",
        "--methods",
        "allreduce,dropping-local",
    ],
}


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
    assert "--out" in result.stdout
    # One process per emulated host: the network benchmark simulates no devices.
    assert ("--devices" in result.stdout) != (script == "bench_network.py")


def test_one_registry_builds_and_models_every_method():
    # compare.py, the network benchmark and the step-time model read one registry: each
    # method builds (a sync exactly where it averages params) and the model takes its row.
    import optax

    from gradcomm import perfmodel

    for label, spec in _methods.METHODS.items():
        method = _methods.build(spec, optax.sgd(0.1))
        assert method.name == label and method.per_device == spec.per_device
        assert (method.sync is not None) == (spec.every is not None)
        assert method.sync is None or method.per_device
        row = spec.describe()
        assert json.loads(json.dumps(row)) == row  # what network.json records carry
        perfmodel.predict(row["method"], 1000, 4, 1.0, options=row["options"], sync=row["sync"])
    assert set(_methods.COMPARE) <= set(_methods.METHODS)
    assert _methods.METHODS["local-sgd"].every == 20
    assert _methods.METHODS["dropping-local"].every == 50


def test_every_study_is_listed():
    benches = {"bench_collectives.py", "bench_network.py", "bench_scaling.py"}
    others = {"train.py", "compare.py", *benches}
    assert set(STUDIES) | others == set(SCRIPTS)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(STUDIES))
def test_study_runs_and_writes_json_png_and_markdown(tmp_path, script):
    args = STUDIES[script]
    if "--devices" not in args:
        args = [*args, "--devices", "2"]
    result = run(script, *args, "--no-progress", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    stem = script.removesuffix(".py")
    study = json.loads((tmp_path / f"{stem}.json").read_text())
    assert study["runs"] and all(np.isfinite(r["losses"]).all() for r in study["runs"])
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
    assert "|" in (tmp_path / f"{stem}.md").read_text()


@pytest.mark.slow
def test_compare_on_one_device_says_nothing_crosses_a_wire(tmp_path):
    methods = ["--method", "allreduce,adasum,sgp"]
    result = run(
        "compare.py", "--devices", "1", "--epochs", "1", "--no-progress", *methods,
        "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads((tmp_path / "compare.json").read_text())["runs"]
    assert [r["bytes_per_step"] for r in runs] == [0, 0, 0]
    assert "One device: nothing crosses a wire" in (tmp_path / "compare.md").read_text()


@pytest.mark.slow
def test_compare_runs_every_method_and_writes_json_png_and_markdown(tmp_path):
    result = run(
        "compare.py", "--devices", "2", "--epochs", "2", "--no-progress", "--out", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads((tmp_path / "compare.json").read_text())["runs"]
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
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert "| adasum |" in (tmp_path / "compare.md").read_text()


def test_train_runs_one_method(tmp_path):
    result = run(
        "train.py",
        "--devices",
        "2",
        "--epochs",
        "1",
        "--method",
        "lags",
        "--no-progress",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["method"] for r in json.loads((tmp_path / "train.json").read_text())["runs"]] == [
        "lags"
    ]


@pytest.mark.slow
def test_compare_in_two_processes_matches_one(tmp_path):
    """Two processes with 4 devices each (gloo) against one with 8: the same numbers.

    Every method but the all-reduce based ones moves data without arithmetic, so those
    runs agree bit for bit; a psum may add in another order across processes, so losses
    are compared to float32 rounding.
    """
    methods = "allreduce,adasum,lags,sgp,local-sgd"
    common = ["--epochs", "1", "--method", methods, "--no-progress"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "experiments" / "compare.py"),
                *common,
                "--devices",
                "4",
                "--coordinator-address",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--out",
                str(tmp_path / "two"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    single = run("compare.py", *common, "--devices", "8", "--out", str(tmp_path / "one"))
    for proc in procs:
        log = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, log[-3000:]
    assert single.returncode == 0, single.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "compare.json").read_text())["runs"]
    one = json.loads((tmp_path / "one" / "compare.json").read_text())["runs"]
    for a, b in zip(two, one, strict=True):
        assert a["method"] == b["method"]
        assert a["test_accuracy"] == b["test_accuracy"]
        assert a["bytes_per_step"] == b["bytes_per_step"]
        np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5, atol=1e-6)


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
