"""Command-line conventions every script keeps: its parser, --quiet, and progress bars.

`make_parser(__doc__)` gives a script a parser whose `--help` shows each flag's default
(flags without one, and on/off switches, show none) and ends with the module docstring's
example commands. `add_quiet` adds `--quiet` (alias `--no-progress`), and `progress`
draws a tqdm bar only on a terminal: in a log or a pipe a bar's carriage returns would
flood it, and each script prints a line per finished run instead. `check` turns a
`ValueError` raised while checking the parsed flags into the parser's usage error (exit
status 2 with the message, no traceback). JAX is not imported here: the network
benchmark's driver uses this module without it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from typing import Any


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help; none for flags without one, or on/off switches."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool):
            return action.help or ""
        return super()._get_help_string(action) or ""


def make_parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser: `doc`'s first line as the description, its example block (the
    indented paragraph after it) as the epilog, and defaults in `--help`."""
    paragraphs = (doc or "").strip("\n").split("\n\n")
    examples = [p for p in paragraphs[1:2] if p.startswith("    ")]
    return argparse.ArgumentParser(
        description=paragraphs[0].strip(),
        epilog="examples:\n" + examples[0] if examples else None,
        formatter_class=HelpFormatter,
    )


def add_outputs(
    parser: argparse.ArgumentParser,
    out: str,
    *,
    repeats: tuple[int, str] | None = None,
    seed: str | None = None,
) -> argparse.ArgumentParser:
    """A benchmark's last flags: `--repeats` (default and help) and `--seed` (its help)
    where it times and draws, then `--out` (default `out`) and `--quiet`."""
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats[0], help=repeats[1])
    if seed is not None:
        parser.add_argument("--seed", type=int, default=0, help=seed)
    parser.add_argument("--out", default=out, help="output directory")
    add_quiet(parser)
    return parser


def add_quiet(parser: argparse.ArgumentParser | Any) -> None:
    """`--quiet` (and its older name `--no-progress`): no progress bars."""
    parser.add_argument(
        "--quiet",
        "--no-progress",
        dest="quiet",
        action="store_true",
        help="no progress bars (off anyway when stderr is not a terminal)",
    )


def progress(iterable: Iterable[Any] | None = None, *, quiet: bool = False, **kwargs: Any) -> Any:
    """A tqdm bar over `iterable`, drawn only on a terminal and unless `quiet`.

    `kwargs` go to tqdm (`total`, `desc`, `leave`, ...); a disabled bar still counts and
    takes `update` and `set_postfix`, silently.
    """
    from tqdm.auto import tqdm

    terminal = sys.stderr is not None and sys.stderr.isatty()
    return tqdm(iterable, disable=quiet or not terminal, **kwargs)


def check(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *checks: Callable[..., Any]
) -> None:
    """Runs each `check(args)`; a `ValueError` becomes `parser.error` (exit 2, the message)."""
    for fn in checks:
        try:
            fn(args)
        except ValueError as e:
            parser.error(str(e))


def device_counts(args: argparse.Namespace) -> list[int]:
    """The N of `--sizes`, each at least 1, the largest within `--devices` (if given).

    Raises:
      ValueError: saying which flag to change.
    """
    sizes = comma_list(args.sizes, int, "--sizes")
    if min(sizes) < 1:
        raise ValueError(f"--sizes {args.sizes}: every N must be at least 1")
    if args.devices is not None and args.devices < max(sizes):
        raise ValueError(f"--sizes up to {max(sizes)} needs --devices {max(sizes)} or more")
    return sizes


def comma_list(text: str, kind: Callable[[str], Any], flag: str) -> list[Any]:
    """The comma-separated values of `flag`, each read with `kind` (ValueError: says which)."""
    try:
        values = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated values") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    return values
