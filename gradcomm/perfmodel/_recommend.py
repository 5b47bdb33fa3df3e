"""`recommend`: the registered methods ranked by the model's step time on a cluster.

Two machines the model knows:

* **"gpu"**: NCCL (every pattern at the alpha-beta ideal, communication hidden behind the
  backward pass where the method's window allows), one GPU per host. A method's extra
  compute is read from the measured NVIDIA H200 kernel record (`gpu_cost_per_byte`), and
  an all-reduce step's compute is `compute_s`, or by default an estimate (not a
  measurement): 6 FLOPs per parameter per token (forward and backward) on 8192 tokens per
  device (8 sequences of 1024) at 400 TFLOP/s (about 40% of an H200's dense
  bfloat16 peak). Pass your own measured step where you have it. NCCL has no swap
  penalty, so a method's `exchange` changes nothing there and "auto" is kept.
* **"cpu"**: the model calibrated to `experiments/network/bench_network.py`'s records
  (gloo, one CPU device per host), as `python -m gradcomm.perfmodel network.json` fits
  them; the rows are the methods those records ran, each with its fitted extra compute.
  The records come from `network` or, in a checkout of gradcomm, docs/bench/network.json.
  Compute per step is the calibrated one (nearest node count) scaled by the model's
  parameters over the benchmark's (compute linear in the parameters), unless given.

Where two rows differ only in their `exchange` (same numbers, another way to move them),
the faster is kept: its options say which to pass. Each row links the method's docs page
and the study of its accuracy (`STUDIES`; the digits comparison of every method where no
study of its own exists).
"""

from __future__ import annotations

import math
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import numpy as np

from gradcomm.perfmodel._fit import Calibration, fit_file, key
from gradcomm.perfmodel._kernels import kernel_record, kernel_seconds
from gradcomm.perfmodel._model import NCCL, predict
from gradcomm.perfmodel._pattern import _entry

Device = Literal["gpu", "cpu"]
# The all-reduce step's compute on a GPU, when none is given (an estimate; see above).
GPU_TOKENS = 8192
GPU_FLOPS = 400e12
_RESULTS = "docs/results.md#"
_DILOCO = _RESULTS + "diloco-family-streaming-diloco-eager-updates-and-1-bit-adam"
# Per method, the study of its accuracy in docs/results.md (methods not here: the digits
# comparison of every method, docs/results/compare.md).
STUDIES = {
    "adasum": _RESULTS + "adasum-accuracy-at-large-n",
    "terngrad": _RESULTS + "terngrad-accuracy-against-the-number-of-workers",
    "lags": _RESULTS + "lags-sgd-assumption-1-and-accuracy",
    "slgs": _RESULTS + "lags-sgd-assumption-1-and-accuracy",
    "sgp": _RESULTS + "sgp-gossip-against-the-all-reduce",
    "dpsgd": _RESULTS + "sgp-gossip-against-the-all-reduce",
    "gradient_dropping": _RESULTS + "gradient-dropping-with-local-gradients",
    "local_sgd": _RESULTS + "gradient-dropping-with-local-gradients",
    "powersgd": _RESULTS + "powersgd-accuracy-against-rank",
    "diloco": _DILOCO,
    "streaming_diloco": _DILOCO,
    "onebit_adam": _DILOCO,
}
COMPARE = "docs/results/compare.md"
# The rows ranked on a GPU: every registered method with the options its studies ran
# (periodic_average alone is local SGD; it appears as dropping-local's sync).
GPU_ROWS: tuple[Mapping[str, Any], ...] = (
    {"label": "allreduce", "method": "allreduce"},
    {"label": "adasum", "method": "adasum"},
    {"label": "terngrad", "method": "terngrad"},
    {"label": "lags-0.001", "method": "lags", "options": {"density": 0.001}},
    {"label": "lags-0.01", "method": "lags", "options": {"density": 0.01}},
    {"label": "slgs-0.001", "method": "slgs", "options": {"density": 0.001}},
    {"label": "slgs-0.01", "method": "slgs", "options": {"density": 0.01}},
    {"label": "dropping", "method": "gradient_dropping"},
    {"label": "dropping-local", "method": "gradient_dropping",
     "options": {"local": "compensated"}, "sync": {"name": "periodic_average", "every": 50}},
    {"label": "sgp", "method": "sgp"},
    {"label": "osgp", "method": "sgp", "options": {"overlap": 1}},
    {"label": "dpsgd", "method": "dpsgd"},
    {"label": "powersgd-r2", "method": "powersgd", "options": {"rank": 2}},
    {"label": "powersgd-r4", "method": "powersgd", "options": {"rank": 4}},
    {"label": "bf16", "method": "low_precision", "options": {"dtype": "bfloat16"}},
    {"label": "fp16", "method": "low_precision", "options": {"dtype": "float16"}},
    {"label": "local-sgd", "method": "local_sgd", "options": {"every": 20}},
    {"label": "diloco", "method": "diloco", "options": {"every": 500}},
    {"label": "streaming-diloco", "method": "streaming_diloco", "options": {"every": 500}},
    {"label": "onebit-adam", "method": "onebit_adam"},
)  # fmt: skip
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}
_LINK = {"": 1.0, "gbit": 1.0, "mbit": 1e-3}


class Choice(NamedTuple):
    """One row of `recommend`: a method, how to call it, its predicted step and evidence.

    Attributes:
      label: the row's name.
      method: the gradcomm factory.
      options: the keyword arguments to pass it (beyond `axis_name`).
      sync: the `ParamsSync` beside it, as `{"name": ..., **kwargs}`, or None.
      exchange: the `exchange` option the prediction used, where the factory has one.
      step_s: the predicted step, in seconds.
      ratio: `step_s` over allreduce's.
      compute_s: the step's compute: an all-reduce step's plus `extra_s`.
      comm_s: the step's communication, in seconds.
      hidden_s: the part of `comm_s` hidden behind compute.
      extra_s: the method's compute beyond an all-reduce step's, in seconds; on "cpu" the
        fitted figure, which can be negative (a step that computes less than the
        all-reduce step, whose in-memory sum is compute there).
      extra_from: where `extra_s` comes from.
      page: the method's docs page.
      evidence: the study of its accuracy.
    """

    label: str
    method: str
    options: dict[str, Any]
    sync: dict[str, Any] | None
    exchange: str | None
    step_s: float
    ratio: float
    compute_s: float
    comm_s: float
    hidden_s: float
    extra_s: float
    extra_from: str
    page: str
    evidence: str


def parse_params(text: str | int) -> int:
    """A parameter count: an int, or text such as "124M", "1.5B", "350k", "2e4" or "4194304".

    Example:
      >>> from gradcomm import perfmodel
      >>> perfmodel.parse_params("124M"), perfmodel.parse_params("1.5B")
      (124000000, 1500000000)
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmbg]?)\s*", str(text).lower())
    count = round(float(match[1]) * _SCALE[match[2]]) if match else 0
    if count < 1:
        raise ValueError(f"params {text!r}: a positive count, such as 124M, 1.5B or 4194304")
    return count


def parse_link(text: str | float) -> float | None:
    """A link in Gbit/s: "100mbit", "1gbit", "10gbit", "100gbit", or a number of Gbit/s;
    "unshaped" gives None (the calibrated unshaped link of the CPU benchmark).

    Example:
      >>> from gradcomm import perfmodel
      >>> perfmodel.parse_link("100mbit"), perfmodel.parse_link("10gbit"), perfmodel.parse_link(25)
      (0.1, 10.0, 25.0)
    """
    if str(text).strip().lower() == "unshaped":
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(mbit|gbit|)(?:/s)?\s*", str(text).lower())
    gbps = float(match[1]) * _LINK[match[2]] if match else 0.0
    if not gbps > 0:
        raise ValueError(
            f"link {text!r}: 100mbit, 1gbit, 10gbit, 100gbit, a number of Gbit/s or unshaped"
        )
    return gbps


def _model(params: Any) -> tuple[int, int, list[tuple[int, ...]] | None]:
    """(parameters, bytes per parameter, leaf shapes or None) of a count or a pytree."""
    if isinstance(params, int | np.integer | str):
        return parse_params(params), 4, None
    leaves = jax.tree.leaves(params)
    shapes = [tuple(np.shape(x)) for x in leaves]
    count = sum(math.prod(s) for s in shapes)
    if not leaves or count < 1:
        raise ValueError("params: a parameter count or a pytree of arrays with elements")
    itemsizes = [np.dtype(getattr(x, "dtype", np.float32)).itemsize for x in leaves]
    nbytes = sum(math.prod(s) * i for s, i in zip(shapes, itemsizes, strict=True))
    return count, max(round(nbytes / count), 1), shapes


def default_network() -> pathlib.Path:
    """docs/bench/network.json of the gradcomm checkout this package runs from.

    Raises:
      ValueError: where gradcomm is installed without its repository (pass `network`).
    """
    path = pathlib.Path(__file__).resolve().parents[2] / "docs" / "bench" / "network.json"
    if not path.is_file():
        raise ValueError(
            "device='cpu' needs experiments/network/bench_network.py's records: pass "
            "network=PATH (--network), e.g. docs/bench/network.json of a gradcomm checkout"
        )
    return path


def _gpu(
    count: int, nodes: int, compute_s: float | None, kernels: str | None
) -> list[tuple[Mapping[str, Any], dict[str, Any], str]]:
    """`GPU_ROWS` with their `predict` settings on NCCL and where their extra compute is from."""
    record = kernel_record(kernels)
    base = 6 * count * GPU_TOKENS / GPU_FLOPS if compute_s is None else compute_s
    out = []
    for row in GPU_ROWS:
        seconds, source = kernel_seconds(row["method"], row.get("options"), nodes, record=record)
        kw = {"backend": NCCL, "compute_s": base, "cost_per_byte": seconds / record.model_bytes}
        out.append((row, kw, f"{source} ({record.device})" if seconds else source))
    return out


def _cpu(
    count: int,
    nodes: int,
    rate_mbit: float | None,
    compute_s: float | None,
    cal: Calibration,
    records: Sequence[Mapping[str, Any]],
) -> list[tuple[Mapping[str, Any], dict[str, Any], str]]:
    """The records' methods (one device per host, once each, as the CLI's crossover rows)
    with their calibrated `predict` settings and where their extra compute is from."""
    rows: dict[str, Mapping[str, Any]] = {
        "allreduce": {"label": "allreduce", "method": "allreduce"}
    }
    for r in records:
        if r.get("devices_per_process", 1) == 1 and r.get("step_s") is not None:
            options = {k: v for k, v in (r.get("options") or {}).items() if k != "warmup_steps"}
            row = {"label": r.get("label"), "method": r["method"], "options": options}
            rows.setdefault(key(r["method"], options, r.get("sync")), row | {"sync": r.get("sync")})
    out = []
    for name, row in rows.items():
        kw = cal.settings(row["method"], row.get("options"), nodes, sync=row.get("sync"))
        kw["backend"] = cal.backend_at(rate_mbit)
        kw["compute_s"] = kw["compute_s"] * count / cal.params if compute_s is None else compute_s
        fitted = "fitted to the records' unshaped cells" if name in cal.cost_per_byte else "none"
        out.append((row, kw, fitted))
    return out


def recommend(
    params: Any,
    nodes: int,
    link: str | float,
    *,
    device: Device = "gpu",
    compute_s: float | None = None,
    network: str | pathlib.Path | None = None,
    kernels: str | None = None,
    latency: float = 0.0,
    every_exchange: bool = False,
) -> list[Choice]:
    """The registered methods ranked by the model's step time, fastest first.

    Args:
      params: the model: a parameter count (an int, or text such as "124M"), or a pytree
        of its arrays (their shapes and dtypes are used). PowerSGD's factors depend on
        the shapes: a count is taken as one square matrix, PowerSGD's best case.
      nodes: the hosts, one device each.
      link: each host's link: Gbit/s, or text as `parse_link` reads it; "unshaped" (the
        calibrated unshaped link of the nearest node count) on "cpu" only.
      device: "gpu" (NCCL, the H200 kernel record) or "cpu" (gloo, calibrated to
        network.json); see `gradcomm.perfmodel._recommend`.
      compute_s: an all-reduce step's compute, in seconds; default: the estimate ("gpu")
        or the calibrated compute scaled to `params` ("cpu").
      network: network.json records for "cpu"; default `default_network()`.
      kernels: a bench_kernels.json for "gpu"; default the packaged H200 record.
      latency: seconds per message.
      every_exchange: keep every row, not only the faster of rows that differ in their
        `exchange` alone.

    Returns:
      A `Choice` per row, by predicted step time; ties keep the rows' order.

    Raises:
      ValueError: for a bad `params`, `nodes`, `link` or `device`, or where the records
        cannot be found.

    Example:
      >>> from gradcomm import perfmodel
      >>> rows = perfmodel.recommend("124M", 32, "10gbit")  # GPT-2 small on 32 GPUs
      >>> [c.label for c in rows[:3]]
      ['streaming-diloco', 'diloco', 'powersgd-r2']
      >>> lags = next(c for c in rows if c.label == "lags-0.001")
      >>> round(lags.ratio, 2), round(lags.extra_s, 4), lags.extra_from
      (0.13, 0.0713, 'topk sampled d=0.001 per leaf + decode d=0.001 (NVIDIA H200)')
      >>> next(c for c in rows if c.label == "allreduce").ratio
      1.0
    """
    count, itemsize, shapes = _model(params)
    gbps = parse_link(link)
    if device not in ("gpu", "cpu"):
        raise ValueError(f"device {device!r}: 'gpu' or 'cpu'")
    if isinstance(nodes, bool) or not isinstance(nodes, int | np.integer) or nodes < 1:
        raise ValueError(f"nodes {nodes!r}: a positive number of hosts")
    if device == "gpu":
        if gbps is None:
            raise ValueError("link 'unshaped' is the CPU benchmark's: give the GPUs' link")
        rows = _gpu(count, nodes, compute_s, kernels)
    else:
        if network is not None and not pathlib.Path(network).is_file():
            raise ValueError(f"network {str(network)!r}: no such file (bench_network.py's JSON)")
        records, cal, _ = fit_file(network or default_network())
        rate_mbit = None if gbps is None else round(gbps * 1000, 9)
        if gbps is None and not cal.unshaped_gbps:
            raise ValueError("link 'unshaped': the records have no unshaped cell")
        if gbps is None:  # the unshaped link fitted at the nearest node count
            gbps = cal.unshaped_gbps[min(cal.unshaped_gbps, key=lambda n: abs(n - nodes))]
        rows = _cpu(count, nodes, rate_mbit, compute_s, cal, records)
    out = []
    for row, kw, source in rows:
        method, options, sync = row["method"], dict(row.get("options") or {}), row.get("sync")
        kw = {**kw, "itemsize": itemsize, "shapes": shapes}
        p = predict(method, count, nodes, gbps, latency, options=options, sync=sync, **kw)
        entry = _entry(method)
        takes_exchange = "exchange" in entry.options()
        out.append(Choice(
            label=row.get("label") or key(method, options, sync), method=method,
            options=options, sync=None if sync is None else dict(sync),
            exchange=options.get("exchange", "auto") if takes_exchange else None,
            step_s=p.step_s, ratio=math.nan, compute_s=p.compute_s, comm_s=p.comm_s,
            hidden_s=p.hidden_s, extra_s=p.compute_s - kw["compute_s"], extra_from=source,
            page=f"docs/site/methods/{entry.page}.md", evidence=STUDIES.get(method, COMPARE),
        ))  # fmt: skip
    baseline = next(c.step_s for c in out if c.method == "allreduce" and not c.options)
    out = [c._replace(ratio=c.step_s / baseline) for c in out]
    if not every_exchange:  # of rows that differ in their exchange alone, the fastest
        fastest: dict[str, Choice] = {}
        for c in out:
            group = key(c.method, {k: v for k, v in c.options.items() if k != "exchange"}, c.sync)
            if group not in fastest or c.step_s < fastest[group].step_s:
                fastest[group] = c
        out = list(fastest.values())
    return sorted(out, key=lambda c: c.step_s)
