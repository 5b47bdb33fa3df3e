"""experiments/studies/powersgd_rank.py: the study runs at its smallest; its verdict is computed."""

import json

import numpy as np
import pytest
from test_experiments import check_provenance, import_script, main_in_process, run

powersgd_rank = import_script("powersgd_rank.py")

SCRIPT = "powersgd_rank.py"
TINY = ["--devices", "2", "--seeds", "0", "--epochs", "1", "--batch-size", "64", "--ranks", "1,2"]


@pytest.mark.slow
def test_study_runs_and_writes_json_png_and_markdown(tmp_path):
    result = run(SCRIPT, *TINY, "--quiet", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    study = json.loads((tmp_path / "powersgd_rank.json").read_text())
    assert {"config", "provenance", "runs", "rows", "verdict"} <= set(study)
    check_provenance(study["provenance"], devices=2, seeds=[0])
    assert study["config"]["lr"] == 0.2 and study["config"]["devices"] == 2
    assert study["config"]["split_seed"] == 0 and "seed" not in study["config"]

    runs, rows = study["runs"], study["rows"]
    names = ["allreduce", "powersgd rank 1", "powersgd rank 2"]
    assert [r["method"] for r in runs] == names and [r["method"] for r in rows] == names
    assert all(np.isfinite(r["losses"]).all() and r["bytes_per_step"] > 0 for r in runs)
    base, one, two = rows
    assert [row["rank"] for row in rows] == [None, 1, 2]
    assert base["bytes_vs_allreduce"] == 1 and base["gap_per_seed"] == [0]
    assert 0 < one["bytes_per_step"] < two["bytes_per_step"] < base["bytes_per_step"]
    assert two["bytes_vs_allreduce"] < 1 < two["compression"]
    for row in rows:
        assert len(row["test_accuracy_per_seed"]) == 1
        assert row["gap_mean"] == pytest.approx(
            row["test_accuracy_mean"] - base["test_accuracy_mean"]
        )
        # The compiled step sends r (m + n) numbers per compressed leaf (two ring
        # all-reduces' worth, 4 bytes each on 2 devices), plus the same two metrics for all.
        assert row["ring_bytes_formula"] == 4 * row["numbers_per_step"]
        extra = row["bytes_per_step"] - row["ring_bytes_formula"]
        assert extra == base["bytes_per_step"] - base["ring_bytes_formula"] == 8

    # The verdict is the rows' numbers, not a fixed sentence.
    gap = two["gap_mean"]
    assert study["verdict"].startswith("Against the all-reduce")
    assert f"rank 2 is {abs(gap):.2f} points {'above' if gap > 0 else 'below'}" in study["verdict"]
    assert ("not held" in study["verdict"]) == (gap < -1.0)
    table = (tmp_path / "powersgd_rank.md").read_text()
    assert "| powersgd rank 2 |" in table and "Verdict: rank 2" in table
    assert (tmp_path / "powersgd_rank.png").read_bytes()[:4] == b"\x89PNG"


def test_help_shows_defaults(monkeypatch, capsys):
    assert main_in_process(SCRIPT, "--help", monkeypatch=monkeypatch) == 0
    shown = capsys.readouterr().out
    for default in ("1,2,4", "0,1,2,3,4", "0.2", "cosine", "20", "16"):
        assert f"(default: {default})" in shown, default
    assert "python experiments/studies/powersgd_rank.py" in shown and "--quiet" in shown
    # One seed option: --seeds, the studies' convention (train.py's single run takes --seed).
    assert "--seeds SEEDS" in shown and "--seed " not in shown and "--seed=" not in shown


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--ranks", "0,2"], "every rank must be at least 1"), (["--tolerance", "-1"], "negative")],
)
def test_bad_arguments_exit_with_a_message(args, message, tmp_path, monkeypatch, capsys):
    code = main_in_process(SCRIPT, *args, "--out", str(tmp_path), monkeypatch=monkeypatch)
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _row(rank, accuracies, base):
    gaps = [a - b for a, b in zip(accuracies, base, strict=True)]
    return {
        "rank": rank,
        "test_accuracy_mean": float(np.mean(accuracies)),
        "test_accuracy_per_seed": accuracies,
        "gap_per_seed": gaps,
        "gap_mean": float(np.mean(gaps)),
        "bytes_vs_allreduce": None if rank is None else 0.01 * rank,
    }


def test_verdict_follows_the_numbers():
    base = [97.0, 96.0, 98.0]
    close = [_row(None, base, base), _row(1, [95.0] * 3, base), _row(2, [96.5, 96.5, 97.0], base)]
    verdict = powersgd_rank.conclude(close, tolerance=1.0)
    assert "rank 2 is 0.33 points below" in verdict and "held, within" in verdict
    assert "at or above it on 1 of 3 seeds" in verdict and "Rank 1 is at or below rank 2" in verdict
    far = [close[0], _row(2, [95.0, 94.0, 96.0], base)]
    verdict = powersgd_rank.conclude(far, tolerance=1.0)
    assert "2.00 points below" in verdict and "not held, beyond the tolerance of 1 point" in verdict
    assert "held, within the tolerance of 2.5 points" in powersgd_rank.conclude(far, tolerance=2.5)
    above = [close[0], _row(2, [99.0, 98.0, 99.0], base)]
    assert "1.67 points above" in powersgd_rank.conclude(above, tolerance=0)
    assert "no verdict" in powersgd_rank.conclude(close[:2], tolerance=1.0)
