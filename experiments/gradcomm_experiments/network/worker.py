"""The network benchmark's worker: one host's JAX process, timing methods.

`bench_network.py` starts one per host of an emulated cluster (`network.cluster`), as

    python -m gradcomm_experiments.network.worker '{"nodes": 2, "process": 0, ...}'

(`network.mesh.run_worker` reads the config: raw collectives, `network.patterns`; the
utilization variants, `network.utilization`; the flat rows, here; or a 2-D mesh's);
each joins the run (gloo collectives over the shaped links) and process 0 prints its
result as one line, `RESULT {"results": ..., "devices": ...}` (the devices as
`provenance.devices_info` gives them). JAX is imported inside the workers only: the driver
reads the methods' specs from here without starting it, and the PyTorch peer worker
(`network.peer`) builds the same MLP from `mlp_init`, which needs NumPy alone.

With a thread count (`--threads`), `compute_threads` sizes XLA:CPU's intra-op pool while
the worker joins the run; see there for how, and why the XLA flag does not.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: it imports gradcomm, and the peer must not
    from gradcomm_experiments import methods


# 1-bit Adam's warm-up (all-reduced Adam) as the benchmark runs it: short, so that the
# untimed warm-up (`warm_up`) gets past it and the timed steps are its 1-bit steady state;
# the warm-up steps after the compiling one are timed apart (`"warmup_step_s"`).
ONEBIT_WARMUP = 4
# Per method, the options of its steady state: gradient dropping without its drop-ratio
# warm-up (it has a steady state from the first step), 1-bit Adam past a short warm-up.
STEADY = {"gradient_dropping": {"warmup_steps": 0}, "onebit_adam": {"warmup_steps": ONEBIT_WARMUP}}


def spec_of(label: str) -> methods.Spec:
    """The registry's method as the benchmark times it, with the options of its steady
    state (`STEADY`): gradient dropping without its drop-ratio warm-up, 1-bit Adam with a
    warm-up of `ONEBIT_WARMUP` steps, which `warm_up` runs untimed."""
    from gradcomm_experiments import methods

    spec = methods.METHODS[label]
    return spec.configured(**STEADY[spec.method]) if spec.method in STEADY else spec


def warmup_of(spec: methods.Spec) -> int:
    """The steps of a method's warm-up phase that run before its steady state (1-bit
    Adam's all-reduced Adam); 0 for the others."""
    return spec.options.get("warmup_steps", 0) if spec.method == "onebit_adam" else 0


def peak_after_warmup(report: Any) -> float:
    """The bytes one device sends in its most expensive step after the warm-ups, from a
    `gradcomm.wire.WireReport`: its `total` (every conditional's largest branch) less, in
    each outermost conditional, what its largest branch sends beyond its largest branch
    that is not a warm-up (`first=`). Streaming DiLoCo's is a fragment's exchange, DiLoCo's
    the whole model's; 1-bit Adam's the 1-bit exchange, not its warm-up all-reduce."""
    inner = {b.computation for c in report.conditionals for b in c.branches}
    peak = report.total
    for cond in report.conditionals:
        if cond.computation in inner:  # nested: its parent's branch already counts it
            continue
        after = [b.sent for b in cond.branches if b.first is None]
        top = max(b.sent for b in cond.branches)
        peak -= cond.count * (top - max(after, default=top))
    return peak


def cycle(spec: methods.Spec, nodes: int) -> int:
    """Steps after which the method's communication repeats (1: every step is alike)."""
    from gradcomm import topology

    if spec.every:
        return spec.every
    if spec.method in ("sgp", "dpsgd"):
        default = "exponential" if spec.method == "sgp" else "exponential-bidirectional"
        return topology.resolve(spec.options.get("topology", default), nodes).num_phases
    return 1


def mlp_widths(params: float, d_in: int = 256, classes: int = 10) -> tuple[int, ...]:
    """Layer widths of a 2-hidden-layer MLP with about `params` parameters."""
    # h^2 + (d_in + classes + 2) h + classes = params
    b = d_in + classes + 2
    h = int((-b + math.sqrt(b * b + 4 * (params - classes))) / 2)
    return (d_in, max(h, 1), max(h, 1), classes)


def mlp_init(
    widths: Sequence[int], batch: int, seed: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(init params, one fixed global batch) of a ReLU MLP, as NumPy arrays.

    He-normal weights `w{i}` of shape (in, out) (used as `x @ w + b`), zero biases `b{i}`,
    then a batch of standard-normal inputs `x` and integer labels `y`, all drawn in that
    order from one `np.random.default_rng(seed)`. NumPy alone: the JAX worker
    (`mlp_task`) and the PyTorch peer worker (`network.peer`) start from these arrays.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        params[f"w{i}"] = (rng.standard_normal((a, b)) * np.sqrt(2 / a)).astype(np.float32)
        params[f"b{i}"] = np.zeros(b, np.float32)
    data = {
        "x": rng.standard_normal((batch, widths[0])).astype(np.float32),
        "y": rng.integers(0, widths[-1], batch).astype(np.int32),
    }
    return params, data


def mlp_task(widths: Sequence[int], batch: int, seed: int = 0) -> tuple[Any, Any, Any]:
    """(init params, loss_fn with accuracy, one fixed global batch) for a ReLU MLP
    (`mlp_init`'s arrays)."""
    import jax
    import jax.numpy as jnp
    import optax

    params, data = mlp_init(widths, batch, seed)
    layers = len(widths) - 1

    def loss_fn(p: Any, data: Any) -> tuple[jax.Array, dict]:
        x = data["x"]
        for i in range(layers):
            x = x @ p[f"w{i}"] + p[f"b{i}"]
            x = jax.nn.relu(x) if i + 1 < layers else x
        loss = optax.softmax_cross_entropy_with_integer_labels(x, data["y"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(x, -1) == data["y"])}

    return params, loss_fn, data


@contextlib.contextmanager
def compute_threads(threads: int | None) -> Iterator[None]:
    """Within: this process may run on `threads` CPUs only; after: every thread as before.

    Start JAX's CPU backend within it to give XLA:CPU `threads` compute threads (None:
    leaves everything as it is). Checked with jax and jaxlib 0.10.2: the CPU client sizes
    its intra-op (Eigen) thread pool, which runs the kernels, once, when it is made, from
    the CPUs the process may run on (tsl's `MaxParallelism`, the `sched_getaffinity`
    mask), and JAX exposes no option for that size. The XLA flag
    `--xla_cpu_multi_thread_eigen=false` does not restrict it there: on two cores both
    pool threads still shared the kernels. With one CPU the pool has one thread, which
    stays nearly idle, and the kernels run on the thread that executes the program.
    Afterwards every thread's mask is restored, so the pool keeps its size while the
    other threads (gloo's, the runtime's) run anywhere, as PyTorch's do under
    `torch.set_num_threads` (the peer rows, `network.peer`).
    """
    if threads is None:
        yield
        return
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(allowed)[:threads])
    try:
        yield
    finally:
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that has since ended
                os.sched_setaffinity(int(task), allowed)


def join(config: dict[str, Any], devices: int) -> list[Any]:
    """Joins the run as this host's process with `devices` CPU devices; all processes'.

    The backend starts here, with `config["threads"]` compute threads (`compute_threads`;
    absent or None: XLA's default, a thread per CPU).
    """
    from gradcomm_experiments import runtime

    args = argparse.Namespace(
        devices=devices,
        coordinator_address=config["coordinator"],
        num_processes=config["nodes"],
        process_id=config["process"],
    )
    with compute_threads(config.get("threads")):
        return runtime.setup(args)


def start(config: dict[str, Any], devices: int) -> tuple[list[Any], Any]:
    """Joins the run with `devices` CPU devices (`join`), turns on the compilation cache
    (`config["cache"]`: later cells of a node count reuse the compiled steps); all
    processes' devices, and `log(text)`, which process 0 prints to stderr."""
    devices_ = join(config, devices)
    import jax

    if config.get("cache"):
        jax.config.update("jax_compilation_cache_dir", config["cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    main = jax.process_index() == 0
    cell = f"[{config['rate']} N={config['nodes']}{config.get('tag', '')}]"

    def log(text: str) -> None:
        if main:
            print(f"{cell} {text}", file=sys.stderr, flush=True)

    return devices_, log


def worker(config: dict[str, Any]) -> None:
    """One host's process: trains with every method, prints records (process 0) as JSON."""
    from gradcomm_experiments import provenance

    local = config["local"]
    devices, log = start(config, 2 if local else 1)
    import jax
    import numpy as np
    import optax

    from gradcomm import parallel, wire
    from gradcomm_experiments import methods

    nodes = config["nodes"]
    # The default mesh, one axis across the hosts: what a user builds. Each step's first
    # call times its "auto" swaps both ways and keeps the faster (`TrainStep.probe`).
    axis = "node" if local else "data"
    mesh = parallel.make_mesh({axis: nodes, **({"local": 2} if local else {})}, devices=devices)
    widths = mlp_widths(config["params"])
    host_params, loss_fn, data = mlp_task(widths, 32 * len(devices))
    num_params = sum(int(np.prod(v.shape)) for v in host_params.values())
    batch = parallel.shard_batch(data, mesh)
    labels = config["labels"]
    main = jax.process_index() == 0
    runs: dict[str, Any] = {}
    for label in labels:
        spec = spec_of(label)
        axes = mesh.axis_names if local and label == "allreduce" else axis  # all devices
        method = methods.build(spec, optax.adam(1e-4), axes, learning_rate=1e-4)
        params, state, step = method.start(loss_fn, mesh, host_params, donate=True)
        sent = None
        if config["measure_bytes"]:  # the step's own compiled program, which training reuses
            sent = wire.measure(step, params, state, batch)
        every, warmup = cycle(spec, nodes), warmup_of(spec)
        runs[label] = warm_up(label, step, params, state, batch, every, log, warmup)
        runs[label]["bytes"] = None if sent is None else sent.average
        runs[label]["peak_bytes"] = None if sent is None else peak_after_warmup(sent)

    time_runs(runs, labels, batch, config, log)
    if main:
        out = {
            label: {
                "runs": run["times"],
                "bytes": run["bytes"],
                "peak_bytes": run["peak_bytes"],
                "warmup_step_s": run["warmup_step_s"],
                "cycle": run["cycle"],
                "params": num_params,
                "probe": probe_of(run["step"]),
            }
            for label, run in runs.items()
        }
        info = provenance.devices_info(devices)
        result = {"results": out, "devices": info}
        print("RESULT " + json.dumps(result), flush=True)


def probe_of(step: Any) -> dict[str, Any] | None:
    """The exchange a step's first call chose for its "auto" swaps and the two step times
    (`TrainStep.probe` as a dict); None where it had no choice."""
    return step.probe._asdict() if step.probe is not None else None


def warm_up(
    label: str, step: Any, params: Any, state: Any, batch: Any, every: int, log: Any,
    warmup: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Compiles and warms up a method's step (at least 3 steps, a whole cycle of `every`,
    and past a warm-up phase of `warmup` steps by two, the first steady step's collectives
    connecting untimed); its run record for `time_runs`: step, params, state, cycle, no
    times yet, and the median of the warm-up phase's steps after the compiling one
    (`warmup_step_s`; None without a phase, or with a phase of one step)."""
    import jax
    import numpy as np

    warm = max(3, every + 1, warmup + 2)
    t0 = time.perf_counter()
    phase = []
    for k in range(warm):
        t = time.perf_counter()
        params, state, metrics = step(params, state, batch)
        jax.block_until_ready((params, metrics))
        if 0 < k < warmup:
            phase.append(time.perf_counter() - t)
    log(f"{label}: compiled and warmed up ({warm} steps) in {time.perf_counter() - t0:.1f}s")
    return {"step": step, "params": params, "state": state, "cycle": every, "times": [],
            "warmup_step_s": float(np.median(phase)) if phase else None}  # fmt: skip


def time_runs(
    runs: dict[str, dict[str, Any]], labels: Sequence[str], batch: Any, config: dict[str, Any],
    log: Any,
) -> None:  # fmt: skip
    """`config["runs"]` interleaved runs of `config["steps"]` timed steps per method (whole
    cycles), the methods in a rotated order each run; appends each run's median step (the
    mean over whole cycles where a cycle is longer than a step) to `runs[label]["times"]`,
    and its steps' times to `runs[label]["steps_s"]`."""
    import jax
    import numpy as np

    steps = config["steps"]
    for r in range(config["runs"]):
        order = list(labels[r % len(labels) :]) + list(labels[: r % len(labels)])
        for label in order:
            run = runs[label]
            count = math.ceil(steps / run["cycle"]) * run["cycle"]
            times = []
            params, state = run["params"], run["state"]
            for _ in range(count):
                t0 = time.perf_counter()
                params, state, metrics = run["step"](params, state, batch)
                jax.block_until_ready((params, metrics))
                times.append(time.perf_counter() - t0)
            run["params"], run["state"] = params, state
            stat = float(np.mean(times)) if run["cycle"] > 1 else float(np.median(times))
            run["times"].append(stat)
            run.setdefault("steps_s", []).append(times)
            log(f"run {r + 1}: {label} {stat:.4f} s/step")


if __name__ == "__main__":  # one host's process: the JSON config is the only argument
    from gradcomm_experiments.network import mesh

    mesh.run_worker(json.loads(sys.argv[1]))
