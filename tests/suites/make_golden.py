"""Writes `tests/data/golden.npz` for `test_golden.py`: run it on the code to compare against.

Usage (see test_golden.py's docstring for the worktree of the commit it was made on):
`JAX_NUM_CPU_DEVICES=8 python tests/suites/make_golden.py OUT.npz`. On the code before the
redesign, periodic averaging was an option of the transformations, which this maker uses
for the two rows whose API changed.
"""

import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import numpy as np
import optax
import test_golden as g

import gradcomm

OLD_API = {
    "dropping_local_average": lambda: g._dropping(local="sum", average_every=2)(),
    "local_sgd": lambda: optax.chain(optax.sgd(0.1), gradcomm.local_sgd("data", every=2)),
}


def main(out: str) -> None:
    arrays = {}
    before = hasattr(gradcomm.dropping, "local_sgd")  # the code before the redesign
    for name, row in g.CASES.items():
        if before and name in OLD_API:
            tx, sync = OLD_API[name](), None
        else:
            tx, sync = row.tx(), row.sync() if row.sync else None
        arrays.update(g.flatten(name, g.run(name, tx, sync)))
        print(name, flush=True)
    np.savez_compressed(out, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
