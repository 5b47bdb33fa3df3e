"""The network benchmark's raw collectives (`bench_network.py --patterns`): one host's process.

`network.mesh.run_worker` runs `pattern_worker` for a config with `"mode": "patterns"`; it
joins the run as `network.worker`'s processes do (one CPU device, gloo over the shaped
links) and prints `RESULT {"results": {pattern: seconds}, "devices": ...}` from process 0.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from gradcomm_experiments.network.worker import join

PATTERNS = (
    "psum",
    "psum_scatter",
    "all_gather",
    "ppermute_ring",
    "ppermute_one_way",
    "ppermute_swap",
    "all_to_all",
    "pair_reduce_scatter",
    "pair_psum",
    "psum_f16",
    "psum_bf16",
    "psum_u16",
)


def pattern_worker(config: dict[str, Any]) -> None:
    """One host's process: times each raw collective on a buffer of `--pattern-mib` MiB.

    The buffer is each device's; `all_gather` gathers N pieces of 1/N of it. The two
    `pair_*` patterns run over one size-2 axis of a mesh whose devices are factored into
    size-2 axes (power-of-two N): a 2-member reduce-scatter of a 2-slot buffer (each
    device sends one buffer, as in a swap) and a 2-member psum of the buffer, which is
    what gradcomm's pairwise exchange runs (on the bits, as unsigned integers).
    """
    from gradcomm_experiments import provenance

    devices = join(config, 1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    size = int(config["pattern_mib"] * 2**20 // 4)
    size -= size % (2 * n)
    flat = jax.make_mesh((n,), ("data",), devices=devices)
    bits = n.bit_length() - 1
    pair_names = tuple(f"b{i}" for i in range(bits)) if n == 1 << bits else ()
    pairs = jax.make_mesh((2,) * bits, pair_names, devices=devices) if pair_names else None

    def shift(pairs_: list[tuple[int, int]]) -> Any:
        return lambda x: lax.ppermute(x, "data", pairs_)

    bodies: dict[str, tuple[Any, Any, int]] = {
        "psum": (flat, lambda x: lax.psum(x, "data"), size),
        "psum_scatter": (flat, lambda x: lax.psum_scatter(x, "data", tiled=True), size),
        "all_gather": (flat, lambda x: lax.all_gather(x, "data", tiled=True), size // n),
        "ppermute_ring": (flat, shift([(i, (i + 1) % n) for i in range(n)]), size),
        "ppermute_one_way": (flat, shift([(i, i + 1) for i in range(0, n - 1, 2)]), size),
        "ppermute_swap": (flat, shift([(i, i ^ 1) for i in range(n - n % 2)]), size),
        "all_to_all": (flat, lambda x: lax.all_to_all(x, "data", 0, 0, tiled=True), size),
        # The buffer's values in a 16-bit type, the cast included: what gloo's sum costs
        # per format (XLA:CPU runs a bfloat16 all-reduce in float32).
        "psum_f16": (flat, lambda x: lax.psum(x.astype(jnp.float16), "data"), size),
        "psum_bf16": (flat, lambda x: lax.psum(x.astype(jnp.bfloat16), "data"), size),
        "psum_u16": (flat, lambda x: lax.psum(x.astype(jnp.uint16), "data"), size),
    }
    if pairs is not None:
        last = pair_names[-1]
        bodies["pair_reduce_scatter"] = (
            pairs, lambda x: lax.psum_scatter(x, last, tiled=True), 2 * size,
        )  # fmt: skip
        bodies["pair_psum"] = (pairs, lambda x: lax.psum(x, last), size)
    results: dict[str, float] = {}
    for name in PATTERNS:
        if name not in bodies:
            continue
        mesh, body, count = bodies[name]
        spec = P(mesh.axis_names)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                   check_vma=False))  # fmt: skip
        local = np.ones((count,), np.float32)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)
        times = []
        for k in range(config["pattern_repeats"] + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            if k:  # the first call sets up gloo's connections
                times.append(time.perf_counter() - t0)
        results[name] = float(np.median(times))
        if jax.process_index() == 0:
            print(f"[{config['rate']} N={n}] {name}: {results[name]:.3f} s", file=sys.stderr)
    if jax.process_index() == 0:
        info = provenance.devices_info(devices)
        print("RESULT " + json.dumps({"results": results, "devices": info}), flush=True)
