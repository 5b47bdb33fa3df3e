"""A method's extra compute on a GPU, read from the measured kernel record.

`experiments/benchmarks/bench_kernels.py` times each method's compress and decompress
kernels on GPT-2 small's 124M-parameter float32 gradient (148 leaves). Its NVIDIA H200
record lives here, `gradcomm/perfmodel/kernels_gpu/bench_kernels.json` (package data, its
one copy; the docs quote it), with the table it printed beside it. `kernel_seconds` says
which kernels one step of a method runs and how long they took, `gpu_cost_per_byte` divides
that by the record's model bytes: `predict`'s `cost_per_byte` on a GPU.

Per step of a method on N devices, the kernels (names as the record's rows):

* terngrad: `terngrad compress` + `terngrad decompress` (the decode sums the codes of the
  record's N = 8 senders);
* lags, gradient_dropping: `topk <selector> d=<density> per leaf` + `decode d=<density>`
  (gradient dropping's density is 1 - `drop_ratio`; its local gradient adds elementwise
  passes that are not timed);
* slgs: `topk <selector> d=<density> concatenated` + `decode d=<density>`;
* powersgd: `powersgd compress r<rank>` + `powersgd decompress r<rank>`;
* low_precision, and allreduce with a 16-bit `dtype`: `low_precision compress <bf16|f16>` +
  `low_precision decompress <bf16|f16>`. Not the one-device `update` row: over one device
  XLA drops the all-reduce and fuses the casts around it, which N > 1 devices cannot;
* adasum: `adasum pair` times (M - 1) / M, M = 2^floor(log2 N), plus one whole pair when
  N > M. Vector halving combines half of the model at the first level, a quarter at the
  second, and so on (`gradcomm.adasum`), and a non-power-of-two N first folds whole models
  into M. (Not log2 N whole pairs: no level combines the whole model.)
* allreduce, sgp, dpsgd, local_sgd, periodic_average, diloco: none. Their extra work is a
  few elementwise passes, which the record does not time; 0 is taken.

Each kernel's time is taken to scale with the model's bytes. That holds for the kernels
near the copy bound; the per-leaf sampled top-k is bound by launches over 148 leaves
(about 400x the bound), so away from GPT-2 small's shapes its figure is rough.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from gradcomm.perfmodel._pattern import _entry

RECORD = "kernels_gpu/bench_kernels.json"  # under gradcomm/perfmodel/
_SIXTEEN = {"bfloat16": "bf16", "float16": "f16"}
_NONE = "none: elementwise passes only, not timed"


class KernelRecord(NamedTuple):
    """A bench_kernels.py record: the device, the model's size, each kernel's seconds."""

    device: str
    params: int
    seconds: Mapping[str, float]
    path: str

    @property
    def model_bytes(self) -> int:
        """The float32 gradient's bytes."""
        return 4 * self.params


@functools.cache
def kernel_record(path: str | None = None) -> KernelRecord:
    """The kernel record at `path`, or the packaged H200 one (`RECORD`).

    Raises:
      ValueError: if the record is cut short or lacks its rows.
    """
    if path is None:
        source = importlib.resources.files("gradcomm.perfmodel").joinpath(RECORD)
        text, where = source.read_text(), f"gradcomm/perfmodel/{RECORD}"
    else:
        text, where = pathlib.Path(path).read_text(), str(path)
    data = json.loads(text)
    if not data.get("complete") or not data.get("rows"):
        raise ValueError(f"{where} is not a complete bench_kernels.py record: rerun it")
    seconds = {r["kernel"]: float(r["seconds"]) for r in data["rows"]}
    return KernelRecord(data["device"], int(data["params"]), seconds, where)


def _look_up(record: KernelRecord, names: list[str]) -> float:
    missing = [n for n in names if n not in record.seconds]
    if missing:
        raise ValueError(
            f"{record.path} has no kernel {', '.join(map(repr, missing))} (its kernels: "
            f"{', '.join(record.seconds)}); rerun experiments/benchmarks/bench_kernels.py "
            "with the densities (--densities) or ranks (--ranks) you need"
        )
    return sum(record.seconds[n] for n in names)


def kernel_seconds(
    method: str,
    options: Mapping[str, Any] | None = None,
    nodes: int = 2,
    *,
    record: KernelRecord | None = None,
) -> tuple[float, str]:
    """The seconds one step of `method` spends in its kernels on the record's model.

    Args:
      method: a registered factory's name (`gradcomm.registry.METHODS`).
      options: the factory's keyword arguments (the others take their defaults).
      nodes: the devices N (Adasum's combines depend on it).
      record: a `kernel_record`; default the packaged H200 one.

    Returns:
      The seconds, and the kernels they come from in words.

    Raises:
      ValueError: for an unknown method or option, or options whose kernels the record
        did not time (a density or rank it did not run).

    Example:
      >>> from gradcomm.perfmodel._kernels import kernel_seconds
      >>> seconds, source = kernel_seconds("lags", {"density": 0.01})
      >>> source, round(1e3 * seconds, 1)
      ('topk sampled d=0.01 per leaf + decode d=0.01', 60.2)
      >>> round(1e3 * kernel_seconds("adasum", nodes=4)[0], 2)  # 3/4 of a whole pair
      4.31
    """
    record = record or kernel_record()
    given = _entry(method).options(options)
    names: list[str] = []
    if method == "terngrad":
        names = ["terngrad compress", "terngrad decompress"]
    elif method in ("lags", "slgs", "gradient_dropping"):
        density = 1 - given["drop_ratio"] if method == "gradient_dropping" else given["density"]
        layout = "concatenated" if method == "slgs" else "per leaf"
        names = [f"topk {given['selector']} d={density:g} {layout}", f"decode d={density:g}"]
    elif method == "powersgd":
        names = [f"powersgd {phase} r{given['rank']}" for phase in ("compress", "decompress")]
    elif method in ("low_precision", "allreduce") and given["dtype"] is not None:
        dtype = np.dtype(given["dtype"]).name
        if dtype not in _SIXTEEN:
            raise ValueError(f"{method}: dtype {dtype} has no kernel; bfloat16 or float16")
        names = [f"low_precision {p} {_SIXTEEN[dtype]}" for p in ("compress", "decompress")]
    elif method == "adasum":
        tree = 1 << (max(nodes, 1).bit_length() - 1)
        combines = (tree - 1) / tree + (nodes > tree)
        pair = _look_up(record, ["adasum pair"])
        return combines * pair, f"adasum pair x {combines:.3g}"
    if not names:
        return 0.0, _NONE
    return _look_up(record, names), " + ".join(names)


def gpu_cost_per_byte(
    method: str,
    options: Mapping[str, Any] | None = None,
    nodes: int = 2,
    *,
    record: str | None = None,
) -> float:
    """A method's extra compute on a GPU per byte of the model, from the kernel record.

    The kernels of one step (`gradcomm.perfmodel._kernels` lists which, per method) over
    the record's float32 gradient bytes: `predict`'s `cost_per_byte` on that GPU, taken to
    scale with the model's bytes.

    Args:
      method: a registered factory's name.
      options: the factory's keyword arguments.
      nodes: the devices N (Adasum's combines depend on it).
      record: a bench_kernels.json path; default the packaged NVIDIA H200 record.

    Returns:
      Seconds per byte of the model.

    Raises:
      ValueError: as `kernel_seconds`.

    Example:
      >>> from gradcomm import perfmodel
      >>> cost = perfmodel.gpu_cost_per_byte("terngrad")  # 9.07 ms on 124M float32 params
      >>> round(cost * 4 * 124_439_808 * 1e3, 2)
      9.07
      >>> p = perfmodel.predict("terngrad", 124_439_808, 8, 10.0, cost_per_byte=cost)
      >>> round(p.compute_s * 1e3, 2)
      9.07
    """
    table = kernel_record(record)
    return kernel_seconds(method, options, nodes, record=table)[0] / table.model_bytes
