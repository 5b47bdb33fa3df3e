"""gradcomm_experiments: the code the experiment scripts share, imported by its name.

Not part of the gradcomm library (which never imports it): the scripts under
`experiments/` (`studies/`, the paper studies and the main job `compare.py`;
`benchmarks/`, the micro-benchmarks; `network/`, the network benchmark) and the tests
import it as `from gradcomm_experiments import cli, methods, ...`. It is installed with
gradcomm from this checkout (`pip install -e ".[experiments]"`), and needs the
`experiments` extra (flax, scikit-learn, matplotlib, tqdm) for most of its modules.

- `cli`: the scripts' parser, `--quiet` and progress bars;
- `runtime`: devices, hosts and the flags every study shares;
- `data`, `tasks`: the datasets and the tasks the training loop runs (the small CNN);
- `methods`: the registry of methods by name, which compare.py, the network benchmark and
  `gradcomm.perfmodel` read;
- `loop`: the training loop, with probes and bytes per step;
- `compare`: the recipe of `studies/compare.py` and `studies/train.py`;
- `report`: a study's JSON, Markdown and plots, and each method's style;
- `provenance`: the record of what ran that every result carries;
- `timing`: what the micro-benchmarks share;
- `network`: the network benchmark's cluster, workers and report.

Importing the package imports none of them. `cli`, `data`, `methods`, `provenance`,
`report` and the network benchmark's driver-side modules do not import JAX, so that driver
and its PyTorch peer worker run without it.
"""
