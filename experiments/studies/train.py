#!/usr/bin/env python
"""Train the small CNN data-parallel with one or more gradcomm methods.

    python experiments/studies/train.py --method adasum                  # 8 simulated CPU devices
    python experiments/studies/train.py --method terngrad,lags --devices 4 --epochs 10
    python experiments/studies/train.py --dataset mnist --data-dir ~/data --method sgp
    python experiments/studies/train.py --coordinator-address 127.0.0.1:1234 --num-processes 2 \\
        --process-id 0 --devices 4                               # one of two processes

Each method gets the same model, data order, optimizer and hyperparameters. Writes
train.json, train.md, train.png and train_bytes.png to --out. `compare.py` runs every
method.
"""

from __future__ import annotations

from gradcomm_experiments import compare


def main(argv: list[str] | None = None) -> None:
    compare.main(__doc__, argv, "train", methods="allreduce")


if __name__ == "__main__":
    main()
