#!/usr/bin/env python
"""Train the small CNN data-parallel with one or more gradcomm methods.

    python experiments/train.py --method adasum                  # 8 simulated CPU devices
    python experiments/train.py --method terngrad,lags --devices 4 --epochs 10
    python experiments/train.py --dataset mnist --data-dir ~/data --method sgp
    python experiments/train.py --coordinator-address 127.0.0.1:1234 --num-processes 2 \\
        --process-id 0 --devices 4                               # one of two processes

Each method gets the same model, data order, optimizer and hyperparameters. Writes
train.json, train.png and train.md to --out. `compare.py` runs every method.
"""

from __future__ import annotations

import argparse

import _compare


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    _compare.add_training_args(parser, methods="allreduce")
    _compare.run_methods(parser.parse_args(argv), "train")


if __name__ == "__main__":
    main()
