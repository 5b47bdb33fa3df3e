#!/usr/bin/env python
"""Bytes on the wire per mesh axis on sharded models: tensor parallelism and FSDP.

    python experiments/benchmarks/bench_sharded.py                   # a 1M-parameter MLP, seconds
    python experiments/benchmarks/bench_sharded.py --data 8 --model 1 --hidden 2048

Tensor parallelism: a Megatron-style MLP's gradient (a column-split kernel and its bias,
a row-split kernel, a whole bias) on a ('data', 'model') mesh of simulated CPU devices,
each method run over 'data' in a jitted `shard_map` over both axes, against the same
method on the whole leaves over a 'data' axis alone. The bytes each device sends are read
from the compiled program (`gradcomm.wire.measure(...).by_axes()`): over 'data', a split
leaf should cost its share of the unsharded bytes; over 'model' go the per-leaf
statistics that give whole-tensor results.

FSDP (ZeRO-3): the kernels split along their leading dimension over 'data'; each method
that reduce-scatters returns each device's shard of the combined gradient, against the
same method's unsharded exchange and a plain `psum_scatter` (the FSDP allreduce). A method
that cannot is recorded with the error it raises. Writes bench_sharded.json and
bench_sharded.md to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomm_experiments import cli, provenance

# name -> (factory(specs), rows): the tables it has a row in. Every method has a
# tensor-parallel row; the methods with a reduce-scatter have FSDP rows. A "<name>
# per_shard" method is <name> on FSDP shards, and <name> itself unsharded.
METHODS: dict[str, tuple[Callable[[Any], Any], tuple[str, ...]]] = {}
BOTH, TP = ("tp", "fsdp"), ("tp",)


def _register() -> None:
    import jax.numpy as jnp

    import gradcomm

    def dropping(s: Any, **kw: Any) -> Any:
        return gradcomm.gradient_dropping("data", drop_ratio=0.99, warmup_steps=0, specs=s, **kw)

    def per_shard(s: Any) -> dict[str, Any]:
        """Each FSDP shard's own top k; unsharded (s None), the method's whole top k."""
        return {"fsdp_topk": "whole" if s is None else "per_shard"}

    METHODS.update({
        "allreduce": (lambda s: gradcomm.allreduce("data", specs=s), BOTH),
        "low_precision bf16": (lambda s: gradcomm.allreduce("data", jnp.bfloat16, specs=s), BOTH),
        "adasum": (lambda s: gradcomm.adasum("data"), TP),
        "terngrad": (lambda s: gradcomm.terngrad("data", specs=s), BOTH),
        "powersgd r4": (lambda s: gradcomm.powersgd("data", rank=4, specs=s), TP),
        "lags 0.01": (lambda s: gradcomm.lags("data", density=0.01, specs=s), BOTH),
        "lags 0.01 per_shard": (
            lambda s: gradcomm.lags("data", density=0.01, specs=s, **per_shard(s)),
            ("fsdp",),
        ),
        "slgs 0.01": (lambda s: gradcomm.slgs("data", density=0.01), TP),
        "dropping 0.99": (dropping, BOTH),
        "dropping 0.99 per_shard": (
            lambda s: dropping(s, **per_shard(s)),
            ("fsdp",),
        ),
    })  # fmt: skip


def leaves(hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    return {"w1": (width, hidden), "b1": (hidden,), "w2": (hidden, width), "b2": (width,)}


TP_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model"), "b2": P()}
FSDP_SPECS = {"w1": P("data"), "b1": P(), "w2": P("data"), "b2": P()}


def wire_of(tx: Any, mesh: Any, specs: dict, shapes: dict) -> Any:
    """The wire report of one update of `tx` on each device's own gradient.

    Inputs carry a leading device axis over 'data' (each device's gradient, split over
    'model' as `specs` say); an FSDP leaf (`P("data")`) leaves as this device's shard.
    """
    from gradcomm import wire

    fsdp = {k for k, spec in specs.items() if len(spec) and spec[0] == "data"}
    tp = {k: () if k in fsdp else tuple(spec) for k, spec in specs.items()}
    in_specs = {k: P("data", *tp[k]) for k in shapes}
    out_specs = {k: P("data") if k in fsdp else in_specs[k] for k in shapes}

    n = mesh.shape["data"]

    def body(g: dict) -> dict:
        g = {k: v[0] for k, v in g.items()}
        # This device's params: an FSDP leaf's shard (its values do not matter here).
        params = {k: v[: v.shape[0] // n] if k in fsdp else v for k, v in g.items()}
        out, _ = tx.update(g, tx.init(params), params)
        for k in fsdp:
            if out[k].shape[0] * n != g[k].shape[0]:
                raise ValueError("no reduce-scatter: it returns each device the whole result")
        return {k: v if k in fsdp else v[None] for k, v in out.items()}

    args = {
        k: jax.ShapeDtypeStruct((n, *s), np.float32, sharding=NamedSharding(mesh, in_specs[k]))
        for k, s in shapes.items()
    }
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs))
    return wire.measure(fn, args)


def row(name: str, sharded: Any, whole: Any) -> dict[str, Any]:
    axes = {"+".join(k) if k else "none": v for k, v in sharded.by_axes().items()}
    data = axes.get("data", 0.0)
    return {
        "method": name,
        "data_bytes": data,
        "model_bytes": sum(v for k, v in axes.items() if k != "data"),
        "unsharded_data_bytes": whole.total,
        "data_ratio": data / whole.total if whole.total else None,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from gradcomm import parallel

    devices = jax.devices()
    shapes = leaves(args.hidden, args.width)
    two = parallel.make_mesh(
        {"data": args.data, "model": args.model}, devices=devices[: args.data * args.model]
    )
    one = parallel.make_mesh({"data": args.data}, devices=devices[: args.data])
    whole_specs = {k: P() for k in shapes}
    tp, fsdp, wholes = [], [], {}
    for name, (make, rows) in cli.progress(METHODS.items(), desc="method", quiet=args.quiet):
        base = name.removesuffix(" per_shard")  # measured unsharded once
        if base not in wholes:
            wholes[base] = wire_of(make(None), one, whole_specs, shapes)
        whole = wholes[base]
        if "tp" in rows:
            tp.append(row(name, wire_of(make(TP_SPECS), two, TP_SPECS, shapes), whole))
        if "fsdp" not in rows:
            continue
        try:
            split = wire_of(make(FSDP_SPECS), one, FSDP_SPECS, shapes)
        except ValueError as e:
            fsdp.append({"method": name, "error": str(e).splitlines()[0]})
            continue
        fsdp.append({
            "method": name, "fsdp_bytes": split.total, "unsharded_bytes": whole.total,
            "by_kind": split.by_kind(),
        })  # fmt: skip
    return {"tensor_parallel": tp, "fsdp": fsdp}


def tables(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"Tensor parallelism: data {cfg['data']} x model {cfg['model']}, hidden {cfg['hidden']},"
        f" width {cfg['width']}; bytes sent per device per step.",
        "",
        "| method | over data | over model | unsharded, over data | data: sharded / unsharded |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["tensor_parallel"]:
        ratio = "" if r["data_ratio"] is None else f"{r['data_ratio']:.3f}"
        lines.append(
            f"| {r['method']} | {r['data_bytes']:,.0f} | {r['model_bytes']:,.0f} | "
            f"{r['unsharded_data_bytes']:,.0f} | {ratio} |"
        )
    lines += [
        "",
        f"FSDP over data {cfg['data']}: the kernels' leading dimension split; bytes per device.",
        "",
        "| method | FSDP | unsharded exchange | FSDP / unsharded | collectives |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for r in result["fsdp"]:
        if "error" in r:
            lines.append(f"| {r['method']} | raises: {r['error']} | | | |")
            continue
        kinds = ", ".join(f"{k} {v:,.0f}" for k, v in r["by_kind"].items())
        lines.append(
            f"| {r['method']} | {r['fsdp_bytes']:,.0f} | {r['unsharded_bytes']:,.0f} | "
            f"{r['fsdp_bytes'] / r['unsharded_bytes']:.3f} | {kinds} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    stamp = provenance.start(argv)
    parser = cli.make_parser(__doc__)
    parser.add_argument("--data", type=int, default=4, help="devices on the data axis")
    parser.add_argument("--model", type=int, default=2, help="devices on the model axis")
    parser.add_argument("--hidden", type=int, default=1024, help="the MLP's hidden units")
    parser.add_argument("--width", type=int, default=512, help="the MLP's input and output width")
    cli.add_outputs(parser, "runs/bench_sharded")
    args = parser.parse_args(argv)

    def check(args: argparse.Namespace) -> None:
        if min(args.data, args.model, args.hidden, args.width) < 1:
            raise ValueError("--data, --model, --hidden and --width must be at least 1")
        if args.hidden % args.model or args.width % args.data or args.hidden % args.data:
            raise ValueError("--model must divide --hidden, and --data --hidden and --width")

    cli.check(parser, args, check)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.data * args.model)  # before the backend
    _register()
    result = {
        "config": vars(args),
        "provenance": stamp.record(jax.devices(), seeds=[]),
        **measure(args),
    }
    table = tables(result)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_sharded.json").write_text(json.dumps(result, indent=1))
    (out / "bench_sharded.md").write_text(table + "\n")
    print(f"{table}\n\nwrote {out}/bench_sharded.json, .md")


if __name__ == "__main__":
    main()
