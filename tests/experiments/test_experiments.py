"""The experiment scripts run end to end (tiny settings) and write what they promise."""

import argparse
import atexit
import datetime
import functools
import importlib.util
import io
import json
import os
import pathlib
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid

import numpy as np
import pytest
from helpers import result_records

from gradcomm_experiments import cli, provenance, report
from gradcomm_experiments import methods as registry

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Each script by its file name: experiments/studies, benchmarks and network.
PATHS = {
    p.name: p
    for folder in ("studies", "benchmarks", "network")
    for p in (ROOT / "experiments" / folder).glob("*.py")
}
SCRIPTS = sorted(PATHS)
# Each study at its smallest: the script runs end to end and writes JSON, PNG and Markdown.
STUDIES = {
    # One N (Adasum and the all-reduce from N = 1: tests/methods/test_adasum.py).
    "adasum_large_batch.py": [
        "--sizes",
        "2",
        "--epochs",
        "1",
        "--seeds",
        "0",
        "--batch-size",
        "32",
        "--probe-every",
        "20",
    ],
    # TernGrad with clipping, the study's subject, and Fig. 2 of the initial model (float
    # momentum SGD and vanilla SGD, and no clipping, are flags of the same calls).
    "terngrad_workers.py": (
        "--sizes 2 --epochs 1 --optimizers momentum --variants terngrad --histogram-epochs 0"
    ).split(),
    # LAGS with its delta(l) probe, and with the eq. 18 plan (dense SGD and SLGS: the study's
    # baselines, gradcomm.allreduce and gradcomm.slgs in the same loop).
    "lags_sparsity.py": [
        "--runs",
        "lags,plan",
        "--densities",
        "0.01",
        "--epochs",
        "1",
        "--batch-size",
        "64",
        "--probe-every",
        "40",
    ],
    # SGP, and the hybrid that switches to it from the all-reduce (2 peers, D-PSGD and the
    # overlaps are other arguments of the same calls: tests/methods/test_gossip.py).
    "sgp_gossip.py": "--epochs 1 --seeds 0 --batch-size 64 --devices 4 --runs sgp,hybrid".split(),
    "local_gradients.py": [
        "--seeds",
        "0",
        "--epochs",
        "1",
        "--train-size",
        "512",
        # Per-device params and a sync on both models, averaged twice in the 16 steps.
        # Gradient dropping's compiled step takes 3 to 6 times as long as this one on them;
        # dropping-local runs in the compare test below.
        "--methods",
        "local-sgd",
        "--local-every",
        "8",
        "--length",
        "6",
    ],
    # Streaming DiLoCo at its center (P = 2, tau = 1, E3M0) beside the all-reduce, H = 4 over
    # the 11 steps (its grid, DiLoCo, eager updates and 1-bit Adam: other --runs of the loop).
    "diloco_family.py": (
        "--seeds 0 --epochs 1 --batch-size 64 --every 4 --runs allreduce,streaming "
        "--fragments 2 --delays 1 --outer-dtypes e3m0"
    ).split(),
}


def script_env():
    """The environment a script runs in: its own device count, and the tests' cheapest XLA:CPU
    codegen (tests/conftest.py: LLVM's optimizations off, and the older fusion emitters where
    this XLA has the flag). These tiny runs spend most of their time compiling (more than
    twice as long without); the HLO passes, and so the collectives gradcomm.wire reads, are
    the same, and so are the results."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    return env | {"XLA_FLAGS": os.environ["GRADCOMM_TEST_EMITTERS"]}


def import_script(script):
    """The script `script` (a file name) as a module named by its stem, imported once."""
    name = script.removesuffix(".py")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PATHS[script])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# The server that starts the scripts: a Python process in `script_env` that has imported
# what they import (about 4 s of CPU a process, half of a tiny run's) and has not started
# JAX's backend. For each script it forks a child, which runs the script from its first
# line as `python script.py args` does (its own sys.argv, sys.path[0] and devices), its
# output to two files; the modules imported are those of the server's start. Requests and
# replies are JSON lines on its stdin and stdout.
SERVER = r"""
import json, os, runpy, signal, sys, time, traceback
import flax.linen, gradcomm, jax, matplotlib.pyplot, optax, tqdm.auto
import sklearn.datasets, sklearn.model_selection

def child(argv, out, err):  # never returns
    written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for path, fd, flags in ((os.devnull, 0, os.O_RDONLY), (out, 1, written), (err, 2, written)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
    try:
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

children, parent = set(), os.getppid()
for line in sys.stdin:
    request = json.loads(line)
    if "argv" in request:
        pid = os.fork()
        if pid == 0:
            try:
                child(request["argv"], request["out"], request["err"])
            finally:
                os._exit(1)
        children.add(pid)
        reply = {"pid": pid}
    else:
        pid, deadline = request["wait"], time.monotonic() + request["timeout"]
        done, status = os.waitpid(pid, os.WNOHANG)
        while not done and time.monotonic() < deadline and os.getppid() == parent:
            time.sleep(0.05)
            done, status = os.waitpid(pid, os.WNOHANG)
        if not done:  # out of time, or the test process is gone
            os.kill(pid, signal.SIGKILL)
            status = os.waitpid(pid, 0)[1]
        children.discard(pid)
        reply = {"returncode": os.waitstatus_to_exitcode(status), "timed_out": not done}
    print(json.dumps(reply), flush=True)
for pid in children:  # started, never waited for: the test process has finished
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
os._exit(0)
"""


@functools.cache
def server():
    """This worker's script server (`SERVER`), started on first use, stopped at exit."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=script_env())  # fmt: skip

    def stop():
        proc.stdin.close()  # the server stops its children, and exits
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    atexit.register(stop)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="scripts-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)

    def ask(request):
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        reply = proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the script server exited with {proc.wait()} (its stderr above)")
        return json.loads(reply)

    return ask, folder


class Script:
    """A script running in a child of the script server; `wait` returns a
    `subprocess.CompletedProcess` (raises `subprocess.TimeoutExpired` after `timeout`)."""

    def __init__(self, script, *args):
        ask, folder = server()
        self.argv = [str(PATHS[script]), *map(str, args)]
        self.out, self.err = (folder / f"{uuid.uuid4().hex}.{e}" for e in ("out", "err"))
        self.pid = ask({"argv": self.argv, "out": str(self.out), "err": str(self.err)})["pid"]

    def wait(self, timeout=300):
        reply = server()[0]({"wait": self.pid, "timeout": timeout})
        out, err = (path.read_text() for path in (self.out, self.err))
        self.out.unlink()
        self.err.unlink()
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(self.argv, timeout, out, err)
        return subprocess.CompletedProcess(self.argv, reply["returncode"], out, err)


def run(script, *args, timeout=300):
    """Runs `script` with `args` to its end (see `Script`)."""
    return Script(script, *args).wait(timeout)


def main_in_process(script, *args, monkeypatch):
    """Runs `script` as __main__ with `args` in this process; returns its exit code."""
    monkeypatch.setattr(sys, "argv", [str(PATHS[script]), *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(PATHS[script]), run_name="__main__")
    return exit_info.value.code


def check_provenance(record, *, devices, seeds, processes=1):
    """A JSON's provenance: every key, and what the run used."""
    assert set(provenance.KEYS) <= set(record), set(provenance.KEYS) - set(record)
    assert record["gradcomm_version"] and record["git_commit"]
    assert record["jax"] and record["python"] and isinstance(record["git_dirty"], bool | None)
    assert record["platform"] == "cpu" and record["device_kind"]
    assert record["device_count"] == devices and record["process_count"] == processes
    assert record["seeds"] == seeds and record["command"][0].endswith(".py")
    assert datetime.datetime.fromisoformat(record["started_utc"]).tzinfo is not None
    assert record["wall_seconds"] > 0


# --help runs in this process: parsing exits before any device is touched (a subprocess
# per script cost a JAX import each; the script runs below run them as programs).
@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_defaults(script, monkeypatch, capsys):
    assert main_in_process(script, "--help", monkeypatch=monkeypatch) == 0
    shown = capsys.readouterr().out
    assert "--out" in shown and "(default:" in shown and "--quiet" in shown
    assert "examples:\n" in shown and f"python {PATHS[script].relative_to(ROOT)}" in shown
    # One process per emulated host: the network and overlap benchmarks simulate no
    # devices; the sharded bench simulates --data x --model.
    no_devices = (
        "bench_network.py", "bench_overlap.py", "bench_decode.py", "bench_kernels.py",
        "bench_sharded.py",
    )  # fmt: skip
    assert ("--devices" in shown) == (script not in no_devices)


# Each: a script's arguments and what its error message says.
BAD_ARGUMENTS = [
    (
        "compare.py",
        ["--method", "allreduce,nope"],
        "unknown method(s): nope; choose from allreduce",
    ),
    ("train.py", ["--devices", "0"], "--devices: must be at least 1"),
    ("compare.py", ["--dataset", "mnist"], "--dataset mnist needs --data-dir"),
    ("compare.py", ["--dataset", "mnist", "--data-dir", "{tmp}"], "train-images-idx3-ubyte"),
    ("train.py", ["--dataset", "cifar10", "--data-dir", "{tmp}/none"], "no such directory"),
    ("train.py", ["--dataset", "imagenet"], "invalid choice: 'imagenet'"),
    ("adasum_large_batch.py", ["--sizes", "1,4", "--devices", "2"], "needs --devices 4"),
    ("terngrad_workers.py", ["--sizes", "3"], "must divide by every N"),
    ("lags_sparsity.py", ["--densities", "0.01,2"], "must be in (0, 1]"),
    ("lags_sparsity.py", ["--runs", "lags,sparse"], "--runs: unknown sparse; choose from"),
    ("sgp_gossip.py", ["--seeds", "0,x"], "--seeds '0,x'"),
    ("sgp_gossip.py", ["--runs", "sgp,gossip"], "--runs: unknown gossip; choose from sgp,"),
    ("terngrad_workers.py", ["--variants", "float,nope"], "--variants: unknown nope"),
    ("local_gradients.py", ["--models", "gru"], "unknown model(s): gru"),
    ("bench_collectives.py", ["--methods", "nope"], "unknown method(s): nope"),
    ("bench_scaling.py", ["--devices", "0"], "must be at least 1"),
    ("bench_sharded.py", ["--model", "3"], "--model must divide --hidden"),
    ("bench_decode.py", ["--max-devices", "1"], "--max-devices must be at least 2"),
]


@pytest.mark.parametrize(("script", "args", "message"), BAD_ARGUMENTS)
def test_bad_arguments_exit_with_a_message(script, args, message, tmp_path, monkeypatch, capsys):
    args = [a.format(tmp=tmp_path) for a in args]
    assert main_in_process(script, *args, "--out", str(tmp_path), monkeypatch=monkeypatch) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not list(tmp_path.glob("*.json"))


def test_the_script_server_passes_on_exit_status_and_output():
    # The script tests below start their scripts with `run` and `Script`: the status and the
    # output of a child of the script server are those of the script.
    result = run("train.py", "--devices", "0", "--out", "never-written")
    assert result.returncode == 2 and "--devices: must be at least 1" in result.stderr
    assert result.args[0].endswith("train.py") and "usage: train.py" in result.stderr


def test_devices_that_cannot_be_simulated_exit_with_a_message():
    import jax

    from gradcomm_experiments import runtime

    count = len(jax.devices())  # the backend has started: the count is fixed
    args = argparse.Namespace(devices=count + 1, coordinator_address=None)
    with pytest.raises(SystemExit, match=f"--devices {count + 1}: "):
        runtime.setup(args)


def test_progress_bars_only_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert cli.progress(range(3)).disable
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert not cli.progress(range(3)).disable
    assert cli.progress(range(3), quiet=True).disable


def test_styles_are_one_per_method_and_stable():
    styles = {m: report.style(m) for m in registry.METHODS}
    compare = [(styles[m]["color"], styles[m]["marker"]) for m in registry.COMPARE]
    assert len({c for c, _ in compare}) == len({m for _, m in compare}) == len(compare)
    assert len({s["marker"] for s in styles.values()}) == len(styles)
    assert styles["adasum-permute"]["color"] == styles["adasum"]["color"]
    assert (
        styles["adasum-permute"]["linestyle"] != "-" and styles["allreduce"]["color"] == "#000000"
    )
    assert report.style("lags", 1)["markerfacecolor"] == "white"
    with pytest.raises(KeyError, match="not in the registry"):
        report.style("nope")
    # Every marker filled (a regular polygon or a star): an outline ("x", "+", "|", "1")
    # all but vanishes at a plot's 5 points.
    from matplotlib.lines import Line2D

    for label, s in styles.items():
        m = s["marker"]
        polygon_or_star = isinstance(m, tuple) and m[1] in (0, 1)
        assert polygon_or_star or (m in Line2D.filled_markers and m != "."), (label, m)


def cie_lab(colour):
    """sRGB "#rrggbb" to CIELAB (D65)."""
    rgb = np.array([int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722],
                    [0.0193, 0.1192, 0.9505]]) @ linear / [0.95047, 1.0, 1.08883]  # fmt: skip
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def ciede2000(one, other):
    """The CIEDE2000 colour difference of two CIELAB colours (about 1: just noticeable)."""
    (l1, a1, b1), (l2, a2, b2) = one, other
    c7 = ((np.hypot(a1, b1) + np.hypot(a2, b2)) / 2) ** 7
    g = 0.5 * (1 - np.sqrt(c7 / (c7 + 25**7)))
    c1, c2 = np.hypot((1 + g) * a1, b1), np.hypot((1 + g) * a2, b2)
    h1, h2 = (np.degrees(np.arctan2(b, (1 + g) * a)) % 360 for a, b in ((a1, b1), (a2, b2)))
    dh = 0.0 if c1 * c2 == 0 else (h2 - h1 + 180) % 360 - 180
    dl, dc, big_dh = l2 - l1, c2 - c1, 2 * np.sqrt(c1 * c2) * np.sin(np.radians(dh / 2))
    lm, cm = (l1 + l2) / 2, (c1 + c2) / 2
    if c1 * c2 == 0:
        hm = h1 + h2
    elif abs(h1 - h2) <= 180:
        hm = (h1 + h2) / 2
    else:
        hm = (h1 + h2 + (360 if h1 + h2 < 360 else -360)) / 2
    cos = [np.cos(np.radians(k * hm + d)) for k, d in ((1, -30), (2, 0), (3, 6), (4, -63))]
    t = 1 - 0.17 * cos[0] + 0.24 * cos[1] + 0.32 * cos[2] - 0.20 * cos[3]
    sl = 1 + 0.015 * (lm - 50) ** 2 / np.sqrt(20 + (lm - 50) ** 2)
    sc, sh = 1 + 0.045 * cm, 1 + 0.015 * cm * t
    rotation = np.sin(np.radians(60 * np.exp(-(((hm - 275) / 25) ** 2))))
    rt = -2 * np.sqrt(cm**7 / (cm**7 + 25**7)) * rotation
    return np.sqrt((dl / sl) ** 2 + (dc / sc) ** 2 + (big_dh / sh) ** 2
                   + rt * (dc / sc) * (big_dh / sh))  # fmt: skip


def test_ciede2000_matches_published_pairs():
    # Sharma, Wu and Dalal (2005), Table 1: some of its pairs, the hue wrapping in two.
    pairs = [
        ((50, 2.6772, -79.7751), (50, 0, -82.7485), 2.0425),
        ((50, 0, 0), (50, -1, 2), 2.3669),
        ((50, 2.49, -0.001), (50, -2.49, 0.0009), 7.1792),
        ((50, 2.49, -0.001), (50, -2.49, 0.0011), 7.2195),
        ((50, 2.5, 0), (73, 25, -18), 27.1492),
        ((60.2574, -34.0099, 36.2677), (60.4626, -34.1751, 39.4387), 1.2644),
    ]
    for one, other, expected in pairs:
        assert ciede2000(one, other) == pytest.approx(expected, abs=1e-4)


def test_compare_methods_have_colours_far_apart():
    # lags and diloco were two yellow-greens 11 apart; no two methods of compare.py are
    # now nearer than 20 (CIEDE2000), and none is so light it fades on white.
    colours = {m: cie_lab(report.style(m)["color"]) for m in registry.COMPARE}
    nearest = min(
        (ciede2000(colours[a], colours[b]), a, b)
        for i, a in enumerate(registry.COMPARE)
        for b in registry.COMPARE[:i]
    )
    assert nearest[0] > 20, nearest
    assert ciede2000(cie_lab("#DDCC77"), cie_lab("#BBCC33")) < 20  # the old lags, diloco
    assert max(lightness for lightness, _, _ in colours.values()) <= 75


def test_pareto_front_keeps_the_most_accuracy_for_the_bytes():
    points = [(100.0, 0.9), (10.0, 0.8), (20.0, 0.7), (10.0, 0.8), (200.0, 0.95), (300, 0.95)]
    assert report.pareto_front(points) == [0, 1, 3, 4]


def fake_run(method, accuracy, sent, loss=0.5, epochs=3):
    from gradcomm_experiments.loop import RunResult

    return RunResult(
        method=method, losses=[2.0] * 20 + [loss] * 10,
        epoch_accuracy=[accuracy / 2] * (epochs - 1) + [accuracy], test_accuracy=accuracy,
        step_seconds=0.01, bytes_per_step=sent, wall_seconds=1.0,
    )  # fmt: skip


def test_several_seeds_report_mean_and_min_max_and_the_front_of_the_means(tmp_path):
    # Seed by seed, as compare.py runs them: adasum beats allreduce on one seed only, and
    # on its mean neither; lags sends least.
    accuracy = {"allreduce": (0.97, 0.98, 0.99), "adasum": (0.99, 0.96, 0.95),
                "lags": (0.90, 0.91, 0.95)}  # fmt: skip
    sent = {"allreduce": 1000.0, "adasum": 1010.0, "lags": 100.0}
    results = [fake_run(m, accuracy[m][k], sent[m], loss=0.1 * (k + 1))
               for k in range(3) for m in accuracy]  # fmt: skip
    summary = {s["method"]: s for s in report.summarize(results)}
    assert list(summary) == ["allreduce", "adasum", "lags"]
    lags = summary["lags"]["test_accuracy"]
    assert lags["per_seed"] == [0.90, 0.91, 0.95] and (lags["min"], lags["max"]) == (0.9, 0.95)
    assert lags["mean"] == pytest.approx(0.92)
    assert summary["adasum"]["final_loss"]["per_seed"] == pytest.approx([0.1, 0.2, 0.3])
    means = [(s["bytes_per_step"], s["test_accuracy"]["mean"]) for s in summary.values()]
    assert report.pareto_front(means) == [0, 2]  # adasum (0.9667 < 0.98) is off it
    table = report.results_table(results)
    assert "test accuracy, mean (min-max) over 3 seeds" in table
    assert "| lags | 92.00% (90.00-95.00) | 0.2000 (0.1000-0.3000) | 100 | 0.100 |" in table
    one = report.results_table(results[:3])  # one seed: the plain numbers
    assert "| lags | 90.00% | 0.1000 | 100 | 0.100 | 1.00x |" in one and "min-max" not in one
    for stem, draw in (("runs", report.plot_runs), ("bytes", report.plot_bytes)):
        report.save_figure(tmp_path / f"{stem}.png", lambda fig, d=draw: d(results, fig),
                            title=stem)  # fmt: skip
        assert (tmp_path / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"


def test_side_by_side_spreads_only_methods_at_about_the_same_bytes():
    xs = report._side_by_side([100.0, 21574.0, 21462.0, 21574.0, 5000.0])
    assert xs[0] == 100.0 and xs[4] == 5000.0
    assert xs[2] < xs[1] < xs[3] and all(abs(x / 21500 - 1) < 0.1 for x in xs[1:4])


def test_committed_results_come_from_a_clean_tree():
    """Every result under docs/ was made from committed code: its provenance says the
    tree was not dirty (records made before provenance existed say `backfilled`)."""
    dirty = set()
    for path in sorted((ROOT / "docs").rglob("*.json")):
        data = json.loads(path.read_text())
        for record in result_records(data):
            prov = record.get("provenance", {})
            if "backfilled" not in prov and prov.get("git_dirty") is True:
                dirty.add(str(path.relative_to(ROOT)))
    assert not dirty, f"made from a dirty tree (rerun from a clean checkout): {sorted(dirty)}"


def test_provenance_outside_a_checkout(tmp_path):
    assert provenance.git_state(tmp_path) == ("unknown", None)
    assert provenance.git_state(None) == ("unknown", None)
    record = provenance.start(["--x"]).record(None, seeds=[3])
    assert set(record) == set(provenance.KEYS) and record["seeds"] == [3]
    assert record["command"][1:] == ["--x"] and record["device_count"] is None


def test_one_registry_builds_and_models_every_method():
    # compare.py, the network benchmark and the step-time model read one registry: each
    # method builds (a sync exactly where it averages params) and the model takes its row.
    import optax

    from gradcomm import perfmodel

    for label, spec in registry.METHODS.items():
        method = registry.build(spec, optax.sgd(0.1))
        assert method.name == label and method.per_device == spec.per_device
        assert (method.sync is not None) == (spec.every is not None)
        assert method.sync is None or method.per_device
        row = spec.describe()
        assert json.loads(json.dumps(row)) == row  # what network.json records carry
        perfmodel.predict(row["method"], 1000, 4, 1.0, options=row["options"], sync=row["sync"])
    assert set(registry.COMPARE) <= set(registry.METHODS)
    assert registry.METHODS["local-sgd"].every == 20
    assert registry.METHODS["dropping-local"].every == 50


def test_every_study_is_listed():
    benches = {
        "bench_collectives.py", "bench_decode.py", "bench_kernels.py", "bench_network.py",
        "bench_scaling.py", "bench_sharded.py",
    }  # fmt: skip
    # Their smoke tests and more: tests/experiments/test_powersgd_rank.py, test_bench_overlap.py.
    own = {"powersgd_rank.py", "bench_overlap.py"}
    others = {"train.py", "compare.py", *benches, *own}
    assert set(STUDIES) | others == set(SCRIPTS)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(STUDIES))
def test_study_runs_and_writes_json_png_and_markdown(tmp_path, script):
    args = STUDIES[script]
    if "--devices" not in args:
        args = [*args, "--devices", "2"]
    result = run(script, *args, "--quiet", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    stem = script.removesuffix(".py")
    study = json.loads((tmp_path / f"{stem}.json").read_text())
    assert study["runs"] and all(np.isfinite(r["losses"]).all() for r in study["runs"])
    devices = int(args[args.index("--devices") + 1])
    check_provenance(study["provenance"], devices=devices, seeds=[0])
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
    assert "|" in (tmp_path / f"{stem}.md").read_text()


@pytest.mark.slow
def test_compare_on_one_device_says_nothing_crosses_a_wire(tmp_path):
    # One method with replicated params and one with per-device params, over two seeds
    # (the second seed's runs and the timing reuse the first's compiled steps): each run
    # says its seed, each method its mean and min-max.
    # The one test of compare.py's interleaved step timing (the others turn it off: it runs
    # every method's step again): 3 rounds of 2 steps, alternating order. --no-progress:
    # --quiet's other name.
    methods = ["--method", "allreduce,sgp", "--timing-rounds", "3", "--timing-steps", "2"]
    result = run(
        "compare.py", "--devices", "1", "--epochs", "1", "--batch-size", "64", "--seeds", "0,1",
        "--no-progress", *methods, "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nothing crosses a wire" in result.stdout
    study = json.loads((tmp_path / "compare.json").read_text())
    runs = study["runs"]
    assert [(r["seed"], r["method"]) for r in runs] == [
        (0, "allreduce"), (0, "sgp"), (1, "allreduce"), (1, "sgp")
    ]  # fmt: skip
    assert [r["bytes_per_step"] for r in runs] == [0, 0, 0, 0]
    for s in study["summary"]:
        each = [r["test_accuracy"] for r in runs if r["method"] == s["method"]]
        assert s["test_accuracy"]["per_seed"] == each
        assert s["test_accuracy"]["mean"] == pytest.approx(np.mean(each))
    check_provenance(study["provenance"], devices=1, seeds=[0, 1])
    # Each method's step time: the median of its rounds, the same for both seeds' runs.
    timed = study["step_timing"]
    assert timed["steps"] == 2 and len(timed["loop_step_seconds"]) == 4
    assert {m: len(r) for m, r in timed["rounds"].items()} == {"allreduce": 3, "sgp": 3}
    for r in runs:
        assert r["step_seconds"] == np.median(timed["rounds"][r["method"]]) > 0
    table = (tmp_path / "compare.md").read_text()
    assert "Step time: the median of 3 interleaved rounds" in table
    assert "One device: nothing crosses a wire" in table
    assert "mean (min-max) over 2 seeds" in table and "over seeds 0, 1" in table
    assert (tmp_path / "compare_bytes.png").stat().st_size > 0


@pytest.mark.slow
def test_compare_runs_every_method_and_train_in_two_processes_repeats_it(tmp_path):
    """compare.py runs every method in one process and writes its files; train.py (the same
    recipe, `compare.run_methods`) repeats two of them in two processes (gloo) of 2
    devices each, against the one process of 4: the same runs, and train.py's own files.

    A psum (local SGD's average, and every step's mean loss) may add in another order
    across processes, so losses are compared to float32 rounding (a recipe that differed
    would differ far more); test accuracy and bytes are the same. One run of each serves
    both checks: each compiles every method's step.
    """
    # One seed (several: the one-device test above, and the summary's own test above), not
    # the default; 1 epoch at 6 examples per device on 4 devices, 59 steps: local SGD and
    # DiLoCo average twice, dropping-local once, at step 50, where gradient dropping's
    # warm-up ends. No interleaved step timing (tested on one device above). No --quiet:
    # the output is a pipe, so the progress bars stay off (no "\r" flood).
    recipe = ["--epochs", "1", "--batch-size", "6", "--timing-rounds", "0"]
    # A sparse all-gather, and per-device params averaged now and then by a psum (the
    # all-reduce's collective; Adasum and SGP across two processes, bit for bit:
    # tests/suites/test_multiprocess.py).
    repeated = ["lags", "local-sgd"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    half = ["--devices", "2", *recipe, "--method", ",".join(repeated), "--seed", "3",
            "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
            "--out", str(tmp_path / "train")]  # fmt: skip
    two_processes = [Script("train.py", *half, "--process-id", i) for i in range(2)]
    every = ["--devices", "4", *recipe, "--seeds", "3", "--out", str(tmp_path)]
    result = run("compare.py", *every)
    for done in (result, *(process.wait(600) for process in two_processes)):
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert "\r" not in done.stderr and "\r" not in done.stdout
    study = json.loads((tmp_path / "compare.json").read_text())
    check_every_method(study, tmp_path)
    assert study["provenance"]["command"][1:] == every
    assert {p.name for p in (tmp_path / "train").iterdir()} == {
        "train.json", "train.md", "train.png", "train_bytes.png"
    }  # fmt: skip
    again = json.loads((tmp_path / "train" / "train.json").read_text())
    check_provenance(again["provenance"], devices=4, seeds=[3], processes=2)
    assert again["provenance"]["command"][1:] == [*half, "--process-id", "0"]
    assert [(r["seed"], r["method"]) for r in again["runs"]] == [(3, m) for m in repeated]
    assert again["seeds"] == study["seeds"] == [3]
    one = [r for r in study["runs"] if r["method"] in repeated]
    # Local SGD averages the devices' params in the runs compared (at step 20).
    assert len(one[1]["losses"]) >= registry.METHODS[one[1]["method"]].every == 20
    summary = [s for s in study["summary"] if s["method"] in repeated]
    for a, b in zip(again["runs"] + again["summary"], one + summary, strict=True):
        assert a["method"] == b["method"]
        assert a["test_accuracy"] == b["test_accuracy"]
        assert a["bytes_per_step"] == b["bytes_per_step"]
    for a, b in zip(again["runs"], one, strict=True):
        np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5, atol=1e-6)


def check_every_method(study, out):
    """compare.py's outputs over every method of the registry's COMPARE, one seed."""
    runs = study["runs"]
    assert [r["method"] for r in runs] == list(registry.COMPARE)
    assert {r["seed"] for r in runs} == {3} and study["seeds"] == [3]
    for r in runs:
        assert 0.5 < r["test_accuracy"] <= 1 and r["bytes_per_step"] > 0
        assert r["losses"][-1] < r["losses"][0]
    summary = study["summary"]
    assert [s["method"] for s in summary] == list(registry.COMPARE)
    for s, r in zip(summary, runs, strict=True):
        accuracy = s["test_accuracy"]
        assert accuracy["per_seed"] == [r["test_accuracy"]] == [accuracy["mean"]]
    points = [(s["bytes_per_step"], s["test_accuracy"]["mean"]) for s in summary]
    front = [runs[i]["method"] for i in sorted(report.pareto_front(points), key=points.__getitem__)]
    assert study["pareto_front"] == front and front
    check_provenance(study["provenance"], devices=4, seeds=[3])
    for png in ("compare.png", "compare_bytes.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    table = (out / "compare.md").read_text()
    assert "| adasum |" in table and "Pareto front" in table


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
        "--bandwidth-size",
        "1MiB",
        "--quiet",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    study = json.loads((tmp_path / "bench_collectives.json").read_text())
    rows = study["rows"]
    assert [r["bytes"] for r in rows] == [4096, 65536]
    for r in rows:
        assert r["ratio_to_psum"]["psum"] == 1 and r["ratio_to_psum"]["adasum"] > 0
        assert r["wire_bytes"]["adasum"] <= 1.2 * r["wire_bytes"]["psum"]
    check_provenance(study["provenance"], devices=4, seeds=[0])
    assert (tmp_path / "bench_collectives.png").stat().st_size > 0


def test_bench_sharded_splits_the_data_axis_bytes(tmp_path):
    result = run("bench_sharded.py", "--hidden", "64", "--width", "32", "--quiet",
                 "--out", str(tmp_path))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    study = json.loads((tmp_path / "bench_sharded.json").read_text())
    check_provenance(study["provenance"], devices=8, seeds=[])
    rows = {r["method"]: r for r in study["tensor_parallel"]}
    # Over 'data', the leaves split in two cost half; the whole bias (32 of 4192 elements)
    # and the per-leaf statistics a little more.
    for name in ("allreduce", "low_precision bf16", "adasum"):
        assert 0.5 <= rows[name]["data_ratio"] <= 0.52, (name, rows[name])
    # At this size rounding shows: each piece sends ceil(k / 2) of a leaf's k pairs, and
    # TernGrad packs each piece's codes into whole bytes and words (both 0.50 at the
    # default size).
    for name in ("lags 0.01", "slgs 0.01", "terngrad", "powersgd r4"):
        assert 0.5 <= rows[name]["data_ratio"] <= 0.6, (name, rows[name])
    fsdp = {r["method"]: r for r in study["fsdp"]}
    assert fsdp["allreduce"]["by_kind"]["reduce-scatter"] > 0
    # Each shard's own top k: an all-to-all of (N - 1) / N of the pairs, 1/N of the
    # whole top k's all-gather, plus the biases' (whole leaves') pairs.
    for name in ("lags 0.01", "dropping 0.99"):
        whole, shards = fsdp[name], fsdp[f"{name} per_shard"]
        assert shards["by_kind"]["all-to-all"] > 0, shards
        assert 0.25 <= shards["fsdp_bytes"] / whole["fsdp_bytes"] <= 0.3, (whole, shards)
    assert "|" in (tmp_path / "bench_sharded.md").read_text()


@pytest.mark.slow
def test_bench_scaling_and_decode_write_json_png_and_markdown(tmp_path):
    scaling = run("bench_scaling.py", "--devices", "2", "--sizes", "512,64", "--repeats", "1",
                  "--out", str(tmp_path))  # fmt: skip
    assert scaling.returncode == 0, scaling.stderr[-3000:]
    decode = run("bench_decode.py", "--platform", "cpu", "--max-devices", "3", "--sizes", "512",
                 "--densities", "0.1", "--repeats", "1", "--out", str(tmp_path))  # fmt: skip
    assert decode.returncode == 0, decode.stderr[-3000:]
    for stem, devices in (("bench_scaling", 2), ("bench_decode", 1)):
        study = json.loads((tmp_path / f"{stem}.json").read_text())
        check_provenance(study["provenance"], devices=devices, seeds=[0])
        assert (tmp_path / f"{stem}.png").stat().st_size > 0
        assert "|" in (tmp_path / f"{stem}.md").read_text()
    rows = json.loads((tmp_path / "bench_decode.json").read_text())["rows"]
    assert [r["n"] for r in rows] == [2, 3] and all(r["same_bits"] for r in rows)


def test_provenance_dirty_means_code_not_output(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "a")
    assert provenance.git_state(tmp_path)[1] is False
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "result.json").write_text("{}")  # a run's own output
    assert provenance.git_state(tmp_path)[1] is False
    (tmp_path / "out" / "helper.py").write_text("y = 2\n")  # untracked code
    assert provenance.git_state(tmp_path)[1] is True
    (tmp_path / "out" / "helper.py").unlink()
    (tmp_path / "a.py").write_text("x = 2\n")  # a changed tracked file
    assert provenance.git_state(tmp_path)[1] is True
