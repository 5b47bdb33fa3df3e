#!/usr/bin/env python
"""gradcomm's main job: every method on the same task, side by side.

    python experiments/studies/compare.py                     # digits, 8 simulated devices, 3 seeds
    python experiments/studies/compare.py --seeds 0 --epochs 5 --devices 4   # quicker
    python experiments/studies/compare.py --dataset cifar10 --data-dir ~/data

For each method, in the place its paper puts it in the optimizer chain, run once per seed
of --seeds (each seed splits digits, initializes the model and orders the batches its own
way, the same for every method): test accuracy and final training loss, as the mean and
the min-max over the seeds; bytes each device sends per step (read from the compiled step
with gradcomm.wire, after warm-up, parameter averaging amortized over its period) and
step time, both relative to the all-reduce, all measured in the same run. Writes
compare.json (every run with its seed, each method's summary, the Pareto front of the
mean accuracies), compare.md, compare.png (loss and accuracy, means over the seeds) and
compare_bytes.png (mean accuracy against bytes sent, min-max error bars, the Pareto front
marked) to --out. On one device nothing crosses a wire: every method runs as local
training, sends 0 bytes, and the outputs say so.
"""

from __future__ import annotations

from gradcomm_experiments import compare, methods


def main(argv: list[str] | None = None) -> None:
    compare.main(__doc__, argv, "compare", methods=",".join(methods.COMPARE), seeds=True)


if __name__ == "__main__":
    main()
