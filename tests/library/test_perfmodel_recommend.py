"""`perfmodel.recommend` and its inputs: the GPU kernel record, the CLI, and the ranking on
the emulated network against the measured one.

What "the ranking matches" means here (`test_ranking_matches_the_emulated_cells`): in each
cell of docs/bench/network.json (N = 2 and 4 hosts, one CPU device each; links shaped to
100 Mbit/s and 1 Gbit/s, and unshaped), every pair of methods whose measured step times
differ by more than the noise is ordered the same by `recommend(..., device="cpu")`, and
the model's fastest method measures within that noise of the measured fastest; at 1 Gbit,
at most 5% of the pairs may go the other way (the model's compute is the unshaped cells',
and on that link the compute-bound methods and the gossip steps ran slower). The noise:
the larger of a floor and the two methods' own run-to-run spread ((max - min) / median of
`ratio_runs`, summed). The floor is 10% on shaped links, where steps are bound by the link
and repeat within 2% (DESIGN.md, "Noise"), and 20% unshaped, where they are bound by
compute and move 15-50% between runs; the model's own fit tolerance is 15% a cell
(`fit_report`). This is in-sample: the model is calibrated to the same records (each
method's extra compute is fitted to the unshaped cells, so those orderings are in part
fitted; the shaped cells' come from gloo's pattern table and allreduce's factor per rate).
`test_ranking_holds_out_a_rate` calibrates without one shaped rate's cells and ranks them:
at least 90% of the pairs beyond the noise in order, and the same fastest method. Both
can fail: `test_the_criterion_rejects_wrong_rankings` shows a reversed ranking and a
ranking by communication alone failing it on the same records.
"""

import itertools
import json
import math
import pathlib
import re
import statistics
import subprocess
import sys
import tomllib

import jax
import numpy as np
import pytest

from gradcomm import perfmodel as pm
from gradcomm import registry
from gradcomm.perfmodel import _kernels, _recommend

ROOT = pathlib.Path(__file__).resolve().parents[2]
NETWORK = ROOT / "docs" / "bench" / "network.json"
RECORD = ROOT / "gradcomm" / "perfmodel" / "kernels_gpu" / "bench_kernels.json"
FLOOR = {"shaped": 0.10, "unshaped": 0.20}


def _records():
    return [
        r
        for r in json.loads(NETWORK.read_text())
        if r.get("framework", "jax") == "jax"
        and r.get("devices_per_process", 1) == 1
        and r.get("step_s") is not None
    ]


def _spread(record):
    runs = [x for x in record.get("ratio_runs") or [] if x is not None]
    return (max(runs) - min(runs)) / statistics.median(runs) if len(runs) > 1 else 0.0


def _cells(records):
    """(nodes, rate in Mbit/s or None) -> {label: record}."""
    cells = {}
    for r in records:
        cells.setdefault((r["nodes"], r.get("rate_mbit")), {})[r["label"]] = r
    return cells


def _link(rate_mbit):
    return "unshaped" if rate_mbit is None else rate_mbit / 1000


def misordered(measured, predicted, floor, spread):
    """The pairs beyond the noise that the model orders the other way, and how many pairs
    are beyond the noise. `measured` and `predicted` map labels to step times."""
    beyond, wrong = 0, []
    for a, b in itertools.combinations(sorted(set(measured) & set(predicted)), 2):
        noise = max(floor, spread.get(a, 0.0) + spread.get(b, 0.0))
        if abs(math.log(measured[a] / measured[b])) <= math.log1p(noise):
            continue
        beyond += 1
        if (measured[a] < measured[b]) != (predicted[a] < predicted[b]):
            wrong.append((a, b, round(measured[a] / measured[b], 2)))
    return wrong, beyond


def _compare(cell, predicted, floor):
    measured = {label: r["step_s"] for label, r in cell.items()}
    spread = {label: _spread(r) for label, r in cell.items()}
    wrong, beyond = misordered(measured, predicted, floor, spread)
    fastest = min(measured, key=measured.get)
    picked = min(predicted, key=predicted.get)
    top = measured[picked] / measured[fastest] <= 1 + max(floor, spread[fastest] + spread[picked])
    return wrong, beyond, top, (picked, fastest)


# ----------------------------------------------------------------------------- the ranking


def test_ranking_matches_the_emulated_cells():
    cells = _cells(_records())
    assert {(n, r) for n in (2, 4) for r in (100.0, 1000.0, None)} <= set(cells)
    report = []
    for (nodes, rate), cell in sorted(cells.items(), key=str):
        params = next(iter(cell.values()))["params"]
        rows = pm.recommend(params, nodes, _link(rate), device="cpu", network=NETWORK,
                            every_exchange=True)  # fmt: skip
        predicted = {c.label: c.step_s for c in rows}
        assert set(cell) <= set(predicted), (
            f"rows the model does not rank: {set(cell) - set(predicted)}"
        )
        floor = FLOOR["unshaped" if rate is None else "shaped"]
        wrong, beyond, top, picks = _compare(cell, predicted, floor)
        report.append((nodes, rate, wrong, beyond, top, picks))
    # At 1 Gbit a few pairs go the other way (the records of 2026-11-26): there the
    # compute-bound sparse methods and the gossip steps ran slower than the model's
    # unshaped compute and full-speed swaps make them; at most 5% of the pairs.
    failed = [r for r in report if len(r[2]) > (0.05 * r[3] if r[1] == 1000.0 else 0) or not r[4]]
    assert not failed, f"(N, rate, misordered, pairs beyond the noise, top ok, picks): {failed}"
    assert all(r[3] >= 20 for r in report), report  # the criterion has pairs to judge


@pytest.mark.parametrize("rate", [100.0, 1000.0])
def test_ranking_holds_out_a_rate(rate, tmp_path):
    records = json.loads(NETWORK.read_text())
    held_out = tmp_path / "network.json"
    held_out.write_text(json.dumps([r for r in records if r.get("rate_mbit") != rate]))
    for (nodes, r), cell in _cells(_records()).items():
        if r != rate:
            continue
        params = next(iter(cell.values()))["params"]
        rows = pm.recommend(params, nodes, rate / 1000, device="cpu", network=held_out,
                            every_exchange=True)  # fmt: skip
        wrong, beyond, top, picks = _compare(cell, {c.label: c.step_s for c in rows}, 0.10)
        assert len(wrong) <= 0.1 * beyond and top, (nodes, rate, wrong, beyond, picks)


def test_the_criterion_rejects_wrong_rankings():
    assert misordered({"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 1.0}, 0.1, {}) == ([("a", "b", 0.5)], 1)
    assert misordered({"a": 1.0, "b": 1.05}, {"a": 2.0, "b": 1.0}, 0.1, {}) == ([], 0)
    assert misordered({"a": 1.0, "b": 1.3}, {"a": 2.0, "b": 1.0}, 0.1, {"a": 0.35}) == ([], 0)
    reversed_, by_bytes = [], []
    for (nodes, rate), cell in _cells(_records()).items():
        params = next(iter(cell.values()))["params"]
        rows = pm.recommend(params, nodes, _link(rate), device="cpu", network=NETWORK,
                            every_exchange=True)  # fmt: skip
        floor = FLOOR["unshaped" if rate is None else "shaped"]
        reversed_ += _compare(cell, {c.label: -c.step_s for c in rows}, floor)[0]
        by_bytes += _compare(cell, {c.label: c.comm_s for c in rows}, floor)[0]
    assert reversed_ and by_bytes


def test_cpu_rows_pick_the_faster_exchange():
    # adasum, adasum-permute and adasum-pairwise differ in their exchange alone: one row,
    # the fastest; so for SGP and D-PSGD.
    every = pm.recommend(4_194_304, 2, "100mbit", device="cpu", network=NETWORK,
                         every_exchange=True)  # fmt: skip
    best = pm.recommend(4_194_304, 2, "100mbit", device="cpu", network=NETWORK)
    adasum = [c for c in every if c.method == "adasum"]
    assert {c.exchange for c in adasum} == {"auto", "permute", "pairwise"}, adasum
    (kept,) = [c for c in best if c.method == "adasum"]
    assert kept.step_s == min(c.step_s for c in adasum)
    swapping = [c for c in every if c.exchange in ("permute", "pairwise")]
    assert len(best) == len(every) - len(swapping) and len(swapping) == 6
    # Compute scales with the parameters unless given; the fitted extras are per byte.
    big = pm.recommend(41_943_040, 2, "unshaped", device="cpu", network=NETWORK)
    small = pm.recommend(4_194_304, 2, "unshaped", device="cpu", network=NETWORK)
    ar = {c.label: c for c in big}["allreduce"], {c.label: c for c in small}["allreduce"]
    assert ar[0].compute_s == pytest.approx(10 * ar[1].compute_s)
    given = pm.recommend(4_194_304, 2, "1gbit", device="cpu", network=NETWORK, compute_s=0.5)
    assert {c.label: c for c in given}["allreduce"].compute_s == 0.5


# ----------------------------------------------------------------------------- the GPU record


def test_the_kernel_record_is_packaged_from_a_clean_tree():
    data = json.loads(RECORD.read_text())
    prov = data["provenance"]
    assert data["complete"] and prov["git_dirty"] is False and prov["platform"] == "gpu"
    assert "H200" in prov["device_kind"] and data["device"] == prov["device_kind"]
    assert all(c["passed"] and c["max_abs_error_exact"] == 0 for c in data["low_precision_check"])
    assert pm.gpu_cost_per_byte("terngrad") > 0  # read through importlib.resources
    assert _kernels.kernel_record().path == "gradcomm/perfmodel/kernels_gpu/bench_kernels.json"
    assert not list((ROOT / "docs").rglob("bench_kernels.json")), "the record has one home"
    data_files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "perfmodel/kernels_gpu/*.json" in data_files["package-data"]["gradcomm"]
    # The table printed beside it holds the record's figures.
    table = RECORD.with_suffix(".md").read_text()
    for r in data["rows"]:
        assert f"| {r['kernel']} | {1e3 * r['seconds']:.3f} |" in table


def _seconds(*names):
    rows = {r["kernel"]: r["seconds"] for r in json.loads(RECORD.read_text())["rows"]}
    return sum(rows[n] for n in names)


@pytest.mark.parametrize(
    ("method", "options", "nodes", "names", "times"),
    [
        ("terngrad", None, 4, ["terngrad compress", "terngrad decompress"], 1),
        ("lags", None, 4, ["topk sampled d=0.001 per leaf", "decode d=0.001"], 1),
        ("lags", {"density": 0.01, "selector": "exact"}, 4,
         ["topk exact d=0.01 per leaf", "decode d=0.01"], 1),
        ("gradient_dropping", None, 4, ["topk sampled d=0.01 per leaf", "decode d=0.01"], 1),
        ("slgs", {"density": 0.01}, 4, ["topk sampled d=0.01 concatenated", "decode d=0.01"], 1),
        ("powersgd", {"rank": 4}, 4, ["powersgd compress r4", "powersgd decompress r4"], 1),
        ("low_precision", None, 4,
         ["low_precision compress bf16", "low_precision decompress bf16"], 1),
        ("allreduce", {"dtype": "float16"}, 4,
         ["low_precision compress f16", "low_precision decompress f16"], 1),
        ("adasum", None, 2, ["adasum pair"], 1 / 2),  # one level: half the model
        ("adasum", None, 8, ["adasum pair"], 7 / 8),  # 1/2 + 1/4 + 1/8
        ("adasum", None, 6, ["adasum pair"], 1 + 3 / 4),  # the fold, then a tree of 4
        ("allreduce", None, 4, [], 0),
        ("sgp", None, 4, [], 0),
        ("diloco", None, 4, [], 0),
    ],
)  # fmt: skip
def test_kernels_per_method_are_the_records(method, options, nodes, names, times):
    seconds, source = _kernels.kernel_seconds(method, options, nodes)
    assert seconds == pytest.approx(times * _seconds(*names))
    assert all(n in source for n in names)
    cost = pm.gpu_cost_per_byte(method, options, nodes)
    assert cost == pytest.approx(seconds / (4 * json.loads(RECORD.read_text())["params"]))


def test_kernels_refuse_what_the_record_lacks(tmp_path):
    with pytest.raises(ValueError, match=r"no kernel 'topk sampled d=0.05 per leaf'.*--densities"):
        pm.gpu_cost_per_byte("lags", {"density": 0.05})
    with pytest.raises(ValueError, match="no kernel 'powersgd compress r3'"):
        pm.gpu_cost_per_byte("powersgd", {"rank": 3})
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        pm.gpu_cost_per_byte("low_precision", {"dtype": np.float32})
    with pytest.raises(ValueError, match="takes no option"):
        pm.gpu_cost_per_byte("lags", {"ratio": 0.01})
    cut = tmp_path / "bench_kernels.json"
    cut.write_text(json.dumps({"complete": False, "rows": []}))
    with pytest.raises(ValueError, match="not a complete"):
        pm.gpu_cost_per_byte("terngrad", record=str(cut))


def test_gpu_ranking():
    rows = pm.recommend("124M", 32, "10gbit")
    assert [c.step_s for c in rows] == sorted(c.step_s for c in rows)
    ranked = {c.method for c in rows}
    assert ranked == set(registry.METHODS) - {"periodic_average"}  # local SGD is it alone
    by = {c.label: c for c in rows}
    assert by["allreduce"].ratio == 1.0 and by["allreduce"].extra_s == 0.0
    assert by["allreduce"].compute_s == pytest.approx(6 * 124e6 * 8192 / 400e12)
    record = _kernels.kernel_record()
    terngrad, _ = _kernels.kernel_seconds("terngrad", None, 32)
    assert by["terngrad"].extra_s == pytest.approx(terngrad * 124e6 / record.params)
    assert by["adasum"].exchange == "auto" and by["lags-0.001"].exchange is None
    assert by["dropping-local"].sync == {"name": "periodic_average", "every": 50}
    for c in rows:  # each row links a docs page and an accuracy study that exist
        assert (ROOT / c.page).is_file(), c.page
        path, _, anchor = c.evidence.partition("#")
        text = (ROOT / path).read_text()
        slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
        assert not anchor or anchor in slugs, c.evidence
    given = pm.recommend("124M", 32, 10.0, compute_s=0.2)
    assert {c.label: c for c in given}["allreduce"].compute_s == 0.2
    # On a slow link every compressing method beats the all-reduce; adasum ties it.
    slow = {c.label: c for c in pm.recommend("124M", 32, "100mbit")}
    assert all(slow[k].ratio < 0.6 for k in ("terngrad", "lags-0.001", "powersgd-r2", "bf16"))
    assert slow["adasum"].ratio == pytest.approx(1.0, abs=0.01)


def _slug(heading):
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_params_as_a_pytree():
    tree = {"w": jax.ShapeDtypeStruct((768, 2304), np.float32), "b": np.zeros(2304, np.float32)}
    count = 768 * 2304 + 2304
    as_tree = {c.label: c for c in pm.recommend(tree, 8, "1gbit")}
    as_int = {c.label: c for c in pm.recommend(count, 8, "1gbit")}
    assert as_tree["allreduce"].step_s == pytest.approx(as_int["allreduce"].step_s)
    assert as_tree["powersgd-r2"].comm_s > as_int["powersgd-r2"].comm_s  # the real shapes
    half = {"w": jax.ShapeDtypeStruct((768, 2304), jax.numpy.bfloat16)}
    bf16 = {c.label: c for c in pm.recommend(half, 8, "1gbit", compute_s=0.0)}
    f32 = {c.label: c for c in pm.recommend(768 * 2304, 8, "1gbit", compute_s=0.0)}
    assert bf16["allreduce"].comm_s == pytest.approx(f32["allreduce"].comm_s / 2)


# ----------------------------------------------------------------------------- parsing, CLI


@pytest.mark.parametrize(
    ("text", "count"),
    [("124M", 124_000_000), ("1.5B", 1_500_000_000), ("350k", 350_000), ("4194304", 4_194_304),
     (" 2G ", 2_000_000_000), (7, 7), ("1.5b", 1_500_000_000)],
)  # fmt: skip
def test_parse_params(text, count):
    assert pm.parse_params(text) == count


@pytest.mark.parametrize("text", ["0", "-5", "12X", "", "1.5.2", "M", "0.1"])
def test_parse_params_refuses(text):
    with pytest.raises(ValueError, match="a positive count"):
        pm.parse_params(text)


@pytest.mark.parametrize(
    ("text", "gbps"),
    [("100mbit", 0.1), ("1gbit", 1.0), ("10gbit", 10.0), ("100gbit", 100.0), ("25", 25.0),
     (2.5, 2.5), ("250Mbit/s", 0.25), ("unshaped", None)],
)  # fmt: skip
def test_parse_link(text, gbps):
    assert pm.parse_link(text) == gbps


@pytest.mark.parametrize("text", ["fast", "0", "-1", "10tbit", "", "0mbit"])
def test_parse_link_refuses(text):
    with pytest.raises(ValueError, match="100mbit, 1gbit"):
        pm.parse_link(text)


def test_recommend_refuses(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="'gpu' or 'cpu'"):
        pm.recommend("124M", 8, "1gbit", device="tpu")
    for nodes in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="positive number of hosts"):
            pm.recommend("124M", nodes, "1gbit")
    with pytest.raises(ValueError, match="unshaped"):
        pm.recommend("124M", 8, "unshaped")
    with pytest.raises(ValueError, match="no such file"):
        pm.recommend("124M", 8, "1gbit", device="cpu", network=tmp_path / "none.json")
    # Installed without its repository: no records to calibrate to, and it says so.
    monkeypatch.setattr(_recommend, "__file__", str(tmp_path / "gradcomm/perfmodel/x.py"))
    with pytest.raises(ValueError, match="network=PATH"):
        pm.recommend("124M", 8, "1gbit", device="cpu")
    with pytest.raises(ValueError, match="a parameter count or a pytree"):
        pm.recommend({}, 8, "1gbit")


def test_cli_recommend(capsys):
    assert pm.main(["recommend", "--params", "124M", "--nodes", "32", "--link", "10gbit"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("## Methods by predicted step: 124,000,000 parameters, 32 hosts")
    assert "NVIDIA H200" in text and "(estimated: 6 FLOPs per parameter per token" in text
    lines = [line for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(lines) == len(pm.recommend("124M", 32, "10gbit"))
    assert '| `gradcomm.lags("data", density=0.001)` |' in text
    assert "docs/results.md#lags-sgd-assumption-1-and-accuracy" in text
    argv = ["recommend", "--params", "4194304", "--nodes", "4", "--link", "unshaped",
            "--device", "cpu", "--network", str(NETWORK), "--json"]  # fmt: skip
    assert pm.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu" and report["params"] == 4_194_304
    assert "calibrated to" in report["setting"]
    expected = pm.recommend(4_194_304, 4, "unshaped", device="cpu", network=NETWORK)
    assert [c["label"] for c in report["choices"]] == [c.label for c in expected]


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--params", "12X", "--nodes", "2", "--link", "1gbit"], "params '12X'"),
     (["--params", "1M", "--nodes", "2", "--link", "1tbit"], "link '1tbit'"),
     (["--params", "1M", "--nodes", "2", "--link", "unshaped"], "the CPU benchmark's"),
     (["--params", "1M", "--nodes", "2"], "--link"),
     (["--params", "1M", "--nodes", "2", "--link", "1gbit", "--device", "tpu"], "tpu")],
)  # fmt: skip
def test_cli_recommend_refuses(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        pm.main(["recommend", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_cli_recommend_runs_as_a_module():
    command = [sys.executable, "-W", "error::RuntimeWarning", "-m", "gradcomm.perfmodel",
               "recommend", "--params", "124M", "--nodes", "32", "--link", "10gbit"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "| 1 | " in result.stdout


# ----------------------------------------------------------------------------- docs


def test_costs_page_quotes_the_record():
    page = (ROOT / "docs" / "site" / "guide" / "costs.md").read_text()
    data = json.loads(RECORD.read_text())
    for r in data["rows"]:
        row = f"| {r['kernel']} | {1e3 * r['seconds']:.3f} |"
        assert row in page and f"| {r['time_over_bound']:.1f}x |" in page, row
    assert f"{data['copy']['gb_per_second']:.1f} GB/s" in page
    command = "PYTHONPATH=.:experiments python3 experiments/benchmarks/bench_kernels.py --out"
    assert command in page and "gradcomm/perfmodel/kernels_gpu/bench_kernels.json" in page
    choosing = (ROOT / "docs" / "site" / "choosing.md").read_text()
    assert "python -m gradcomm.perfmodel recommend --params 124M --nodes 32 --link 10gbit" in (
        choosing
    )
