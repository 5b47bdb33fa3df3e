#!/usr/bin/env python
"""Latency of gradcomm's collectives and kernels against lax.psum and a memory-bandwidth bound.

    python experiments/benchmarks/bench_collectives.py                  # 4 KiB .. 64 MiB, 8 devices
    python experiments/benchmarks/bench_collectives.py --sizes 1MiB,16MiB,64MiB --repeats 20
    python experiments/benchmarks/bench_collectives.py --methods terngrad --sizes 4MiB,64MiB
    python experiments/benchmarks/bench_collectives.py --methods topk-exact,topk-sampled,lags \\
        --sizes 4MiB,64MiB --density 0.001
    python experiments/benchmarks/bench_collectives.py --devices 1 --sizes 16MiB,64MiB \\
        --methods ternarize,unpack,topk-exact,topk-sampled,residual,terngrad,lags

A message is each device's buffer of that many bytes (float32), split into --leaves
leaves; terngrad times its whole update (clip, ternarize, pack, exchange, unpack,
average), and the kernel rows time one part of a method on each device's buffer, with
no exchange: `ternarize` (clip, draw, pack), `unpack` (sum N devices' packed codes and
scale), `topk-exact` and `topk-sampled` (the selection), `residual` (selection plus the
error-feedback residual). Every method reduces the same inputs; their runs are
interleaved (in alternating order) so machine noise hits all alike, and the ratio to
psum is reported, with the bytes each device sends read from the compiled program
(gradcomm.wire).

Each row also gets a memory-bandwidth bound: the bytes the method must read and write
per device (`min_bytes`, which states the count for each), divided by the bandwidth of
an in-place copy (`x + 1`, donated) of every device's buffer of --bandwidth-size bytes,
measured in the same run; `time/bound` says how far a kernel is from streaming its data once. Writes
bench_collectives.json, bench_collectives.md and bench_collectives.png (time and time over
psum's against the message size) to --out.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import _packing, parallel, sparse
from gradcomm.terngrad import _ternary
from gradcomm_experiments import cli, provenance, report, runtime
from gradcomm_experiments import methods as registry

tg = importlib.import_module("gradcomm.terngrad")  # the module (the package exports the factory)


def transformation(tx: Any) -> Callable[[Any], Any]:
    """A gradcomm transformation's update at step 0 as a collective on the devices' trees."""
    return lambda tree: tx.update(tree, tx.init(tree))[0]


def selection(selector: str, density: float) -> Callable[[Any], Any]:
    """Top-k selection alone (no communication), k = density * size per leaf."""

    def select(tree: Any) -> Any:
        return [sparse.topk(x.ravel(), sparse.num_kept(x.size, density), selector)[0] for x in tree]

    return select


def ternarize(tree: Any) -> Any:
    """TernGrad's send side on each device: clip bound, scale, random draw, 5 codes a byte."""
    words = _ternary.key_words(jax.random.key(0))
    out = []
    for x in tree:
        bound = tg._clip_bound(x, 2.5)
        out.append(_ternary.pack_leaf(x, bound, tg._local_scale(x, bound), words, 0))
    return out


def unpack(n: int) -> Callable[[Any], Any]:
    """TernGrad's receive side: n devices' packed codes summed digit by digit, then scaled.

    Its inputs are each device's codes from `ternarize` (see PREPARE), taken as all n
    devices' (no exchange); every leaf comes out whole, with its up to 4 codes of padding.
    """

    def fn(tree: Any) -> Any:
        out = []
        for packed in tree:
            rows = _packing.digit_sums(jnp.stack([packed] * n), 3, _ternary.sum_dtype(n))
            out.append(
                _packing.concatenate([(r.astype(jnp.float32) - n) * (0.5 / n) for r in rows])
            )
        return out

    return fn


def residual(density: float) -> Callable[[Any], Any]:
    """LAGS's error feedback on each device, with acc given: select k, zero them in acc."""

    def fn(tree: Any) -> Any:
        out = []
        for x in tree:
            values, indices = sparse.topk(x.ravel(), sparse.num_kept(x.size, density), "sampled")
            out.append((values, sparse.unsent(x.ravel(), indices, x)))
        return out

    return fn


def collectives(density: float, n: int) -> dict[str, Callable[[Any], Any]]:
    """Each method maps this device's pytree to its result, inside shard_map."""
    return {
        "psum": lambda tree: lax.psum(tree, "data"),
        "copy": lambda tree: jax.tree.map(lambda x: x * 1, tree),
        "adasum": lambda tree: gradcomm.adasum_reduce(tree, "data"),
        "terngrad": transformation(gradcomm.terngrad("data")),
        "lags": transformation(gradcomm.lags("data", density=density)),
        "sgp": lambda tree: (tx := gradcomm.sgp("data")).update(tree, tx.init(tree), tree)[0],
        "topk-exact": selection("exact", density),
        "topk-sampled": selection("sampled", density),
        "ternarize": ternarize,
        "unpack": unpack(n),
        "residual": residual(density),
    }


# Kernels whose inputs are another kernel's outputs, computed once before timing.
PREPARE: dict[str, Callable[[Any], Any]] = {"unpack": ternarize}


def min_bytes(method: str, size: int, n: int, density: float) -> float:
    """The bytes a method must read and write on each device for a message of `size` bytes.

    float32 messages of e = size / 4 elements; k = density * e (value, index) pairs of 8
    bytes; ternary codes take 1.6 bits, size / 20 bytes. Exchanges count the bytes that
    arrive (written by the transport, read by the decoder), not the wire time.
    """
    codes = size / 20
    pairs = 8 * density * size / 4
    counts = {
        "psum": 2 * size,  # read the buffer, write the sum
        "copy": 2 * size,  # read, write
        "adasum": adasum_bytes(size, n),
        # read g, write codes; read the n devices' codes, write the mean
        "terngrad": 2 * size + (1 + n) * codes,
        # read residual and update, write residual and mean; n devices' pairs
        "lags": 4 * size + n * pairs,
        "sgp": 3 * size,  # read z and the update, write the new z (one message each way)
        "topk-exact": size + pairs,  # read x, write k pairs
        "topk-sampled": size + pairs,
        "ternarize": size + codes,  # read g, write codes
        "unpack": n * codes + size,  # read n devices' codes, write the mean
        "residual": 2 * size + pairs,  # read acc, write the residual and k pairs
    }
    return counts[method]


def adasum_bytes(size: int, n: int) -> float:
    """Adasum's floor per device: at level j, on halves of h = size / 2^(j+1), the exchange
    (2h), the dot products (read 2h) and the combine (read 2h, write h), 7h; over log2 P
    levels (P = 2^floor(log2 n)) 7 (1 - 1/P) size, then the gather (2 size), and a fold
    (one level on the whole buffer, 7 size) where n > P."""
    p = 1 << (n.bit_length() - 1)
    return 0.0 if n == 1 else 7 * (1 - 1 / p) * size + 2 * size + (7 * size if n > p else 0)


METHODS = (
    "psum",
    "copy",
    "adasum",
    "terngrad",
    "lags",
    "sgp",
    "topk-exact",
    "topk-sampled",
    "ternarize",
    "unpack",
    "residual",
)
DEFAULT_SIZES = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB"


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*", text)
    if not match:
        raise ValueError(f"bad size {text!r}: use e.g. 4KiB, 16MiB")
    scale = {"B": 1, None: 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[match.group(2)]
    return int(match.group(1)) * scale


def label(size: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def make_inputs(mesh: Any, size: int, leaves: int, seed: int) -> list[jax.Array]:
    """Per-device float32 leaves totalling `size` bytes, with a leading device axis."""
    n = parallel.num_shards(mesh)
    elements = max(size // 4, leaves)
    counts = [elements // leaves + (i < elements % leaves) for i in range(leaves)]
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal((n, c), dtype=np.float32) for c in counts]
    return parallel.shard_batch(host, mesh)


def compile_collective(
    fn: Callable[[Any], Any], mesh: Any, *, donate: bool = False
) -> Callable[[Any], Any]:
    def body(tree: Any) -> Any:
        return jax.tree.map(lambda x: x[None], fn([x[0] for x in tree]))

    mapped = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    return jax.jit(mapped, donate_argnums=0 if donate else ())


def bytes_ratio(sent: float, psum: float) -> str:
    """Bytes sent over a psum's, or "-" where the psum sends none (one device)."""
    return f"{sent / psum:.4f}" if psum else "-"


def measure_copy(mesh: Any, size: int, repeats: int, seed: int) -> float:
    """Median seconds of `x + 1` in place on every device's buffer of `size` bytes.

    The buffer is donated, so the copy reads and writes each byte once with no fresh
    memory to fault in (an output of tens of MiB is mapped anew on every call).
    """
    step = compile_collective(lambda tree: jax.tree.map(lambda x: x + 1, tree), mesh, donate=True)
    times = []
    for _ in range(max(repeats, 3) + 1):
        inputs = jax.block_until_ready(make_inputs(mesh, size, 1, seed))
        times.append(time_once(step, inputs))
    return float(np.median(times[1:]))


def time_once(fn: Callable[[Any], Any], inputs: Any) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(inputs))
    return time.perf_counter() - start


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.make_parser(__doc__)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated message sizes")
    parser.add_argument(
        "--methods",
        default="adasum",
        help="methods to compare with psum: adasum, terngrad, lags, sgp (one gossip step); "
        "kernels on each device (no exchange): topk-exact and topk-sampled (the selection), "
        "ternarize, unpack, residual; copy",
    )
    parser.add_argument(
        "--density", type=float, default=0.001, help="k/d for lags and the top-k selectors"
    )
    parser.add_argument("--leaves", type=int, default=1, help="leaves each message is split into")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per method and size")
    parser.add_argument(
        "--bandwidth-size",
        default="64MiB",
        help="bytes per device of the in-place copy that measures the memory bandwidth "
        "(larger than the caches)",
    )
    runtime.add_common_args(parser, data=False)

    def check(args: argparse.Namespace) -> None:
        args.size_list = cli.comma_list(args.sizes, parse_size, "--sizes")
        args.bandwidth_bytes = parse_size(args.bandwidth_size)
        args.method_list = ["psum"] + [m for m in args.methods.split(",") if m and m != "psum"]
        unknown = [m for m in args.method_list if m not in METHODS]
        if unknown:
            raise ValueError(
                f"unknown method(s): {', '.join(unknown)}; choose from {', '.join(METHODS)}"
            )
        if args.repeats < 1 or args.leaves < 1:
            raise ValueError("--repeats and --leaves must be at least 1")

    return runtime.parse_args(parser, argv, check)


def main(argv: list[str] | None = None) -> None:
    stamp = provenance.start(argv)
    args = parse_args(argv)
    sizes, methods, bandwidth_size = args.size_list, args.method_list, args.bandwidth_bytes
    devices = runtime.setup(args)
    mesh = parallel.make_mesh(devices=devices)
    n = parallel.num_shards(mesh)
    available = collectives(args.density, n)
    main_process = runtime.is_main_process()
    if main_process:
        print(f"gradcomm {gradcomm.__version__}: {runtime.describe(devices)}")

    copy_seconds = measure_copy(mesh, bandwidth_size, args.repeats, args.seed)
    rows = []
    for size in cli.progress(sizes, desc="sizes", quiet=not main_process or args.quiet):
        floats = make_inputs(mesh, size, args.leaves, args.seed)
        inputs = {
            m: compile_collective(PREPARE[m], mesh)(floats) if m in PREPARE else floats
            for m in methods
        }
        compiled = {m: compile_collective(available[m], mesh) for m in methods}
        wire = {m: gradcomm.wire.measure(compiled[m], inputs[m]).total for m in methods}
        times: dict[str, list[float]] = {m: [] for m in methods}
        for m in methods:
            time_once(compiled[m], inputs[m])  # warm up
        for r in range(args.repeats):
            for m in methods if r % 2 == 0 else methods[::-1]:
                times[m].append(time_once(compiled[m], inputs[m]))
        median = {m: float(np.median(t)) for m, t in times.items()}
        needed = {m: min_bytes(m, size, n, args.density) for m in methods}
        # The copy moved 2 * bandwidth_size bytes per device in copy_seconds.
        bound = {m: needed[m] * copy_seconds / (2 * bandwidth_size) for m in methods}
        rows.append(
            {
                "bytes": size,
                "median_seconds": median,
                "ratio_to_psum": {m: median[m] / median["psum"] for m in methods},
                "wire_bytes": wire,
                "min_bytes": needed,
                "bound_seconds": bound,
                "ratio_to_bound": {m: median[m] / bound[m] for m in methods},
                "times": times,
            }
        )
    copy_seconds = min(copy_seconds, measure_copy(mesh, bandwidth_size, args.repeats, args.seed))

    if main_process:
        bandwidth = 2 * bandwidth_size / copy_seconds
        lines = [
            f"Copy bandwidth: {bandwidth / 1e9:.2f} GB/s per device ({runtime.describe(devices)}; "
            f"a copy of {label(bandwidth_size)} per device took {1e3 * copy_seconds:.3f} ms).",
            "",
            "| message | method | time (ms) | / psum time | / psum bytes | must move (MiB) "
            "| bound (ms) | time / bound |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in rows:
            for m in methods:
                lines.append(
                    f"| {label(row['bytes'])} | {m} | {1e3 * row['median_seconds'][m]:.3f} "
                    f"| {row['ratio_to_psum'][m]:.2f}x "
                    f"| {bytes_ratio(row['wire_bytes'][m], row['wire_bytes']['psum'])} "
                    f"| {row['min_bytes'][m] / 2**20:.3f} | {1e3 * row['bound_seconds'][m]:.3f} "
                    f"| {row['ratio_to_bound'][m]:.1f}x |"
                )
        table = "\n".join(lines)
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        config = {**vars(args), "devices": runtime.describe(devices)}
        result = {
            "config": config,
            "provenance": stamp.record(devices, seeds=[args.seed]),
            "bandwidth": {
                "bytes_per_device": bandwidth_size,
                "copy_seconds": copy_seconds,
                "bytes_per_second_per_device": bandwidth,
            },
            "rows": rows,
        }
        (out / "bench_collectives.json").write_text(json.dumps(result, indent=1))
        (out / "bench_collectives.md").write_text(table + "\n")
        report.save_figure(
            out / "bench_collectives.png",
            lambda fig: plot(fig, rows, methods),
            title=f"Collectives and kernels against lax.psum, {runtime.describe(devices)}",
        )
        print(f"\n{table}\n\nwrote {out}/bench_collectives.json, .md, .png")


def plot(fig: Any, rows: list[dict[str, Any]], methods: list[str]) -> None:
    """Median time and time over psum's against the message size, one line per method."""
    left, right = fig.subplots(1, 2)
    sizes = [r["bytes"] for r in rows]
    for k, m in enumerate(methods):
        kw = _style(m, k)
        left.plot(sizes, [1e3 * r["median_seconds"][m] for r in rows], label=m, **kw)
        right.plot(sizes, [r["ratio_to_psum"][m] for r in rows], label=m, **kw)
    left.set(xlabel="message per device (bytes, log scale)", ylabel="median time (ms, log scale)",
             yscale="log", title="time per call")  # fmt: skip
    right.set(xlabel="message per device (bytes, log scale)", ylabel="time / psum's time",
              title="against lax.psum (1: as fast)")  # fmt: skip
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3, which="both")
    right.axhline(1, color="k", lw=1)
    right.legend(fontsize=7, ncol=2)


def _style(method: str, k: int) -> dict[str, Any]:
    """A registry method's style (psum as the all-reduce); a kernel's a dotted line."""
    name = "allreduce" if method == "psum" else method
    if name in registry.METHODS:
        return report.style(name)
    return {"marker": report.MARKERS[-1 - k % 5], "linestyle": ":"}


if __name__ == "__main__":
    main()
