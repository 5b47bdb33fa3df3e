"""experiments/benchmarks/bench_overlap.py: its flags, and a tiny run on loopback.

The run starts two gloo processes on 127.0.0.1 and times a 1 MiB psum, a short matmul
chain and both in one program; the record carries the three times, their ratios and the
provenance of a two-process run.
"""

import json

from test_experiments import check_provenance, main_in_process, run

SCRIPT = "bench_overlap.py"


def test_help_lists_the_flags(monkeypatch, capsys):
    assert main_in_process(SCRIPT, "--help", monkeypatch=monkeypatch) == 0
    shown = capsys.readouterr().out
    for flag in ("--mode", "--nodes", "--rates", "--flags", "--mib", "--repeats", "--out"):
        assert flag in shown
    assert "python experiments/benchmarks/bench_overlap.py" in shown and "(default:" in shown


def test_a_tiny_run_on_loopback(tmp_path):
    args = ["--nodes", "2", "--rates", "loopback", "--flags", "default", "--mib", "1"]
    args += ["--dim", "64", "--matmuls", "2", "--repeats", "2", "--out", str(tmp_path)]
    proc = run(SCRIPT, *args, "--quiet", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "bench_overlap.json").read_text())
    (record,) = out["records"]
    assert record["nodes"] == 2 and record["rate"] == "loopback"
    assert {"psum", "compute", "both"} <= set(record["result"])
    assert all(record["result"][k] > 0 for k in ("psum", "compute", "both"))
    verdict = record["verdict"]
    assert verdict["max"] <= verdict["sum"] and verdict["both/sum"] > 0
    check_provenance(out["provenance"], devices=2, seeds=[0], processes=2)
    assert "| 2 | loopback |" in (tmp_path / "bench_overlap.md").read_text()
