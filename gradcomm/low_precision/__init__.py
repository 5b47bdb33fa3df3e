"""Low-precision all-reduce: the mean of the updates with 16-bit values on the wire.

PyTorch DDP's `fp16_compress_hook` and `bf16_compress_hook`: each device's update is
rounded to float16 or bfloat16 for the exchange, which halves the bytes of a float32
all-reduce, and the mean comes back in each leaf's own dtype. Two ways to move it:

* **all_to_all** (bfloat16 off GPU). XLA:CPU runs a bfloat16 all-reduce, reduce-scatter,
  all-gather or all-to-all as a float32 one (its optimized HLO converts the operand to
  f32 first), so a cast saves nothing there. The values travel as their bit patterns
  (`uint16`), through collectives that add nothing: every leaf is rounded to bfloat16 and
  laid end to end in one flat buffer, zero-padded to a multiple of N; an `all_to_all`
  hands device j chunk j of every device's buffer (a reduce-scatter by hand); device j
  adds them up in float32, in device order, divides by N and rounds the mean to
  bfloat16; an `all_gather` of those chunks gives every device the whole mean, the same
  bits everywhere. Each collective sends (N - 1) / N of the buffer: 2 (N - 1) / N * 2
  bytes per element in all, half of the float32 ring all-reduce's 2 (N - 1) / N * 4.
* **psum** (float16; bfloat16 on GPU). XLA:CPU keeps a float16 all-reduce in float16 (it
  adds in float16, in device order, the same bits on every device), and NCCL reduces
  float16 and bfloat16 natively, so there the 16-bit values go through one `lax.psum`.
  Each leaf is divided by N first (in float32 at least, then rounded), as PyTorch's
  hook divides before its all-reduce: the sum of the scaled values is the mean, and
  cannot overflow where the mean fits. The GPU branch is chosen at trace time from the
  mesh's platform; it is this same code with bfloat16, and on an H200 it ran as a native
  bfloat16 and float16 all-reduce, exact (gradcomm/perfmodel/kernels_gpu/bench_kernels.md).

`exchange` picks one of them ("all_to_all" or "psum", for either format), one of two
schemes for gloo, or "auto". Both gloo schemes move the psum's scaled 16-bit values as bits
and round each partial sum (two values added in float32) to 16 bits, as a 16-bit ring
all-reduce does:

* **ring**: a reduce-scatter around a one-way ring, N - 1 `ppermute` shifts
  (`gradcomm._collectives.reduce_scatter_ring`), then one `all_gather`; any N.
* **pairwise** (a power-of-two N): recursive halving in two-member reduce-scatters, then
  a gather by recursive doubling.

Over gloo (XLA:CPU in several processes) a float16 all-reduce is slow to add (56 ms for
4.2M values between two processes against 33 ms in float32 and 18 ms in uint16, one
compute thread each; docs/bench/peer/patterns.md), and a `ppermute` in which two processes
send to each other, like an all-to-all's swaps, runs at half the link's speed. The ring
has no such swap for N > 2; at N = 2 its one shift is a swap, which the pairwise scheme
runs as a two-member reduce-scatter at full speed. So "auto" on CPU devices in several
processes is "pairwise" at N = 2 and "ring" above it, and elsewhere the above: the all_to_all
for bfloat16 off GPU, else the psum. Over 100 Mbit links (a 4.2M-parameter MLP, float16),
the ring's step took 0.52x the float32 all-reduce's at N = 4, against the pairwise
scheme's 0.58x and the psum's 0.57x; at N = 8, 0.61x against 0.81x and 0.83x
(docs/bench/peer/network.md, docs/bench/low_precision/network.md).

Overflow cannot raise under `jit`, so it is reported in the state: a step overflowed when
the mean is not finite although every device's inputs were (float16's largest value is
65504; bfloat16's range is float32's, so there only a sum or a rounding near 3.4e38
overflows, where the float32 `lax.pmean` would overflow too). Inputs that were not finite
on some device give a non-finite mean but no overflow. The flag travels with the values:
in the all_to_all scheme each device appends one word to the chunk it gathers (its inputs not
finite: bit 0; its chunk of the mean not finite: bit 1), 2 (N - 1) bytes per step; in the
psum one more 16-bit element counts the devices whose inputs were not finite, 4 (N - 1) /
N bytes per step. No collective is added.

On a mesh with axes besides `axis_name` (tensor parallelism: inside `jax.shard_map` over
`('data', 'model')`, a leaf split over `'model'` beside one replicated over it), each
device exchanges its piece of a sharded leaf with the devices of the data axes that hold
the same piece. The leaves go in one buffer per set of shard axes (the axes besides
`axis_name` they vary over, `gradcomm._shards`): fused, a replicated leaf would come out
typed as varying over the model axis. Each buffer's two flags are then reduced over its
shard axes (one `pmax` of two words; on a mesh of data axes only, none), so that the
overflow flag and count stay the same on every device. The all_to_all, psum and pairwise
schemes add each element in an order that does not depend on where it lies in the
buffer, so a piece's mean is the whole tensor's, bit for bit. The ring starts each
element's sum on a device set by its place in the buffer (as a leaf's bits there
depend on the leaves before it): a piece's mean is the ring's sum of it, within the same
bound, not always the same bits as the whole tensor's.

With FSDP (ZeRO-3: `specs` splits a leaf's leading dimension over the data axes,
`P("data", ...)`, as `gradcomm.parallel.shard_params` places it), the update of such a
leaf comes in whole and each device keeps only its shard of the mean: the exchange's
reduce-scatter without its gather. These leaves are laid out as `(N, m)`, row j every
such leaf's shard j (`gradcomm._shards.to_rows`), rounded to 16 bits as above, and moved
by the same scheme: the `all_to_all` and float32 sum in device order, a
`lax.psum_scatter` in `dtype` for the psum, `reduce_scatter_ring` or
`reduce_scatter_pairwise`. Each device sends (N - 1) / N of their 16-bit bytes, half of
the 16-bit all-reduce's and of `gradcomm.allreduce(specs=...)`'s float32 reduce-scatter
(XLA:CPU runs a bfloat16 reduce-scatter in float32, as it does a psum: on CPU, bfloat16
uses the all_to_all). A shard's values are the same bits as the slice of the whole mean for
the all_to_all, psum and pairwise schemes; the ring's sum of an element starts on the device
after its row, elsewhere than in the fused buffer, so there a shard is within the
ring's bound of the mean, not always its bits (a row being a shard, a piece of it split
over a model axis is the whole shard's, for every scheme). Its flags are known on one device only,
so one more collective, a `lax.pmax` of two int32 words over the data (and shard) axes,
keeps the overflow flag and count the same on every device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gradcomm import _axes, _checks, _shards, _transform, perfmodel, registry, sparse
from gradcomm.low_precision import _exchanges

DTYPES: tuple[np.dtype, ...] = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
Exchange = Literal["auto", "all_to_all", "pairwise", "psum", "ring"]
EXCHANGES: tuple[str, ...] = get_args(Exchange)
# `exchange="bits"` was renamed (ARCHITECTURE.md, "One vocabulary"): it raises with the new name.
_RENAMED = {"bits": "all_to_all"}


class LowPrecisionState(NamedTuple):
    """State of `low_precision`: whether the mean overflowed, the same on every device.

    Attributes:
      overflow: bool scalar: the last update's mean was not finite although every
        device's inputs were (the 16-bit exchange overflowed).
      overflow_count: int32 scalar: how many updates so far overflowed.
    """

    overflow: jax.Array
    overflow_count: jax.Array


def check_dtype(dtype: Any) -> np.dtype:
    """The 16-bit format, validated at construction: bfloat16 or float16."""
    try:
        fmt = None if isinstance(dtype, jax.Array | np.ndarray) else np.dtype(dtype)
    except TypeError:
        fmt = None
    if fmt not in DTYPES:
        raise ValueError(
            f"dtype must be jnp.bfloat16 or jnp.float16 (the 16-bit formats on the wire), "
            f"got {dtype!r}" + _checks.static_hint(dtype, "dtype")
        )
    return fmt


def low_precision(
    axis_name: _axes.AxisName = "data",
    dtype: Any = jnp.bfloat16,
    exchange: Exchange = "auto",
    *,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Replaces each update by its mean over the devices, sent as 16-bit floats.

    The mean of the module docstring: bfloat16 values as bits through an `all_to_all` and
    an `all_gather` (half the bytes of a float32 all-reduce on every backend), float16
    values through a `lax.psum` in float16 after dividing by N, and on CPU devices in
    several processes (gloo) either format divided by N and summed around a one-way ring
    (or, at N = 2, in a two-member reduce-scatter), then gathered. The result is in each
    leaf's own dtype and is the same bits on every device; it is the mean rounded to
    `dtype` (so on one device, the update rounded to `dtype`). Like `gradcomm.allreduce`,
    place it before the optimizer to average gradients, or after it to average updates;
    `gradcomm.allreduce(axis_name, dtype=...)` is this transformation. Leaves sharded over
    mesh axes besides `axis_name` (a model axis) keep their types, and the state stays
    replicated over every axis (see the module docstring). With FSDP (`specs`), each
    device receives only its shard of the 16-bit mean of a split leaf: the exchange's
    reduce-scatter alone, (N - 1) / N of the leaf's 16-bit bytes per device.

    Args:
      axis_name: the mesh axis, or tuple of axes, to average over.
      dtype: the format on the wire, `jnp.bfloat16` (8 significant bits, float32's range)
        or `jnp.float16` (11 significant bits, largest value 65504).
      exchange: "all_to_all" (an `all_to_all` of the 16-bit patterns, float32 sums in device
        order, an `all_gather`; with float16, each device's values must fit float16),
        "psum" (one `lax.psum` in `dtype` of the values divided by N; XLA:CPU runs a
        bfloat16 one in float32, which saves no bytes), "ring" (the values divided by
        N and rounded as in the psum, summed around a one-way ring of `ppermute`s, each
        partial sum rounded to `dtype`, then gathered: a ring all-reduce's bytes),
        "pairwise" (a power-of-two N, the same values summed by recursive halving in
        two-member reduce-scatters and gathered by doubling) or "auto" (on CPU devices
        in several processes, where gloo carries the collectives: "pairwise" at N = 2,
        "ring" above; elsewhere "all_to_all" for bfloat16 off GPU and the psum
        otherwise).
      specs: None, or the params' `PartitionSpec`s (a pytree like them). A leaf whose spec
        splits its leading dimension over `axis_name`, `P("data", ...)`, is FSDP-sharded:
        its update comes in whole (the gradient of the gathered param) and leaves as this
        device's shard of the mean (its leading dimension divided by N), through the
        exchange's reduce-scatter without the gather.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `LowPrecisionState`
      (the overflow flag and count).

    Raises:
      ValueError: at construction for a malformed axis name, a `dtype` other than
        bfloat16 or float16 or an unknown `exchange`, and at trace time for an axis that
        is not bound, a leaf that is not floating point, `specs` not shaped like the
        updates, or an FSDP leaf whose leading dimension N does not divide.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm.low_precision import low_precision
      >>> tx = low_precision("data")  # bfloat16: 8 significant bits
      >>> grads = jnp.array([[1.0, 3.14159], [2.0, 3.14159]])  # one row per device
      >>> jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data"))(grads)
      Array([[1.5     , 3.140625],
             [1.5     , 3.140625]], dtype=float32)

      float16 divides by N before the sum: 6e4 on two devices fits (float16's largest
      value is 65504), a mean of 1.2e5 does not, and the state says so.

      >>> tx = low_precision("data", jnp.float16)
      >>> def step(g):
      ...     mean, state = tx.update(g, tx.init(g))
      ...     return mean[0], state.overflow
      >>> mapped = jax.jit(jax.vmap(step, axis_name="data"))  # one compilation, two calls
      >>> mapped(jnp.array([[6e4], [6e4]]))
      (Array([60000., 60000.], dtype=float32), Array([False, False], dtype=bool))
      >>> mapped(jnp.array([[1.2e5], [1.2e5]]))
      (Array([inf, inf], dtype=float32), Array([ True,  True], dtype=bool))

      With FSDP, device j keeps row j of the mean of a leaf split over "data":

      >>> from jax.sharding import PartitionSpec as P
      >>> tx = low_precision("data", specs=P("data"))
      >>> grads = jnp.array([[1.0, 3.14159], [2.0, 3.14159]])  # whole, one row per device
      >>> jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data"))(grads)
      Array([[1.5     ],
             [3.140625]], dtype=float32)

    References:
      PyTorch, `torch.distributed.algorithms.ddp_comm_hooks.default_hooks`:
      `fp16_compress_hook` and `bf16_compress_hook` (DDP communication hooks).
    """
    _axes.check_axis_name(axis_name)
    dtype = check_dtype(dtype)
    if isinstance(exchange, str) and exchange in _RENAMED:
        raise ValueError(f"exchange={exchange!r} is now exchange={_RENAMED[exchange]!r}")
    _axes.check_exchange(exchange, EXCHANGES)

    def init_fn(params: Any) -> LowPrecisionState:
        del params
        return LowPrecisionState(overflow=jnp.array(False), overflow_count=_transform.zero_count())

    def step(updates: Any, state: LowPrecisionState, params: Any) -> tuple[Any, LowPrecisionState]:
        del params
        n = _axes.axis_size(axis_name)
        leaves, names, treedef = _checks.named_leaves(updates)
        split = sparse.fsdp_leaves(specs, updates, names, axis_name, "low_precision")
        out = list(leaves)
        live = []
        for i, leaf in enumerate(leaves):
            if jnp.size(leaf):
                live.append(i)
            elif split[i]:  # an empty leaf's shard is empty too
                out[i] = _empty_shard(jnp.asarray(leaf), n)
        if not live:
            return jax.tree.unflatten(treedef, out), LowPrecisionState(
                jnp.array(False), state.overflow_count
            )
        how = _resolve(exchange, axis_name, n, dtype)
        flags = []  # per buffer: (its mean is not finite, some inputs were not finite)
        whole = [(i, jnp.asarray(leaves[i])) for i in live if not split[i]]
        if whole:
            groups = _shard_groups(whole, axis_name)
            grouped = [[x for _, x in members] for _, members in groups]
            if how == "psum":  # one variadic all-reduce for every buffer
                summed = _exchanges.psum_mean(grouped, axis_name, n, dtype)
                results = list(zip(*summed, strict=True))
            else:
                results = [
                    _exchanges.bits_mean(xs, _exchanges.all_finite(xs), axis_name, n, dtype, how)
                    for xs in grouped
                ]
            for (axes, members), (means, flag) in zip(groups, results, strict=True):
                for (i, x), m in zip(members, means, strict=True):
                    out[i] = m.reshape(x.shape).astype(x.dtype)
                # A sharded leaf's pieces on the devices of its shard axes make one tensor:
                # the flags of the whole tensor, the same on each of them (the state is
                # replicated).
                flags.append(lax.pmax(flag, axes) if axes else flag)
        scattered = [(i, jnp.asarray(leaves[i])) for i in live if split[i]]
        if scattered:
            local, shard_axes = [], set()
            for axes, members in _shard_groups(scattered, axis_name):
                xs = [x for _, x in members]
                shards, flag = _exchanges.scatter_mean(xs, axis_name, n, dtype, how)
                for (i, x), shard in zip(members, shards, strict=True):
                    out[i] = shard.astype(x.dtype)
                local.append(flag)
                shard_axes.update(axes)
            # Each device knows its shards' flags only: one pmax makes them everyone's.
            others = tuple(a for a in _shards.other_manual_axes(axis_name) if a in shard_axes)
            over = (*_axes.axis_names(axis_name), *others)
            stacked = jnp.stack([_axes.vary(f, over) for f in local])
            flags.append(lax.pmax(jnp.max(stacked, axis=0), over))
        mean_nonfinite = jnp.any(jnp.stack([f[0] for f in flags]))
        overflow = mean_nonfinite & ~jnp.any(jnp.stack([f[1] for f in flags]))
        count = jnp.where(
            overflow, optax.safe_increment(state.overflow_count), state.overflow_count
        )
        return jax.tree.unflatten(treedef, out), LowPrecisionState(overflow, count)

    return _transform.transformation("low_precision", axis_name, init_fn, step)


def _resolve(
    exchange: Exchange, axis_name: _axes.AxisName, n: int, dtype: np.dtype
) -> Literal["all_to_all", "pairwise", "psum", "ring"]:
    """The exchange "auto" stands for here (at trace time); "pairwise" checks its axes."""
    if exchange == "pairwise":
        _axes.use_pairwise(axis_name, exchange, "low_precision")  # raises unless a power of two
    if exchange != "auto":
        return exchange
    if _axes.on_gloo(axis_name):
        return "pairwise" if n == 2 else "ring"
    native = dtype == np.dtype(jnp.float16) or _axes._platform() == "gpu"
    return "psum" if native else "all_to_all"


def _shard_groups(
    leaves: list[tuple[int, jax.Array]], axis_name: _axes.AxisName
) -> list[tuple[tuple[str, ...], list[tuple[int, jax.Array]]]]:
    """The (index, leaf) pairs by their shard axes, in first-seen order: one buffer each.

    A leaf's shard axes are the mesh axes besides `axis_name` that it varies over
    (`gradcomm._shards`). The leaves travel in the 16-bit `dtype` whatever their own, so dtype does
    not split them (unlike `_flat.dtype_groups`); the varying axes do: fused with a leaf
    sharded over a model axis, a leaf replicated over it would come out typed as varying
    over it. Where `shard_map` runs with `check_vma=False` over axes besides `axis_name`,
    the types say nothing: one buffer, its flags reduced over all those axes.
    """
    others = _shards.other_manual_axes(axis_name)
    checked = all(name in _axes.varying_axes(lax.axis_index(name)) for name in others)
    groups: dict[tuple[str, ...], list[tuple[int, jax.Array]]] = {}
    for i, leaf in leaves:
        varying = _axes.varying_axes(leaf)
        axes = tuple(a for a in others if a in varying) if checked else others
        groups.setdefault(axes, []).append((i, leaf))
    return list(groups.items())


def _empty_shard(leaf: jax.Array, n: int) -> jax.Array:
    """The (empty) shard of an empty FSDP leaf; raises where n does not divide its rows."""
    if not leaf.ndim or leaf.shape[0] % n:
        _shards.to_rows([leaf], n, "low_precision")  # raises its error
    return leaf[: leaf.shape[0] // n]


def _pattern(options: Mapping[str, Any], s: perfmodel.Setting) -> list[perfmodel.Collective]:
    """2 bytes per parameter, moved as `exchange` moves them ("auto" as on the backend)."""
    n, params, coll = s.nodes, s.params, perfmodel.Collective
    exchange = options["exchange"]
    if exchange == "auto" and s.gloo:
        exchange = "pairwise" if n == 2 else "ring"
    if exchange == "ring":  # n - 1 one-way shifts of 1/n (a swap at n = 2), an all-gather
        shift = coll("swap" if n == 2 else "permute", n, 2.0 * params / n)
        return [shift] * (n - 1) + [coll("allgather", n, 2.0 * params)]
    if exchange == "pairwise":  # two-member reduce-scatters on every backend
        levels = max(n.bit_length() - 1, 1)  # recursive halving: half, a quarter, ...
        sent = [params / 2**b for b in range(levels)]  # bytes: 2 params / 2^(b + 1)
        sent += [2.0 * params * 2**b / n for b in range(levels)]  # the doubling gather
        return [coll("reduce_scatter", 2, 2 * x) for x in sent]  # 2 members: x of 2 x
    bf16 = np.dtype(options["dtype"]).name == "bfloat16"
    if exchange == "all_to_all" or (exchange == "auto" and bf16 and not s.native_bf16):
        return [coll("alltoall", n, 2.0 * params), coll("allgather", n, 2.0 * params)]
    return [coll("allreduce", n, 2.0 * params)]


registry.register(
    registry.Method(
        low_precision,
        "before",
        title="16-bit all-reduce",
        paper="PyTorch DDP's fp16 and bf16 hooks",
        page="low_precision",
        collectives=_pattern,
    )
)
