"""gradcomm: communication-efficient data-parallel training as optax transformations.

Each method is a factory returning an `optax.GradientTransformationExtraArgs` that runs
inside `jax.shard_map` (or `jax.pmap`) and talks to the other devices through `jax.lax`
collectives over a named mesh axis. `gradcomm.parallel` builds the sharded train step and
`gradcomm.wire` reads the bytes each device sends from the compiled program.
"""

from gradcomm import parallel, perfmodel, registry, sparse, sync, topology, wire
from gradcomm.adasum import (
    AdasumState,
    adasum,
    adasum_pair,
    adasum_reduce,
    orthogonality,
)
from gradcomm.dense import AllReduceState, allreduce
from gradcomm.diloco import DilocoState, diloco
from gradcomm.dropping import GradientDroppingState, gradient_dropping
from gradcomm.finite import apply_if_finite
from gradcomm.gossip import DpsgdState, SgpState, consensus_distance, dpsgd, sgp
from gradcomm.lags import (
    LagsPlan,
    LagsState,
    SlgsState,
    lags,
    lags_delta,
    lags_plan,
    lags_profile,
    lags_speedup_bound,
    slgs,
)
from gradcomm.low_precision import LowPrecisionState, low_precision
from gradcomm.onebit_adam import OnebitAdamState, onebit_adam
from gradcomm.powersgd import PowerSgdState, powersgd
from gradcomm.streaming_diloco import StreamingDilocoState, streaming_diloco
from gradcomm.sync import (
    ParamsSync,
    PeriodicAverageState,
    average_params,
    local_sgd,
    periodic_average,
)
from gradcomm.terngrad import TernGradState, ternarize, terngrad

__version__ = "0.1.0"

__all__ = [
    "AdasumState",
    "AllReduceState",
    "DilocoState",
    "DpsgdState",
    "GradientDroppingState",
    "LagsPlan",
    "LagsState",
    "LowPrecisionState",
    "OnebitAdamState",
    "ParamsSync",
    "PeriodicAverageState",
    "PowerSgdState",
    "SgpState",
    "SlgsState",
    "StreamingDilocoState",
    "TernGradState",
    "adasum",
    "adasum_pair",
    "adasum_reduce",
    "allreduce",
    "apply_if_finite",
    "average_params",
    "consensus_distance",
    "diloco",
    "dpsgd",
    "gradient_dropping",
    "lags",
    "lags_delta",
    "lags_plan",
    "lags_profile",
    "lags_speedup_bound",
    "local_sgd",
    "low_precision",
    "onebit_adam",
    "orthogonality",
    "parallel",
    "perfmodel",
    "periodic_average",
    "powersgd",
    "registry",
    "sgp",
    "slgs",
    "sparse",
    "streaming_diloco",
    "sync",
    "ternarize",
    "terngrad",
    "topology",
    "wire",
]
