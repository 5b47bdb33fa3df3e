"""The alpha-beta step-time model: hand-computed cases, wire bytes, calibration, the papers."""

import dataclasses
import doctest
import importlib
import json
import math
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import gradcomm
from gradcomm import perfmodel as pm
from gradcomm_experiments import methods as registry  # the registry that hands the model its rows

ROOT = pathlib.Path(__file__).resolve().parents[2]

ROWS = registry.rows()  # the network benchmark's methods, one device per host
P = 4_194_304  # the network benchmark's MLP
S = 4 * P  # 16 MiB
# The methods whose records time whole cycles (an average, not a median).
PERIODIC = ("local_sgd", "diloco", "streaming_diloco", "sgp", "dpsgd")
LINK = 0.0958  # Gbit/s: the shaped 100 Mbit link as measured
ONE_WAY = 8 * S / (LINK * 1e9)  # 1.40 s
AVERAGE_50 = {"name": "periodic_average", "every": 50}  # dropping-local's sync


def test_docstring_examples_run():
    # Every module of the package: doctest finds an object only in the module defining it.
    names = [pm.__name__] + [f"{pm.__name__}.{m.name}" for m in pkgutil.iter_modules(pm.__path__)]
    attempted = 0
    for name in names:
        result = doctest.testmod(
            importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE
        )
        assert result.failed == 0, name
        attempted += result.attempted
    assert attempted >= 8


def test_exported():
    assert gradcomm.perfmodel is pm
    assert "perfmodel" in gradcomm.__all__


# ----------------------------------------------------------------------------- arithmetic


def test_allreduce_by_hand():
    # 25M float32 parameters = 100 MB; ring: 2 (15/16) 100 MB = 187.5 MB = 1.5 Gbit.
    p = pm.predict("allreduce", 25_000_000, 16, 10.0)
    assert p.comm_s == pytest.approx(0.15)
    assert p.wire_bytes == pytest.approx(187.5e6)
    # 2 (N - 1) = 30 messages of 10 us each.
    assert pm.predict("allreduce", 25_000_000, 16, 10.0, 1e-5).comm_s == pytest.approx(0.1503)
    # On NCCL the all-reduce hides behind the backward pass, 2/3 of the compute.
    p = pm.predict("allreduce", 25_000_000, 16, 10.0, compute_s=0.15)
    assert (p.hidden_s, p.step_s) == pytest.approx((0.1, 0.2))
    # On gloo nothing hides, and the measured factor applies: 2.18 s / 2.10 s at N = 4.
    p = pm.predict("allreduce", P, 4, LINK, backend=pm.GLOO, compute_s=0.15)
    assert p.comm_s == pytest.approx(2.18, rel=1e-3)
    assert p.step_s == pytest.approx(2.33, rel=1e-3)


def test_gloo_factors_are_the_measured_table():
    assert pm.GLOO.swap_factor == pytest.approx(2.80 / ONE_WAY)
    assert pm.GLOO.factor("allgather", 2) == pytest.approx(1.06 / (ONE_WAY / 2))
    assert pm.GLOO.factor("allgather", 8) == pm.GLOO.factor("allgather", 4)  # largest below
    assert pm.GLOO.factor("allreduce", 3) == pm.GLOO.factor("allreduce", 2)
    assert pm.GLOO.factor("unknown", 4) == 1.0
    assert pm.GLOO_PAIRWISE.factor("swap", 2) == pytest.approx(0.75 / (ONE_WAY / 2))
    assert pm.NCCL.factor("swap", 2) == pm.NCCL.factor("alltoall", 64) == 1.0
    # Each measured pattern comes back from the model as measured.
    for (kind, n), seconds in pm.GLOO_MEASURED.items():
        coll = pm.Collective(kind, n, S)
        assert pm.GLOO.factor(kind, n) * coll.seconds(LINK) == pytest.approx(seconds)


def test_gossip_on_gloo_by_hand():
    # N = 2: the peer i + 1 is a swap, 2.80 s; the push-sum weight adds 4 bytes.
    assert pm.predict("sgp", P, 2, LINK, backend=pm.GLOO).comm_s == pytest.approx(2.80, 1e-5)
    # N = 4: shifts 1 (a ring shift, 1.53 s) and 2 (a swap, 2.80 s) alternate.
    assert pm.predict("sgp", P, 4, LINK, backend=pm.GLOO).comm_s == pytest.approx(2.165, 1e-5)
    # D-PSGD at N = 4: phase 0 sends i + 1 and i - 1 (two ring shifts), phase 1 i + 2 (a swap).
    assert pm.predict("dpsgd", P, 4, LINK, backend=pm.GLOO).comm_s == pytest.approx(
        (2 * 1.53 + 2.80) / 2, 1e-5
    )
    # Pairwise, a lone swap of which only the sum is mixed is a 2-member all-reduce (1.57 s);
    # with overlap the received share is kept apart, so it is an exchange: 0.75 s per half.
    pairwise = pm.predict("sgp", P, 2, LINK, backend=pm.GLOO_PAIRWISE).comm_s
    assert pairwise == pytest.approx(1.57, 1e-5)
    osgp = pm.predict("sgp", P, 2, LINK, options={"overlap": 1}, backend=pm.GLOO_PAIRWISE)
    assert osgp.comm_s == pytest.approx(2 * 0.75, 1e-5)
    # N = 4: the ring shift (1.53 s) and the pair's sum (1.57 s) alternate.
    pairwise = pm.predict("sgp", P, 4, LINK, backend=pm.GLOO_PAIRWISE).comm_s
    assert pairwise == pytest.approx((1.53 + 1.57) / 2, 1e-5)
    # A factory's `exchange` overrides the backend's.
    forced = pm.predict(
        "sgp", P, 4, LINK, options={"exchange": "permute"}, backend=pm.GLOO_PAIRWISE
    )
    assert forced.comm_s == pytest.approx(2.165, 1e-5)


def test_adasum_by_hand():
    # N = 2 on gloo: a swap of S/2 (1.40 s) and an all-gather with output S (1.06 s).
    assert pm.predict("adasum", P, 2, LINK, backend=pm.GLOO).comm_s == pytest.approx(2.46)
    # Pairwise: the swap of S/2 and the doubling gather (a swap of S/2) run as 2-member
    # reduce-scatters at full duplex (0.75 s each): allreduce's 1.5 s.
    assert pm.predict("adasum", P, 2, LINK, backend=pm.GLOO_PAIRWISE).comm_s == pytest.approx(
        0.75 + 0.75
    )
    # N = 4: swaps of S/2 and S/4 (at 2.80 s per S), then the all-gather (1.14 s).
    assert pm.predict("adasum", P, 4, LINK, backend=pm.GLOO).comm_s == pytest.approx(
        0.75 * 2.80 + 1.14, rel=1e-3
    )
    # Bytes are a ring all-reduce's for powers of two (README: 7/8 + 7/8 at N = 8).
    for n in (2, 4, 8, 16):
        adasum = pm.predict("adasum", 1000, n, 1.0).wire_bytes
        assert adasum == pytest.approx(pm.predict("allreduce", 1000, n, 1.0).wire_bytes)
    # N = 6: device 4 + i folds into i (a model-sized permute), then the tree of 4.
    kinds = [c.kind for c in pm.pattern("adasum", 1000, 6)]
    assert kinds == ["permute", "swap", "allgather", "swap", "allgather", "doubling_gather"]
    # With S = 4000 bytes: 4000 (fold) + 2000 + 1000 (swaps) + (5/6) 6000 (all-gather).
    assert pm.predict("adasum", 1000, 6, 1.0).wire_bytes == pytest.approx(12000)


@pytest.mark.parametrize(("n", "ratio"), [(2, 20.0), (4, 13.3), (8, 10.4), (16, 9.2)])
def test_terngrad_bytes_match_the_readme(n, ratio):
    # README, "TernGrad: bytes on the wire": psum / terngrad bytes read from the HLO.
    psum = pm.predict("allreduce", 1_200_000, n, 1.0).wire_bytes
    assert psum / pm.predict("terngrad", 1_200_000, n, 1.0).wire_bytes == pytest.approx(
        ratio, abs=0.05
    )
    expected = ["allreduce", "allgather"] if n <= 2 else ["allreduce", "alltoall", "allgather"]
    assert [c.kind for c in pm.pattern("terngrad", 1000, n)] == expected


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sparse_bytes_match_the_readme(n):
    d = 1_200_000
    psum = pm.predict("allreduce", d, n, 1.0).wire_bytes
    # LAGS at density 0.001: d / (N k) = 1000 / N fewer bytes (124.9x at N = 8 with padding).
    lags = pm.predict("lags", d, n, 1.0, options={"density": 0.001})
    assert lags.wire_bytes == pytest.approx((n - 1) * 1200 * 8)
    assert psum / lags.wire_bytes == pytest.approx(1000 / n)
    # Gradient dropping at 99%: 100 / N (25x at 4, 12.5x at 8).
    assert psum / pm.predict("gradient_dropping", d, n, 1.0).wire_bytes == pytest.approx(100 / n)
    # With local gradients averaged every 50 steps (a sync): the dense psum / 50 on top.
    local = pm.predict(
        "gradient_dropping", d, n, 1.0, options={"local": "compensated"}, sync=AVERAGE_50
    )
    assert local.wire_bytes == pytest.approx(psum * n / 100 + psum / 50)


def test_sgp_bytes_match_the_readme():
    # One model-sized message whatever N is: SGP / psum = 1.000, 0.667, 0.571, 0.533.
    for n, ratio in [(2, 1.0), (4, 0.667), (8, 0.571), (16, 0.533)]:
        sgp = pm.predict("sgp", 1_205_608, n, 1.0).wire_bytes
        assert sgp == 4 * 1_205_608 + 4
        assert sgp / pm.predict("allreduce", 1_205_608, n, 1.0).wire_bytes == pytest.approx(
            ratio, abs=1e-3
        )
    # D-PSGD: two messages where i + s and i - s differ (averaged over phases here).
    assert pm.predict("dpsgd", 1000, 8, 1.0).wire_bytes == pytest.approx(4004 * (2 + 2 + 1) / 3)
    hypercube = pm.predict("dpsgd", 1000, 8, 1.0, options={"topology": "hypercube"})
    assert hypercube.wire_bytes == pytest.approx(4004)


@pytest.mark.parametrize(
    ("name", "n", "expected"),
    [
        ("exponential", 8, [["permute"], ["permute"], ["swap"]]),  # i + 4 = i - 4
        ("exponential", 2, [["swap"]]),
        ("exponential-bidirectional", 4, [["permute", "permute"], ["swap"]]),
        ("exponential-bidirectional", 3, [["permute", "permute"], ["permute", "permute"]]),
        ("ring", 5, [["permute"]]),
        ("hypercube", 8, [["swap"], ["swap"], ["swap"]]),
    ],
)
def test_gossip_messages_follow_the_graph(name, n, expected):
    """A move in which devices send to each other is a swap; a phase's messages share the
    step (time-varying graphs are averaged over their phases)."""
    options = {"topology": name, "overlap": 1}  # no overlap: a lone swap is a pair's sum
    pattern = pm.pattern("sgp", 1000, n, options=options)
    assert [c.kind for c in pattern] == [k for phase in expected for k in phase]
    assert {c.share for c in pattern} == {1 / len(expected)}
    summed = [c.kind for c in pm.pattern("sgp", 1000, n, options={"topology": name})]
    assert summed == [k for p in expected for k in (["pair_sum"] if p == ["swap"] else p)]
    assert pm.pattern("sgp", 1000, 1, options={"topology": name}) == []


def test_local_sgd_and_amortizing():
    every = pm.predict("local_sgd", P, 4, 1.0, options={"every": 20})
    assert every.wire_bytes == pytest.approx(pm.predict("allreduce", P, 4, 1.0).wire_bytes / 20)
    assert pm.predict("local_sgd", P, 4, 1.0, amortize=False).comm_s == 0.0
    diloco = pm.predict("diloco", P, 4, 1.0, options={"every": 20})  # DiLoCo's outer step
    assert diloco.wire_bytes == pytest.approx(every.wire_bytes)
    assert pm.predict("diloco", P, 4, 1.0).wire_bytes == pytest.approx(every.wire_bytes / 25)
    # A sync beside a method is the same all-reduce every k steps, whichever factory.
    for name in ("periodic_average", "local_sgd", "diloco"):
        sync = {"name": name, "every": 20}
        beside = pm.predict("lags", P, 4, 1.0, sync=sync).wire_bytes
        assert beside == pytest.approx(pm.predict("lags", P, 4, 1.0).wire_bytes + every.wire_bytes)
    assert pm.predict("lags", P, 4, 1.0, sync=AVERAGE_50, amortize=False).comm_s == pytest.approx(
        pm.predict("lags", P, 4, 1.0).comm_s
    )
    with pytest.raises(ValueError, match="unknown sync"):
        pm.pattern("lags", 10, 2, sync={"name": "gossip"})
    # The option it replaced is refused, not ignored: a record would be misread.
    with pytest.raises(ValueError, match="takes no option 'average_every'"):
        pm.pattern("gradient_dropping", 10, 2, options={"average_every": 50})
    with pytest.raises(ValueError, match="unknown method"):
        pm.pattern("psum", 10, 2)
    with pytest.raises(ValueError, match="unknown topology"):
        pm.pattern("sgp", 10, 2, options={"topology": "torus"})


SHAPES = [(64, 48), (48,), (48, 12), (12,), (3, 3, 4, 8)]  # 3996 parameters, N = 4 divides


@pytest.mark.parametrize(
    "method, options, extra",
    [
        ("powersgd", {"rank": 2}, 0.0),
        ("powersgd", {"rank": 1, "min_compression_rate": 1.0}, 0.0),
        ("low_precision", {"dtype": "bfloat16"}, 2 * 3),  # + its flag word from each peer
        ("low_precision", {"dtype": "float16", "exchange": "all_to_all"}, 2 * 3),
        ("low_precision", {"dtype": "float16", "exchange": "ring"}, 2 * 3),
        # The state is dropped here, and with it the psum's element that counts overflows.
        ("low_precision", {"dtype": "float16"}, 0.0),
        ("allreduce", {"dtype": "float16"}, 0.0),
    ],
)
def test_new_methods_bytes_are_the_compiled_programs(method, options, extra):
    """The model's bytes for PowerSGD and the 16-bit all-reduces are what `gradcomm.wire`
    reads from the compiled step (N = 4, the leaves' shapes given to the model)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as Spec

    n = 4
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    tx = getattr(gradcomm, method)("data", **options)

    def body(tree):
        out, _ = tx.update([x[0] for x in tree], tx.init([x[0] for x in tree]))
        return [x[None] for x in out]

    spec = Spec("data")
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    sharding = NamedSharding(mesh, spec)
    tree = [jax.ShapeDtypeStruct((n, *s), np.float32, sharding=sharding) for s in SHAPES]
    measured = gradcomm.wire.measure(step, tree).total
    params = sum(math.prod(s) for s in SHAPES)
    model = pm.pattern(method, params, n, options=options, shapes=SHAPES)
    assert measured == pytest.approx(sum(c.sent() for c in model) + extra)
    if method == "powersgd":  # P with the dense leaves, then Q: two all-reduces
        assert [c.kind for c in model] == ["allreduce", "allreduce"]
    # The bits of bfloat16 go as an all-to-all and an all-gather on gloo, psum on NCCL.
    if options.get("dtype") == "bfloat16" or options.get("exchange") == "all_to_all":
        gloo = pm.predict(method, params, n, 1.0, options=options, backend=pm.GLOO)
        nccl = pm.predict(method, params, n, 1.0, options=options, backend=pm.NCCL)
        assert gloo.wire_bytes == pytest.approx(nccl.wire_bytes)
        assert [c.kind for c in model] == ["alltoall", "allgather"]
    if options.get("exchange") == "ring":  # three one-way shifts of a quarter, a gather
        assert [c.kind for c in model] == ["permute"] * 3 + ["allgather"]
    # On gloo, "auto" is the ring (N = 4) or the pairwise form (N = 2: a two-member
    # reduce-scatter each way, on any backend); either with a ring's bytes.
    if method == "low_precision" and "exchange" not in options:
        kinds = [c.kind for c in pm.pattern(method, params, n, options=options, gloo=True)]
        assert kinds == ["permute"] * 3 + ["allgather"]
        kinds = [c.kind for c in pm.pattern(method, params, 2, options=options, gloo=True)]
        assert kinds == ["reduce_scatter", "reduce_scatter"]
        for backend in (pm.GLOO, pm.GLOO_PAIRWISE):
            ring = pm.predict(method, params, n, 1.0, options=options, backend=backend)
            assert ring.wire_bytes == pytest.approx(2 * 2 * 3 / 4 * params)
            pair = pm.predict(method, params, 2, 1.0, options=options, backend=backend)
            assert pair.wire_bytes == pytest.approx(2 * params)  # half of 2 bytes, each way
        assert pair.comm_s == pytest.approx(  # at gloo's two-member reduce-scatter speed
            2 * backend.factor("reduce_scatter", 2) * 8 * params / 1e9
        )


def test_terngrad_pattern_follows_its_exchange():
    # "auto" is the all-gather at N = 2, the all-to-all from N = 3 on; "psum" (floats, no
    # compression) a float32 all-reduce's bytes.
    def kinds(exchange, n):
        return [c.kind for c in pm.pattern("terngrad", P, n, options={"exchange": exchange})]

    assert kinds("auto", 2) == kinds("all_gather", 2) == ["allreduce", "allgather"]
    assert kinds("auto", 4) == kinds("all_to_all", 4) == ["allreduce", "alltoall", "allgather"]
    assert kinds("all_gather", 4) == ["allreduce", "allgather"]
    psum = pm.predict("terngrad", P, 4, 1.0, options={"exchange": "psum"}).wire_bytes
    assert psum == pytest.approx(pm.predict("allreduce", P, 4, 1.0).wire_bytes)


def test_overlap():
    args = ("sgp", 25_000_000, 16, 10.0)
    # NCCL: 1-overlap SGP hides its 0.08 s message behind the step; SGP hides nothing.
    osgp = pm.predict(*args, options={"overlap": 1}, compute_s=0.2)
    sgp = pm.predict(*args, compute_s=0.2)
    assert (osgp.step_s, sgp.step_s) == pytest.approx((0.2, 0.28), abs=1e-4)
    # gloo (this CPU path): every collective runs after the backward pass; osgp = sgp.
    gloo = {"backend": pm.GLOO, "compute_s": 0.2}
    assert pm.predict(*args, options={"overlap": 1}, **gloo) == pm.predict(*args, **gloo)
    # LAGS hides behind the backward pass, SLGS does not.
    lags = pm.predict("lags", 25_000_000, 16, 0.8, options={"density": 0.01}, compute_s=0.3)
    slgs = pm.predict("slgs", 25_000_000, 16, 0.8, options={"density": 0.01}, compute_s=0.3)
    assert lags.comm_s == slgs.comm_s == pytest.approx(0.3)  # 15 x 250k x 8 B at 0.8 Gbit/s
    assert (lags.step_s, slgs.step_s) == pytest.approx((0.4, 0.6))
    assert pm.window("sgp", {"overlap": 2}) == "step"
    assert pm.window("slgs") == pm.window("local_sgd") == "none"
    # Extra compute per byte adds to the compute, not to the window.
    p = pm.predict("terngrad", 1000, 2, 1.0, compute_s=0.1, cost_per_byte=1e-6)
    assert p.compute_s == pytest.approx(0.104)


def test_crossover_by_hand():
    # LAGS at density 0.001 with 0.1 s of extra compute: the all-reduce exposes
    # 1.5 / B - (2/3) 0.1 s, which equals 0.1 s at B = 9 Gbit/s; LAGS's 3 MB hide.
    kw = {"compute_s": 0.1, "cost_per_byte": 1e-9}
    assert pm.crossover_bandwidth("lags", 25_000_000, 16, **kw) == pytest.approx(9.0, rel=1e-6)
    # Without extra compute LAGS only ties once the all-reduce hides: 1.5 / B = 0.0667.
    b = pm.crossover_bandwidth("lags", 25_000_000, 16, compute_s=0.1)
    assert b == pytest.approx(22.5, rel=1e-6)
    # Never: D-PSGD at N = 2 on gloo swaps the whole model (2.80 s against 1.57 s).
    assert pm.crossover_bandwidth("dpsgd", P, 2, backend=pm.GLOO) is None
    # Always: local SGD sends a twentieth and computes no more.
    assert pm.crossover_bandwidth("local_sgd", P, 4, backend=pm.GLOO) == math.inf
    assert pm.crossover_bandwidth("allreduce", P, 4) is None


def test_crossover_table():
    table = pm.crossover_table(25_000_000, 16, 0.2, methods=ROWS)
    lines = table.strip().splitlines()
    assert lines[0] == "| method | beats allreduce below | 1 Gbit/s | 10 Gbit/s | 100 Gbit/s |"
    assert len(lines) == 2 + len(ROWS)
    assert "| allreduce | - | 1.00x | 1.00x | 1.00x |" in lines
    assert any(line.startswith("| adasum | no crossover |") for line in lines)


# ----------------------------------------------------------------------------- calibration

TRUTH = pm.Calibration(
    backend=pm.GLOO,
    base_s={(2, 1): 0.045, (4, 1): 0.08},
    cost_per_byte={
        pm.key("lags", {"density": 0.01}): 0.05 / S,
        pm.key("terngrad"): 0.07 / S,
        pm.key("sgp"): 0.01 / S,
        pm.key("local_sgd", {"every": 20}): 0.02 / S,
    },
    unshaped_gbps={2: 8.0, 4: 2.5},
    params=P,
)


def simulate(truth, nodes=(2, 4), rates=(None, 100.0, 1000.0), methods=ROWS):
    """network.json records as the model would measure them."""
    out = []
    for n in nodes:
        for rate in rates:
            gbps = truth.unshaped_gbps[n] if rate is None else rate / 1000
            steps = {}
            for row in methods:
                m, o, sync = row["method"], row["options"], row["sync"]
                kw = truth.settings(m, o, n, sync=sync)
                steps[row["label"]] = pm.predict(m, P, n, gbps, options=o, sync=sync, **kw).step_s
            for row in methods:
                label, m = row["label"], row["method"]
                periodic = m in PERIODIC or row["sync"] is not None
                out.append(
                    {
                        **row,
                        "nodes": n,
                        "devices_per_process": 1,
                        "rate": "unshaped" if rate is None else f"{rate:g}mbit",
                        "rate_mbit": rate,
                        "link_mbit_measured": rate,
                        "params": P,
                        "param_bytes": S,
                        "step_s": steps[label],
                        "allreduce_step_s": steps["allreduce"],
                        "ratio_vs_allreduce": steps[label] / steps["allreduce"],
                        "timing": "cycle-mean" if periodic else "median",
                    }
                )
    return out


def test_calibrate_recovers_what_made_the_records():
    records = simulate(TRUTH)
    cal = pm.calibrate(records)
    assert cal.params == P and cal.itemsize == 4
    for g, v in TRUTH.base_s.items():
        assert cal.base_s[g] == pytest.approx(v, rel=1e-6)
    for n, v in TRUTH.unshaped_gbps.items():
        assert cal.unshaped_gbps[n] == pytest.approx(v, rel=1e-6)
    for k, v in TRUTH.cost_per_byte.items():
        assert cal.cost_per_byte[k] == pytest.approx(v, rel=1e-5)
    assert cal.cost_per_byte[pm.key("adasum")] == pytest.approx(0.0, abs=1e-15)
    for n in (2, 4):
        assert cal.backend.factor("allreduce", n) == pytest.approx(pm.GLOO.factor("allreduce", n))
    rows = pm.fit_report(records, cal)
    assert len(rows) == len(records)
    assert all(r.ok and abs(r.error) < 1e-6 for r in rows)
    assert {r.bound for r in rows} == {"bandwidth", "compute"}


def test_calibrate_refits_the_allreduce_factor():
    # The shaped all-reduce runs 10% slower than the pattern table says: the fit follows.
    slow = pm.Calibration(
        dataclasses.replace(
            pm.GLOO, factors={**pm.GLOO.factors, ("allreduce", 2): 1.2, ("allreduce", 4): 1.15}
        ),
        TRUTH.base_s,
        TRUTH.cost_per_byte,
        TRUTH.unshaped_gbps,
        P,
    )
    for rates in [(None, 100.0), (100.0, 1000.0)]:  # unshaped cells, or a line through two
        cal = pm.calibrate(simulate(slow, rates=rates))
        assert cal.backend.factor("allreduce", 2) == pytest.approx(1.2, rel=1e-3)
        assert cal.backend.factor("allreduce", 4) == pytest.approx(1.15, rel=1e-3)
        assert cal.base_s[(4, 1)] == pytest.approx(0.08, rel=1e-2)
    # One shaped rate and no unshaped cell: the table's factor, the rest taken as compute.
    cal = pm.calibrate(simulate(slow, rates=(100.0,)))
    assert cal.backend.factor("allreduce", 2) == pytest.approx(pm.GLOO.factor("allreduce", 2))


def test_calibrate_fits_allreduce_per_rate():
    # gloo's ring runs at a different factor on each link: 1.2 at 100 Mbit, 0.9 at 1 Gbit.
    def at(factor):
        backend = dataclasses.replace(
            pm.GLOO, factors={**pm.GLOO.factors, ("allreduce", 2): factor, ("allreduce", 4): factor}
        )
        return pm.Calibration(backend, TRUTH.base_s, TRUTH.cost_per_byte, TRUTH.unshaped_gbps, P)

    records = simulate(at(1.2), rates=(None, 100.0)) + [
        r for r in simulate(at(0.9), rates=(None, 1000.0)) if r["rate_mbit"] == 1000.0
    ]
    cal = pm.calibrate(records)
    for n in (2, 4):
        assert cal.rate_factors[n, 100.0] == pytest.approx(1.2, rel=0.03)
        assert cal.rate_factors[n, 1000.0] == pytest.approx(0.9, rel=0.03)
    # (Within 3%: the unshaped cells are fitted with the median factor.) Each shaped
    # allreduce is predicted with its rate's factor; one factor for both would miss both.
    for r in records:
        if r["rate_mbit"] and r["method"] == "allreduce":
            assert cal.predict_record(r).step_s == pytest.approx(r["step_s"], rel=0.03)


def test_calibrate_drops_a_negative_link_term():
    # Unshaped steps made with a negative link term at N = 2 (sending more made it faster):
    # that term is dropped (no bandwidth cost), N = 4's is kept.
    inverse, base, extra = {2: -0.01, 4: 0.4}, {2: 0.05, 4: 0.09}, {"sgp": 0.01, "terngrad": 0.05}
    records = []
    for n in (2, 4):
        cell = {"nodes": n, "params": P, "param_bytes": S, "rate_mbit": None}
        ar = base[n] + inverse[n] * pm.predict("allreduce", P, n, 1.0, backend=pm.GLOO).comm_s
        records.append(cell | {"method": "allreduce", "step_s": ar, "allreduce_step_s": ar})
        for m, x in extra.items():
            comm = pm.predict(m, P, n, 1.0, backend=pm.GLOO).comm_s
            step = base[n] + x + inverse[n] * comm
            records.append(cell | {"method": m, "step_s": step, "allreduce_step_s": ar})
    cal = pm.calibrate(records)
    assert math.isinf(cal.unshaped_gbps[2]) and math.isfinite(cal.unshaped_gbps[4])


def test_fit_tolerances():
    records = simulate(TRUTH, nodes=(2, 4), rates=(None, 100.0))
    off = []
    for r in records:
        r = dict(r)
        if r["label"] in ("sgp", "terngrad"):  # 20% off the model
            r["ratio_vs_allreduce"] *= 1.25
            r["ratio_runs"] = [r["ratio_vs_allreduce"] * f for f in (0.8, 1.0, 1.2)]
        off.append(r)
    rows = {(r.label, r.rate): r for r in pm.fit_report(off, pm.calibrate(records)) if r.nodes == 2}
    # Bandwidth-bound: 15% however much the runs spread.
    assert rows[("sgp", "100mbit")].bound == "bandwidth"
    assert not rows[("sgp", "100mbit")].ok
    assert rows[("sgp", "100mbit")].error == pytest.approx(-0.2)
    # Compute-bound: within the runs' spread (40% here).
    assert rows[("terngrad", "unshaped")].bound == "compute"
    assert rows[("terngrad", "unshaped")].tolerance == pytest.approx(0.4)
    assert rows[("terngrad", "unshaped")].ok
    text = pm.fit_markdown(list(rows.values()))
    assert "| sgp | 2 | 100mbit |" in text and "no (tolerance 15%)" in text
    assert "osgp shows no gain" in text and "latency is 0" in text
    assert re.search(r"bandwidth-bound cells: \d+, largest error 20%", text)


# The pattern table and the step times measured with gloo on this machine's shaped links
# (4M-parameter MLP, Adam; ratios to allreduce in the same run, and allreduce's step).
MEASURED = {
    (2, 100.0, 1.51): {"lags": 0.08, "lags-0.001": 0.03, "terngrad": 0.13, "sgp": 1.93,
                       "adasum": 1.66},
    (4, 100.0, 2.43): {"lags": 0.11, "lags-0.001": 0.04, "terngrad": 0.17, "sgp": 0.98,
                       "adasum": 1.44},
    (2, None, 0.063): {"lags": 1.74, "lags-0.001": 0.82, "terngrad": 2.10},
    (4, None, 0.158): {},
}  # fmt: skip


def test_bandwidth_bound_cells_measured_here():
    records = []
    for (n, rate, ar), ratios in MEASURED.items():
        cell = {"nodes": n, "rate": f"{rate}", "rate_mbit": rate, "link_mbit_measured": 95.8}
        cell |= {"params": P, "param_bytes": S, "allreduce_step_s": ar}
        records.append(cell | {"method": "allreduce", "label": "allreduce", "step_s": ar})
        for label, x in ratios.items():
            row = registry.METHODS[label].describe()
            records.append(cell | row | {"step_s": x * ar})
    rows = pm.fit_report(records, pm.calibrate(records))
    bound = {(r.label, r.nodes): r for r in rows if r.bound == "bandwidth"}
    assert set(bound) == {(m, n) for m in ("allreduce", "sgp", "adasum") for n in (2, 4)}
    assert all(abs(r.error) < 0.05 for r in bound.values())


# ----------------------------------------------------------------------------- papers


def test_paper_checks():
    checks = pm.paper_checks()
    assert len(checks) == 11
    by = {c.setting.split(",")[0]: c for c in checks if not c.paper.startswith("SGP")}
    # The figures as the papers state them.
    assert by["64 V100s (16 nodes x 4)"].paper_value == 1.45
    assert [by[m].paper_value for m in ("ResNet-50", "Inception-v4", "LSTM-PTB")] == [
        2.86,
        3.08,
        8.52,
    ]
    tern = [c for c in checks if c.paper.startswith("TernGrad")]
    assert [c.paper_value for c in tern] == [3.04, 2.0]
    sgp = [c for c in checks if c.paper.startswith("SGP")]
    assert [round(c.paper_value, 2) for c in sgp] == [3.0, 1.96]
    # Adasum sends the ring's bytes: at zero latency its collective takes the all-reduce's time.
    adasum = checks[0]
    assert adasum.quantity == "latency ratio"
    assert adasum.predicted == pytest.approx(1.0) and adasum.implied_compute_s is None
    # TernGrad gives no compute time: the model's speed-up is a bound, above the paper's.
    assert all(c.compute_s == 0 and c.predicted > c.paper_value for c in tern)
    assert tern[0].predicted == pytest.approx(20.0)  # 1.6-bit codes against float32, N = 2
    # SGP: the model's SGP step is close to the paper's, its all-reduce far from it, so no
    # compute time gives 3x.
    assert all(c.predicted < 1.3 and c.implied_compute_s is None for c in sgp)
    # Compute read from the papers' own measurements.
    assert by["ResNet-50"].compute_s == pytest.approx(0.67 - 15 * 25_557 * 8 * 8 / 1e9, rel=1e-3)
    assert sgp[0].compute_s == pytest.approx(8.8 * 3600 / (90 * 1_281_167 / 1024), rel=1e-3)
    for c in checks:
        assert c.inputs.count("Gbit/s") == 1 and "compute" in c.inputs


def test_model_doc_quotes_the_papers_table():
    doc = (ROOT / "docs" / "bench" / "model.md").read_text()
    assert pm.paper_table() in doc
    assert pm.crossover_table(25_557_032, 32, 0.281, methods=ROWS) in doc
    assert "no crossover" in doc and "osgp row shows no gain" in doc


# ----------------------------------------------------------------------------- CLI


def test_cli(tmp_path, capsys):
    path = tmp_path / "network.json"
    peer = {"framework": "torch", "label": "torch-fp16", "hook": "fp16_compress_hook"}
    path.write_text(json.dumps([*simulate(TRUTH), peer]))  # a peer row is left out
    out = tmp_path / "model.json"
    assert pm.main([str(path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "## The model's fit to" in text and "osgp shows no gain" in text
    assert "| lags |" in text and "## The papers' figures beside the model" in text
    report = json.loads(out.read_text())
    assert len(report["fit"]) == len(simulate(TRUTH)) and len(report["papers"]) == 11
    assert report["calibration"]["base_s"]["2x1"] == pytest.approx(0.045)
    with pytest.raises(SystemExit) as exit_:
        pm.main(["--help"])
    assert exit_.value.code == 0


@pytest.mark.parametrize(
    ("records", "flags"),
    [("docs/bench/quick/network.json", []), ("docs/bench/network.json", ["--nodes", "4"])],
)
def test_committed_fits_come_back_from_the_committed_records(records, flags, capsys, monkeypatch):
    # The records were migrated when gradient dropping's averaging became a sync
    # (`average_every` in options -> `sync`); the model reads them as before: each fit.md is
    # the CLI's output, after its command line.
    monkeypatch.chdir(ROOT)
    fit = pathlib.Path(records).with_name("fit.md").read_text()
    assert pm.main([records, *flags]) == 0
    assert capsys.readouterr().out == fit.split("\n", 2)[2]
    assert not any(
        "average_every" in r["options"] for r in json.loads(pathlib.Path(records).read_text())
    )


def test_cli_runs_as_a_module():
    # As `python -m`, with runtime warnings as errors: runpy warns if importing the package
    # had already imported the module it runs.
    command = [sys.executable, "-W", "error::RuntimeWarning", "-m", "gradcomm.perfmodel", "--help"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m gradcomm.perfmodel")


def test_hierarchical_baseline_rings_every_device():
    # 2 hosts x 2 devices: allreduce's ring of 4 crosses each host's link once, carrying
    # 2 (4 - 1) / 4 of the model; the hierarchical Adasum's cross-host traffic is the flat
    # 2-host Adasum's (each local device carries half).
    cal = pm.Calibration(pm.NCCL, {(2, 2): 0.0}, {}, {}, P)
    record = {"method": "adasum", "options": {"local_axis": "local"}, "nodes": 2,
              "devices_per_process": 2, "params": P, "param_bytes": 4 * P,
              "rate_mbit": 100.0, "link_mbit_measured": 95.8}  # fmt: skip
    ring = cal.predict_record(record, "allreduce").comm_s
    assert ring == pytest.approx(2 * 3 / 4 * 8 * 4 * P / 95.8e6)
    flat = pm.predict("adasum", P, 2, LINK).comm_s
    assert cal.predict_record(record).comm_s == pytest.approx(flat)
