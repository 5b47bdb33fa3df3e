#!/usr/bin/env python
"""gradcomm's main job: a small CNN on scikit-learn's digits, data-parallel, one run per method.

    python experiments/train.py                      # every method, 8 simulated CPU devices
    python experiments/train.py --method adasum --devices 4 --epochs 10
    python experiments/train.py --coordinator-address 127.0.0.1:1234 --num-processes 2 \\
        --process-id 0 --devices 4                   # one of two processes on one host

Each method gets the same model, data order, optimizer and hyperparameters. Writes
train.json, train.png and train.md to --out.
"""

from __future__ import annotations

import argparse

import _common

import gradcomm


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--method",
        default=",".join(_common.METHODS),
        help=f"comma-separated methods, from: {', '.join(_common.METHODS)}",
    )
    parser.add_argument("--optimizer", default="adam", help="adam, sgd or momentum")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    parser.add_argument("--schedule", default="cosine", help="cosine (decay to 0) or constant")
    parser.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per device per step")
    parser.add_argument("--density", type=float, default=0.01, help="k/d for lags and slgs")
    _common.add_common_args(parser)
    args = parser.parse_args(argv)
    methods = _common.parse_methods(args.method)

    devices = _common.setup(args)
    mesh = gradcomm.parallel.make_mesh(devices=devices)
    data = _common.load_digits(args.seed)
    model = _common.small_cnn(data.num_classes)
    main_process = _common.is_main_process()
    if main_process:
        print(
            f"gradcomm {gradcomm.__version__}: {_common.describe(devices)}; "
            f"{data.name}: {len(data.x_train)} train / {len(data.x_test)} test"
        )

    steps = args.epochs * _common.steps_per_epoch(data, len(devices) * args.batch_size)
    results = []
    for method in methods:
        inner = _common.optimizer(args.optimizer, args.lr, steps, args.schedule)
        spec = _common.make_method(method, inner, density=args.density)
        result = _common.train(
            spec,
            model,
            data,
            mesh,
            epochs=args.epochs,
            batch_per_device=args.batch_size,
            seed=args.seed,
            progress=main_process and not args.no_progress,
        )
        results.append(result)
        if main_process:
            print(
                f"{method:>10}: test accuracy {100 * result.test_accuracy:.2f}% "
                f"in {result.wall_seconds:.1f}s"
            )

    if main_process:
        table = _common.results_table(results)
        config = {**vars(args), "devices": len(devices), "processes": _common.jax.process_count()}
        path = _common.write_outputs(args.out, "train", config, results, table)
        print(f"\n{table}\n\nwrote {path}/train.json, train.png, train.md")


if __name__ == "__main__":
    main()
