"""gradcomm.wire: bytes per device read from compiled programs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_of, quick_start
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel, wire


def compiled_report(fn, n, *shapes, out_specs=None):
    out_specs = P() if out_specs is None else out_specs
    mesh = mesh_of(n)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=out_specs)
    args = [
        jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P("data")))
        for s in shapes
    ]
    return wire.measure(jax.jit(mapped), *args)


@pytest.mark.parametrize("n", [2, 8])
def test_psum_costs_two_n_minus_one_over_n(n):
    report = compiled_report(lambda x: lax.psum(x[0], "data"), n, (n, 1000))
    assert report.total == pytest.approx(2 * (n - 1) / n * 4000)
    assert set(report.by_kind()) == {"all-reduce"}
    assert report.exact and report.devices == n
    one_device = "One device: nothing crosses a wire" in report.table()
    assert one_device == (n == 1)


def test_each_collective_kind():
    n = 8

    def f(x):
        x = x[0]
        return (
            lax.all_gather(x, "data", tiled=True).sum()
            + lax.psum_scatter(x, "data", tiled=True).sum()
            + lax.all_to_all(x.reshape(n, -1), "data", 0, 0, tiled=True).sum()
            + lax.ppermute(x, "data", [(i, (i + 1) % n) for i in range(n)]).sum()
        )[None]

    kinds = compiled_report(f, n, (n, 800), out_specs=P("data")).by_kind()
    assert kinds["all-gather"] == pytest.approx(7 / 8 * 8 * 3200)  # output S = 8 * 3200 B
    assert kinds["reduce-scatter"] == pytest.approx(7 / 8 * 3200)
    assert kinds["all-to-all"] == pytest.approx(7 / 8 * 3200)
    assert kinds["collective-permute"] == pytest.approx(3200)


def test_conditional_costs_its_largest_branch_and_loops_their_trip_count():
    n = 4

    def f(x):
        x = x[0]
        k = lax.axis_index("data") % 2
        shifted = lax.switch(
            k,
            [
                lambda v, s=s: lax.ppermute(v, "data", [(i, (i + s) % n) for i in range(n)])
                for s in (1, 2)
            ],
            x,
        )
        looped = lax.fori_loop(0, 5, lambda i, c: lax.psum(c, "data") * 0.5 + x, shifted)
        return looped[None]

    report = compiled_report(f, n, (n, 100), out_specs=P("data"))
    kinds = report.by_kind()
    assert kinds["collective-permute"] == pytest.approx(400)  # one branch of two
    assert kinds["all-reduce"] == pytest.approx(5 * 2 * 3 / 4 * 400)
    assert [c.count for c in report.collectives if c.kind == "all-reduce"] == [5]


SYNTHETIC = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %t = (s32[], f32[1024]{0}) parameter(0)
  %v = f32[1024]{0} get-tuple-element(%t), index=1
  %i = s32[] get-tuple-element(%t), index=0
  %c = bf16[512]{0} collective-permute(%v), source_target_pairs={{0,1},{1,0}}
  ROOT %o = (s32[], f32[1024]{0}) tuple(%i, %v)
}

%cond (t: (s32[], f32[1024])) -> pred[] {
  %t = (s32[], f32[1024]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  %ars = f32[1024]{0} all-reduce-start(%p), replica_groups=[2,4]<=[8], to_apply=%add
  %ard = f32[1024]{0} all-reduce-done(%ars)
  %ags = (f32[1024]{0}, f32[4096]{0}) all-gather-start(%ard), \
replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  %agd = f32[4096]{0} all-gather-done(%ags)
  %init = (s32[], f32[1024]{0}) tuple(%p, %ard)
  %w = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[1024]{0} add(%ard, %ard)
}
"""


def test_synthetic_async_iota_groups_and_unknown_trip_count():
    report = wire.analyze_hlo(SYNTHETIC)
    kinds = report.by_kind()
    assert kinds["all-reduce"] == pytest.approx(2 * 3 / 4 * 4096)  # groups of 4, counted once
    assert kinds["all-gather"] == pytest.approx(1 / 2 * 2 * 4096)  # groups of 2, output 8 KiB
    assert kinds["collective-permute"] == pytest.approx(4096)  # the f32 operand, once
    assert not report.exact  # the while loop's trip count is unknown
    assert "| **total** |" in report.table()
    assert '"all-reduce"' in report.to_json()
    with pytest.raises(ValueError, match="ENTRY"):
        wire.analyze_hlo("HloModule empty")


def test_adasum_sends_about_what_psum_sends():
    """At N = 8 on 1.2M parameters: within 1.1x of a psum, extras O(leaves) scalars."""
    n = 8
    shapes = [(1000, 1000), (1000,), (200, 1000), (7,), (3, 3, 16, 32), ()]
    tree = [jax.ShapeDtypeStruct((n, *s), jnp.float32) for s in shapes]
    size = sum(int(np.prod(s)) for s in shapes) * 4
    mesh = mesh_of(n)
    sharding = NamedSharding(mesh, P("data"))
    tree = [jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=sharding) for t in tree]

    def mapped(fn):
        body = lambda t: fn([x[0] for x in t])  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))

    psum = wire.measure(mapped(lambda t: lax.psum(t, "data")), tree)
    adasum = wire.measure(mapped(lambda t: gradcomm.adasum_reduce(t, "data")), tree)
    assert psum.total == pytest.approx(2 * 7 / 8 * size)
    assert adasum.total <= 1.1 * psum.total
    # Per level j: the 5 scalars per leaf of each member of the level's group of 2^(j+1),
    # gathered by recursive doubling within the group (d members at distance d).
    stats = [c for c in adasum.collectives if c.payload < 10_000]
    assert all(c.kind == "collective-permute" for c in stats)
    want = [d * 5 * len(shapes) * 4 for d in (1, 1, 2, 1, 2, 4)]
    assert sorted(c.payload for c in stats) == sorted(want)


def test_collectives_do_not_grow_with_the_number_of_leaves():
    n = 8
    mesh = mesh_of(n)

    def count(num_leaves):
        tree = [
            jax.ShapeDtypeStruct((n, 10), jnp.float32, sharding=NamedSharding(mesh, P("data")))
            for _ in range(num_leaves)
        ]
        body = lambda t: gradcomm.adasum_reduce([x[0] for x in t], "data")  # noqa: E731
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))
        return len(wire.measure(f, tree).collectives)

    # halving ppermutes, the levels' stats swaps (1 + 2 + 3), the final gather: the same for
    # 2 leaves as for 8 (a collective per leaf would add at least 6)
    assert count(2) == count(8) == 3 + (1 + 2 + 3) + 1


def test_measure_a_train_step():
    mesh = mesh_of(8)
    params = {"w": np.zeros((100, 10), np.float32)}
    batch = {"x": np.ones((16, 100), np.float32)}
    loss = lambda p, b: jnp.sum(b["x"] @ p["w"])  # noqa: E731
    tx = optax.chain(gradcomm.allreduce(), optax.sgd(0.1))
    step = parallel.train_step(loss, tx, mesh)
    state = parallel.init_state(tx, params, mesh)
    report = wire.measure(step, parallel.replicate(params, mesh), state, batch)
    grads = 2 * 7 / 8 * 4000
    assert grads <= report.total <= grads + 64  # plus the loss metric's pmean


def test_measure_a_train_step_from_shapes():
    # wire.measure accepts jax.ShapeDtypeStruct arguments for a TrainStep too: the state's
    # carry their shardings (per-device leaves), the params and batch are placed.
    params, state, step = quick_start(mesh_of(4))
    batch = {"x": np.ones((8, 3), np.float32), "y": np.ones(8, np.float32)}

    def shapes(tree):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)
            ),
            tree,
        )

    real = wire.measure(step, params, state, batch)
    from_shapes = wire.measure(step, shapes(params), shapes(state), shapes(batch))
    assert from_shapes.total == real.total > 0


# ----------------------------------------------------------------------------- branches

PARAMS = {"w": np.zeros((100, 10), np.float32), "b": np.zeros(10, np.float32)}


def step_text(tx, per_device, n=8, sync=None):
    """The compiled HLO of one real train step of `tx` (then `sync`, a `gradcomm.ParamsSync`,
    on the params) on a linear model over n devices."""
    mesh = mesh_of(n)
    params = (parallel.per_device if per_device else parallel.replicate)(PARAMS, mesh)
    state = parallel.init_state(tx, params, mesh, params_per_device=per_device, sync=sync)
    step = parallel.train_step(
        lambda p, b: jnp.sum(b["x"] @ p["w"] + p["b"]),
        tx,
        mesh,
        params_per_device=per_device,
        sync=sync,
    )
    batch = {"x": np.ones((2 * n, 100), np.float32)}
    return step.lower(params, state, batch).compile().as_text()


def step_report(tx, per_device, n=8):
    return wire.analyze_hlo(step_text(tx, per_device, n))


def unnamed(text):
    """The report of a program as if no branch were named (what `measure` gave before)."""
    return wire.analyze_hlo(text.replace("gradcomm.wire.branch", "some.scope"))


def params_mean(n=8):
    """Bytes of one exact parameter average, measured on its own."""
    mesh = mesh_of(n)
    mean = jax.shard_map(
        lambda p: lax.pmean(p, "data"), mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False
    )
    return wire.measure(jax.jit(mean), parallel.replicate(PARAMS, mesh)).total


def branches(report):
    return {b.label: (b.every, b.first) for c in report.conditionals for b in c.branches}


def test_gradient_dropping_steady_skips_the_warm_up_and_average_amortizes_averaging():
    k = 4

    def dropping(warmup):
        return optax.chain(
            gradcomm.gradient_dropping(
                "data", drop_ratio=0.9, local="compensated", warmup_steps=warmup
            ),
            optax.sgd(0.1),
        )

    # The paper's periodic model averaging is a sync on the params, after the step.
    text = step_text(dropping(5), True, sync=gradcomm.periodic_average("data", every=k))
    report, before = wire.analyze_hlo(text), unnamed(text)
    sparse = step_report(dropping(0), per_device=True)  # the sparse step alone
    mean = params_mean()
    assert before.total == before.steady == before.average > sparse.total + mean
    assert report.total == before.total  # the worst case, as before: dense and averaging
    assert report.steady == sparse.total
    assert report.average == pytest.approx(sparse.total + mean / k, rel=1e-12)
    assert report.period == k
    assert branches(report) == {
        "warm-up": (None, 5),
        "sparse": (None, None),
        "average params": (k, None),
        "otherwise": (None, None),
    }
    table = report.table()
    assert "| **steady** |" in table and f"| **average** over {k} steps |" in table
    assert "| warm-up | first 5 steps |" in table and f"| average params | 1 step in {k} |" in table
    data = json.loads(report.to_json())
    assert data["steady"] == report.steady and data["period"] == k
    assert {b["label"] for c in data["conditionals"] for b in c["branches"]} == set(
        branches(report)
    )


def test_local_sgd_through_train_step_averages_one_step_in_k():
    k = 5
    text = step_text(optax.sgd(0.1), True, sync=gradcomm.local_sgd(every=k))
    report = wire.analyze_hlo(text)
    alone = step_report(optax.sgd(0.1), per_device=True)  # what runs between averages
    mean = params_mean()
    assert report.total == unnamed(text).average == alone.total + mean
    assert report.steady == alone.total
    assert report.average == pytest.approx(alone.total + mean / k, rel=1e-12)
    assert report.period == k
    assert branches(report) == {"average params": (k, None), "otherwise": (None, None)}


def test_local_sgd_outside_train_step_names_its_average_too():
    # A hand-written loop runs the sync itself, after optax.apply_updates.
    k, n = 3, 4
    sync = gradcomm.local_sgd("data", every=k)

    def f(p):
        p = p[0]
        return sync.update(p, sync.init(p))[0][None]

    report = compiled_report(f, n, (n, 100), out_specs=P("data"))
    assert report.total == 2 * (n - 1) / n * 400
    assert report.steady == 0 and report.average == pytest.approx(report.total / k, rel=1e-12)
    assert branches(report) == {"average params": (k, None), "otherwise": (None, None)}


def test_sgp_steady_is_gossip_after_its_all_reduce_steps():
    from gradcomm import topology

    text = step_text(optax.chain(optax.sgd(0.1), gradcomm.sgp(allreduce_steps=3)), True)
    report = wire.analyze_hlo(text)
    gossip = step_report(optax.chain(optax.sgd(0.1), gradcomm.sgp()), True)
    phases = topology.resolve("exponential", 8).num_phases
    assert report.steady == report.average == gossip.total < report.total
    assert report.total == unnamed(text).steady  # before: the exact all-reduce every step
    assert report.period == phases
    outer, switch = report.conditionals
    assert [(b.label, b.first) for b in outer.branches] == [("gossip", None), ("all-reduce", 3)]
    # One branch per phase, each on one step in num_phases, nested in the gossip branch.
    assert [(b.label, b.every) for b in switch.branches] == [
        (f"phase {i}", phases) for i in range(phases)
    ]
    assert switch.computation == outer.branches[0].computation


def test_a_switch_over_unequal_phases_charges_their_mean():
    # D-PSGD on the bidirectional exponential graph of 8: 2, 2 and 1 peers per phase.
    report = step_report(optax.chain(optax.sgd(0.1), gradcomm.dpsgd()), True)
    [switch] = report.conditionals
    sent = [b.sent for b in switch.branches]
    assert [b.every for b in switch.branches] == [3, 3, 3]
    assert sent[0] == sent[1] == 2 * sent[2] > 0
    outside = report.total - max(sent)
    assert report.steady == report.average == pytest.approx(outside + sum(sent) / 3, rel=1e-12)
    assert report.period == 3


def test_an_unnamed_conditional_costs_its_largest_branch_in_every_figure():
    n = 4

    def f(x):
        x = x[0]
        summed = lambda v: lax.pcast(lax.psum(v, "data"), "data", to="varying")  # noqa: E731
        shifted = lambda v: lax.ppermute(v, "data", [(i, (i + 1) % n) for i in range(n)])  # noqa: E731
        return lax.cond(x[0] > 0, summed, shifted, x)[None]

    report = compiled_report(f, n, (n, 100), out_specs=P("data"))
    largest = 2 * (n - 1) / n * 400
    assert report.total == report.steady == report.average == largest
    assert report.period == 1
    [cond] = report.conditionals
    assert not cond.named
    assert [b.label for b in cond.branches] == [b.computation for b in cond.branches]
    assert sorted(b.sent for b in cond.branches) == [400, largest]
    assert "unnamed: charged in full" in report.table()


# Named branches nested in a while loop: a dense warm-up, else a switch over two phases.
NESTED = """HloModule m, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%phase0 (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %cp = f32[1024]{0} collective-permute(%x), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, \
metadata={op_name="jit(f)/while/body/cond/branch_0_fun/gradcomm.wire.branch[sparse]/switch/\
branch_0_fun/gradcomm.wire.branch[phase 0|every=2]/ppermute"}
}

%phase1 (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %h = f32[512]{0} slice(%x), slice={[0:512]}, metadata={op_name="jit(f)/while/body/cond/\
branch_0_fun/gradcomm.wire.branch[sparse]/switch/branch_1_fun/\
gradcomm.wire.branch[phase 1|every=2]/slice"}
  %cp = f32[512]{0} collective-permute(%h), source_target_pairs={{0,2},{1,3},{2,0},{3,1}}, \
metadata={op_name="jit(f)/while/body/cond/branch_0_fun/gradcomm.wire.branch[sparse]/switch/\
transpose(jvp(branch_1_fun/gradcomm.wire.branch[phase 1|every=2]))/ppermute"}
  ROOT %r = f32[1024]{0} concatenate(%cp, %cp), dimensions={0}
}

%sparse (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %i = s32[] constant(1), metadata={op_name="jit(f)/while/body/cond/branch_0_fun/\
gradcomm.wire.branch[sparse]/rem"}
  ROOT %switch = f32[1024]{0} conditional(%i, %x, %x), branch_computations={%phase0, %phase1}, \
metadata={op_name="jit(f)/while/body/cond/branch_0_fun/gradcomm.wire.branch[sparse]/switch"}
}

%dense (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %ar = f32[1024]{0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add, \
metadata={op_name="jit(f)/while/body/cond/branch_1_fun/gradcomm.wire.branch[dense|first=10]/psum"}
}

%body (t: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %t = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[1024]{0} get-tuple-element(%t), index=1
  %p = pred[] constant(false)
  %c = f32[1024]{0} conditional(%p, %v, %v), true_computation=%dense, false_computation=%sparse, \
metadata={op_name="jit(f)/while/body/cond"}
  ROOT %o = (s32[], f32[1024]{0}) tuple(%i, %c)
}

%cond (t: (s32[], f32[1024])) -> pred[] {
  %t = (s32[], f32[1024]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

%big (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %cp = f32[1024]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}, \
metadata={op_name="jit(f)/gradcomm.wire.branch[outer|every=5]/cond/branch_1_fun/ppermute"}
}

%small (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %s = f32[256]{0} slice(%x), slice={[0:256]}
  %cp = f32[256]{0} collective-permute(%s), source_target_pairs={{0,1},{1,0}}, \
metadata={op_name="jit(f)/gradcomm.wire.branch[outer|every=5]/cond/branch_0_fun/ppermute"}
  ROOT %r = f32[1024]{0} concatenate(%cp, %cp, %cp, %cp), dimensions={0}
}

ENTRY %main (p: f32[1024]) -> f32[4096] {
  %p = f32[1024]{0} parameter(0)
  %k = s32[] constant(0)
  %init = (s32[], f32[1024]{0}) tuple(%k, %p)
  %w = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  %v = f32[1024]{0} get-tuple-element(%w), index=1
  %q = pred[] constant(true)
  %u = f32[1024]{0} conditional(%q, %v, %v), true_computation=%big, false_computation=%small, \
metadata={op_name="jit(f)/gradcomm.wire.branch[outer|every=5]/cond"}
  ROOT %ag = f32[4096]{0} all-gather(%u), replica_groups={{0,1,2,3}}, dimensions={0}
}
"""


def test_nested_named_branches_in_a_loop_and_a_scope_around_a_conditional():
    report = wire.analyze_hlo(NESTED)
    dense, phases = 2 * 3 / 4 * 4096, (4096 + 2048) / 2
    big, gathered = 4096, 3 / 4 * 4 * 4096
    # Per loop iteration: the dense warm-up at worst, else the mean of the two phases.
    assert report.total == 3 * dense + big + gathered
    assert report.steady == report.average == 3 * phases + big + gathered
    assert report.period == 2 and report.exact
    body, switch, outer = report.conditionals
    assert (body.count, switch.count, outer.count) == (3, 3, 1)
    assert [(b.label, b.first, b.sent) for b in body.branches] == [
        ("dense", 10, dense),
        ("sparse", None, 4096),
    ]
    assert [(b.label, b.every, b.sent) for b in switch.branches] == [
        ("phase 0", 2, 4096),
        ("phase 1", 2, 2048),
    ]
    # A scope opened around the conditional, not in its branches, names none of them.
    assert not outer.named and [b.label for b in outer.branches] == ["big", "small"]


def test_branch_checks_its_arguments():
    for bad in ("", "a/b", "x[1]", "a|b", 'say "hi"', "two\nlines", 3):
        with pytest.raises(ValueError, match="label"):
            wire.branch(bad)
    for kwargs in ({"every": 0}, {"first": -1}, {"every": True}, {"first": 2.0}):
        with pytest.raises(ValueError, match="positive int"):
            wire.branch("x", **kwargs)
    with pytest.raises(ValueError, match="either"):
        wire.branch("x", every=2, first=3)


# ----------------------------------------------------------------------------- mesh axes


def mesh_2d():
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=explicit)


def measure_2d(f, *shapes):
    """`f` under shard_map on the ('data'=4, 'model'=2) mesh, each input split over both."""
    mesh = mesh_2d()
    spec = P("data", "model")
    mapped = jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec)
    args = [
        jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, spec)) for s in shapes
    ]
    return wire.measure(jax.jit(mapped), *args)


def test_collectives_count_under_the_mesh_axes_they_span():
    def f(x, y):
        summed = lax.psum(x, "data")  # groups {0,2,4,6}, {1,3,5,7}
        gathered = lax.all_gather(y, "model", tiled=True)  # {0,1}, {2,3}, ...
        return summed, gathered[: y.shape[0]]

    report = measure_2d(f, (4 * 5, 2 * 100), (4 * 7, 2 * 30))  # per device 5x100, 7x30
    assert report.mesh == (("data", 4), ("model", 2))
    assert report.by_axes() == {
        ("data",): pytest.approx(2 * 3 / 4 * 5 * 100 * 4),
        ("model",): pytest.approx(1 / 2 * 2 * 7 * 30 * 4),  # output S: 2 shards gathered
    }
    assert {c.kind: c.axes for c in report.collectives} == {
        "all-reduce": ("data",),
        "all-gather": ("model",),
    }
    assert sum(report.by_axes().values()) == pytest.approx(report.total)
    table = report.table()
    assert "| all-reduce | 2,000 | 4 | data | 1 | 3,000 |" in table
    assert "| mesh axes (data=4, model=2) | sent per device (B) |" in table
    assert "| model | 840 |" in table
    data = json.loads(report.to_json())
    assert data["mesh"] == [["data", 4], ["model", 2]]
    assert {tuple(e["axes"]): e["sent"] for e in data["by_axes"]} == report.by_axes()
    assert {c["kind"]: c["axes"] for c in data["collectives"]}["all-gather"] == ["model"]


@pytest.mark.parametrize("axes", [("data", "model"), ("model", "data")])
def test_a_psum_over_both_axes_spans_both_in_mesh_order(axes):
    report = measure_2d(lambda x: lax.psum(x, axes), (4 * 10, 2 * 10))
    assert report.by_axes() == {("data", "model"): pytest.approx(2 * 7 / 8 * 400)}


def test_a_ppermute_over_data_spans_data():
    perm = [(i, (i + 1) % 4) for i in range(4)]
    report = measure_2d(lambda x: lax.ppermute(x, "data", perm), (4 * 10, 2 * 10))
    [c] = report.collectives
    assert c.kind == "collective-permute" and c.axes == ("data",)
    assert report.by_axes() == {("data",): 400}


def test_device_ids_are_positions_in_the_mesh_not_device_ids():
    # A mesh over the devices in a shuffled order: the groups still name mesh positions.
    devices = np.array(jax.devices())[[3, 1, 0, 2, 7, 5, 6, 4]].reshape(4, 2)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    f = jax.shard_map(lambda x: lax.psum(x, "model"), mesh=mesh, in_specs=P(), out_specs=P())
    report = wire.measure(jax.jit(f), jnp.zeros(100, jnp.float32))
    assert report.by_axes() == {("model",): 400}


def test_by_axes_on_a_one_axis_mesh_adds_up_to_the_total():
    n = 8

    def f(x):
        x = x[0]
        return (
            lax.psum(x, "data").sum()
            + lax.all_gather(x, "data", tiled=True).sum()
            + lax.ppermute(x, "data", [(i, (i + 1) % n) for i in range(n)]).sum()
        )[None]

    report = compiled_report(f, n, (n, 800), out_specs=P("data"))
    assert report.mesh == (("data", n),)
    assert report.by_axes() == {("data",): report.total}
    assert {c.axes for c in report.collectives} == {("data",)}


IOTA = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[1000]) -> f32[1000] {
  %p = f32[1000]{0} parameter(0)
  %data = f32[1000]{0} all-reduce(%p), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
  %model = f32[1000]{0} all-reduce(%data), replica_groups=[4,2]<=[8], to_apply=%add
  %all = f32[1000]{0} all-reduce(%model), replica_groups={}, to_apply=%add
  %self = f32[1000]{0} all-reduce(%all), replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, \
to_apply=%add
  ROOT %cp = f32[1000]{0} collective-permute(%self), source_target_pairs={{0,1},{1,0}}
}
"""


def test_analyze_hlo_reads_the_axes_of_iota_and_list_groups_with_a_mesh():
    mesh = {"data": 4, "model": 2}
    report = wire.analyze_hlo(IOTA, mesh=mesh)
    assert [c.axes for c in report.collectives] == [
        ("data",),
        ("model",),
        ("data", "model"),
        (),
        ("model",),
    ]
    assert sum(report.by_axes().values()) == report.total
    assert wire.analyze_hlo(IOTA, mesh=mesh_2d()).by_axes() == report.by_axes()
    # Without a mesh the axes are unknown; the figures are the same.
    unknown = wire.analyze_hlo(IOTA)
    assert unknown.mesh is None and unknown.by_axes() == {None: report.total}
    assert "mesh axes" not in unknown.table()
    with pytest.raises(ValueError, match="devices"):
        wire.analyze_hlo(IOTA, mesh={"data": 4})
