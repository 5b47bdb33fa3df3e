#!/usr/bin/env python
"""Each method's compress and decompress kernels on GPT-2 small's gradient, against a copy.

    python experiments/benchmarks/bench_kernels.py                  # 124M parameters
    python experiments/benchmarks/bench_kernels.py --scale 16 --repeats 3   # small, for a CPU
    python experiments/benchmarks/bench_kernels.py --kernels terngrad,powersgd --ranks 4

The gradient: GPT-2 small's 148 leaves (wte 50257 x 768, wpe 1024 x 768, 12 blocks of
two layer norms, c_attn, c_proj, c_fc and c_proj with biases, ln_f), 124,439,808 float32
parameters P, standard normal; --scale s divides every dimension by s (rounding up), the
12 blocks too. A kernel is a method's device-local compute before its exchange (compress)
or after it (decompress, summing N = --senders devices' messages: this device's, N
times), built from gradcomm's own functions (private ones too) and jitted, its time the
median of --repeats calls: TernGrad's packed codes and their digit sums (the all-gather
form's decode); `sparse.topk`, "sampled" and "exact", per leaf (LAGS, dropping) and over
the concatenation (SLGS); the sparse decode in device order; PowerSGD's M Q,
orthogonalize, M^T P, then P Q^T and the residual; low_precision's psum operands, the
mean back in float32, its whole update over one device; `gradcomm.adasum_pair`.
`FORMULAS` gives the bytes each must at least read and write; the bound is a copy, `x +
1` jitted over 4 P float32 elements (32 P bytes) before and after, the faster kept: time /
bound is a kernel's time over that of moving its bytes at the copy's speed.

low_precision's "auto" resolves at trace time (`low_precision._resolve`) to a native
16-bit `lax.psum` on a GPU; on a CPU in one process to an all-to-all of the 16-bit
patterns (bfloat16) or the psum (float16). First the script runs `gradcomm.low_precision`
in both formats over one device (`jax.shard_map`), records the exchange resolved and the
collectives of the lowered and compiled programs, and checks the mean against the float64
reference (the gradient rounded to the format and back), compiled as XLA does by default
and without excess precision (on one GPU, XLA drops the all-reduce and would then fold the
rounding away but for the method's optimization barrier): both must be exact. Writes
bench_kernels.json (rewritten after each kernel) and .md to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import _flat, _packing, parallel, sparse
from gradcomm.low_precision import _exchanges, _resolve
from gradcomm.powersgd import compresses, matrix_shape, orthogonalize
from gradcomm.powersgd._orthogonalize import HIGHEST, inverse_scales
from gradcomm.terngrad import _mean, _scales, _ternary
from gradcomm_experiments import cli, provenance
from gradcomm_experiments.timing import device_pairs, median_seconds

GROUPS = ("terngrad", "topk", "decode", "powersgd", "low_precision", "adasum")
WIRES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
_COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)")
_DTYPE = re.compile(r"\b(pred|bf16|[subf]\d+)\[")

COPIES = 4  # the copy's elements per parameter: its dispatch and sync weigh little
# Per kind of kernel: its phase, and the bytes it must at least read and write. P float32
# parameters, N senders, K pairs kept (k per leaf summed, or one k of P), Pc the parameters
# PowerSGD compresses (M = g + e is written, and read again: the two products need it).
FORMULAS = {
    "copy": ("bound", "32 P: x + 1 over 4 P float32 elements, read and written"),
    "terngrad compress": ("compress", "4 P + P/5: read g, write its codes (5 to a byte)"),
    "terngrad decompress": ("decompress", "N P/5 + 4 P: read N devices' codes, write the mean"),
    "topk": ("compress", "4 P + 8 K: read g, write K (value, index) pairs"),
    "decode": ("decompress", "8 N K + 4 P: read N devices' K pairs, write the sum"),
    "powersgd compress": ("compress", "16 Pc: read g and e, write M, read M again"),
    "powersgd decompress": ("decompress", "12 Pc: read M, write P Q^T and M - P Q^T"),
    "low_precision compress": ("compress", "6 P: read g, write g / N in 16 bits"),
    "low_precision decompress": ("decompress", "6 P: read the 16-bit mean, write float32"),
    "low_precision update": ("update", "8 P: read g, write the mean (over one device)"),
    "adasum pair": ("combine", "20 P: read a and b twice (statistics, combine), write one"),
}


class Kernel(NamedTuple):
    """One timed kernel: `fn(*args)`, jitted; the bytes it must move, by `FORMULAS[kind]`."""

    kind: str
    variant: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    bytes: float


def gpt2_shapes(scale: int) -> dict[str, tuple[int, ...]]:
    """GPT-2 small's leaves (Hugging Face's names, Conv1D layout), every dimension / scale."""
    d = lambda n: -(-n // scale)  # noqa: E731
    e, f, h = d(768), d(3072), "h.{}."
    shapes = {"wte": (d(50257), e), "wpe": (d(1024), e)}
    for i in range(d(12)):
        shapes |= {h.format(i) + f"{ln}.{w}": (e,) for ln in ("ln_1", "ln_2") for w in "gb"}
        for name, (rows, cols) in {"attn.c_attn": (e, d(2304)), "attn.c_proj": (e, e),
                                   "mlp.c_fc": (e, f), "mlp.c_proj": (f, e)}.items():  # fmt: skip
            shapes |= {h.format(i) + name + ".w": (rows, cols), h.format(i) + name + ".b": (cols,)}
    return shapes | {"ln_f.g": (e,), "ln_f.b": (e,)}


def normal_leaves(shapes: list[tuple[int, ...]], seed: int) -> list[jax.Array]:
    key = jax.random.key(seed)
    return [jax.random.normal(jax.random.fold_in(key, i), s) for i, s in enumerate(shapes)]


def terngrad_compress(leaves: list[jax.Array], key: jax.Array, n: int) -> Any:
    """TernGrad's send side (`_mean.ternary_mean`): clip bounds, the scales (their pmax over
    the devices is the exchange, left out), each leaf's codes packed 5 to a byte."""
    words, bounds = _ternary.key_words(key), _scales.clip_bounds(leaves, 2.5, ())
    local = jnp.stack([_scales.local_scale(g, b) for g, b in zip(leaves, bounds, strict=True)])
    scales, starts = _scales.round_up_scale(local, n), _flat.offsets([g.size for g in leaves])
    return [
        _ternary.pack_leaf(g, b, scales[i], words, starts[i])
        for i, (g, b) in enumerate(zip(leaves, bounds, strict=True))
    ], scales


def terngrad_decompress(received: list[jax.Array], scales: jax.Array, n: int, shapes: Any) -> Any:
    """N devices' packed codes `(N, b)` per leaf summed digit by digit, scaled, over N."""
    dtype, ct = _ternary.sum_dtype(n), jnp.float32
    return [
        _mean._unpack_sums(list(_packing.digit_sums(r, 3, dtype)), scales[i], n, ct, s) / n
        for i, (r, s) in enumerate(zip(received, shapes, strict=True))
    ]


def topk_leaves(leaves: list[jax.Array], density: float, selector: str) -> Any:
    return [sparse.topk(x.ravel(), sparse.num_kept(x.size, density), selector) for x in leaves]


def powersgd_compress(gs: list[jax.Array], es: list[jax.Array], qs: tuple[jax.Array, ...]) -> Any:
    """`gradcomm.powersgd`'s compress per leaf: M, P = orthogonalize(M Q), Q' = M^T P."""
    ms, ps, new_qs = [], [], []
    for g, e, q in zip(gs, es, qs, strict=True):
        m = sparse.accumulate(e, g).reshape(matrix_shape(g.shape))
        p = orthogonalize(jnp.matmul(m, q * inverse_scales(q, 0), precision=HIGHEST))
        ms.append(m), ps.append(p), new_qs.append(jnp.matmul(m.T, p, precision=HIGHEST))
    return ms, ps, new_qs


def powersgd_decompress(ms: Any, ps: Any, qs: Any, old_qs: Any) -> Any:
    """`gradcomm.powersgd`'s combine: P Q^T, the residual M - P Q^T, the Q kept."""
    out = []
    for m, p, q, old in zip(ms, ps, qs, old_qs, strict=True):
        approx = jnp.matmul(p, q.T, precision=HIGHEST)
        out.append((approx, m - approx, jnp.where(jnp.any(q != 0, axis=0), q, old)))
    return out


def low_precision_compress(leaves: list[jax.Array], n: int, wire: Any) -> Any:
    """The psum exchange's operands (`_exchanges.psum_mean`): g / N in `wire`, the flag."""
    sent = [(x.astype(jnp.float32) / n).astype(wire) for x in leaves]
    return sent, _exchanges.all_finite(leaves)


def low_precision_decompress(sums: list[jax.Array]) -> Any:
    """After the psum: the mean back in float32, and whether it is not finite."""
    return [s.astype(jnp.float32) for s in sums], ~_exchanges.all_finite(sums)


def one_device_update(wire: Any, mesh: Any, leaves: list[jax.Array], seen: list[str]) -> Any:
    """`gradcomm.low_precision(dtype=wire)`'s update in `shard_map` over the one-device mesh
    (the mean and the overflow flag), and its arguments: the leaves with a leading device
    axis. `seen` gets the exchange "auto" resolves to there."""
    tx, spec = gradcomm.low_precision("data", wire), P("data")
    local = jax.device_put([g[None] for g in leaves], NamedSharding(mesh, spec))

    def body(tree: list[jax.Array]) -> Any:
        seen.append(_resolve("auto", "data", 1, np.dtype(wire)))
        local = [x[0] for x in tree]
        out, state = tx.update(local, tx.init(local))
        return [x[None] for x in out], state.overflow

    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, P())), (local,)


def kernels(leaves: list[jax.Array], args: argparse.Namespace, mesh: Any) -> Iterator[Kernel]:
    """The kernels of the groups asked for, with the bytes of their `FORMULAS`; the inputs
    one needs from another are computed (untimed) just before it."""
    n, groups, sizes = args.senders, set(args.kernel_list), [g.size for g in leaves]
    total, shapes = sum(sizes), [g.shape for g in leaves]
    residuals = normal_leaves(shapes, args.seed + 1)
    if "terngrad" in groups:
        codes, key = sum(-(-s // 5) for s in sizes), jax.random.key(args.seed)
        compress = functools.partial(terngrad_compress, n=n)
        yield Kernel("terngrad compress", "", compress, (leaves, key), 4 * total + codes)
        packed, scales = jax.jit(compress)(leaves, key)
        received = ([jnp.stack([c] * n) for c in packed], scales)
        decompress = functools.partial(terngrad_decompress, n=n, shapes=shapes)
        yield Kernel("terngrad decompress", "", decompress, received, n * codes + 4 * total)
    concatenated = [_packing.concatenate([g.ravel() for g in leaves])] if "topk" in groups else []
    for d in args.density_list:
        k = sum(sparse.num_kept(s, d) for s in sizes)
        one = sparse.num_kept(total, d)
        for layout, xs, m in (("per leaf", leaves, k), ("concatenated", concatenated, one)):
            for selector in sparse.SELECTORS[::-1] if "topk" in groups else ():
                fn = functools.partial(topk_leaves, density=d, selector=selector)
                yield Kernel("topk", f"{selector} d={d:g} {layout}", fn, (xs,), 4 * total + 8 * m)
        if "decode" in groups:
            pairs = device_pairs(n, total, k, 0.5, np.random.default_rng(args.seed))
            fn = functools.partial(sparse._sum_in_device_order, size=total, divide_by=n)
            pairs = (jnp.asarray(pairs[0]), jnp.asarray(pairs[1]))
            yield Kernel("decode", f"d={d:g}", fn, pairs, 8 * n * k + 4 * total)
    for rank in args.rank_list if "powersgd" in groups else ():
        ids = [i for i, s in enumerate(shapes) if compresses(s, rank, 2.0)]
        gs, es = [leaves[i] for i in ids], [residuals[i] for i in ids]
        qs, pc = gradcomm.powersgd("data", rank).init(leaves).q, sum(g.size for g in gs)
        yield Kernel("powersgd compress", f"r{rank}", powersgd_compress, (gs, es, qs), 16 * pc)
        factors = (*jax.jit(powersgd_compress)(gs, es, qs), qs)
        yield Kernel("powersgd decompress", f"r{rank}", powersgd_decompress, factors, 12 * pc)
    for label, wire in WIRES.items() if "low_precision" in groups else ():
        fn = functools.partial(low_precision_compress, n=n, wire=wire)
        yield Kernel("low_precision compress", label, fn, (leaves,), 6 * total)
        sums = (jax.jit(fn)(leaves)[0],)
        yield Kernel("low_precision decompress", label, low_precision_decompress, sums, 6 * total)
        update, local = one_device_update(wire, mesh, leaves, [])
        yield Kernel("low_precision update", label, update, local, 8 * total)
    if "adasum" in groups:
        yield Kernel("adasum pair", "", gradcomm.adasum_pair, (leaves, residuals), 20 * total)


def collectives(text: str) -> list[str]:
    """The collectives in an HLO module's text, as 'opcode dtypes xcount'."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        match = _COLLECTIVE.search(line)
        if match and " = " in line[: match.start()]:
            dtypes = sorted(set(_DTYPE.findall(line[: match.start()])))
            label = f"{match.group(1)} {','.join(dtypes)}"
            found[label] = found.get(label, 0) + 1
    return [f"{label} x{count}" for label, count in sorted(found.items())]


def check_low_precision(leaves: list[jax.Array], mesh: Any) -> list[dict[str, Any]]:
    """`gradcomm.low_precision` ("auto") over one device, per 16-bit format: the exchange
    resolved, the collectives of its programs, and the largest error against the float64
    reference (the gradient rounded to the format and back: the mean over one device),
    compiled as XLA does by default and without excess precision (on a GPU, XLA drops the
    one-member all-reduce, then may fold the rounding to 16 bits and back away)."""
    rows, gpu = [], mesh.devices.flat[0].platform == "gpu"
    for label, wire in WIRES.items():
        seen: list[str] = []
        update, local = one_device_update(wire, mesh, leaves, seen)
        lowered = jax.jit(update).lower(*local)
        hlo = collectives(lowered.as_text(dialect="hlo"))
        row = dict(dtype=label, exchange=seen[0], lowered_collectives=hlo)
        for key, options in (("", {}), ("_exact", {"xla_allow_excess_precision": False})):
            compiled = lowered.compile(options)
            out, overflow = compiled(*local)
            row[f"overflow{key}"] = bool(overflow)
            row[f"max_abs_error{key}"] = max(
                float(np.max(np.abs(np.asarray(m[0], np.float64) - reference)))
                for x, m in zip(leaves, out, strict=True)
                for reference in [np.asarray(x).astype(wire).astype(np.float64)]
            )
        native = row["native_16bit_psum"] = any(c.startswith(f"all-reduce {label} ") for c in hlo)
        expected = native == (seen[0] == "psum") == (label == "f16" or gpu)  # psum on a GPU
        row["compiled_collectives"] = collectives(compiled.as_text())
        exact = row["max_abs_error"] == row["max_abs_error_exact"] == 0
        row["passed"] = expected and exact and not row["overflow"]
        rows.append(row)
    return rows


def measure_copy(total: int, repeats: int) -> float:
    """Median seconds of `x + 1` over `COPIES * total` float32 elements (a fresh output)."""
    x = jnp.zeros(COPIES * total)
    return median_seconds(jax.jit(lambda x: x + 1), (x,), max(repeats, 5))


def measure(kernel: Kernel, repeats: int) -> dict[str, Any]:
    """A kernel's median seconds, its compile's, and its `FORMULAS` entry."""
    start = time.perf_counter()
    compiled = jax.jit(kernel.fn).lower(*kernel.args).compile()
    compile_seconds = time.perf_counter() - start
    (phase, formula), name = FORMULAS[kernel.kind], f"{kernel.kind} {kernel.variant}".strip()
    return dict(kernel=name, phase=phase, formula=formula, bytes=float(kernel.bytes),
                seconds=median_seconds(compiled, kernel.args, repeats),
                compile_seconds=compile_seconds)  # fmt: skip


def bound(rows: list[dict[str, Any]], copy_seconds: float, total: int) -> None:
    """Each row's bytes per parameter, GB/s, and its time against the copy's bandwidth."""
    for r in rows:
        r["bytes_per_param"] = r["bytes"] / total
        r["gb_per_second"] = r["bytes"] / r["seconds"] / 1e9
        r["bound_seconds"] = r["bytes"] / (8 * COPIES * total) * copy_seconds
        r["time_over_bound"] = r["seconds"] / r["bound_seconds"]


def markdown(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A Markdown table's lines: the first column aligned left, the others right."""
    rule = "| --- |" + " ---: |" * (len(header) - 1)
    return [f"| {' | '.join(header)} |", rule, *(f"| {' | '.join(map(str, r))} |" for r in rows)]


def table(result: dict[str, Any]) -> str:
    copy, config, checks = result["copy"], result["config"], result["low_precision_check"]
    head = ["kernel", "ms", "must move (MB)", "B / param", "GB/s", "time / bound", "compile s"]
    lines = [
        f"Kernels on {result['device']} ({result['platform']}), JAX {result['jax']}: a "
        f"{result['params']:,}-parameter gradient (GPT-2 small, --scale {config['scale']}), "
        f"N = {config['senders']} senders; median of {config['repeats']} calls. Copy bound: "
        f"{copy['gb_per_second']:.1f} GB/s ({copy['bytes'] / 1e6:.1f} MB read and written in "
        f"{1e3 * copy['seconds']:.3f} ms).",
        "",
        *markdown(head, [[r["kernel"], f"{1e3 * r['seconds']:.3f}", f"{r['bytes'] / 1e6:.1f}",
                          f"{r['bytes_per_param']:.2f}", f"{r['gb_per_second']:.1f}",
                          f"{r['time_over_bound']:.1f}x", f"{r['compile_seconds']:.1f}"]
                         for r in result["rows"]]),
    ]  # fmt: skip
    head = ["format", "exchange", "lowered collectives", "native 16-bit psum", "max error",
            "exact: max error", "passed"]  # fmt: skip
    rows = [[c["dtype"], c["exchange"], "; ".join(c["lowered_collectives"]), c["native_16bit_psum"],
             f"{c['max_abs_error']:g}", f"{c['max_abs_error_exact']:g}", c["passed"]]
            for c in checks]  # fmt: skip
    tail = ["", "low_precision, exchange 'auto', over one device:", "", *markdown(head, rows)]
    return "\n".join(lines + tail if checks else lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.make_parser(__doc__)
    parser.add_argument("--platform", default=None, help="cpu, gpu or tpu (default: jax's)")
    parser.add_argument("--scale", type=int, default=1, help="divide every dimension by this")
    parser.add_argument("--kernels", default=",".join(GROUPS), help="comma-separated groups")
    parser.add_argument("--densities", default="0.001,0.01", help="top-k densities k / size")
    parser.add_argument("--ranks", default="2,4", help="PowerSGD ranks")
    parser.add_argument("--senders", type=int, default=8, help="N: devices a decompress sums")
    cli.add_outputs(
        parser,
        "runs/bench_kernels",
        repeats=(10, "timed calls per kernel"),
        seed="random seed of the gradient",
    )
    args = parser.parse_args(argv)

    def check(args: argparse.Namespace) -> None:
        args.kernel_list = cli.comma_list(args.kernels, str, "--kernels")
        args.density_list = cli.comma_list(args.densities, float, "--densities")
        args.rank_list = cli.comma_list(args.ranks, int, "--ranks")
        if unknown := sorted(set(args.kernel_list) - set(GROUPS)):
            raise ValueError(f"unknown kernel group(s): {', '.join(unknown)}")
        if not all(0 < d <= 1 for d in args.density_list):
            raise ValueError("every density must be in (0, 1]")
        if min(*args.rank_list, args.scale, args.senders, args.repeats) < 1:
            raise ValueError("--ranks, --scale, --senders and --repeats must be at least 1")

    cli.check(parser, args, check)
    return args


def main(argv: list[str] | None = None) -> None:
    stamp = provenance.start(argv)
    args = parse_args(argv)
    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    try:
        devices = jax.devices()
    except RuntimeError as e:
        raise SystemExit(f"--platform {args.platform}: {e}") from None
    print(f"jax {jax.__version__}, jax.devices(): {devices}", flush=True)
    device, shapes, out = devices[0], gpt2_shapes(args.scale), pathlib.Path(args.out)
    mesh = parallel.make_mesh({"data": 1}, devices=[device])
    leaves = normal_leaves(list(shapes.values()), args.seed)
    total = sum(g.size for g in leaves)
    out.mkdir(parents=True, exist_ok=True)
    copy_seconds = measure_copy(total, args.repeats)
    check = check_low_precision(leaves, mesh) if "low_precision" in args.kernel_list else []
    result = dict(config=vars(args), provenance=None, complete=False, jax=jax.__version__,
                  device=device.device_kind, platform=device.platform, params=total,
                  leaves=shapes, copy={}, rows=[], low_precision_check=check)  # fmt: skip

    def write(copy_seconds: float) -> None:
        bound(result["rows"], copy_seconds, total)
        copied = 8 * COPIES * total
        result["copy"] = dict(seconds=copy_seconds, bytes=copied, formula=FORMULAS["copy"][1],
                              gb_per_second=copied / copy_seconds / 1e9)  # fmt: skip
        result["provenance"] = stamp.record([device], seeds=[args.seed])
        (out / "bench_kernels.json").write_text(json.dumps(result, indent=1))

    bar = cli.progress(kernels(leaves, args, mesh), desc="kernels", quiet=args.quiet)
    for kernel in bar:
        result["rows"].append(r := measure(kernel, args.repeats))
        write(copy_seconds)  # what is done so far, should the run be cut short
        if bar.disable:
            print(f"{r['kernel']}: {1e3 * r['seconds']:.3f} ms, {r['time_over_bound']:.1f}x the "
                  f"bound, compiled in {r['compile_seconds']:.1f} s", flush=True)  # fmt: skip
    result["complete"] = True
    write(min(copy_seconds, measure_copy(total, args.repeats)))
    text = table(result)
    (out / "bench_kernels.md").write_text(text + "\n")
    print(f"\n{text}\n\nwrote {out}/bench_kernels.json, .md")
    if not all(c["passed"] for c in check):
        raise SystemExit("low_precision's check failed: see low_precision_check")


if __name__ == "__main__":
    main()
