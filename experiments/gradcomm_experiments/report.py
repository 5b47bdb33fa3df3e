"""Outputs: a study's JSON, Markdown and PNGs, each method's colour and marker, and tables.

Every plot draws a method in its `style`: one colour per method of compare.py (no two
alike: the nearest pair is over 20 CIEDE2000 units apart) and one filled marker per method
of the registry (`methods.METHODS`), the same in every figure. A study run over several
seeds reports each method's mean and its min-max over the seeds (`summarize`). JAX is not
imported here, so the network benchmark's driver draws with the same styles.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradcomm_experiments.methods import COMPARE, METHODS

if TYPE_CHECKING:
    from gradcomm_experiments.loop import RunResult

# One colour per method of compare.py, in its order: black for the all-reduce baseline,
# then 13 picked from Paul Tol's, Kelly's and matplotlib's tab10 qualitative colours for the
# largest smallest difference between any two (CIEDE2000 above 21; lags and diloco, 11
# apart before, now 58), none lighter than L* 75, so each shows on white; then, for
# Streaming DiLoCo and 1-bit Adam, the HSV grid's colours farthest from those (above 22).
PALETTE = (
    "#000000", "#0077BB", "#CC3311", "#228833", "#8DB600", "#F6A600", "#654522", "#33BBEE",
    "#E377C2", "#882255", "#604E97", "#44AA99", "#7F7F7F", "#F99379", "#1B5954", "#000059",
)  # fmt: skip
# Filled markers only (an outline such as "x", "+" or "|" all but vanishes at 5 points): the
# methods of compare.py take the first ones, in its order; the registry's other methods the
# rest, in its order (regular polygons and stars matplotlib draws from (sides, style, angle)).
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "h", "p", "<", ">", "d", "H", "8",
           (6, 1, 0), (4, 1, 0), (5, 0, 180), (7, 0, 0), (3, 1, 0), (4, 1, 45), (8, 1, 0),
           (5, 1, 180), (10, 1, 0), (3, 1, 180), (7, 1, 0), (9, 0, 0), (9, 1, 0),
           (8, 0, 22.5), (11, 0, 0), (11, 1, 0), (12, 1, 0), (10, 0, 18))  # fmt: skip
LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1)))


def _family(label: str) -> str:
    """The method of compare.py that `label` is a variant of (itself if it is one)."""
    if label in COMPARE:
        return label
    return next(c for c in COMPARE if METHODS[c].method == METHODS[label].method)


def style(label: str, variant: int = 0) -> dict[str, Any]:
    """Matplotlib keywords (colour, marker, line style) of the registry's method `label`.

    Each method of compare.py has its own colour and marker; the registry's other methods
    (adasum-permute, lags-0.001, ...) take the colour of the method they vary, their own
    marker, and a broken line. A study's own variant of a method (`variant` 1, 2, ...:
    another density, topology, ...) keeps the method's colour and marker, hollow, on the
    `variant`-th broken line.
    """
    if label not in METHODS:
        raise KeyError(f"{label!r} is not in the registry: one of {', '.join(METHODS)}")
    family = _family(label)
    siblings = [m for m in METHODS if m not in COMPARE and _family(m) == family]
    level = variant + (siblings.index(label) + 1 if label in siblings else 0)
    colour = PALETTE[COMPARE.index(family) % len(PALETTE)]
    order = [*COMPARE, *(m for m in METHODS if m not in COMPARE)]
    return {
        "color": colour,
        "marker": MARKERS[order.index(label) % len(MARKERS)],
        "linestyle": LINESTYLES[level % len(LINESTYLES)],
        "markerfacecolor": "white" if variant else colour,
        "markeredgecolor": colour,
    }


def count(n: int, noun: str) -> str:
    """`n` `noun`s, in words for a title: "1 device", "8 devices"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def write_bench(
    out: str | os.PathLike,
    name: str,
    result: dict[str, Any],
    table: str,
    draw: Callable[[Any], None],
    **figure: Any,
) -> pathlib.Path:
    """A benchmark's outputs in `out`: `<name>.json` (`result`), `<name>.md` (`table`) and
    `<name>.png` (`save_figure(draw, **figure)`). Returns the folder."""
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(result, indent=1))
    (folder / f"{name}.md").write_text(table + "\n")
    save_figure(folder / f"{name}.png", draw, **figure)
    return folder


def save_figure(
    path: str | os.PathLike,
    draw: Callable[[Any], None],
    *,
    title: str,
    size: tuple[float, float] = (11, 4.2),
) -> None:
    """Draws `draw(figure)` under `title` and writes the PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from cycler import cycler

    # Lines that are not a method's (layers, kernels) cycle through the same palette.
    with plt.rc_context({"axes.prop_cycle": cycler(color=PALETTE[1:])}):
        fig = plt.figure(figsize=size, layout="constrained")
        draw(fig)
        fig.suptitle(title)
        fig.savefig(path, dpi=110)
        plt.close(fig)


def write_study(
    out: str | os.PathLike,
    name: str,
    config: dict[str, Any],
    results: Sequence[RunResult],
    table: str,
    plot: Callable[[Any], None],
    extra: dict[str, Any] | None = None,
    *,
    provenance: dict[str, Any],
    title: str,
    figures: Mapping[str, tuple[str, Callable[[Any], None]]] | None = None,
    run_seeds: Sequence[int] | None = None,
) -> pathlib.Path:
    """Writes `name`.json (config, provenance, every run, `extra`), `name`.md and
    `name`.png under `out`, plus a PNG per `figures` entry (`{file stem: (title, draw)}`).

    `plot(figure)` draws on a matplotlib figure, titled `title`. With `run_seeds` (one per
    run), each run's record says its seed.
    """
    path = pathlib.Path(out)
    path.mkdir(parents=True, exist_ok=True)
    runs = [dataclasses.asdict(r) for r in results]
    if run_seeds is not None:
        runs = [{"seed": int(seed), **run} for seed, run in zip(run_seeds, runs, strict=True)]
    payload = {"config": config, "provenance": provenance, "runs": runs, **(extra or {})}
    (path / f"{name}.json").write_text(json.dumps(_jsonable(payload), indent=1))
    (path / f"{name}.md").write_text(table + "\n")
    save_figure(path / f"{name}.png", plot, title=title)
    for stem, (caption, draw) in (figures or {}).items():
        save_figure(path / f"{stem}.png", draw, title=caption, size=(9, 5))
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


def by_method(results: Sequence[RunResult]) -> dict[str, list[RunResult]]:
    """Each method's runs (one per seed), the methods in the order they first ran."""
    groups: dict[str, list[RunResult]] = {}
    for r in results:
        groups.setdefault(r.method, []).append(r)
    return groups


def final_loss(result: RunResult) -> float:
    """A run's final training loss: the mean of its last 10 steps."""
    return float(np.mean(result.losses[-10:]))


def spread(values: Sequence[float]) -> dict[str, Any]:
    """`values` (one per seed) as their mean, min and max, and the values themselves."""
    v = np.asarray(values, dtype=float)
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()),
            "per_seed": v.tolist()}  # fmt: skip


def mean_range(mean: float, low: float, high: float, digits: int, unit: str = "") -> str:
    """A table cell: `mean` and, in brackets, the range over seeds, "98.24% (97.50-98.61)"."""
    return f"{mean:.{digits}f}{unit} ({low:.{digits}f}-{high:.{digits}f})"


def summarize(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per method, over its runs (seeds, in the order they ran): test accuracy and final loss
    (`spread`: mean, min, max, each seed's), bytes per step (the same every seed: read from
    the compiled step) and the mean step time."""
    return [
        {
            "method": name,
            "test_accuracy": spread([r.test_accuracy for r in runs]),
            "final_loss": spread([final_loss(r) for r in runs]),
            "bytes_per_step": float(np.mean([r.bytes_per_step for r in runs])),
            "step_seconds": float(np.mean([r.step_seconds for r in runs])),
        }
        for name, runs in by_method(results).items()
    ]


def plot_runs(results: Sequence[RunResult], fig: Any) -> None:
    """Training loss per step (a running mean over 10 steps when there are 50 or more) and
    test accuracy per epoch, one line per method: the mean over its seeds (runs; their
    spread: `plot_bytes`). The accuracy axis fits the second half of training (all of it
    under 4 epochs), where the methods part; earlier epochs run below it."""
    left, right = fig.subplots(1, 2)
    groups = by_method(results)
    window = 10 if min(len(r.losses) for r in results) >= 50 else 1
    seeds = max(len(runs) for runs in groups.values())
    low, high = [], []
    for k, (name, runs) in enumerate(groups.items()):
        loss = np.mean(
            [np.convolve(r.losses, np.ones(window) / window, mode="valid") for r in runs], axis=0
        )
        every = max(1, len(loss) // 8)
        kw = {**style(name), "markersize": 5}
        steps = np.arange(window, len(loss) + window)
        left.plot(steps, loss, lw=1, markevery=(k * every // len(groups), every), **kw)
        mean = 100 * np.mean([r.epoch_accuracy for r in runs], axis=0)
        epochs = np.arange(1, len(mean) + 1)
        every = max(1, len(mean) // 8)
        right.plot(epochs, mean, label=name, lw=1.2, markevery=(k % every, every), **kw)
        first = len(epochs) // 2 if len(epochs) >= 4 else 0
        low.append(mean[first:].min())
        high.append(mean[first:].max())
    smooth = f", {window}-step running mean" if window > 1 else ""
    over = f"mean over {seeds} seeds" if seeds > 1 else ""
    left.set(
        xlabel="step", ylabel="training loss (cross-entropy)", yscale="log",
        title=f"training loss (log scale{smooth})" + (f"\n{over}" if over else ""),
    )  # fmt: skip
    pad = max(0.15, 0.08 * (max(high) - min(low)))
    fit = f"axis fit to epochs {first + 1}-{len(epochs)}" if first else ""
    notes = "; ".join(note for note in (over, fit) if note)
    right.set(
        xlabel="epoch", ylabel="test accuracy (%)",
        title="test accuracy after each epoch" + (f"\n{notes}" if notes else ""),
        ylim=(min(low) - pad, min(100.0 + pad / 2, max(high) + pad)),
    )  # fmt: skip
    right.xaxis.get_major_locator().set_params(integer=True)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """The indices of the (bytes, accuracy) points no other point beats: none sends no
    more bytes with no less accuracy, and fewer bytes or more accuracy."""
    return [
        i
        for i, (b, a) in enumerate(points)
        if not any(c <= b and d >= a and (c < b or d > a) for c, d in points)
    ]


def plot_bytes(results: Sequence[RunResult], fig: Any) -> None:
    """Final test accuracy against bytes sent per device per step (log), the front marked.

    Each method's marker is its mean over seeds (runs), its error bar the min and max;
    methods within 2% of each other's bytes are drawn side by side (a few percent apart),
    so that their bars do not hide each other. The Pareto front is that of the means.
    """
    from matplotlib import ticker

    ax = fig.subplots()
    summary = [s for s in summarize(results) if s["bytes_per_step"] > 0]
    if not summary:
        ax.text(0.5, 0.5, ONE_DEVICE.replace(". ", ".\n"), ha="center", va="center", wrap=True)
        ax.set_axis_off()
        return
    seeds = max(len(s["test_accuracy"]["per_seed"]) for s in summary)
    xs = _side_by_side([s["bytes_per_step"] for s in summary])
    points = [(x, 100 * s["test_accuracy"]["mean"]) for x, s in zip(xs, summary, strict=True)]
    means = [(s["bytes_per_step"], s["test_accuracy"]["mean"]) for s in summary]
    front = sorted((points[i] for i in pareto_front(means)), key=lambda p: p[0])
    ax.plot(*zip(*front, strict=True), color="0.6", lw=5, alpha=0.5, drawstyle="steps-post",
            zorder=1, label="Pareto front of the means:\nmost accuracy for its bytes")  # fmt: skip
    labels = []
    for s, (x, y) in zip(summary, points, strict=True):
        acc = s["test_accuracy"]
        err = [[y - 100 * acc["min"]], [100 * acc["max"] - y]]
        kw = style(s["method"]) | {"linestyle": "none", "markeredgecolor": "0.15",
                                    "markeredgewidth": 0.7}  # fmt: skip
        ax.errorbar([x], [y], yerr=err if seeds > 1 else None, markersize=9, zorder=3,
                    capsize=3, elinewidth=1.3, label=s["method"], **kw)  # fmt: skip
        labels.append(ax.annotate(s["method"], (x, y), textcoords="offset points",
                                  xytext=(7, 3), fontsize=7, zorder=4))  # fmt: skip
    over = f", mean and min-max over {seeds} seeds" if seeds > 1 else ""
    ax.set(
        xscale="log", xlabel="bytes sent per device per step (log scale)",
        ylabel=f"final test accuracy (%{over})",
    )  # fmt: skip
    ax.margins(x=0.12, y=0.06)  # room for the labels
    ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    _unoverlap(fig, labels)


def _side_by_side(sent: Sequence[float], close: float = 0.02, step: float = 0.012) -> list[float]:
    """`sent` with the values within `close` (relative) of another spread `step` decades
    apart around their place (a plot's dodge), each value's order kept."""
    order = sorted(range(len(sent)), key=lambda i: sent[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and sent[i] <= sent[groups[-1][-1]] * (1 + close):
            groups[-1].append(i)
        else:
            groups.append([i])
    xs = list(sent)
    for group in groups:
        for k, i in enumerate(group):
            xs[i] = sent[i] * 10 ** (step * (k - (len(group) - 1) / 2))
    return xs


def _unoverlap(fig: Any, labels: Sequence[Any], points: float = 3.0) -> None:
    """Moves each label, lowest first, up by `points` at a time (after 20 steps, down from
    where it was) until it overlaps no label placed before it: nearby points' labels stay
    readable."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    placed: list[Any] = []
    for label in sorted(labels, key=lambda t: t.get_window_extent(renderer).y0):
        x, y = label.xyann
        for k in range(40):
            box = label.get_window_extent(renderer)
            if not any(box.overlaps(p) for p in placed):
                break
            label.xyann = (x, y + points * (k + 1) if k < 20 else y - points * (k - 19))
        placed.append(label.get_window_extent(renderer))


ONE_DEVICE = (
    "One device: nothing crosses a wire, so every method sends 0 bytes and runs as local "
    "training. Run on several devices (on a CPU, `--devices 8`) to compare what they send."
)


def results_table(results: Sequence[RunResult], baseline: str = "allreduce") -> str:
    """A Markdown table: accuracy, loss, bytes per step and step time against the baseline.

    One row per method; a method run over several seeds (several runs of one name) shows
    its accuracy and loss as the mean (min-max) over them, its mean step time.
    """
    summary = summarize(results)
    base = next((s for s in summary if s["method"] == baseline), summary[0])
    seeds = max(len(s["test_accuracy"]["per_seed"]) for s in summary)
    over = f", mean (min-max) over {seeds} seeds" if seeds > 1 else ""
    loss = ", mean (min-max)" if seeds > 1 else ""
    rows = [
        f"| method | test accuracy{over} | final loss{loss} "
        f"| bytes sent per device per step | bytes vs {base['method']} "
        f"| step time vs {base['method']} |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summary:
        acc, final, sent = s["test_accuracy"], s["final_loss"], s["bytes_per_step"]
        many = len(acc["per_seed"]) > 1
        acc_cell = (
            mean_range(100 * acc["mean"], 100 * acc["min"], 100 * acc["max"], 2, "%")
            if many
            else f"{100 * acc['mean']:.2f}%"
        )
        loss_cell = (
            mean_range(final["mean"], final["min"], final["max"], 4)
            if many
            else f"{final['mean']:.4f}"
        )
        vs = f"{sent / base['bytes_per_step']:.3f}" if base["bytes_per_step"] else "-"
        time = s["step_seconds"] / base["step_seconds"]
        rows.append(
            f"| {s['method']} | {acc_cell} | {loss_cell} | {sent:,.0f} | {vs} | {time:.2f}x |"
        )
    if not any(s["bytes_per_step"] for s in summary):
        rows += ["", ONE_DEVICE]
    return "\n".join(rows)
