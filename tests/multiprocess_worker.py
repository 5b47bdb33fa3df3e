"""One of several JAX processes on 127.0.0.1 (gloo): Adasum and SGP over the global devices.

Usage: python multiprocess_worker.py PORT NUM_PROCESSES PROCESS_ID DEVICES_PER_PROCESS OUT
Writes this process's copy of the result to OUT (.npy), and to OUT.probe the exchange
an Adasum `train_step` chose (`TrainStep.probe`) and whether it then swapped pairwise.
"""

import os
import sys

port, num_processes, process_id, local, out = sys.argv[1:]
os.environ["JAX_NUM_CPU_DEVICES"] = local
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", int(num_processes), int(process_id))

import numpy as np  # noqa: E402
from multiprocess_case import adasum_of_case, pairwise_of_case, probe_of_case  # noqa: E402

pairwise, text = pairwise_of_case()
assert "reduce-scatter(" in text, "across processes the swaps should be pairwise exchanges"
np.save(out, np.concatenate([adasum_of_case(), pairwise]))
exchange, pairwise_after = probe_of_case()
with open(f"{out}.probe", "w") as f:
    f.write(f"{exchange} {pairwise_after}")
