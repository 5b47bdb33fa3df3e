"""The experiment scripts run end to end (tiny settings) and write what they promise."""

import argparse
import datetime
import functools
import importlib.util
import io
import json
import os
import pathlib
import runpy
import socket
import subprocess
import sys

import numpy as np
import pytest

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
        "dropping-local",  # the study's subject (per-device params, a sync) on both models
        "--length",
        "6",
    ],
}


@functools.cache
def script_env():
    """The environment a script runs in: its own device count, and XLA's CPU codegen at its
    cheapest: LLVM's optimizations off (`jax_disable_most_optimizations`) and the older
    fusion emitters, where this XLA has the flag. These tiny runs spend most of their time
    compiling (more than twice as long without); the HLO passes, and so the collectives
    gradcomm.wire reads, are the same, and so are the results."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    cheap = env | {"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false"}
    probe = [sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0)"]
    known = subprocess.run(probe, env=cheap, capture_output=True, timeout=120, check=False)
    return cheap if known.returncode == 0 else env  # an unknown flag aborts XLA


def import_script(script):
    """The script `script` (a file name) as a module named by its stem, imported once."""
    name = script.removesuffix(".py")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PATHS[script])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def run(script, *args, timeout=300):
    env = script_env()
    return subprocess.run(
        [sys.executable, str(PATHS[script]), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


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
    ("sgp_gossip.py", ["--seeds", "0,x"], "--seeds '0,x'"),
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
        for record in data if isinstance(data, list) else [data]:
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
    # One method with replicated params and one with per-device params (Adasum on one
    # device: adasum_large_batch.py's N=1), over two seeds: each run says its seed, each
    # method its mean and min-max.
    # The one test of compare.py's interleaved step timing (the others turn it off: it
    # compiles every method's step again): 3 rounds of 2 steps, alternating order.
    methods = ["--method", "allreduce,sgp", "--timing-rounds", "3", "--timing-steps", "2"]
    result = run(
        "compare.py", "--devices", "1", "--epochs", "1", "--batch-size", "64", "--seeds", "0,1",
        "--quiet", *methods, "--out", str(tmp_path),
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
def test_compare_runs_every_method_and_writes_json_pngs_and_markdown(tmp_path):
    # No --quiet: the output is a pipe, so the progress bars stay off (no "\r" flood).
    # One seed (several: the test below, and the summary's own test above); 2 epochs, 88
    # steps: local SGD and DiLoCo average 4 times, dropping-local once.
    # No interleaved step timing (it compiles each step again; tested on one device above).
    args = ["--devices", "2", "--epochs", "2", "--seeds", "0", "--timing-rounds", "0",
            "--out", str(tmp_path)]  # fmt: skip
    result = run("compare.py", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\r" not in result.stderr and "\r" not in result.stdout
    study = json.loads((tmp_path / "compare.json").read_text())
    runs = study["runs"]
    assert [r["method"] for r in runs] == list(registry.COMPARE)
    assert {r["seed"] for r in runs} == {0} and study["seeds"] == [0]
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
    check_provenance(study["provenance"], devices=2, seeds=[0])
    assert study["provenance"]["command"][1:] == args
    for png in ("compare.png", "compare_bytes.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "compare.md").read_text()
    assert "| adasum |" in table and "Pareto front" in table


# What may differ between two runs of the same recipe: how long things took.
TIMINGS = ("step_seconds", "wall_seconds")


def test_compare_twice_gives_the_same_results(tmp_path):
    """The comparison twice, as train.py and then as compare.py with the same settings (one
    recipe, `compare.run_methods`): the same runs, bit for bit, and the same summary and
    front. The first run is also train.py's smoke test (its files; compare.py's: above)."""
    common = ["--devices", "2", "--epochs", "1", "--batch-size", "64",
              "--method", "allreduce,lags", "--timing-rounds", "0"]  # fmt: skip
    # No --quiet: the output is a pipe, so the progress bars stay off (no "\r" flood).
    train = run("train.py", *common, "--seed", "3", "--out", str(tmp_path / "train"))
    assert train.returncode == 0, train.stderr[-3000:]
    assert "\r" not in train.stderr
    assert {p.name for p in (tmp_path / "train").iterdir()} == {
        "train.json", "train.md", "train.png", "train_bytes.png"
    }  # fmt: skip
    compare = run("compare.py", *common, "--seeds", "3", "--quiet", "--out", str(tmp_path))
    assert compare.returncode == 0, compare.stderr[-3000:]
    studies = [json.loads((tmp_path / f).read_text()) for f in ("train/train.json", "compare.json")]
    for study in studies:
        check_provenance(study["provenance"], devices=2, seeds=[3])

    def results(study):
        drop = lambda record: {k: v for k, v in record.items() if k not in TIMINGS}  # noqa: E731
        return {
            "runs": [drop(r) for r in study["runs"]],
            "summary": [drop(s) for s in study["summary"]],
            **{key: study[key] for key in ("seeds", "pareto_front")},
        }

    first, second = map(results, studies)
    assert [(r["seed"], r["method"]) for r in first["runs"]] == [(3, "allreduce"), (3, "lags")]
    assert first == second


@pytest.mark.slow
def test_compare_in_two_processes_matches_one(tmp_path):
    """Two processes with 4 devices each (gloo) against one with 8: the same numbers.

    Every method but the all-reduce based ones moves data without arithmetic, so those
    runs agree bit for bit; a psum may add in another order across processes, so losses
    are compared to float32 rounding.
    """
    # A psum, a sparse all-gather and per-device params averaged now and then (Adasum and
    # SGP across two processes, bit for bit: tests/suites/test_multiprocess.py).
    methods = "allreduce,lags,local-sgd"
    common = ["--epochs", "1", "--method", methods, "--seeds", "0", "--no-progress",
              "--timing-rounds", "0"]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = script_env()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(PATHS["compare.py"]),
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
    two_study = json.loads((tmp_path / "two" / "compare.json").read_text())
    check_provenance(two_study["provenance"], devices=8, seeds=[0], processes=2)
    two = two_study["runs"]
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
