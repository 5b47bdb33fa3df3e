"""The computation that one process and several processes must agree on."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import gradcomm
from gradcomm import parallel


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
