"""The network benchmark's PyTorch DDP peer rows: one MLP for both frameworks, the flags,
the thread pinning, the records, and a tiny run.

PyTorch is optional (`pip install -e ".[peer]"`) and CI does not install it: the tests
that run it skip without it. The end-to-end run also needs root with CAP_NET_ADMIN (and
iproute2), as tests/experiments/test_bench_network.py's runs do; where that is missing, two peer
workers on loopback stand in for it.
"""

import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
from test_experiments import import_script, main_in_process

from gradcomm_experiments import provenance
from gradcomm_experiments.network import cluster as netcluster
from gradcomm_experiments.network import peer as peerworker
from gradcomm_experiments.network import report as netreport
from gradcomm_experiments.network import worker as networker

ROOT = pathlib.Path(__file__).resolve().parents[2]
bench_network = import_script("bench_network.py")

SCRIPT = ROOT / "experiments" / "network" / "bench_network.py"
PROBLEM = netcluster.root_problem(probe=True)
TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not TORCH, reason='PyTorch is not installed (optional: pip install -e ".[peer]")'
)
WIDTHS = networker.mlp_widths(2e4)


def env():
    drop = ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")  # conftest's simulated devices
    return {k: v for k, v in os.environ.items() if k not in drop}


def test_mlp_init_is_the_jax_tasks_arrays():
    params, _, data = networker.mlp_task(WIDTHS, 64)
    np_params, np_data = networker.mlp_init(WIDTHS, 64)
    assert params.keys() == np_params.keys() and data.keys() == np_data.keys()
    for tree, np_tree in ((params, np_params), (data, np_data)):
        for key, value in tree.items():
            assert type(value) is np.ndarray and value.dtype == np_tree[key].dtype
            np.testing.assert_array_equal(value, np_tree[key])


def test_peer_worker_never_imports_jax():
    code = (
        "import sys; from gradcomm_experiments.network import peer, worker; "
        "worker.mlp_init(worker.mlp_widths(2e4), 8); "
        "print(sorted(m for m in ('jax', 'jaxlib', 'optax', 'gradcomm') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_local_batch_is_the_ranks_rows():
    pytest.importorskip("torch", reason='PyTorch is not installed (pip install -e ".[peer]")')
    _, data = networker.mlp_init(WIDTHS, 64)
    x, y = peerworker.local_batch(data, 1, 2)
    np.testing.assert_array_equal(x.numpy(), data["x"][32:])
    np.testing.assert_array_equal(y.numpy(), data["y"][32:])


@needs_torch
def test_torch_model_computes_the_jax_loss_and_gradients():
    import jax
    import torch

    params, loss_fn, data = networker.mlp_task(WIDTHS, 64)
    model = peerworker.build_model(networker.mlp_init(WIDTHS, 64)[0])
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    for i, linear in enumerate(linears):  # the same initial params, transposed
        np.testing.assert_array_equal(linear.weight.detach().numpy(), params[f"w{i}"].T)
        np.testing.assert_array_equal(linear.bias.detach().numpy(), params[f"b{i}"])
    loss = peerworker.loss_of(model, *peerworker.local_batch(data, 0, 1))
    loss.backward()
    jax_loss, jax_grads = jax.value_and_grad(lambda p: loss_fn(p, data)[0])(params)
    np.testing.assert_allclose(loss.item(), float(jax_loss), rtol=1e-5)
    for i, linear in enumerate(linears):
        np.testing.assert_allclose(linear.weight.grad.numpy().T, jax_grads[f"w{i}"], atol=1e-6)
        np.testing.assert_allclose(linear.bias.grad.numpy(), jax_grads[f"b{i}"], atol=1e-6)


def test_help_lists_peer_and_threads(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_network.parse_args(["--help"])
    assert exit_info.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "--peer also time PyTorch DDP" in shown and "(off by default)" in shown
    assert "--threads THREADS" in shown and "(default: not pinned" in shown
    args = bench_network.parse_args([])
    assert args.peer is False and args.threads is None


def test_peer_without_torch_exits_2_with_the_install_hint(tmp_path, monkeypatch, capsys):
    # torch made unimportable (None in sys.modules: ImportError); the script runs here, as
    # its flags are checked before it touches a device.
    out = tmp_path / "never-written"
    monkeypatch.setitem(sys.modules, "torch", None)
    args = ["--peer", "--nodes", "2", "--out", str(out)]
    assert main_in_process("bench_network.py", *args, monkeypatch=monkeypatch) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("bench_network: --peer needs PyTorch") and "\n" not in message
    assert 'pip install -e ".[peer]"' in message
    assert "CPU-only" in message and "download.pytorch.org/whl/cpu" in message
    assert not out.exists()


def test_compute_threads_sizes_xlas_pool_and_restores_the_mask():
    # XLA:CPU's intra-op pool threads are named tf_XLAEigen (jax 0.10.2): one with one CPU.
    code = """
import os
from gradcomm_experiments.network import worker as networker
before = os.sched_getaffinity(0)
with networker.compute_threads(1):
    import jax
    jax.devices()
    inside = len(os.sched_getaffinity(0))
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
masks = {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print(inside, names.count("tf_XLAEigen"), masks == {frozenset(before)})
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**env(), "JAX_PLATFORMS": "cpu"}, check=True,
    )  # fmt: skip
    assert result.stdout.split() == ["1", "1", "True"]


def peer_payload():
    runs = {"torch-allreduce": [2.0, 4.0], "torch-fp16": [1.0, 3.0], "torch-powersgd": [0.5, 1.0]}
    results = {
        label: {"runs": r, "bytes": 100.0, "buckets": 1, "warmup_steps": 3, "params": 25}
        for label, r in runs.items()
    }
    devices = {"platform": "cpu", "device_kind": "cpu", "device_count": 2, "process_count": 2}
    return {"results": results, "devices": devices, "torch": "2.x", "threads": [1, 1]}


def test_peer_records_are_marked_and_relative_to_torchs_allreduce():
    jax_cell = {"allreduce": {"runs": [1.0, 1.0], "bytes": 100.0, "cycle": 1, "params": 25}}
    records = netreport.records_of(jax_cell, 2, "100mbit", [95.0], False, {}, "retain", 1)
    records += netreport.peer_records_of(peer_payload(), 2, "100mbit", [95.0], "retain", 1)
    assert [r["framework"] for r in records] == ["jax", "torch", "torch", "torch"]
    assert all(r["threads"] == 1 for r in records)
    by = {r["label"]: r for r in records}
    fp16, powersgd = by["torch-fp16"], by["torch-powersgd"]
    assert fp16["ratio_runs"] == [0.5, 0.75] and fp16["ratio_vs_allreduce"] == 0.625
    assert fp16["allreduce_step_s"] == 3.0 and fp16["baseline"] == "torch-allreduce"
    assert fp16["hook"] == "default_hooks.fp16_compress_hook" and fp16["torch_threads"] == [1, 1]
    assert powersgd["hook_options"] == {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}
    assert powersgd["bucket_cap_mb"] == 64 and powersgd["buckets"] == 1
    text = netreport.table(records, ["100mbit"])
    assert "| allreduce | 1.00 (1.000) | 100 |" in text
    assert "| PyTorch DDP: allreduce (no hook) | 1.00 (3.000) | 100 |" in text
    assert "| PyTorch DDP: fp16_compress_hook | 0.62 (2.000) | 100 |" in text
    assert "| PyTorch DDP: powerSGD_hook, rank 2 | 0.25 (0.750) | 100 |" in text
    assert "relative to PyTorch's own allreduce" in text
    assert "Compute threads per process: 1" in text


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_peer_results(results, params):
    assert set(results) == set(peerworker.VARIANTS)
    for res in results.values():
        assert res["buckets"] == 1 and res["params"] == params
        assert all(t > 0 for t in res["runs"])
    # 2 processes: an all-reduce of S bytes sends S per process (2 (n-1)/n S).
    assert results["torch-allreduce"]["bytes"] == 4 * params
    assert results["torch-fp16"]["bytes"] == 2 * params
    assert 0 < results["torch-powersgd"]["bytes"] < params / 2
    assert results["torch-powersgd"]["warmup_steps"] == 5


@needs_torch
@pytest.mark.skipif(PROBLEM is None, reason="the end-to-end run below covers the peer worker")
def test_peer_workers_on_loopback():
    config = {"nodes": 2, "rate": "loopback", "params": 2e4, "steps": 2, "runs": 2, "threads": 1}
    peer_env = {**env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
    worker = ["-m", bench_network.PEER_WORKER]
    procs = []
    for i in range(2):
        argv = [sys.executable, *worker, json.dumps({**config, "process": i})]
        procs.append(
            subprocess.Popen(
                argv, env=peer_env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        )
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
    payload = json.loads(line[len("RESULT ") :])
    assert payload["threads"] == [1, 1]
    results = payload["results"]
    check_peer_results(results, results["torch-allreduce"]["params"])
    assert all(len(r["runs"]) == 2 for r in results.values())


@needs_torch
@pytest.mark.skipif(PROBLEM is not None, reason=f"bench_network {PROBLEM}")
@pytest.mark.slow
def test_tiny_run_with_peer_rows(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--nodes", "2", "--rates", "unshaped", "--methods",
         "allreduce", "--peer", "--threads", "1", "--params", "2e4", "--steps", "2",
         "--runs", "1", "--out", str(tmp_path), "--quiet"],
        capture_output=True, text=True, timeout=300, env=env(), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads((tmp_path / "network.json").read_text())
    by = {r["label"]: r for r in records}
    assert set(by) == {"allreduce", *peerworker.VARIANTS}
    assert by["allreduce"]["framework"] == "jax" and by["allreduce"]["threads"] == 1
    peers = {label: by[label] for label in peerworker.VARIANTS}
    results = {label: {"bytes": r["bytes_per_step"], "buckets": r["buckets"], "params":
                       r["params"], "runs": r["step_s_runs"], "warmup_steps":
                       r["warmup_steps"]} for label, r in peers.items()}  # fmt: skip
    check_peer_results(results, by["allreduce"]["params"])
    assert peers["torch-allreduce"]["ratio_vs_allreduce"] == 1.0
    for r in peers.values():
        assert r["framework"] == "torch" and r["threads"] == 1 and r["torch_threads"] == [1, 1]
        prov = r["provenance"]
        assert set(provenance.KEYS) <= set(prov) and prov["torch"]
        assert (prov["platform"], prov["device_count"], prov["process_count"]) == ("cpu", 2, 2)
    text = (tmp_path / "network.md").read_text()
    assert "| PyTorch DDP: powerSGD_hook, rank 2 |" in text and "Compute threads per" in text
