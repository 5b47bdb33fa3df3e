"""Top-k sparsification with error feedback: the engine under LAGS-SGD and gradient dropping.

The pieces that every sparse method shares:

* `topk(x, k, selector)`: exactly k (value, index) pairs of largest magnitude from a flat
  array, ties to lower indices, by `lax.top_k` or by a block-sampled threshold refined to
  the same entries without a sort (`gradcomm.sparse._topk`, re-exported here).
* `sum_sparse(sent, sizes, axis_name)`: one fixed-capacity all-gather of every device's
  (value, index) pairs (values and indices in one byte buffer; never a variable-size
  message), decoded once per dtype in device order (see below); optionally divided by N
  on the entries that were sent, which gives the bits of dividing the dense sum without a
  pass over it.
  `sum_sparse_segments` decodes one sparse vector over a concatenation of leaves (SLGS).
* Error feedback: the residual keeps exactly what was not sent. `residual' = acc - sent`
  is computed as `acc` with the sent entries set to zero, so
  `residual' + sent == acc` bit for bit.
* Leaves sharded over mesh axes beyond the data axes (tensor parallelism, S pieces,
  `gradcomm._shards`): k and every size test are the whole leaf's. `topk_over_shards`
  finds the whole leaf's top k: each piece's own top min(k, piece) candidates are
  gathered over the shard axes and exactly k of them kept. Ties at the threshold go to
  lower positions in the whole leaf's row-major order where the caller gives each
  element's place in it (`order=`, from `_shards.global_index`: the methods do where
  they are given the params' `PartitionSpec`s), so the entries are the whole leaf's in
  every layout; else in shard-major order (piece s's element j is `s * piece + j`), the
  row-major order only where the leaf is split along its leading dimension, so a leaf
  split along another one may send other tied entries. `sum_sparse(..., shards=)` and
  `sum_sparse_over_shards` then exchange it at fixed capacity: piece s sends slice s of
  the k pairs (ceil(k / S)) over the data axes, the pieces pool what they received over
  the shard axes, and each decodes its own entries in data-device order. Over the data
  axes that is 1/S of the whole leaf's bytes; over the shard axes each device sends
  (S - 1) min(k, piece) candidate pairs and (S - 1) N ceil(k / S) pooled ones. The bits
  are those of the whole leaf's exchange, and each piece's residual keeps exactly what
  it did not send.
* FSDP (ZeRO-3: a leaf split along its leading dimension over the data axes themselves,
  `sum_sparse(..., scatter=)`, `sum_scattered`): each device selects from its whole
  gradient as without FSDP (the same k, pairs and residual; the residual is whole-sized
  and per device, `zero_residuals`) and keeps only its shard of the sum, the same bits as
  the slice of the whole sum. The pairs go in the same fixed-capacity all-gather, each
  device decoding its own shard only: (N - 1) k pairs per device, not the (N - 1) / N k
  of a reduce-scatter of the compressed vector. No fixed-capacity exact exchange sends
  fewer: a device's k pairs may all fall in one shard, and the sum over one shard may
  need every other device's k pairs (disjoint indices), so each device must be able to
  receive (N - 1) k pairs, whatever its shard; as every message is sized in advance,
  it receives that many on every step, which is the all-gather. (Per-destination buffers
  of capacity about k / N reach the target only where a step's pairs spread evenly
  enough, with a fallback on the steps where they do not: a data-dependent choice of
  message, which gradcomm does not make.) What does reach it is choosing each shard's
  entries on their own (`fsdp_topk="per_shard"`, `topk_per_shard`): then device j is
  owed exactly c pairs by every other device, and one `all_to_all` sends them, (N - 1) c
  pairs per device, (N - 1) / N of the leaf's k. Where the pairs' all-gather would cost more
  than a dense reduce-scatter of the leaf, (N - 1) / N of its bytes (density above about
  1 / (2N) in float32), the dense sent vectors go in an `all_to_all` of their rows,
  summed in device order (the decode's bits); the leaves `sparse_bytes_exceed_dense`
  sends dense go in a `lax.psum_scatter`, half the all-reduce.

The decode sums, index by index, the values of the devices that sent it in device order,
`((0 + v_0) + v_1) + ...`: one scatter-add per device, in one loop over the devices for all
the leaves of a dtype (each leaf's indices moved to its place in their concatenation). Each
device's indices are distinct, so no scatter adds twice into one place and the order of a
scatter's own updates cannot matter: the same bits on every device and every run, on every
backend, duplicates across devices included. The exact alternatives with a fixed number of
operations whatever N (a scatter-max with a grid of values, a stable sort by index) were
built and measured with the same bits: `gradcomm.sparse._decode` gives their times against
the loop's, whose work, N k updates, is what the exchange must do anyway.
"""

from __future__ import annotations

# Where things live: selection in `_topk`; the pairs' wire and decode (whole leaves) in
# `_decode`; `sum_sparse` and its forms in `_exchange`; leaves sharded over other mesh axes
# in `_sharded`; FSDP's helpers and per-shard picks in `_fsdp`; error feedback in
# `_feedback`. The names in `__all__` are this module's API; `FSDP_TOPKS` and
# `check_fsdp_topk` serve gradcomm.lags and gradcomm.dropping, `_sum_in_device_order`
# experiments/benchmarks/bench_decode.py.
from gradcomm.sparse._decode import _sum_in_device_order as _sum_in_device_order
from gradcomm.sparse._decode import densify, segment, sparse_bytes_exceed_dense
from gradcomm.sparse._exchange import (
    collectives,
    sum_pairs,
    sum_scattered,
    sum_sparse,
    sum_sparse_segments,
)
from gradcomm.sparse._feedback import (
    accumulate,
    as_residual,
    check_whole_residual,
    unsent,
    zero_residuals,
)
from gradcomm.sparse._fsdp import FSDP_TOPKS as FSDP_TOPKS
from gradcomm.sparse._fsdp import (
    FsdpTopK,
    PerShardTopK,
    check_fsdp_axes,
    fsdp_leaves,
    own_shard,
    reduce_scatter_dense,
    scatter_bytes_exceed_dense,
    shard_index,
    topk_per_shard,
)
from gradcomm.sparse._fsdp import check_fsdp_topk as check_fsdp_topk
from gradcomm.sparse._sharded import ShardedTopK, sum_sparse_over_shards, topk_over_shards
from gradcomm.sparse._topk import (
    SELECTORS,
    Selector,
    check_density,
    check_selector,
    kth_largest,
    magnitude_bits,
    num_kept,
    topk,
)

__all__ = [
    "SELECTORS",
    "FsdpTopK",
    "PerShardTopK",
    "Selector",
    "ShardedTopK",
    "accumulate",
    "as_residual",
    "check_density",
    "check_fsdp_axes",
    "check_selector",
    "check_whole_residual",
    "collectives",
    "densify",
    "fsdp_leaves",
    "kth_largest",
    "magnitude_bits",
    "num_kept",
    "own_shard",
    "reduce_scatter_dense",
    "scatter_bytes_exceed_dense",
    "segment",
    "shard_index",
    "sparse_bytes_exceed_dense",
    "sum_pairs",
    "sum_scattered",
    "sum_sparse",
    "sum_sparse_over_shards",
    "sum_sparse_segments",
    "topk",
    "topk_over_shards",
    "topk_per_shard",
    "unsent",
    "zero_residuals",
]
