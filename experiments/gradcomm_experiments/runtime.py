"""Devices, hosts and the flags every experiment shares.

Scripts call `add_common_args` on their parser, `parse_args` (which checks the shared
flags, and the script's own checks, before any device is touched: a bad flag exits with
the usage and a message) and `setup` before anything touches a JAX device: `setup`
simulates CPU devices (`--devices`), or joins a multi-host run (`--coordinator-address`,
`--num-processes`, `--process-id`, gloo collectives on CPU).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable, Sequence

import jax

from gradcomm_experiments import cli
from gradcomm_experiments import data as datasets


def add_common_args(
    parser: argparse.ArgumentParser, *, data: bool = True, seed: bool = True
) -> None:
    """Device, host, data, seed and output flags shared by every experiment.

    A study that makes its own data leaves out `--dataset` and `--data-dir` (`data=False`);
    one that runs several seeds leaves out `--seed` (`seed=False`).
    """
    group = parser.add_argument_group("devices and hosts")
    group.add_argument(
        "--devices",
        type=positive_int,
        default=None,
        help="devices per process: simulated on a CPU (default 8 there), or the first N "
        "accelerators (default: all of them)",
    )
    group.add_argument("--coordinator-address", default=None, help="host:port of process 0")
    group.add_argument("--num-processes", type=positive_int, default=1, help="processes in the run")
    group.add_argument("--process-id", type=int, default=0, help="this process's index")
    if data:
        parser.add_argument(
            "--dataset",
            default="digits",
            choices=datasets.DATASETS,
            help="digits (bundled with scikit-learn), or mnist or cifar10 from --data-dir",
        )
        parser.add_argument(
            "--data-dir",
            default=None,
            help="directory with the MNIST idx files or the CIFAR-10 python batches "
            "(needed for mnist and cifar10)",
        )
    if seed:
        parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--out",
        default="runs/" + pathlib.Path(sys.argv[0]).stem,
        help="output directory for JSON, PNG and Markdown",
    )
    cli.add_quiet(parser)


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def check_common(args: argparse.Namespace) -> None:
    """The shared flags make sense together (ValueError, with the reason, if not)."""
    if args.process_id < 0 or args.process_id >= args.num_processes:
        raise ValueError(
            f"--process-id {args.process_id}: must be in 0..{args.num_processes - 1} "
            f"(--num-processes {args.num_processes})"
        )
    if args.num_processes > 1 and not args.coordinator_address:
        raise ValueError("--num-processes above 1 needs --coordinator-address host:port")
    if getattr(args, "dataset", "digits") != "digits":
        if args.data_dir is None:
            raise ValueError(f"--dataset {args.dataset} needs --data-dir with its files")
        if not pathlib.Path(args.data_dir).is_dir():
            raise ValueError(f"--data-dir {args.data_dir}: no such directory")
        datasets.check_files(args.dataset, args.data_dir)
    for flag in ("epochs", "batch_size", "probe_every", "eval_every"):
        if getattr(args, flag, 1) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if hasattr(args, "seeds"):
        cli.comma_list(args.seeds, int, "--seeds")


def parse_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    *checks: Callable[[argparse.Namespace], None],
) -> argparse.Namespace:
    """`parser`'s flags, the shared ones checked, then each of `checks` (a `ValueError`
    from any of them exits with the parser's usage and the message)."""
    args = parser.parse_args(argv)
    cli.check(parser, args, check_common, *checks)
    return args


def add_schedule_args(
    parser: argparse.ArgumentParser,
    *,
    epochs: int,
    batch_size: int | None = None,
    probe_every: int | None = None,
    seeds: bool = False,
) -> None:
    """The training-length flags a study takes, with its own defaults.

    Args:
      parser: the study's parser.
      epochs: the default of `--epochs`.
      batch_size: the default of `--batch-size` (examples per device per step); None
        leaves the flag out.
      probe_every: the default of `--probe-every`; None leaves the flag out.
      seeds: whether to add `--seeds` (the seeds a study averages over).
    """
    parser.add_argument("--epochs", type=int, default=epochs, help="passes over the training set")
    if batch_size is not None:
        parser.add_argument(
            "--batch-size", type=int, default=batch_size, help="examples per device per step"
        )
    if probe_every is not None:
        parser.add_argument(
            "--probe-every", type=int, default=probe_every, help="steps between probes"
        )
    if seeds:
        parser.add_argument("--seeds", default="0,1,2", help="seeds to average over")


def seed_list(args: argparse.Namespace) -> list[int]:
    """The seeds of `--seeds`."""
    return cli.comma_list(args.seeds, int, "--seeds")


def setup_sizes(args: argparse.Namespace) -> tuple[list[int], list[jax.Device]]:
    """For a study over N devices: the distinct N of `--sizes`, sorted, and `setup`'s
    devices (by default as many as the largest N).

    Exits with a message where fewer devices than the largest N can be had.
    """
    sizes = sorted(set(cli.comma_list(args.sizes, int, "--sizes")))
    args.devices = args.devices or max(sizes)
    devices = setup(args)
    if max(sizes) > len(devices):
        raise SystemExit(f"--sizes up to {max(sizes)} needs that many devices, got {len(devices)}")
    return sizes, devices


def setup(args: argparse.Namespace) -> list[jax.Device]:
    """Configures JAX for the run and returns the devices to use (all processes').

    Exits with a message where the devices asked for cannot be had: more than this
    process's accelerators, or simulated CPU devices asked for after JAX's backend started
    (its device count is fixed then).
    """
    if args.devices is not None and args.devices < 1:
        raise SystemExit("--devices must be at least 1")
    try:
        jax.config.update("jax_num_cpu_devices", args.devices or 8)
    except RuntimeError as e:  # the backend started before this call
        raise SystemExit(f"--devices {args.devices}: {e}") from None
    if args.coordinator_address:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    local = jax.local_devices()
    if args.devices is not None and args.devices > len(local):
        raise SystemExit(
            f"--devices {args.devices}: this process has only {len(local)} "
            f"{local[0].platform} device(s)"
        )
    if args.devices is not None and local[0].platform != "cpu":
        keep = {
            d.id for p in range(jax.process_count()) for d in _first_of_process(p, args.devices)
        }
        return [d for d in jax.devices() if d.id in keep]
    return jax.devices()


def _first_of_process(process: int, count: int) -> list[jax.Device]:
    return [d for d in jax.devices() if d.process_index == process][:count]


def is_main_process() -> bool:
    return jax.process_index() == 0


def describe(devices: Sequence[jax.Device]) -> str:
    kind = devices[0].device_kind if devices else "none"
    return f"{len(devices)} x {devices[0].platform} ({kind}), {jax.process_count()} process(es)"
