"""What ran a result: the one `provenance` record every script's JSON carries.

    stamp = _provenance.start(argv)             # first thing in a script's main
    ...
    payload["provenance"] = stamp.record(devices, seeds=[args.seed])

The record (`KEYS`): gradcomm's version and the directory it was imported from; the git
commit of that directory's checkout and whether its tree was dirty (uncommitted changes
or untracked files; "unknown" and None outside a git checkout or without git); the
versions of Python, jax, jaxlib, optax and flax (None if not installed); the platform
(the JAX backend of the devices used), their kind and count, and the process count; the
command line; the seeds; the start time (ISO 8601, UTC) and the wall time in seconds
until the record was made. JAX is not imported here: the network benchmark's driver,
which runs none, passes what its workers reported (`devices_info`).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import importlib.util
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

KEYS = (
    "gradcomm_version",
    "gradcomm_path",
    "git_commit",
    "git_dirty",
    "python",
    "jax",
    "jaxlib",
    "optax",
    "flax",
    "platform",
    "device_kind",
    "device_count",
    "process_count",
    "command",
    "seeds",
    "started_utc",
    "wall_seconds",
)


@dataclasses.dataclass(frozen=True)
class Stamp:
    """A run's start: the command line, the UTC time and a monotonic clock reading."""

    command: list[str]
    started_utc: str
    clock: float

    def record(
        self, devices: Sequence[Any] | dict[str, Any] | None, *, seeds: Sequence[int]
    ) -> dict[str, Any]:
        """The provenance record, with the wall time since `start`.

        `devices` are the JAX devices the run used, or `devices_info` of them as a worker
        reported it; None leaves the platform, device kind and count unknown (None).
        """
        info = devices if isinstance(devices, dict) or devices is None else devices_info(devices)
        return {
            **software(),
            **{k: (info or {}).get(k) for k in _DEVICE_KEYS},
            "command": self.command,
            "seeds": [int(s) for s in seeds],
            "started_utc": self.started_utc,
            "wall_seconds": round(time.perf_counter() - self.clock, 3),
        }


_DEVICE_KEYS = ("platform", "device_kind", "device_count", "process_count")


def start(argv: Sequence[str] | None = None) -> Stamp:
    """Now, for a script called with `argv` (None: `sys.argv`, as from the shell)."""
    command = list(sys.argv) if argv is None else [sys.argv[0], *argv]
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return Stamp(command, now, time.perf_counter())


def devices_info(devices: Sequence[Any]) -> dict[str, Any]:
    """The platform, kind and count of the JAX devices used, and the process count."""
    import jax

    return {
        "platform": devices[0].platform if devices else jax.default_backend(),
        "device_kind": devices[0].device_kind if devices else None,
        "device_count": len(devices),
        "process_count": jax.process_count(),
    }


def software() -> dict[str, Any]:
    """gradcomm's version, where it came from and its git state; the other versions."""
    module = sys.modules.get("gradcomm")
    if module is not None:
        version, where = getattr(module, "__version__", None), pathlib.Path(module.__file__)
    else:
        spec = importlib.util.find_spec("gradcomm")
        version = _version("gradcomm")
        where = pathlib.Path(spec.origin) if spec and spec.origin else None
    directory = where.parent if where is not None else None
    commit, dirty = git_state(directory)
    return {
        "gradcomm_version": version,
        "gradcomm_path": str(directory) if directory is not None else None,
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        **{name: _version(name) for name in ("jax", "jaxlib", "optax", "flax")},
    }


def git_state(directory: pathlib.Path | None) -> tuple[str, bool | None]:
    """(HEAD's commit, whether the tree is dirty) of the checkout holding `directory`;
    ("unknown", None) outside a git checkout, or without git.

    Dirty means a tracked file changed, or an untracked Python file exists (code the run
    may have imported). Other untracked files, such as the run's own output folder inside
    the checkout, do not make it dirty.
    """
    if directory is None:
        return "unknown", None
    try:
        head = _git(directory, "rev-parse", "HEAD")
        status = _git(directory, "status", "--porcelain", "--untracked-files=all")
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    changes = [line for line in status.splitlines() if line.strip()]
    dirty = any(not line.startswith("??") or line.endswith(".py") for line in changes)
    return head.strip(), dirty


def _git(directory: pathlib.Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(directory), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
