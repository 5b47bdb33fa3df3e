"""gradcomm: communication-efficient data-parallel training as optax transformations.

Each method is a factory returning an `optax.GradientTransformationExtraArgs` that runs
inside `jax.shard_map` (or `jax.pmap`) and talks to the other devices through `jax.lax`
collectives over a named mesh axis. `gradcomm.parallel` builds the sharded train step and
`gradcomm.wire` reads the bytes each device sends from the compiled program.
"""

from gradcomm import parallel, wire
from gradcomm.adasum import (
    AdasumState,
    adasum,
    adasum_pair,
    adasum_reduce,
    orthogonality,
)
from gradcomm.dense import AllReduceState, allreduce
from gradcomm.terngrad import TernGradState, ternarize, terngrad

__version__ = "0.1.0"

__all__ = [
    "AdasumState",
    "AllReduceState",
    "TernGradState",
    "adasum",
    "adasum_pair",
    "adasum_reduce",
    "allreduce",
    "orthogonality",
    "parallel",
    "ternarize",
    "terngrad",
    "wire",
]
