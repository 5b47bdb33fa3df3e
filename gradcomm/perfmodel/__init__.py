"""An alpha-beta model of a training step's time per method, and where each beats all-reduce.

    step = compute + comm - hidden,   comm = sum over the step's collectives of
           share * factor(kind, n) * (latency * messages + 8 * bytes_sent / bandwidth)

Each method's collectives per step (`pattern`) come from its algorithm (its entry in
`gradcomm.registry`), their bytes are
`gradcomm.wire`'s count, and `factor` is the backend's time against the alpha-beta ideal
(1 on `NCCL`, measured per pattern on `GLOO`); `hidden` is what overlaps the backward pass
or, for 1-overlap SGP, the step. `predict` gives one step's time, `crossover_bandwidth` and
`crossover_table` the link below which each method beats allreduce (for the rows its caller
hands it: the model names gradcomm's factories, not a study's methods), `calibrate` and
`fit_report` fit the model to `experiments/network/bench_network.py`'s records, and `paper_checks`
sets the figures of the Adasum, LAGS-SGD, TernGrad, SGP and gradient dropping papers
beside the model's. `gpu_cost_per_byte` reads a method's extra compute on a GPU from the
measured kernel record packaged here (kernels_gpu/bench_kernels.json, an NVIDIA H200), and
`recommend` ranks the registered methods for a model, hosts and link, on a GPU or on the
calibrated CPU cluster. Units: bandwidth in Gbit/s, latency and times in seconds, model
size in parameters. `python -m gradcomm.perfmodel network.json` prints the fit, the
crossovers and the papers, `python -m gradcomm.perfmodel recommend --params 124M --nodes 32
--link 10gbit` the ranking; docs/bench/model.md explains the model.

Example:
  >>> from gradcomm import perfmodel
  >>> ar = perfmodel.predict("allreduce", 25_000_000, 16, bandwidth=10.0)
  >>> round(ar.comm_s, 4)  # 2 (15/16) 100 MB at 10 Gbit/s
  0.15
  >>> sgp = perfmodel.predict("sgp", 25_000_000, 16, bandwidth=10.0)
  >>> round(sgp.comm_s, 4)  # one 100 MB message
  0.08
"""

from gradcomm.perfmodel._cli import main
from gradcomm.perfmodel._crossover import crossover_bandwidth, crossover_table
from gradcomm.perfmodel._fit import (
    OVERLAP_NOTE,
    Calibration,
    FitRow,
    calibrate,
    fit_file,
    fit_markdown,
    fit_report,
    key,
)
from gradcomm.perfmodel._kernels import gpu_cost_per_byte
from gradcomm.perfmodel._model import (
    BACKWARD,
    GLOO,
    GLOO_MEASURED,
    GLOO_PAIRWISE,
    NCCL,
    Backend,
    Prediction,
    predict,
)
from gradcomm.perfmodel._papers import PaperCheck, paper_checks, paper_table
from gradcomm.perfmodel._pattern import Collective, Setting, Window, averaging, pattern, window
from gradcomm.perfmodel._recommend import Choice, parse_link, parse_params, recommend

__all__ = [
    "BACKWARD",
    "GLOO",
    "GLOO_MEASURED",
    "GLOO_PAIRWISE",
    "NCCL",
    "OVERLAP_NOTE",
    "Backend",
    "Calibration",
    "Choice",
    "Collective",
    "FitRow",
    "PaperCheck",
    "Prediction",
    "Setting",
    "Window",
    "averaging",
    "calibrate",
    "crossover_bandwidth",
    "crossover_table",
    "fit_file",
    "fit_markdown",
    "fit_report",
    "gpu_cost_per_byte",
    "key",
    "main",
    "paper_checks",
    "paper_table",
    "parse_link",
    "parse_params",
    "pattern",
    "predict",
    "recommend",
    "window",
]
