#!/usr/bin/env python
"""gradcomm's main job: every method on the same task, side by side.

    python experiments/compare.py                                # digits, 8 simulated devices
    python experiments/compare.py --epochs 5 --devices 4         # quicker
    python experiments/compare.py --dataset cifar10 --data-dir ~/data

For each method, in the place its paper puts it in the optimizer chain: test accuracy,
bytes each device sends per step (read from the compiled step with gradcomm.wire, after
warm-up, parameter averaging amortized over its period) and step time, both relative to
the all-reduce, all measured in the same run. Writes compare.json, compare.png and
compare.md to --out.
"""

from __future__ import annotations

import argparse

import _compare
import _methods


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    _compare.add_training_args(parser, methods=",".join(_methods.COMPARE))
    parser.set_defaults(out="runs/compare")
    _compare.run_methods(parser.parse_args(argv), "compare")


if __name__ == "__main__":
    main()
