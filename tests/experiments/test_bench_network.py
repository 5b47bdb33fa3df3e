"""The network benchmark: its refusal without root, its cleanup, and a tiny shaped run.

Tests that make namespaces need root with CAP_NET_ADMIN (and iproute2); elsewhere they
skip with the reason `gradcomm_experiments.network.cluster.root_problem` gives.
"""

import itertools
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_experiments import import_script

from gradcomm import parallel, wire
from gradcomm_experiments import methods, provenance
from gradcomm_experiments.network import cluster as netcluster
from gradcomm_experiments.network import mesh as netmesh
from gradcomm_experiments.network import report as netreport
from gradcomm_experiments.network import utilization as netutil
from gradcomm_experiments.network import worker as networker

ROOT = pathlib.Path(__file__).resolve().parents[2]
bench_network = import_script("bench_network.py")

SCRIPT = ROOT / "experiments" / "network" / "bench_network.py"
PROBLEM = netcluster.root_problem(probe=True)
needs_root = pytest.mark.skipif(PROBLEM is not None, reason=f"bench_network {PROBLEM}")


def namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def env():
    drop = ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")
    return {k: v for k, v in os.environ.items() if k not in drop}


def test_refuses_without_root(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as exit_info:
        bench_network.main(["--nodes", "2", "--out", str(tmp_path)])
    message = str(exit_info.value.code)
    assert message.startswith("bench_network: needs root") and "\n" not in message
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root")
def test_refuses_without_root_as_a_process():
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    readable = subprocess.run([*nobody, "test", "-r", str(SCRIPT)], check=False, timeout=30)
    if readable.returncode:  # a checkout in a private (0700) directory, such as mktemp -d's
        pytest.skip(f"uid 65534 cannot read {SCRIPT}: its directory is private")
    result = subprocess.run(
        [*nobody, sys.executable,
         str(SCRIPT), "--nodes", "2", "--out", "/tmp/never-written"],
        capture_output=True, text=True, timeout=120, env=env(), check=False,
    )  # fmt: skip
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_network: needs root"), lines


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rates", "100mb"], "bad rate '100mb'"),
        (["--methods", "nope"], "unknown method(s): nope; choose from allreduce"),
        (["--nodes", "1"], "every node count must be at least 2"),
        (["--threads", "0"], "--threads must be between 1 and the"),
        (["--threads", str(len(os.sched_getaffinity(0)) + 1)], "--threads must be between"),
        (["--patterns", "--peer"], "--peer times training steps"),
        (["--mesh", "tp,nope"], "--mesh: unknown mesh(es) nope; choose from flat, tp, fsdp"),
        (["--mesh", "fsdp", "--nodes", "2,3"], "node counts [3] do not divide them"),
        (["--mesh", "tp", "--patterns"], "--patterns times raw collectives on the flat mesh"),
        (["--mesh", "tp", "--peer"], "--peer runs beside the flat rows"),
        (["--utilization", "--patterns"], "--utilization runs its own rows on the flat mesh"),
        (["--utilization", "--variants", "diloco,nope"], "unknown: nope"),
        (["--variants", "diloco"], "--variants goes with --utilization"),
    ],
)
def test_bad_arguments_exit_with_a_message(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_network.parse_args(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_network.parse_args(["--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    assert "(default: 2,4)" in shown and "unshaped,1gbit,100mbit" in shown
    assert "--mesh MESH" in shown and "(default: flat)" in " ".join(shown.split())


def test_help_states_the_model_size_and_the_duration_readably(capsys):
    with pytest.raises(SystemExit):
        bench_network.parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: 4M)" in shown and "4000000" not in shown
    assert "the default grid: ~45 min" in shown and "depends on its grid" in shown
    assert "19.4 min" in shown  # the measured basis of the estimate
    assert bench_network.parse_args(["--nodes", "2"]).params == 4e6
    for text, count in (("4M", 4e6), ("250k", 2.5e5), ("2e4", 2e4), ("4000000", 4e6)):
        assert bench_network.parameter_count(text) == count


# The script run as `python SCRIPT ARGS...` where `import matplotlib` fails, as it does
# without the experiments extra (None in sys.modules: the import raises ModuleNotFoundError).
WITHOUT_MATPLOTLIB = """
import runpy, sys
sys.modules["matplotlib"] = None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_without_matplotlib_exits_before_any_work(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_MATPLOTLIB, str(SCRIPT), "--nodes", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=60, env=env(), check=False,
    )  # fmt: skip
    assert time.monotonic() - start < 10
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_network: network.png needs matplotlib")
    assert 'install the experiments extra: pip install -e ".[experiments]"' in lines[0]
    assert not result.stdout and not out.exists()


def test_plot_check_in_process(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit_info:
        bench_network.parse_args(["--nodes", "2"])
    assert exit_info.value.code == 2 and ".[experiments]" in capsys.readouterr().err
    assert bench_network.parse_args(["--patterns"]).patterns  # draws no plot: no check


def test_plot_draws_every_method_in_its_style(tmp_path):
    # The committed records, redrawn: one line per method and node count, registry styles.
    records = json.loads((ROOT / "docs" / "bench" / "quick" / "network.json").read_text())
    netreport.plot(records, tmp_path / "network.png")
    assert (tmp_path / "network.png").read_bytes()[:4] == b"\x89PNG"


def test_rates_and_model_sizes():
    assert netcluster.parse_rate("100mbit") == 100
    assert netcluster.parse_rate("1gbit") == 1000
    assert netcluster.parse_rate("unshaped") is None
    with pytest.raises(ValueError, match="bad rate"):
        netcluster.parse_rate("fast")
    widths = networker.mlp_widths(4e6)
    count = sum(a * b + b for a, b in itertools.pairwise(widths))
    assert abs(count - 4e6) / 4e6 < 0.002


def test_cycles_cover_every_period():
    by = {label: networker.spec_of(label) for label in methods.NETWORK}
    assert networker.cycle(by["allreduce"], 4) == 1
    assert networker.cycle(by["local-sgd"], 4) == 20
    assert networker.cycle(by["dropping-local"], 2) == 50
    assert networker.cycle(by["sgp"], 2) == 1
    assert networker.cycle(by["sgp"], 4) == 2
    assert networker.cycle(by["osgp"], 8) == 3
    assert networker.cycle(by["dpsgd"], 4) == 2


def test_records_name_methods_as_the_registry_does():
    # The rows are the registry's, timed in the steady state (no drop-ratio warm-up); a
    # record carries the registry's method, options and sync, which the model reads.
    assert bench_network.parse_args([]).labels == list(methods.NETWORK)
    assert networker.spec_of("dropping").options == {"warmup_steps": 0}
    result = {"runs": [1.0, 2.0], "bytes": 10.0, "cycle": 50, "params": 100}
    cell = {"allreduce": result, "dropping-local": result}
    records = netreport.records_of(cell, 2, "100mbit", [95.0], False, {})
    local = next(r for r in records if r["label"] == "dropping-local")
    assert local["method"] == "gradient_dropping"
    assert local["options"] == {"local": "compensated", "warmup_steps": 0}
    assert local["sync"] == {"name": "periodic_average", "every": 50}
    assert local["ratio_vs_allreduce"] == 1.0 and local["timing"] == "cycle-mean"


@needs_root
def test_cluster_removes_only_what_it_made():
    decoy = f"gcdecoy{os.getpid()}"
    subprocess.run(["ip", "netns", "add", decoy], check=True)
    try:
        before = namespaces()
        with pytest.raises(RuntimeError, match="boom"):
            with netcluster.Cluster(2, "100mbit") as cluster:
                made = set(cluster.namespaces) | {cluster.bridge_ns}
                assert made <= namespaces()
                assert all(
                    (netcluster.NETNS_ETC / ns / "hosts").exists() for ns in cluster.namespaces
                )
                qdisc = cluster.run(0, ["tc", "qdisc", "show", "dev", "veth0"],
                                    capture_output=True, text=True, check=True)  # fmt: skip
                assert "tbf" in qdisc.stdout and "100Mbit" in qdisc.stdout
                raise RuntimeError("boom")
        assert namespaces() == before and decoy in namespaces()
        assert not any((netcluster.NETNS_ETC / ns).exists() for ns in made)
    finally:
        subprocess.run(["ip", "netns", "del", decoy], check=False)


@needs_root
def test_shaping_is_measured():
    with netcluster.Cluster(2, "100mbit") as cluster:
        links = cluster.measure_links(seconds=0.5)
    assert len(links) == 2
    assert all(85 <= m <= 105 for m in links), links


@needs_root
def test_ctrl_c_cleans_up(tmp_path):
    before = namespaces()
    # A shell's background job inherits SIGINT ignored, and so would the script. A handled
    # signal becomes the default across exec, where Python turns it into KeyboardInterrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--nodes", "2", "--rates", "100mbit", "--methods",
             "allreduce", "--params", "2e4", "--steps", "500", "--shaped-runs", "5",
             "--out", str(tmp_path)],
            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    prefix = f"gc{proc.pid % 100000}-"
    deadline = time.time() + 60
    while time.time() < deadline and not any(n.startswith(prefix) for n in namespaces()):
        time.sleep(0.2)
    assert any(n.startswith(prefix) for n in namespaces()), "the run made no namespace"
    time.sleep(3)  # let the workers start
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not any(n.startswith(prefix) for n in namespaces())
    assert namespaces() == before


@needs_root
@pytest.mark.slow
def test_tiny_run_writes_records(tmp_path):
    # One shaped cell, two rows: a step's median (allreduce) and a cycle's mean (local-sgd,
    # which also carries options); each compiled method costs seconds. An unshaped cell:
    # test_tiny_mesh_run_records_the_mesh; a grid of rates and meshes, each cell's bytes
    # measured once: test_main_runs_every_cell_of_the_grid.
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--nodes", "2", "--rates", "100mbit",
         "--methods", "allreduce,local-sgd", "--params", "2e4", "--steps", "3",
         "--runs", "3", "--shaped-runs", "2", "--out", str(tmp_path), "--quiet"],
        capture_output=True, text=True, timeout=600, env=env(), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads((tmp_path / "network.json").read_text())
    assert {(r["label"], r["rate"]) for r in records} == {
        ("allreduce", "100mbit"), ("local-sgd", "100mbit"),
    }  # fmt: skip
    keys = {"method", "options", "nodes", "rate", "step_s", "ratio_vs_allreduce",
            "bytes_per_step", "link_mbit_measured"}  # fmt: skip
    for r in records:
        assert keys <= set(r)
        assert r["step_s"] > 0 and r["bytes_per_step"] > 0
        assert len(r["step_s_runs"]) == 2  # a shaped cell: --shaped-runs, not --runs
        assert abs(r["link_mbit_measured"] - 100) <= 10
        if r["method"] == "allreduce":
            assert r["ratio_vs_allreduce"] == 1.0
            assert r["timing"] == "median" and r["cycle"] == 1
    local = next(r for r in records if r["label"] == "local-sgd")
    assert local["method"] == "local_sgd" and local["options"] == {"every": 20}
    # Its peak step sends the whole model; on average, a twentieth of it.
    assert local["peak_bytes_per_step"] > 10 * local["bytes_per_step"]
    assert local["timing"] == "cycle-mean" and local["cycle"] == 20
    assert (tmp_path / "network.png").stat().st_size > 0
    assert "netem" in (tmp_path / "network.md").read_text()
    for r in records:  # each record's cell: 2 hosts, one CPU device each
        prov = r["provenance"]
        assert set(provenance.KEYS) <= set(prov) and prov["seeds"] == [0]
        assert (prov["platform"], prov["device_count"], prov["process_count"]) == ("cpu", 2, 2)
        assert prov["command"][0].endswith("bench_network.py") and prov["wall_seconds"] > 0


# ------------------------------------------------------------------------------------------
# 2-D meshes (`--mesh tp`, `--mesh fsdp`, `network/mesh.py`): data across hosts, model inside.


def test_mesh_plan_keeps_the_rows_each_mesh_can_run(capsys):
    args = bench_network.parse_args(
        ["--mesh", "tp,flat,fsdp,tp", "--methods", "powersgd,adasum-hierarchical,diloco"]
    )
    assert args.mesh_list == ["tp", "flat", "fsdp"]
    plan = netmesh.plan(args.mesh_list, args.labels)
    assert plan == [
        ("tp", ["allreduce", "powersgd", "diloco"], False),
        ("flat", ["allreduce", "powersgd", "diloco"], False),
        ("flat", ["allreduce", "adasum-hierarchical"], True),
        ("fsdp", ["allreduce"], False),  # the FSDP rows are netmesh.FSDP's
    ]
    out = capsys.readouterr().out
    assert "--mesh tp: no rows for adasum-hierarchical" in out
    assert "--mesh fsdp: no rows for powersgd, adasum-hierarchical, diloco" in out


def test_mesh_model_is_the_flat_mlp_split_over_the_model_axis():
    from jax.sharding import PartitionSpec as P

    widths = netmesh.widths(4e6)
    assert widths[1] % netmesh.HIDDEN_MULTIPLE == 0
    count = sum(a * b + b for a, b in itertools.pairwise(widths))
    assert abs(count - 4e6) / 4e6 < 0.03
    tp = netmesh.param_specs(("data0",), fsdp=False)
    assert tp["w0"] == P(None, "model") and tp["w1"] == P(None, "model") and tp["w2"] == P()
    fsdp = netmesh.param_specs(("data0", "data1"), fsdp=True)
    assert fsdp["w0"] == P(("data0", "data1"), "model") and fsdp["w2"] == P(("data0", "data1"))
    # The same arrays as the flat rows' MLP, the middle kernel stored transposed.
    params, _, data = netmesh.task((16, 8, 8, 3), 4)
    flat, flat_data = networker.mlp_init((16, 8, 8, 3), 4)
    assert (params["w1"] == flat["w1"].T).all() and (data["x"] == flat_data["x"]).all()


MESH_RESULT = {
    "results": {
        "allreduce": {"runs": [2.0, 4.0], "cycle": 1, "params": 100, "bytes": 50.0,
                      "link_bytes": 40.0, "bytes_by_axes": {"data0": 40.0, "model": 10.0}},
        "powersgd": {"runs": [1.0, 1.0], "cycle": 1, "params": 100, "bytes": 15.0,
                     "link_bytes": 5.0, "bytes_by_axes": {"data0": 5.0, "model": 10.0}},
    },
    "mesh": {"name": "tp", "axes": {"data0": 2, "model": 2}, "data_axes": ["data0"],
             "param_specs": {"w0": "P(None, 'model')"}, "batch": 64},
}  # fmt: skip


def test_mesh_records_and_table():
    known = {}
    records = netreport.records_of(
        MESH_RESULT["results"], 2, "100mbit", [95.0], False, known, mesh=MESH_RESULT["mesh"]
    )
    power = next(r for r in records if r["label"] == "powersgd")
    assert power["mesh"] == "tp" and power["mesh_axes"] == {"data0": 2, "model": 2}
    assert power["devices_per_process"] == 2 and power["baseline"] == "allreduce"
    assert power["ratio_runs"] == [0.5, 0.25] and power["ratio_vs_allreduce"] == 0.375
    assert power["link_bytes_per_step"] == 5.0 and power["bytes_per_step"] == 15.0
    assert power["options"] == {"rank": 2}  # the registry's, without the specs it was given
    assert known[("tp", 2, "powersgd")]["bytes_by_axes"] == {"data0": 5.0, "model": 10.0}
    flat = netreport.records_of(MESH_RESULT["results"], 2, "100mbit", [95.0], False, known)
    assert {r["mesh"] for r in flat} == {"flat"} and "mesh_axes" not in flat[0]
    text = netreport.table(flat + records, ["100mbit"])
    assert "**N = 2**\n" in text and "**N = 2, mesh tp** (data0 2 x model 2;" in text
    assert "| powersgd | 0.38 (1.000) | 5 | 10 |" in text
    assert "| powersgd | 0.38 (1.000) | 15 |" in text  # the flat section: all bytes


GRID_LABELS = ["allreduce", "local-sgd", "terngrad", "adasum-hierarchical"]


def test_main_runs_every_cell_of_the_grid(monkeypatch, tmp_path):
    """`main` over node counts, rates and meshes, each cell's workers stood in for
    (`run_cell`; real ones run in the tiny runs): one worker run per cell and
    row group, bytes measured in the first cell of each mesh and node count only, and
    every record of that mesh and node count given those bytes, not another mesh's."""
    calls = []

    def sent(mesh, nodes, label):  # distinct bytes per mesh, node count and row
        return 1e3 * netmesh.MESHES.index(mesh) + 1e2 * nodes + GRID_LABELS.index(label)

    def run_cell(nodes, rate, args, *, peer=False, **config):
        mesh, labels = config.get("mesh", "flat"), config["labels"]
        measure = config["measure_bytes"]
        calls.append((nodes, rate, mesh, labels, config["local"], measure))
        results = {}
        for label in labels:
            nbytes = sent(mesh, nodes, label) if measure else None
            every = networker.cycle(networker.spec_of(label), nodes)
            results[label] = {"runs": [1.0], "bytes": nbytes, "params": 100, "probe": None,
                              "cycle": every}  # fmt: skip
            if mesh != "flat":  # what `network.mesh.worker` sends: None where not measured
                results[label].update(
                    link_bytes=nbytes and nbytes / 2,
                    bytes_by_axes=nbytes and {"data": nbytes / 2, "model": nbytes / 2},
                )
        devices = {"platform": "cpu", "device_count": nodes, "process_count": nodes}
        payload = {"results": results, "devices": devices}
        if mesh != "flat":
            axes = {"data": nodes, "model": 2}
            payload["mesh"] = {"name": mesh, "axes": axes, "data_axes": ["data"],
                               "param_specs": {}, "batch": 32 * nodes}  # fmt: skip
        return payload, [95.0] * nodes if rate == "100mbit" else [], None

    drawn = []
    monkeypatch.setattr(bench_network, "run_cell", run_cell)
    monkeypatch.setattr(bench_network, "plot_problem", lambda: None)
    monkeypatch.setattr(netcluster, "root_problem", lambda: None)
    monkeypatch.setattr(netreport, "plot", lambda records, path: drawn.append(path))
    monkeypatch.setattr(provenance, "software", dict)  # no git per record
    args = ["--nodes", "2,4", "--rates", "100mbit,unshaped", "--mesh", "flat,tp,fsdp",
            "--methods", ",".join(GRID_LABELS[1:]), "--out", str(tmp_path), "--quiet"]  # fmt: skip
    records = bench_network.main(args)
    groups = [
        ("flat", GRID_LABELS[:3], False),
        ("flat", ["allreduce", "adasum-hierarchical"], True),  # 2 devices per host
        ("tp", GRID_LABELS[:3], False),  # no hierarchical rows on a 2-D mesh
        ("fsdp", ["allreduce", "terngrad"], False),  # netmesh.FSDP's rows
    ]
    assert calls == [
        (nodes, rate, mesh, labels, local, rate == "100mbit")
        for nodes in (2, 4) for rate in ("100mbit", "unshaped") for mesh, labels, local in groups
    ]  # fmt: skip
    rows = {(mesh, label) for mesh, labels, _ in groups for label in labels}
    assert sorted((r["nodes"], r["rate"], r["mesh"], r["label"]) for r in records) == sorted(
        (nodes, rate, *row) for nodes in (2, 4) for rate in ("100mbit", "unshaped") for row in rows
    )  # fmt: skip
    for r in records:
        assert r["bytes_per_step"] == sent(r["mesh"], r["nodes"], r["label"])
        if r["mesh"] != "flat":
            assert r["link_bytes_per_step"] == r["bytes_per_step"] / 2
            assert r["mesh_axes"] == {"data": r["nodes"], "model": 2}
    assert json.loads((tmp_path / "network.json").read_text()) == records
    assert drawn == [tmp_path / "network.png"]
    text = (tmp_path / "network.md").read_text()
    for nodes in (2, 4):
        assert f"**N = {nodes}**" in text and f"**N = {nodes}, mesh tp**" in text
        assert f"**N = {nodes}, mesh fsdp**" in text
    assert "allreduce (psum_scatter)" in text and "netem" in text


def _mesh_workers(mesh, labels, port):
    procs = []
    for i in range(2):
        config = {"coordinator": f"127.0.0.1:{port}", "nodes": 2, "process": i,
                  "rate": "unshaped", "params": 2e4, "steps": 2, "runs": 1, "threads": None,
                  "labels": labels, "local": False, "measure_bytes": True,
                  "mesh": mesh}  # fmt: skip
        argv = [sys.executable, "-m", bench_network.WORKER, json.dumps(config)]
        out = subprocess.PIPE
        worker_env = {**env(), "JAX_PLATFORMS": "cpu"}
        procs.append(subprocess.Popen(argv, env=worker_env, stdout=out, text=True))
    return bench_network._results(procs, 600, f"--mesh {mesh} on 127.0.0.1")


@pytest.mark.slow
def test_mesh_workers_on_loopback():
    """Two worker processes on 127.0.0.1 (no namespaces, no root), 2 CPU devices each:
    gloo collectives over the data axis across the processes, the model axis inside."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    labels = ["allreduce", "powersgd", "diloco", "dpsgd"]
    payload = _mesh_workers("tp", labels, port)
    assert payload["devices"]["device_count"] == 4 and payload["devices"]["process_count"] == 2
    mesh = payload["mesh"]
    assert mesh["name"] == "tp" and mesh["axes"] == {"data": 2, "model": 2}
    assert mesh["param_specs"]["w1"] == "P(None, 'model')" and mesh["batch"] == 64
    results = payload["results"]
    assert set(results) == set(labels)
    assert results["diloco"]["cycle"] == 20 and len(results["diloco"]["runs"]) == 1
    for res in results.values():
        # The model axis's psums stay inside a process; the data axis's cross the link.
        assert res["bytes_by_axes"]["model"] > 0 and res["link_bytes"] > 0
    assert results["powersgd"]["link_bytes"] < results["allreduce"]["link_bytes"] / 5
    # D-PSGD's step timed its "auto" swaps both ways on its first call and kept the
    # faster (`TrainStep.probe`); the others have no swap to choose. (Adasum's step,
    # whose compilation here costs the most, probes across processes in
    # tests/suites/test_multiprocess.py, and in tests/library/test_calibrate.py.)
    probe = results["dpsgd"]["probe"]
    assert probe["exchange"] in ("permute", "pairwise") and probe["permute_s"] > 0
    assert all(results[m]["probe"] is None for m in labels if m != "dpsgd")
    records = netreport.records_of(results, 2, "unshaped", [], False, {}, mesh=mesh)
    assert {r["mesh"] for r in records} == {"tp"}
    assert {r["label"]: r["exchange"] for r in records} == {
        "allreduce": None,
        "powersgd": None,
        "diloco": None,
        "dpsgd": probe["exchange"],
    }


@needs_root
@pytest.mark.slow
def test_tiny_mesh_run_records_the_mesh(tmp_path):
    # The FSDP mesh, whose rows reduce-scatter, in an unshaped cell: allreduce's plain
    # psum_scatter and fp16's 16-bit one (TernGrad's FSDP form, which takes far longer to
    # compile, runs in tests/methods/test_terngrad.py). The tp mesh's workers run in
    # test_mesh_workers_on_loopback, and a grid of both (and the flat one) in
    # test_main_runs_every_cell_of_the_grid; each compiled method costs seconds.
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--mesh", "fsdp", "--nodes", "2", "--rates",
         "unshaped", "--methods", "allreduce,fp16", "--params", "2e4", "--steps", "2",
         "--runs", "2", "--out", str(tmp_path), "--quiet"],
        capture_output=True, text=True, timeout=600, env=env(), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads((tmp_path / "network.json").read_text())
    assert {(r["label"], r["mesh"], r["method"]) for r in records} == {
        ("allreduce", "fsdp", "allreduce"), ("fp16", "fsdp", "low_precision"),
    }  # fmt: skip
    for r in records:
        assert r["mesh_axes"] == {"data": 2, "model": 2} and r["devices_per_process"] == 2
        assert r["rate"] == "unshaped" and len(r["step_s_runs"]) == 2  # --runs
        assert r["link_mbit_measured"] > 0  # the veth links, unshaped
        assert r["probe"] is None and r["exchange"] is None  # no swap to choose
        assert r["bytes_per_step"] > r["link_bytes_per_step"] > 0
        assert (r["provenance"]["device_count"], r["provenance"]["process_count"]) == (4, 2)
        assert r["param_specs"]["w0"] == "P('data', 'model')"
        assert r["baseline"] == "allreduce (psum_scatter)"
    text = (tmp_path / "network.md").read_text()
    assert "mesh fsdp" in text and "allreduce (psum_scatter)" in text


# ------------------------------------------------------------------------------------------
# Whole cycles and steady states (Streaming DiLoCo, 1-bit Adam), peak bytes, utilization.


def test_onebit_adam_is_timed_past_its_warmup():
    spec = networker.spec_of("onebit-adam")
    assert spec.options == {"warmup_steps": networker.ONEBIT_WARMUP}
    assert networker.warmup_of(spec) == networker.ONEBIT_WARMUP
    assert networker.warmup_of(networker.spec_of("dropping")) == 0
    assert networker.cycle(networker.spec_of("streaming-diloco"), 4) == 20
    calls = []

    def step(params, count, batch):
        calls.append(count)
        return params, count + 1, {"loss": jnp.zeros(())}

    def warm(every, warmup):
        calls.clear()
        return networker.warm_up("x", step, jnp.zeros(()), 0, None, every, print, warmup)

    run = warm(1, networker.ONEBIT_WARMUP)  # the phase's steps, then two steady ones, untimed
    assert calls == list(range(networker.ONEBIT_WARMUP + 2)) and run["warmup_step_s"] > 0
    run = warm(20, 0)  # a whole cycle and one step
    assert len(calls) == 21 and run["warmup_step_s"] is None and run["cycle"] == 20


def test_peak_bytes_leave_out_warmups_and_count_periodic_syncs():
    def collective(sent):
        return wire.Collective("all-reduce", "c", "main", sent, 2, 1, sent)

    def conditional(computation, *branches):
        return wire.Conditional("cond", computation, 1, True, tuple(branches))

    warm = wire.Branch("warm-up all-reduce", "warm", None, 4, 1000.0)
    nested = conditional("warm", wire.Branch("a", "a", None, None, 600.0))  # counted in warm
    onebit = wire.WireReport(
        (collective(8.0), collective(1000.0)), steady=58.0, average=58.0,
        conditionals=(conditional("main", warm, wire.Branch("1-bit", "s", None, None, 50.0)),
                      nested),
    )  # fmt: skip
    assert onebit.total == 1008 and networker.peak_after_warmup(onebit) == 58
    sync = wire.Branch("average", "y", 20, None, 300.0)
    periodic = wire.WireReport(
        (collective(8.0), collective(300.0)), steady=8.0, average=23.0, period=20,
        conditionals=(conditional("main", sync, wire.Branch("otherwise", "z", None, None, 0.0)),),
    )  # fmt: skip
    assert networker.peak_after_warmup(periodic) == 308


def test_records_and_table_carry_peak_bytes_where_measured():
    result = {"runs": [1.0], "bytes": 10.0, "cycle": 20, "params": 100, "peak_bytes": 200.0}
    cell = {"allreduce": {**result, "cycle": 1, "peak_bytes": 10.0}, "streaming-diloco": result}
    records = netreport.records_of(cell, 4, "100mbit", [95.0], False, {})
    assert [r["peak_bytes_per_step"] for r in records] == [10.0, 200.0]
    assert "| streaming-diloco | 1.00 (1.000) | 10 | 200 |" in netreport.table(records, ["100mbit"])
    old = [{**r, "peak_bytes_per_step": None} for r in records]  # records from before
    assert "peak" not in netreport.table(old, ["100mbit"])


def test_utilization_figures_and_training_alone_sends_nothing():
    def record(label, rate, step, phases=(1.0,)):
        spec = netutil.VARIANTS.get(label)
        described = spec.describe() if spec else {"method": None, "options": {}, "label": label}
        return {**described, "nodes": 4, "rate": rate, "step_s": step, "phase_s": list(phases)}

    phases = [0.1] * 18 + [0.3, 0.5]  # two syncing steps of 20
    records = [
        record(netutil.ALONE, "unshaped", 0.09),
        record(netutil.ALONE, "100mbit", 0.1),
        record("streaming-diloco-d0", "100mbit", 0.2, phases),
        record("streaming-diloco", "100mbit", 0.125, phases),
    ]
    figs = netutil.figures(records)
    by = {u["label"]: u for u in figs["utilization"]}
    assert by["streaming-diloco"]["utilization"] == pytest.approx(0.09 / 0.125)
    assert by["streaming-diloco"]["utilization_same_cell"] == pytest.approx(0.8)
    assert by["streaming-diloco"]["sync_step_extra_s"] == pytest.approx(0.3)
    (pair,) = figs["overlap"]
    assert pair["hidden_share"] == pytest.approx(0.75)  # 0.075 of the 0.1 s sync cost
    assert "| 4 | 100mbit | streaming-diloco | 0.1250 | 72.0% | 80.0% |" in netutil.markdown(
        figs, "cmd", 1.0
    )
    # Training alone: the MLP's step and Adam on each device's own params, no collective.
    mesh = parallel.make_mesh(devices=jax.devices()[:2])
    params, loss_fn, data = networker.mlp_task((8, 4, 4, 2), 4)
    init, step = netutil.alone_step(loss_fn, optax.adam(0.1), mesh)
    placed = parallel.per_device(params, mesh)
    state, batch = init(placed), parallel.shard_batch(data, mesh)
    assert wire.measure(step, placed, state, batch).total == 0
    first = step(placed, state, batch)[2]["loss"]
    first = np.asarray(first)
    assert first.shape == (2,) and not np.allclose(first[0], first[1])  # each its own half


def test_straggling_is_the_slowest_hosts_lead_between_syncs():
    # Two hosts, a cycle of 4 with its syncing step at phase 3; the run starts at phase 1.
    hosts = np.array([
        [1.0, 1.0, 5.0, 1.0, 1.0, 1.0, 5.0, 1.0],
        [2.0, 2.0, 4.0, 1.0, 3.0, 1.0, 4.0, 9.0],
    ])  # fmt: skip
    # Syncs at steps 2 and 6; the one window between them, steps 3-5: 3 s and 5 s, the
    # slowest 1 s above the mean, over the 4 steps from the first sync to the last.
    assert netutil.straggling(hosts, 1, 4, [3]) == pytest.approx(0.25)
    assert netutil.straggling(hosts, 1, 4, []) == 0.0  # no sync: nothing to wait for
    assert netutil.straggling(hosts[:, :4], 1, 4, [3]) == 0.0  # one sync: no whole window


def test_utilization_runs_the_baselines_unshaped_and_the_variants_shaped(monkeypatch, tmp_path):
    calls = []

    def run_cell(nodes, rate, args, **config):
        calls.append((nodes, rate, config["mode"], config["labels"]))
        results = {
            label: {"runs": [1.0], "cycle": 1, "bytes": 0.0, "peak_bytes": 0.0, "phase_s": [1.0]}
            for label in config["labels"]
        }
        devices = {"platform": "cpu", "device_count": nodes, "process_count": nodes}
        return {"results": results, "devices": devices}, [95.0] * nodes, None

    monkeypatch.setattr(bench_network, "run_cell", run_cell)
    monkeypatch.setattr(netcluster, "root_problem", lambda: None)
    monkeypatch.setattr(provenance, "software", dict)  # no git per record
    args = ["--utilization", "--nodes", "4", "--rates", "unshaped,100mbit", "--out", str(tmp_path)]
    (done,) = bench_network.main(args)
    assert calls == [
        (4, "unshaped", "utilization", list(netutil.BASELINES)),
        (4, "100mbit", "utilization", [*netutil.BASELINES, *netutil.VARIANTS]),
    ]
    assert json.loads((tmp_path / "utilization.json").read_text()) == done
    assert all(r["provenance"]["devices"]["device_count"] == 4 for r in done["records"])
    assert len(done["utilization"]) == len(netutil.VARIANTS)
    assert "--utilization" in (tmp_path / "utilization.md").read_text()
    calls.clear()
    bench_network.main([*args, "--rates", "100mbit", "--variants", "diloco,local-sgd"])
    assert calls == [(4, "100mbit", "utilization", [*netutil.BASELINES, "diloco", "local-sgd"])]
