#!/usr/bin/env python
"""Latency of gradcomm's collectives against lax.psum, message by message, in the same run.

    python experiments/bench_collectives.py                       # 4 KiB .. 64 MiB, 8 devices
    python experiments/bench_collectives.py --sizes 1MiB,16MiB,64MiB --repeats 20
    python experiments/bench_collectives.py --methods terngrad --sizes 4MiB,64MiB
    python experiments/bench_collectives.py --methods topk-exact,topk-sampled,lags \\
        --sizes 4MiB,64MiB --density 0.001

A message is each device's buffer of that many bytes (float32), split into --leaves
leaves; terngrad times its whole update (clip, ternarize, pack, exchange, unpack,
average). Every method reduces the same inputs; their runs are interleaved (in
alternating order) so machine noise hits all alike, and the ratio to psum is reported,
with the bytes each device sends read from the compiled program (gradcomm.wire). Writes
bench_collectives.json and bench_collectives.md to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import time
from collections.abc import Callable
from typing import Any

import _common
import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel, sparse


def transformation(tx: Any) -> Callable[[Any], Any]:
    """A gradcomm transformation's update at step 0 as a collective on the devices' trees."""
    return lambda tree: tx.update(tree, tx.init(tree))[0]


def selection(selector: str, density: float) -> Callable[[Any], Any]:
    """Top-k selection alone (no communication), k = density * size per leaf."""

    def select(tree: Any) -> Any:
        return [sparse.topk(x.ravel(), sparse.num_kept(x.size, density), selector)[0] for x in tree]

    return select


def collectives(density: float) -> dict[str, Callable[[Any], Any]]:
    """Each method maps this device's pytree to its result, inside shard_map."""
    return {
        "psum": lambda tree: lax.psum(tree, "data"),
        "adasum": lambda tree: gradcomm.adasum_reduce(tree, "data"),
        "terngrad": transformation(gradcomm.terngrad("data")),
        "lags": transformation(gradcomm.lags("data", density=density)),
        "sgp": lambda tree: (tx := gradcomm.sgp("data")).update(tree, tx.init(tree), tree)[0],
        "topk-exact": selection("exact", density),
        "topk-sampled": selection("sampled", density),
    }


DEFAULT_SIZES = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB"


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*", text)
    if not match:
        raise SystemExit(f"bad size {text!r}: use e.g. 4KiB, 16MiB")
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


def compile_collective(fn: Callable[[Any], Any], mesh: Any) -> Callable[[Any], Any]:
    def body(tree: Any) -> Any:
        return jax.tree.map(lambda x: x[None], fn([x[0] for x in tree]))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))


def time_once(fn: Callable[[Any], Any], inputs: Any) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(inputs))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated message sizes")
    parser.add_argument(
        "--methods",
        default="adasum",
        help="methods to compare with psum: adasum, terngrad, lags, sgp (one gossip step), "
        "or topk-exact and topk-sampled (the selection alone)",
    )
    parser.add_argument(
        "--density", type=float, default=0.001, help="k/d for lags and the top-k selectors"
    )
    parser.add_argument("--leaves", type=int, default=1, help="leaves each message is split into")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per method and size")
    _common.add_common_args(parser)
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    methods = ["psum"] + [m for m in args.methods.split(",") if m and m != "psum"]
    available = collectives(args.density)
    unknown = [m for m in methods if m not in available]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}: choose from {', '.join(available)}")

    devices = _common.setup(args)
    mesh = parallel.make_mesh(devices=devices)
    main_process = _common.is_main_process()
    if main_process:
        print(f"gradcomm {gradcomm.__version__}: {_common.describe(devices)}")

    from tqdm.auto import tqdm

    rows = []
    for size in tqdm(sizes, desc="sizes", disable=not main_process or args.no_progress):
        inputs = make_inputs(mesh, size, args.leaves, args.seed)
        compiled = {m: compile_collective(available[m], mesh) for m in methods}
        wire = {m: gradcomm.wire.measure(compiled[m], inputs).total for m in methods}
        times: dict[str, list[float]] = {m: [] for m in methods}
        for m in methods:
            time_once(compiled[m], inputs)  # warm up
        for r in range(args.repeats):
            for m in methods if r % 2 == 0 else methods[::-1]:
                times[m].append(time_once(compiled[m], inputs))
        median = {m: float(np.median(t)) for m, t in times.items()}
        rows.append(
            {
                "bytes": size,
                "median_seconds": median,
                "ratio_to_psum": {m: median[m] / median["psum"] for m in methods},
                "wire_bytes": wire,
                "times": times,
            }
        )

    if main_process:
        header = "| message | psum (ms) | " + " | ".join(
            f"{m} (ms) | {m}/psum time | {m}/psum bytes" for m in methods[1:]
        )
        lines = [header + " |", "| --- " * (2 + 3 * (len(methods) - 1)) + "|"]
        for row in rows:
            cells = [label(row["bytes"]), f"{1e3 * row['median_seconds']['psum']:.3f}"]
            for m in methods[1:]:
                cells += [
                    f"{1e3 * row['median_seconds'][m]:.3f}",
                    f"{row['ratio_to_psum'][m]:.2f}x",
                    f"{row['wire_bytes'][m] / row['wire_bytes']['psum']:.4f}",
                ]
            lines.append("| " + " | ".join(cells) + " |")
        table = "\n".join(lines)
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        config = {**vars(args), "devices": _common.describe(devices)}
        (out / "bench_collectives.json").write_text(
            json.dumps({"config": config, "rows": rows}, indent=1)
        )
        (out / "bench_collectives.md").write_text(table + "\n")
        print(f"\n{table}\n\nwrote {out}/bench_collectives.json, bench_collectives.md")


if __name__ == "__main__":
    main()
