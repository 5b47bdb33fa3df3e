"""Outputs: a study's JSON, Markdown and PNG, the curves of several runs, and their table."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from _loop import RunResult


def write_study(
    out: str | os.PathLike,
    name: str,
    config: dict[str, Any],
    results: Sequence[RunResult],
    table: str,
    plot: Callable[[Any], None],
    extra: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Writes `name`.json (config, every run, `extra`), `name`.md and `name`.png under `out`.

    `plot(figure)` draws on a matplotlib figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = pathlib.Path(out)
    path.mkdir(parents=True, exist_ok=True)
    payload = {"config": config, "runs": [dataclasses.asdict(r) for r in results], **(extra or {})}
    (path / f"{name}.json").write_text(json.dumps(_jsonable(payload), indent=1))
    (path / f"{name}.md").write_text(table + "\n")
    fig = plt.figure(figsize=(11, 4))
    plot(fig)
    fig.tight_layout()
    fig.savefig(path / f"{name}.png", dpi=110)
    plt.close(fig)
    return path


def _jsonable(value: Any) -> Any:
    """NumPy arrays and scalars inside nested containers to plain lists and floats."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    return value


def plot_runs(results: Sequence[RunResult], fig: Any) -> None:
    """Training loss per step and test accuracy per epoch, one line per run."""
    left, right = fig.subplots(1, 2)
    for r in results:
        left.plot(r.losses, label=r.method, lw=1)
        right.plot(range(1, len(r.epoch_accuracy) + 1), r.epoch_accuracy, label=r.method)
    left.set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
    right.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


ONE_DEVICE = (
    "One device: nothing crosses a wire, so every method sends 0 bytes and runs as local "
    "training. Run on several devices (on a CPU, `--devices 8`) to compare what they send."
)


def results_table(results: Sequence[RunResult], baseline: str = "allreduce") -> str:
    """A Markdown table: accuracy, loss, bytes per step and step time against the baseline."""
    base = next((r for r in results if r.method == baseline), results[0])
    rows = [
        f"| method | test accuracy | final loss | bytes sent per device per step "
        f"| bytes vs {base.method} | step time vs {base.method} |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        final = float(np.mean(r.losses[-10:]))
        vs = f"{r.bytes_per_step / base.bytes_per_step:.3f}" if base.bytes_per_step else "-"
        rows.append(
            f"| {r.method} | {100 * r.test_accuracy:.2f}% | {final:.4f} "
            f"| {r.bytes_per_step:,.0f} | {vs} | {r.step_seconds / base.step_seconds:.2f}x |"
        )
    if not any(r.bytes_per_step for r in results):
        rows += ["", ONE_DEVICE]
    return "\n".join(rows)
