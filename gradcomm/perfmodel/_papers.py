"""The papers' figures beside the model's, from each paper's own inputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from gradcomm.perfmodel._model import NCCL, Backend, predict

_NO_OVERLAP = Backend("nccl, no overlap", overlap=0.0)


class PaperCheck(NamedTuple):
    """A paper's figure beside the model's prediction from that paper's own inputs.

    `quantity` is allreduce's step over the method's ("speed-up") or, for Adasum, the
    method's collective over allreduce's ("latency ratio"). `predicted` uses `NCCL`
    (overlap 1); `predicted_no_overlap` the same with overlap 0.
    `compute_s` is the compute per step used (read from the paper as `inputs` says), and
    `implied_compute_s` the compute at which the model gives the paper's figure (None: at
    no compute, or, for a latency ratio, not applicable).
    """

    paper: str
    setting: str
    inputs: str
    figure: str
    quantity: Literal["speed-up", "latency ratio"]
    paper_value: float
    predicted: float
    predicted_no_overlap: float
    compute_s: float
    implied_compute_s: float | None


class _Spec(NamedTuple):
    paper: str
    setting: str
    figure: str
    value: float
    method: str
    options: dict[str, Any]
    params: int
    nodes: int
    gbps: float
    rule: tuple[Any, ...]  # how the compute per step is read from the paper
    sync: dict[str, Any] | None = None  # the method's parameter averaging, as for `predict`


_ADASUM, _LAGS = "Adasum (Maleki et al., MLSys 2021), 5.1.1, Fig. 1", "LAGS-SGD (Shi et al., 2020)"
_TERN, _SGP = "TernGrad (Wen et al., 2017), App. B, Fig. 5", "SGP (Assran et al., 2019), Table 1"
_GD = "Gradient dropping (Aji et al., EMNLP 2019), Table 2"
_AVERAGE_500 = {"name": "periodic_average", "every": 500}
_SGP_STEP = 8.8 * 3600 / (90 * 1_281_167 / (4 * 256))  # 90 epochs, 256 images a node, 4 nodes
# Compute rules: ("none",) the collective alone; ("bound",) the paper gives none: 0, so the
# model's figure is an upper bound; ("ref", method, options, nodes, Gbit/s, seconds, where):
# the paper's measured step of that configuration; ("scaling", r, where): the paper's dense
# multi-node step is r times the compute (its single-node run sends nothing on the network).
# Sizes the paper does not state are the architecture's (AlexNet, VggNet-A, ResNet-50, ...).
# fmt: off
_PAPERS = (
    _Spec(_ADASUM, "64 V100s (16 nodes x 4), 100 Gb/s InfiniBand, a 64 MB tensor (Horovod's "
          "fusion size)", "latency at most 1.45x NCCL all-reduce's", 1.45, "adasum", {},
          16_000_000, 64, 100.0, ("none",)),
    *(_Spec(f"{_LAGS}, Table 2", f"{m}, 16 nodes x 1 GPU, 1 GbE, density {d}",
            f"{s1}x over Dense", s1, "lags", {"density": d}, p, 16, 1.0,
            ("ref", "slgs", {"density": d}, 16, 1.0, t, f"SLGS step in Table 2, {t} s"))
      for m, p, d, t, s1 in (("ResNet-50", 25_557_032, 0.001, 0.67, 2.86),
                             ("Inception-v4", 42_679_816, 0.001, 1.60, 3.08),
                             ("LSTM-PTB", 66_034_000, 0.004, 1.02, 8.52))),
    _Spec(f"{_TERN}(a)", "AlexNet, 8 GPUs (2 nodes x 4), 1 GbE", "3.04x over float "
          "all-reduce", 3.04, "terngrad", {}, 60_965_224, 2, 1.0, ("bound",)),
    _Spec(f"{_TERN}(b)", "VggNet-A, 512 GPUs (128 nodes x 4), 100 Gb/s InfiniBand", "about "
          "2x ('double')", 2.0, "terngrad", {}, 132_863_336, 128, 100.0, ("bound",)),
    *(_Spec(_SGP, f"ResNet-50, 32 nodes x 8 V100, 10 GbE, {label}", f"{5.1 / h:.2f}x over "
            f"AllReduce-SGD (5.1 h / {h} h)", 5.1 / h, m, {}, 25_557_032, 32, 10.0,
            ("ref", "allreduce", {}, 4, 100.0, _SGP_STEP, "AllReduce-SGD, 4 nodes, 100 Gb/s "
             "InfiniBand (Table 2): 8.8 h / 112,600 steps"))
      for m, label, h in (("sgp", "SGP, 1 peer", 1.7), ("dpsgd", "D-PSGD", 2.6))),
    *(_Spec(_GD, f"{m}, 4 nodes x 4 P100, 40 Gb/s InfiniBand, {what}", f"{x / y:.2f}x over "
            f"dense 4x4 ({x:,} / {y:,} words/s)", x / y, "gradient_dropping", o, p, 4, 40.0,
            ("scaling", 4 * one / y, f"{one:,} words/s on one node of 4 GPUs"), sync)
      for m, what, o, sync, p, one, y, x in (
          ("Transformer", "drop 99% + local gradients, average every 500",
           {"local": "compensated"}, _AVERAGE_500, 62_000_000, 36029, 97111, 122914),
          ("Deep RNN", "drop 99%", {}, None, 225_000_000, 18205, 42930, 60090),
          ("Shallow RNN", "drop 99%", {}, None, 119_000_000, 36466, 75641, 118189))),
)
# fmt: on


def _solve(f: Callable[[float], float], target: float, hi: float = 1e3) -> float | None:
    """x in [0, hi] with f(x) = target, for a monotone f; None if the target lies outside."""
    lo, sign = 0.0, f(0.0) - target
    if sign * (f(hi) - target) > 0:
        return None
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (f(mid) - target) * sign > 0 else (lo, mid)
    return (lo + hi) / 2


def _ratio(s: _Spec, compute_s: float, backend: Backend) -> float:
    """The spec's figure as the model gives it: a speed-up, or Adasum's latency ratio."""
    kw = {"backend": backend, "compute_s": compute_s}
    t_m = predict(s.method, s.params, s.nodes, s.gbps, options=s.options, sync=s.sync, **kw).step_s
    t_ar = predict("allreduce", s.params, s.nodes, s.gbps, **kw).step_s
    return t_m / t_ar if s.rule[0] == "none" else t_ar / t_m


def _compute(s: _Spec, backend: Backend) -> tuple[float, str]:
    """Compute per step read from the paper as the spec's rule says, and how."""
    rule, *args = s.rule
    if rule == "ref":  # the compute that gives the paper's measured step of another setup
        method, options, nodes, gbps, seconds, where = args

        def step(c: float) -> float:
            kw = {"options": options, "backend": backend, "compute_s": c}
            return predict(method, s.params, nodes, gbps, **kw).step_s

        return _solve(step, seconds) or 0.0, f"{where}, less the model's communication"
    if rule == "scaling":  # the compute at which the dense step is `ratio` times it
        ratio, where = args

        def excess(c: float) -> float:
            kw = {"backend": backend, "compute_s": c}
            return predict("allreduce", s.params, s.nodes, s.gbps, **kw).step_s - ratio * c

        c = _solve(excess, 0.0) or 0.0
        return c, f"{where}: the dense 4x4 step is {ratio:.2f}x compute"
    return 0.0, "none: the collective alone" if rule == "none" else "not given: 0, a bound"


def paper_checks() -> list[PaperCheck]:
    """Each paper's figure beside the model's prediction, from the paper's inputs alone.

    Inputs: the model's size, N (hosts on the slow link), the link's bandwidth, and the
    compute per step where the paper gives it or a measured step it can be read from (the
    `inputs` field says which). Latency is 0, as no paper gives it. The backend is NCCL
    (ideal patterns). No parameter is fitted per paper.

    Returns:
      A `PaperCheck` per figure; `paper_table` prints them.

    Example:
      >>> from gradcomm import perfmodel
      >>> c = perfmodel.paper_checks()[0]
      >>> c.paper_value, round(c.predicted, 2)  # Adasum's latency over NCCL all-reduce's
      (1.45, 1.0)
    """
    out = []
    for s in _PAPERS:
        (c, how), (c0, _) = _compute(s, NCCL), _compute(s, _NO_OVERLAP)
        latency = s.rule[0] == "none"
        implied = None if latency else _solve(lambda x, s=s: _ratio(s, x, NCCL), s.value)
        inputs = (
            f"{s.params / 1e6:.1f}M parameters, N = {s.nodes}, {s.gbps:g} Gbit/s; "
            f"compute {c:.3g} s ({how})"
        )
        out.append(
            PaperCheck(
                s.paper,
                s.setting,
                inputs,
                s.figure,
                "latency ratio" if latency else "speed-up",
                s.value,
                _ratio(s, c, NCCL),
                _ratio(s, c0, _NO_OVERLAP),
                c,
                implied,
            )
        )
    return out


def paper_table(checks: Sequence[PaperCheck] | None = None) -> str:
    """`paper_checks` as a Markdown table, as docs/bench/model.md quotes it."""
    lines = [
        "| paper | setting | inputs | paper's figure | model | model, no overlap "
        "| compute that gives the paper's figure |",
        "| --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for c in paper_checks() if checks is None else checks:
        implied = "none" if c.implied_compute_s is None else f"{c.implied_compute_s:.3g} s"
        implied = "-" if c.quantity == "latency ratio" else implied
        lines.append(
            f"| {c.paper} | {c.setting} | {c.inputs} | {c.figure} | {c.predicted:.2f}x | "
            f"{c.predicted_no_overlap:.2f}x | {implied} |"
        )
    return "\n".join(lines) + "\n"
