"""The network benchmark's parts (`experiments/network/bench_network.py` drives them).

- `cluster`: an emulated cluster on one Linux machine (network namespaces, a bridge, links
  shaped with tc);
- `worker`: one host's JAX process (`python -m gradcomm_experiments.network.worker`),
  timing the methods or raw collectives;
- `mesh`: the rows on a 2-D mesh (`--mesh tp`, `fsdp`), and the worker's dispatch;
- `peer`: one host's PyTorch DDP process (`python -m gradcomm_experiments.network.peer`,
  `--peer`), which never imports JAX;
- `report`: network.json's records, the Markdown tables and the plot.

Importing the package imports none of them.
"""
