"""Shared test helpers: meshes over the first n of the 8 simulated devices."""

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomm import parallel

assert jax.device_count() == 8, "tests need 8 simulated CPU devices"


@functools.cache
def mesh_of(n: int, axis: str = "data"):
    """A 1-D mesh over the first n devices."""
    return parallel.make_mesh({axis: n}, devices=jax.devices()[:n])


@functools.cache
def _compiled(fn, n: int, axis: str):
    mesh = mesh_of(n, axis)

    def body(*args):
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))


def per_device(fn, n: int, *trees, axis: str = "data"):
    """Runs `fn` under shard_map on the first n devices.

    Inputs and outputs carry a leading device axis; outputs come back as NumPy, one row per
    device, so tests can check every device's result. `fn` must be hashable (a module-level
    function) so that its compilation is cached across tests.
    """
    sharding = NamedSharding(mesh_of(n, axis), P(axis))
    placed = jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), trees)
    return jax.tree.map(np.asarray, _compiled(fn, n, axis)(*placed))
