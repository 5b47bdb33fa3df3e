"""Outputs: a study's JSON, Markdown and PNGs, each method's colour and marker, and tables.

Every plot draws a method in its `style`: one colour-blind-safe colour and one marker per
method of the registry (`_methods.METHODS`), the same in every figure. JAX is not
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
from _methods import COMPARE, METHODS

if TYPE_CHECKING:
    from _loop import RunResult

# Paul Tol's "muted" scheme (colour-blind safe), with black for the all-reduce baseline and
# grey, then orange, blue and pear from his "vibrant" and "light" schemes: one colour per
# method of compare.py, in its order.
PALETTE = (
    "#000000", "#CC6677", "#332288", "#DDCC77", "#117733", "#88CCEE", "#882255", "#44AA99",
    "#999933", "#AA4499", "#777777", "#EE7733", "#0077BB", "#BBCC33",
)  # fmt: skip
# One marker per method of the registry, in its order.
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "h", "p", "<", ">", "d", "H", "8",
           "x", "+", "1", "2", "3", "4", "|")  # fmt: skip
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
    return {
        "color": colour,
        "marker": MARKERS[list(METHODS).index(label) % len(MARKERS)],
        "linestyle": LINESTYLES[level % len(LINESTYLES)],
        "markerfacecolor": "white" if variant else colour,
        "markeredgecolor": colour,
    }


def count(n: int, noun: str) -> str:
    """`n` `noun`s, in words for a title: "1 device", "8 devices"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


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
) -> pathlib.Path:
    """Writes `name`.json (config, provenance, every run, `extra`), `name`.md and
    `name`.png under `out`, plus a PNG per `figures` entry (`{file stem: (title, draw)}`).

    `plot(figure)` draws on a matplotlib figure, titled `title`.
    """
    path = pathlib.Path(out)
    path.mkdir(parents=True, exist_ok=True)
    runs = [dataclasses.asdict(r) for r in results]
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


def plot_runs(results: Sequence[RunResult], fig: Any) -> None:
    """Training loss per step (a running mean over 10 steps when there are 50 or more) and
    test accuracy per epoch, one line per run."""
    left, right = fig.subplots(1, 2)
    window = 10 if min(len(r.losses) for r in results) >= 50 else 1
    for k, r in enumerate(results):
        loss = np.convolve(r.losses, np.ones(window) / window, mode="valid")
        every = max(1, len(loss) // 8)
        kw = {**style(r.method), "markersize": 5}
        steps = np.arange(window, len(r.losses) + 1)
        left.plot(steps, loss, lw=1, markevery=(k * every // len(results), every), **kw)
        epochs = range(1, len(r.epoch_accuracy) + 1)
        right.plot(epochs, 100 * np.asarray(r.epoch_accuracy), label=r.method, **kw)
    mean = f", {window}-step running mean" if window > 1 else ""
    left.set(
        xlabel="step", ylabel=f"training loss (cross-entropy{mean})", yscale="log",
        title="training loss (log scale)",
    )  # fmt: skip
    right.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy after each epoch")
    right.xaxis.get_major_locator().set_params(integer=True)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    right.legend(fontsize=7, ncol=2)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """The indices of the (bytes, accuracy) points no other point beats: none sends no
    more bytes with no less accuracy, and fewer bytes or more accuracy."""
    return [
        i
        for i, (b, a) in enumerate(points)
        if not any(c <= b and d >= a and (c < b or d > a) for c, d in points)
    ]


def plot_bytes(results: Sequence[RunResult], fig: Any) -> None:
    """Final test accuracy against bytes sent per device per step (log), the front marked."""
    from matplotlib import ticker

    ax = fig.subplots()
    sent = [r for r in results if r.bytes_per_step > 0]
    if not sent:
        ax.text(0.5, 0.5, ONE_DEVICE.replace(". ", ".\n"), ha="center", va="center", wrap=True)
        ax.set_axis_off()
        return
    points = [(r.bytes_per_step, 100 * r.test_accuracy) for r in sent]
    front = sorted((points[i] for i in pareto_front(points)), key=lambda p: p[0])
    ax.plot(*zip(*front, strict=True), color="0.6", lw=5, alpha=0.5, drawstyle="steps-post",
            zorder=1, label="Pareto front: most\naccuracy for its bytes")  # fmt: skip
    names: dict[tuple[float, float], list[str]] = {}
    for r, point in zip(sent, points, strict=True):
        ax.plot(*point, markersize=9, zorder=2, label=r.method,
                **(style(r.method) | {"linestyle": "none"}))  # fmt: skip
        names.setdefault(point, []).append(r.method)
    for point, shared in names.items():  # methods at the same point share one label
        ax.annotate(", ".join(shared), point, textcoords="offset points", xytext=(7, 5),
                    fontsize=7)  # fmt: skip
    ax.set(
        xscale="log", xlabel="bytes sent per device per step (log scale)",
        ylabel="final test accuracy (%)",
    )  # fmt: skip
    ax.margins(x=0.12, y=0.08)  # room for the labels
    ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))


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
