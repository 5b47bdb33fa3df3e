#!/usr/bin/env python
"""The DiLoCo family against the all-reduce: local SGD, DiLoCo, Streaming DiLoCo, eager updates.

    python experiments/studies/diloco_family.py            # digits, 4 simulated devices, 3 seeds
    python experiments/studies/diloco_family.py --seeds 0 --fragments 2 --outer-dtypes e3m0
    python experiments/studies/diloco_family.py --runs diloco,streaming --delays 0,1,2,5

The claims: Streaming DiLoCo (Douillard et al. 2025, Algorithm 1) matches DiLoCo's loss
while its peak bytes fall to one fragment's; its 4-bit (E3M0) outer gradients cost nothing
against float32; eager updates (Kale et al. 2025) keep DiLoCo's loss while the outer step's
exchange overlaps the next period; 1-bit Adam (Tang et al., ICML 2021, Algorithm 1)
converges like Adam after its warm-up. The small CNN of compare.py on the digits, the inner
optimizer as there (Adam, cosine decay), the outer one DiLoCo's (Nesterov, rate 0.7,
momentum 0.9), the same H (--every) for local SGD and every DiLoCo. Streaming DiLoCo runs
every combination of --fragments (P), --delays (tau) and --outer-dtypes; the claims are
judged at P = 2, tau = 1, E3M0 (`CENTER`). Each run: final training loss and test accuracy
over the seeds (mean, min-max); bytes each device sends per step, average and peak (the
worst step after warm-ups), read from the compiled step with gradcomm.wire; step time at
--rate on --nodes emulated hosts, from the network benchmark's records (--network) where
they have the method, beside gradcomm.perfmodel's prediction calibrated on those records
(a model figure). Writes diloco_family.{json,png,md} to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import pathlib
from typing import Any

import jax
import numpy as np

import gradcomm
from gradcomm import parallel, perfmodel
from gradcomm_experiments import cli, loop, provenance, report, runtime, tasks
from gradcomm_experiments import data as datasets
from gradcomm_experiments import methods as registry
from gradcomm_experiments.network.worker import peak_after_warmup

RUNS = ("allreduce", "local-sgd", "diloco", "diloco-eager", "streaming", "streaming-eager",
        "onebit-adam", "onebit-adam-eps")  # fmt: skip
# 1-bit Adam's eps beside Adam's 1e-8 ("onebit-adam-eps"): about the median sqrt(v) of the
# CNN at the freeze, where entries with v = 0 would step the scale over 1e-8 (compare.py's).
ONEBIT_EPS = 1e-3
CENTER = (2, 1, "e3m0")  # Streaming DiLoCo's P, tau and outer dtype that the grid varies around
NETWORK = pathlib.Path(__file__).resolve().parents[2] / "docs/bench/diloco_family/network.json"
Summary = dict[str, dict[str, Any]]  # report.summarize's entries by run label
Wire = dict[str, dict[str, float]]  # per run label: average, peak, total, period
Results = list[loop.RunResult]


@dataclasses.dataclass(frozen=True)
class Run:
    """One configuration: its label, its spec, the registry entry it draws as
    (`report.style`), and its variant there (0: the entry itself)."""

    label: str
    spec: registry.Spec
    family: str
    variant: int = 0

    @property
    def grid(self) -> tuple[str, str] | None:
        """("P=2 tau=1", "e3m0") for a run of Streaming DiLoCo's grid; None for the others."""
        words = self.label.split()
        return (" ".join(words[1:3]), words[3]) if "tau=" in self.label else None


def streaming_label(fragments: int, delay: int | None, dtype: str) -> str:
    """A Streaming DiLoCo run's label; `delay` None: eager updates."""
    return f"streaming P={fragments} {'eager' if delay is None else f'tau={delay}'} {dtype}"


def configurations(args: argparse.Namespace) -> list[Run]:
    """The study's runs, in the order of `--runs`, "streaming" expanded to `grid`. The
    grid's center and its float32 twin draw as the registry's two Streaming DiLoCo
    entries, its other points and eager updates as variants (hollow, broken lines)."""
    every, specs, out, variants = args.every, registry.METHODS, [], itertools.count(1)
    for name in cli.comma_list(args.runs, str, "--runs"):
        if name in ("allreduce", "local-sgd", "diloco", "diloco-eager", *RUNS[-2:]):
            spec = specs[name.removesuffix("-eps")]
            spec = spec.configured(every=every) if spec.every else spec
            if name.startswith("onebit-adam"):
                spec = spec.configured(warmup_steps=args.warmup_steps)
            if name == "onebit-adam-eps":
                spec = spec.configured(eps=ONEBIT_EPS)
            family = name.removesuffix("-eps")  # the eps variant: hollow, 1-bit Adam's colour
            out.append(Run(name, spec, family, 0 if family == name else next(variants)))
            continue
        points = grid(args) if name == "streaming" else [(CENTER[0], None, CENTER[2])]
        for p, tau, d in points:
            timing = {"eager": True} if tau is None else {"delay": tau}
            spec = specs["streaming-diloco"].configured(
                every=every, fragments=p, outer_dtype=d, **timing
            )
            own = (p, tau) == CENTER[:2] and d in ("e3m0", "float32")
            family = "streaming-diloco-f32" if own and d == "float32" else "streaming-diloco"
            out.append(Run(streaming_label(p, tau, d), spec, family, 0 if own else next(variants)))
    return [dataclasses.replace(r, spec=dataclasses.replace(r.spec, label=r.label)) for r in out]


def grid(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    """Streaming DiLoCo's (P, tau, dtype): every combination of the flags' values."""
    flags = ("fragments", int), ("delays", int), ("outer_dtypes", str)
    return list(itertools.product(*(cli.comma_list(getattr(args, f), t, f) for f, t in flags)))


def check_flags(args: argparse.Namespace) -> None:
    """Known runs and dtypes, each P dividing H, each tau below H, a warm-up of 1 or more."""
    unknown = set(cli.comma_list(args.runs, str, "--runs")) - set(RUNS)
    if unknown:
        raise ValueError(f"--runs: unknown {', '.join(sorted(unknown))}; choose from {RUNS}")
    if set(cli.comma_list(args.outer_dtypes, str, "--outer-dtypes")) - {"float32", "e3m0"}:
        raise ValueError(f"--outer-dtypes {args.outer_dtypes}: choose from float32, e3m0")
    for p, tau, _ in grid(args):
        if p < 1 or args.every % p or not 0 <= tau < args.every:
            raise ValueError(
                f"--every {args.every} with P = {p}, tau = {tau}: each P must divide --every "
                "and each tau be in [0, --every)"
            )
    if args.warmup_steps < 1:
        raise ValueError(f"--warmup-steps {args.warmup_steps}: must be at least 1")


def _effective(spec: registry.Spec | dict[str, Any], warmup: bool = True) -> str:
    """A spec's (or network.json record's) method, every factory option (but a warm-up's
    length, unless `warmup`: it sets no step after the warm-up) and sync, as a key."""
    row = spec.describe() if isinstance(spec, registry.Spec) else spec
    options = gradcomm.registry.METHODS[row["method"]].options(row["options"])
    if row["method"] == "streaming_diloco" and options["delay"] is None:  # the factory's rule
        options["delay"] = 0 if options["eager"] else 1
    options = {k: v for k, v in options.items() if warmup or k != "warmup_steps"}
    return json.dumps([row["method"], options, row["sync"]], sort_keys=True, default=str)


def network_times(path: pathlib.Path, runs: list[Run], nodes: int, rate: str) -> dict[str, Any]:
    """Each run's step time over the all-reduce's at `rate` on `nodes` hosts: measured
    (the latest record, one device per host, of the same method, options and sync, or
    failing that the same but for the warm-up's length, which the record then names) where
    the network benchmark has one, and the model's (`perfmodel` calibrated on the records,
    for a record of the run's spec at the all-reduce record's size and link)."""
    out: dict[str, Any] = {"measured": {}, "model": {}}
    try:
        records, cal, _ = perfmodel.fit_file(path)
    except (OSError, ValueError) as e:  # no file, or one being rewritten: say so
        return {"error": f"{path}: {e}", **out}
    cell = [r for r in records if (r["nodes"], r.get("rate")) == (nodes, rate) and r.get("step_s")]
    latest = {}
    for r in sorted(cell, key=lambda r: r["provenance"].get("started_utc", "")):
        if r.get("devices_per_process", 1) == 1:
            latest[_effective(r)] = latest[_effective(r, warmup=False)] = r
    if (base := latest.get(_effective(registry.METHODS["allreduce"]))) is None:
        return {"error": f"{path}: no allreduce at {rate}, N = {nodes}", **out}
    ar = cal.predict_record(base, "allreduce").step_s
    for run in runs:
        row = latest.get(_effective(run.spec)) or latest.get(_effective(run.spec, warmup=False))
        if row is not None:
            out["measured"][run.label] = {"ratio": row["ratio_vs_allreduce"], "label": row["label"],
                                          "options": row["options"]}  # fmt: skip
            if _effective(row) != _effective(run.spec):
                out["measured"][run.label]["note"] = f"warm-up {row['options']['warmup_steps']}"
        every = run.spec.every
        timing = {"cycle": every or 1, "timing": "cycle-mean" if every else "median"}
        predicted = cal.predict_record(base | run.spec.describe() | timing)
        out["model"][run.label] = predicted.step_s / ar
    keys = ("params", "link_mbit_measured", "step_s")
    return {**out, "setting": {k: base[k] for k in keys}, "error": None}


def main(argv: list[str] | None = None) -> None:
    stamp = provenance.start(argv)
    parser = cli.make_parser(__doc__)
    add = parser.add_argument
    add("--runs", default=",".join(RUNS), help=f"comma-separated, from {', '.join(RUNS)}")
    add("--every", type=int, default=20, help="H: inner steps per outer step, for all")
    add("--fragments", default="1,2,4", help="Streaming DiLoCo's P values")
    add("--delays", default="0,1,5", help="Streaming DiLoCo's tau values")
    add("--outer-dtypes", default="e3m0,float32", help="Streaming DiLoCo's outer gradients")
    add("--warmup-steps", type=int, default=100, help="1-bit Adam's warm-up steps")
    add("--optimizer", default="adam", choices=("adam", "sgd", "momentum"),
        help="inner optimizer (1-bit Adam replaces it, at the same rate)")  # fmt: skip
    add("--lr", type=float, default=1e-2, help="peak inner learning rate")
    add("--schedule", default="cosine", choices=("cosine", "constant"), help="cosine decays to 0")
    runtime.add_schedule_args(parser, epochs=30, batch_size=16, seeds=True)
    add("--tolerance", type=float, default=0.5, help="accuracy points a match may lose")
    add("--loss-tolerance", type=float, default=0.01, help="final loss a match may gain")
    add("--network", default=str(NETWORK), help="the network benchmark's records")
    add("--nodes", type=int, default=4, help="hosts of the step-time figures")
    add("--rate", default="100mbit", help="link of the step-time figures")
    runtime.add_common_args(parser, seed=False)
    parser.set_defaults(devices=4)
    args = runtime.parse_args(parser, argv, check_flags)

    runs, seeds = configurations(args), runtime.seed_list(args)
    devices = runtime.setup(args)
    mesh = parallel.make_mesh(devices=devices)
    built: dict[str, registry.Method] = {}
    results, run_seeds, wire, loss_fn = [], [], {}, None
    for seed in seeds:
        data = datasets.load_dataset(args.dataset, args.data_dir, seed)
        task = tasks.classification_task(tasks.small_cnn(data.num_classes), data)
        loss_fn = loss_fn or task.loss_fn
        task = dataclasses.replace(task, loss_fn=loss_fn)  # one compiled step for every seed
        batches = task.batches(len(devices) * args.batch_size, seed, 0)
        steps = args.epochs * len(batches)
        for run in runs:
            if run.label not in built:  # its bytes, from the step that every seed then runs
                inner = registry.optimizer(args.optimizer, args.lr, steps, args.schedule)
                rate = registry.learning_rate(args.lr, steps, args.schedule)  # 1-bit Adam's
                method = registry.build(run.spec, inner, learning_rate=rate)
                built[run.label] = method = dataclasses.replace(method, compiled={})
                host = task.init(jax.random.key(seed))
                params, state, step = method.start(loss_fn, mesh, host, donate=True)
                got = gradcomm.wire.measure(step, params, state, batches[0])
                wire[run.label] = {"average": got.average, "peak": peak_after_warmup(got),
                                   "total": got.total, "period": got.period}  # fmt: skip
            result = loop.train_as_flagged(args, built[run.label], task, mesh, seed=seed)
            results.append(result)
            run_seeds.append(seed)
            if runtime.is_main_process():
                print(f"seed {seed} {run.label:>26}: test accuracy {100 * result.test_accuracy:.2f}"
                      f"%, loss {report.final_loss(result):.4f}")  # fmt: skip

    if runtime.is_main_process():
        times = network_times(pathlib.Path(args.network), runs, args.nodes, args.rate)
        summary = report.summarize(results)
        by_label = {s["method"]: s for s in summary}
        claims = judge(by_label, wire, times, results, args)
        table = "\n\n".join([results_table(by_label, wire, times, args), claims_table(claims)])
        setting = (
            f"{data.name}, small CNN, {report.count(len(devices), 'device')}, {args.optimizer} "
            f"(lr {args.lr:g}, {args.schedule}), H = {args.every}, {steps} steps, "
            f"{report.count(len(seeds), 'seed')}"
        )
        extra = {"seeds": seeds, "steps": steps, "summary": summary, "wire": wire,
                 "network": times, "claims": claims}  # fmt: skip
        path = report.write_study(
            args.out, "diloco_family", {**vars(args), "devices": len(devices)}, results, table,
            lambda fig: plot(fig, runs, results, by_label, wire), extra,
            provenance=stamp.record(devices, seeds=seeds),
            title=f"The DiLoCo family: {setting}", run_seeds=run_seeds,
        )  # fmt: skip
        print(f"\n{table}\n\nwrote {path}/diloco_family.json, .png, .md")


def versus(
    runs: Summary, results: Results, label: str, ref: str, args: argparse.Namespace
) -> dict[str, Any]:
    """`label` against `ref`: the gaps in mean accuracy (points) and final loss, and the
    verdict: holds where the accuracy is at most `--tolerance` points below and the loss
    at most `--loss-tolerance` above; does not hold otherwise, or where it diverged."""
    if label not in runs or ref not in runs:
        return {"verdict": "not tested here", "measured": f"{label} or {ref} not run (--runs)"}
    acc_a, acc_b = (100 * runs[x]["test_accuracy"]["mean"] for x in (label, ref))
    loss_a, loss_b = (runs[x]["final_loss"]["mean"] for x in (label, ref))
    acc, loss = acc_a - acc_b, loss_a - loss_b
    text = (f"{label}: {acc_a:.2f}%, loss {loss_a:.4f}; {ref}: {acc_b:.2f}%, loss {loss_b:.4f} "
            f"({acc:+.2f} points, loss {loss:+.4f})")  # fmt: skip
    first = [next((i + 1 for i, x in enumerate(r.losses) if not math.isfinite(x)), None)
             for r in results if r.method == label]  # fmt: skip
    if bad := [s for s in first if s is not None]:
        text += f"; loss not finite on {len(bad)} of {len(first)} seeds, from step {min(bad)}"
    ok = not bad and acc >= -args.tolerance and loss <= args.loss_tolerance
    return {"verdict": "holds" if ok else "does not hold", "measured": text,
            "accuracy_gap": acc, "loss_gap": loss}  # fmt: skip


def judge(
    runs: Summary, wire: Wire, times: dict[str, Any], results: Results, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Each claim, its paper, what this run measured, and the verdict."""
    (p, tau, d), name = CENTER, streaming_label
    center, f32 = name(p, tau, d), name(p, tau, "float32")
    tau0, eager = name(p, 0, d), name(p, None, d)
    douillard, kale, tang = "Douillard et al. 2025", "Kale et al. 2025", "Tang et al. 2021"
    pairs = [
        ("Streaming DiLoCo matches DiLoCo's loss", douillard, center, "diloco"),
        ("4-bit (E3M0) outer gradients cost nothing against float32", douillard, center, f32),
        ("eager updates keep DiLoCo's loss", kale, "diloco-eager", "diloco"),
        ("eager updates keep Streaming DiLoCo's loss (against tau = 0)", kale, eager, tau0),
        ("1-bit Adam converges like Adam after its warm-up", tang, "onebit-adam", "allreduce"),
        (f"... with eps = {ONEBIT_EPS:g} (Adam's is 1e-8)", tang, "onebit-adam-eps", "allreduce"),
    ]
    out = [{"claim": c, "paper": w, **versus(runs, results, a, b, args)} for c, w, a, b in pairs]
    acc = {k: 100 * s["test_accuracy"]["mean"] for k, s in runs.items()}
    gaps = [acc[k] - acc[k.replace(d, "float32")] for k in acc
            if "tau=" in k and k.endswith(d) and k.replace(d, "float32") in acc]  # fmt: skip
    if len(gaps) > 1:  # the grid: E3M0 against float32 at every (P, tau) it ran
        out[1]["measured"] += (f"; E3M0 against float32 at the grid's {len(gaps)} (P, tau): "
                               f"{min(gaps):+.2f} to {max(gaps):+.2f} points, mean "
                               f"{np.mean(gaps):+.2f}")  # fmt: skip
    claim = "Streaming DiLoCo's peak bytes per step are one fragment's, 1/P of the model's"
    out.append({"claim": claim, "paper": douillard, **peak_claim(wire)})
    measured, where = times.get("measured", {}), f"{args.rate}, N = {args.nodes}"
    if "diloco" in measured and "diloco-eager" in measured:
        ratio = measured["diloco-eager"]["ratio"] / measured["diloco"]["ratio"]
        text = f"diloco-eager's step {ratio:.2f}x diloco's (network.json, {where})"
        overlap = {"verdict": "holds" if ratio < 1 else "does not hold", "measured": text}
    else:
        text = f"network.json has no measured diloco and diloco-eager records at {where}"
        overlap = {"verdict": "not tested here", "measured": text}
    claim = "eager updates hide the outer step's exchange (a shorter step than DiLoCo's)"
    return [*out, {"claim": claim, "paper": kale, **overlap}]


def peak_claim(wire: Wire) -> dict[str, Any]:
    """Streaming DiLoCo's peak bytes at P fragments over its peak at P = 1 (the same tau
    and dtype), against 1/P: holds where every ratio is at most 15% above 1/P."""
    found = {tuple(k.split()[1:]): w["peak"] for k, w in wire.items() if "tau=" in k}
    ratios = {(int(p[2:]), t, d): v / found["P=1", t, d] for (p, t, d), v in found.items()
              if p != "P=1" and ("P=1", t, d) in found}  # fmt: skip
    if not ratios:
        return {"verdict": "not tested here", "measured": "no P = 1 run beside one with P > 1"}
    text = "; ".join(f"P={p} {t} {d}: {r:.3f} of P=1's peak (1/P = {1 / p:.3f})"
                     for (p, t, d), r in sorted(ratios.items()))  # fmt: skip
    ok = all(r <= 1.15 / p for (p, _, _), r in ratios.items())
    return {"verdict": "holds" if ok else "does not hold", "measured": text}


def results_table(
    runs: Summary, wire: Wire, times: dict[str, Any], args: argparse.Namespace
) -> str:
    """Accuracy and loss over seeds, bytes (average and peak) and step time, per run."""
    name = "allreduce" if "allreduce" in runs else next(iter(runs))
    wb, net = wire[name], f"{args.rate}, N = {args.nodes}"
    seeds = len(runs[name]["test_accuracy"]["per_seed"])
    rows = [
        f"| run | test accuracy, mean (min-max) over {report.count(seeds, 'seed')} | final loss "
        f"| bytes per step, average | vs {name} | peak | vs {name} "
        f"| step vs {name}, {net}: measured | model |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, s in runs.items():
        acc, loss, w = s["test_accuracy"], s["final_loss"], wire[label]
        measured, model = times["measured"].get(label), times["model"].get(label)
        cells = [label, report.mean_range(*(100 * acc[k] for k in ("mean", "min", "max")), 2, "%"),
                 report.mean_range(loss["mean"], loss["min"], loss["max"], 4),
                 f"{w['average']:,.0f}", f"{w['average'] / wb['average']:.4f}",
                 f"{w['peak']:,.0f}", f"{w['peak'] / wb['peak']:.4f}",
                 "not measured" if measured is None else f"{measured['ratio']:.3f}x"
                 + (f" ({measured['note']})" if "note" in measured else ""),
                 "-" if model is None else f"{model:.3f}x (model)"]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    rows.append(
        "\nBytes: what one device sends per step (gradcomm.wire, from the compiled step): the "
        "average over the sync period and the peak, the worst step, both after warm-ups (1-bit "
        "Adam's warm-up steps send the all-reduce's bytes); each holds the step's loss "
        "all-reduce. Final loss: the mean of the last 10 training steps."
    )
    if times.get("error"):
        return "\n".join([*rows, f"\nStep time: unavailable ({times['error']})."])
    st = times["setting"]
    return "\n".join([*rows,
        f"\nStep time: the ratio to the all-reduce's step at {net} for the network benchmark's "
        f"model ({st['params']:,} parameters, not this CNN; all-reduce {st['step_s']:.3f} s a "
        f"step on a {st['link_mbit_measured']:.1f} Mbit/s link). Measured: the record of the same "
        f"method and options in {pathlib.Path(args.network).name} (read at run time), where there "
        "is one. Model: gradcomm.perfmodel calibrated on those records, a model figure, not a "
        "measurement."])  # fmt: skip


def claims_table(claims: list[dict[str, Any]]) -> str:
    """The claims beside the measurements, with their verdicts."""
    rows = ["| claim | paper | measured here | verdict |", "| --- | --- | --- | --- |"]
    rows += [f"| {c['claim']} | {c['paper']} | {c['measured']} | **{c['verdict']}** |"
             for c in claims]  # fmt: skip
    return "\n".join(rows)


def plot(fig: Any, runs: list[Run], results: Results, stats: Summary, wire: Wire) -> None:
    """Training loss and accuracy against bytes (average filled, peak hollow) of the runs
    other than the grid's variants; the grid's accuracy per (P, tau), E3M0 (o) and float32
    (square). Means over seeds; bars: min-max."""
    loss_ax, grid_ax, bytes_ax = fig.subplots(1, 3, width_ratios=(1.1, 1.2, 1))
    groups, colours = report.by_method(results), {}  # per gradcomm method: report's palette
    cells = list(dict.fromkeys(sorted(r.grid[0] for r in runs if r.grid)))  # repeats after 14
    for k, run in enumerate(runs):
        kw = report.style(run.family, run.variant) | {"markersize": 5}
        free = [c for c in report.PALETTE if c not in colours.values()]
        own = kw["color"] if kw["color"] in free else free[0]
        c = colours.setdefault(registry.METHODS[run.family].method, own)
        kw |= {"color": c, "markeredgecolor": c} | ({} if run.variant else {"markerfacecolor": c})
        acc = stats[run.label]["test_accuracy"]
        y = 100 * acc["mean"]
        err = [[max(y - 100 * acc["min"], 0)], [max(100 * acc["max"] - y, 0)]]  # rounding: >= 0
        if run.grid:
            f32 = run.grid[1] == "float32"
            grid_ax.errorbar([cells.index(run.grid[0]) + (0.15 if f32 else -0.15)], [y], yerr=err,
                             capsize=2, linestyle="none", marker="s" if f32 else "o", color=c,
                             markersize=5, markerfacecolor="white" if f32 else c)  # fmt: skip
            if run.variant:
                continue
        elif run.label in ("allreduce", "diloco"):
            grid_ax.axhline(y, color=c, lw=0.8, ls="-" if run.label == "allreduce" else ":",
                            label=f"{run.label} (mean)")  # fmt: skip
        n = min(10, *(len(r.losses) for r in groups[run.label]))
        curves = [np.convolve(r.losses, np.ones(n) / n, "valid") for r in groups[run.label]]
        loss, every = np.mean(curves, 0), max(1, len(curves[0]) // 6)
        loss_ax.plot(np.arange(n, len(loss) + n), loss, lw=1, label=run.label,
                     markevery=(k % every, every), **kw)  # fmt: skip
        w = wire[run.label]
        bytes_ax.plot([w["average"], w["peak"]], [y, y], color=c, lw=0.8, alpha=0.6)
        bytes_ax.errorbar([w["average"]], [y], yerr=err, capsize=2, **kw | {"linestyle": "none"})
        bytes_ax.plot([w["peak"]], [y], linestyle="none", marker=kw["marker"], color=c,
                      markerfacecolor="white", markersize=5)  # fmt: skip
    loss_ax.set(
        xlabel="step",
        ylabel="training loss (10-step running mean)",
        yscale="log",
        title="training loss (a diverging run leaves the top)",
        ylim=(None, 10),
    )
    grid_ax.set_xticks(range(len(cells)), cells, rotation=45, fontsize=7)
    grid_ax.set(ylabel="final test accuracy (%)", title="Streaming DiLoCo: o E3M0, [] float32")
    bytes_ax.set(xscale="log", xlabel="bytes per step:\naverage (filled), peak (hollow)",
                 ylabel="final test accuracy (%)", title="accuracy against bytes")  # fmt: skip
    for ax in (loss_ax, grid_ax, bytes_ax):
        ax.grid(alpha=0.3, which="both")
    loss_ax.legend(fontsize=6, loc="upper right")
    grid_ax.legend(fontsize=6, loc="lower left")


if __name__ == "__main__":
    main()
