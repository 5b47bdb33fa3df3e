#!/usr/bin/env python
"""The sparse exchange's decode: the loop in device order against one sort and one scatter.

    python experiments/benchmarks/bench_decode.py                   # this machine's default backend
    python experiments/benchmarks/bench_decode.py --platform cpu --sizes 278784 --densities 0.01

After its one all-gather, the sparse exchange under `gradcomm.lags` and
`gradcomm.gradient_dropping` holds every device's (value, index) pairs, `(N, k)` each, and
sums them into a dense vector index by index in device order, `((0 + v_0) + v_1) + ...`,
the same bits on every device, duplicate indices across devices included. gradcomm does it
with one scatter-add per device in a loop (`gradcomm.sparse`, the module docstring). This
script times that decode against the other exact way there is with a fixed number of
operations whatever N, written here only to be measured:

* sort: one stable sort of the N k pairs by index (equal indices stay in device order),
  N - 1 shifted adds that fold each run of equal indices left to right, and one scatter of
  each run's sum to its index (indices distinct, so the scatter has no order to keep).

For each size, density and N = 2 .. --max-devices it checks that both give the same bits
(NaN, -0.0 and inf planted among the values) and reports the median time of each on one
device of the chosen backend: the decode is the same program on every device, so one
device's time is each device's. A share --overlap of every device's indices is common to
all devices, as top-k indices of correlated gradients are. Writes bench_decode.json,
bench_decode.md and bench_decode.png (sort over loop against N) to --out.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradcomm_experiments import cli, provenance, report
from gradcomm_experiments.timing import device_pairs, median_seconds


def sort_decode(values: jax.Array, indices: jax.Array, size: int, divide_by: int) -> jax.Array:
    """The pairs summed in device order by one sort, N - 1 shifted adds and one scatter."""
    from gradcomm import _numeric

    n = values.shape[0]
    ct = _numeric.compute_dtype(values.dtype)
    index, value = lax.sort(
        (indices.reshape(-1), values.reshape(-1).astype(ct)), num_keys=1, is_stable=True
    )
    total = jnp.where(value == 0, jnp.zeros_like(value), value)  # 0 + v: -0.0 becomes 0.0
    m = index.shape[0]
    padded_index = jnp.concatenate([index, jnp.full((n,), -1, index.dtype)])
    padded_value = jnp.concatenate([value, jnp.zeros((n,), ct)])
    for t in range(1, n):  # a run holds each device at most once: at most n long
        same = lax.slice(padded_index, (t,), (t + m,)) == index
        total = jnp.where(same, total + lax.slice(padded_value, (t,), (t + m,)), total)
    first = jnp.concatenate([jnp.ones((1,), bool), index[1:] != index[:-1]])
    return jnp.zeros(size, ct).at[jnp.where(first, index, size)].set(total / divide_by, mode="drop")


def loop_decode(values: jax.Array, indices: jax.Array, size: int, divide_by: int) -> jax.Array:
    """gradcomm's decode (a private function: the public API decodes only after a gather)."""
    from gradcomm import sparse

    return sparse._sum_in_device_order(values, indices, size, divide_by)


def measure(n: int, size: int, density: float, args: argparse.Namespace) -> dict[str, Any]:
    from gradcomm import sparse

    rng = np.random.default_rng(args.seed + n)
    k = sparse.num_kept(size, density)
    values, indices = device_pairs(n, size, k, args.overlap, rng)
    values[0, :3] = [np.nan, -0.0, np.inf]
    values, indices = jax.device_put(values), jax.device_put(indices)
    row: dict[str, Any] = {"n": n, "size": size, "density": density, "k": k}
    outputs = {}
    for name, decode in (("loop", loop_decode), ("sort", sort_decode)):
        fn = jax.jit(lambda v, i, decode=decode: decode(v, i, size, n))
        outputs[name] = np.asarray(fn(values, indices))
        row[f"{name}_ms"] = 1e3 * median_seconds(fn, (values, indices), args.repeats)
    row["same_bits"] = bool(
        np.array_equal(outputs["loop"].view(np.uint32), outputs["sort"].view(np.uint32))
    )
    row["sort_over_loop"] = row["sort_ms"] / row["loop_ms"]
    return row


def table(rows: list[dict[str, Any]], device: str) -> str:
    lines = [
        f"Sparse decode on {device}: median ms of one call, N devices' pairs",
        "",
        "| size | density | k | N | loop ms | sort ms | sort / loop | same bits |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    lines += [
        f"| {r['size']} | {r['density']} | {r['k']} | {r['n']} | {r['loop_ms']:.3f} "
        f"| {r['sort_ms']:.3f} | {r['sort_over_loop']:.2f} | {r['same_bits']} |"
        for r in rows
    ]
    return "\n".join(lines)


def plot(fig: Any, rows: list[dict[str, Any]]) -> None:
    """The sort's time over the loop's against N, one line per size and density."""
    ax = fig.subplots()
    cells = sorted({(r["size"], r["density"]) for r in rows})
    for size, density in cells:
        cell = [r for r in rows if (r["size"], r["density"]) == (size, density)]
        ax.plot([r["n"] for r in cell], [r["sort_over_loop"] for r in cell], marker="o",
                label=f"{size:,} elements, density {density:g}")  # fmt: skip
    ax.axhline(1, color="k", lw=1)
    ax.set(xlabel="devices N (pairs decoded)", ylabel="sort time / loop time (above 1: loop "
           "faster)", yscale="log")  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> None:
    stamp = provenance.start(argv)
    parser = cli.make_parser(__doc__)
    parser.add_argument("--platform", default=None, help="cpu, gpu or tpu (default: jax's)")
    parser.add_argument("--max-devices", type=int, default=8, help="N runs from 2 to this")
    parser.add_argument("--sizes", default="278784,16777216", help="comma-separated sizes")
    parser.add_argument("--densities", default="0.01,0.001", help="comma-separated k / size")
    parser.add_argument(
        "--overlap", type=float, default=0.5, help="share of each device's indices common to all"
    )
    cli.add_outputs(
        parser,
        "runs/bench_decode",
        repeats=(50, "timed calls per measurement"),
        seed="random seed of the pairs",
    )
    args = parser.parse_args(argv)

    def check(args: argparse.Namespace) -> None:
        if args.max_devices < 2:
            raise ValueError("--max-devices must be at least 2")
        args.size_list = cli.comma_list(args.sizes, int, "--sizes")
        args.density_list = cli.comma_list(args.densities, float, "--densities")
        if min(args.size_list) < 1 or not all(0 < d <= 1 for d in args.density_list):
            raise ValueError("every size must be at least 1 and every density in (0, 1]")

    cli.check(parser, args, check)
    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    try:
        device = jax.devices()[0]
    except RuntimeError as e:
        raise SystemExit(f"--platform {args.platform}: {e}") from None
    cells = [
        (n, size, density)
        for size in args.size_list
        for density in args.density_list
        for n in range(2, args.max_devices + 1)
    ]
    rows = [measure(*cell, args) for cell in cli.progress(cells, quiet=args.quiet)]
    result = {
        "config": vars(args),
        "provenance": stamp.record([device], seeds=[args.seed]),
        "jax": jax.__version__,
        "device": device.device_kind,
        "rows": rows,
    }
    text = table(rows, device.device_kind)
    out = report.write_bench(
        args.out,
        "bench_decode",
        result,
        text,
        lambda fig: plot(fig, rows),
        title=f"Sparse decode on {device.device_kind}: one sort against gradcomm's loop",
        size=(7.5, 5),
    )
    print(f"{text}\n\nwrote {out}/bench_decode.json, .md, .png")
    if not all(r["same_bits"] for r in rows):
        raise SystemExit("the two decodes differ: see same_bits")


if __name__ == "__main__":
    main()
