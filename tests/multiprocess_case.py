"""The computation that one process and several processes must agree on."""

import jax
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import _axes, _collectives, parallel


def case_inputs(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(42)
    return {
        "w": rng.standard_normal((n, 37, 5)).astype(np.float32),
        "b": rng.standard_normal((n, 3)).astype(np.float32),
    }


def adasum_of_case() -> np.ndarray:
    """Adasum of fixed per-device inputs over all global devices, as one flat array."""
    mesh = parallel.make_mesh()
    inputs = parallel.shard_batch(case_inputs(mesh.size), mesh)
    body = lambda t: gradcomm.adasum_reduce(jax.tree.map(lambda x: x[0], t), "data")  # noqa: E731
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))(inputs)
    out = parallel.host_copy(out)
    return np.concatenate([out["b"].ravel(), out["w"].ravel()])


def pairwise_of_case() -> tuple[np.ndarray, str]:
    """Adasum and SGP over size-2 mesh axes, as one flat array, and the compiled program.

    Across processes `exchange="auto"` sends every pairwise swap through gloo as a
    two-member reduce-scatter of the bits (Adasum, SGP; SGP's lone-swap phase, i <-> i + 4
    at N = 8, adds the pair's); in one process it keeps `ppermute`.
    Both must give the same bits.
    """
    n = jax.device_count()
    mesh = parallel.make_mesh(parallel.pairwise_axes("data", n))
    axes = tuple(mesh.axis_names)
    inputs = parallel.shard_batch(case_inputs(n), mesh)

    def body(tree):
        local = jax.tree.map(lambda x: x[0], tree)
        results = [gradcomm.adasum_reduce(local, axes)]
        for overlap in (0, 1):
            tx = gradcomm.sgp(axes, overlap=overlap)

            def sgp_step(carry, _, tx=tx):
                params, state = carry
                grads = jax.tree.map(lambda p: 0.01 * p, params)
                delta, state = tx.update(grads, state, params)
                return (jax.tree.map(jax.numpy.add, params, delta), state), None

            # Every phase of the exponential graph at N = 8: three steps, one compiled body
            # (the carry typed as varying, as the state becomes after a step).
            carry = jax.tree.map(lambda x: _axes.vary(x, axes), (local, tx.init(local)))
            (params, _), _ = lax.scan(sgp_step, carry, length=3)
            gathered = jax.tree.map(lambda p: _collectives.all_gather_invariant(p, axes), params)
            results.append(gathered)
        return results

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P()))
    out = parallel.host_copy(fn(inputs))
    text = fn.lower(inputs).compile().as_text()
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(out)]), text


def probe_of_case() -> tuple[str, bool]:
    """The exchange that an Adasum `parallel.train_step` chose on its first call (it times
    its step both ways across processes, `TrainStep.probe`), and whether its compiled
    program then swaps pairwise (two-member reduce-scatters).

    The mesh has one device of each process, so its one swap crosses the link: the probe
    is the same at any N, and a step of Adasum over N = 2 compiles in a fraction of the
    time of N = 8's (three compilations here), whose swaps `adasum_of_case` runs.
    """
    devices = [
        next(d for d in jax.devices() if d.process_index == i) for i in range(jax.process_count())
    ]
    mesh = parallel.make_mesh(devices=devices)
    tx = optax.chain(optax.sgd(0.1), gradcomm.adasum("data"))
    params = parallel.replicate({"w": np.zeros(5, np.float32)}, mesh)
    state = parallel.init_state(tx, params, mesh)
    loss = lambda p, b: jax.numpy.mean((b @ p["w"] - 1.0) ** 2)  # noqa: E731
    step = parallel.train_step(loss, tx, mesh)
    batch = np.ones((4 * mesh.size, 5), np.float32)
    step(params, state, batch)  # across processes: the first call probes
    text = step.lower(params, state, batch).compile().as_text()
    return step.probe.exchange, "reduce-scatter(" in text
