"""PowerSGD: rank-r gradient compression by one step of power iteration, with error feedback.

Vogels, Karimireddy & Jaggi, NeurIPS 2019. Each device views a leaf as an m x n matrix
(`matrix_shape`), adds its residual, and the devices agree on a rank-r approximation of the
mean of their matrices by one step of subspace iteration warm-started from the previous
step's Q (Algorithm 1), each device keeping what the approximation missed (Algorithm 2):

    M = g + e;   P = orthogonalize(mean_devices(M Q));   Q' = mean_devices(M^T P);
    update = P Q'^T;   e' = M - P Q'^T.

Only P (m x r) and Q' (n x r) cross the wire: two all-reduces of r (m + n) numbers instead
of one of m n. All P's go in one `lax.pmean` with the leaves sent dense, all Q's in a
second one (XLA may merge or regroup those all-reduces; the bytes stay the same).
Numerics (documented on `powersgd`): products and factors in float32 (float64 for float64
leaves), at `Precision.HIGHEST`; Q's columns are scaled by exact powers of two before
`M Q`, and every column by its largest entry before its norm, so gradients near 1e-30 or
1e30 in float32 neither under- nor overflow; Gram-Schmidt runs twice per column ("twice
is enough"), so P stays orthonormal when M has rank below r.

A leaf sharded over mesh axes other than the data axes (tensor parallelism, `specs=`) is
treated as the whole matrix it is a piece of: where its rows are split, P's rows are split
with them and orthogonalization sums its dot products over the shards; where its columns
are split, `M Q` is summed over the shards and each device computes Q's rows for its own
columns. Q itself stays whole, the same on every device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec

from gradcomm import _axes, _checks, _numeric, _transform, perfmodel, registry, sparse
from gradcomm.powersgd import _split
from gradcomm.powersgd._orthogonalize import HIGHEST, inverse_scales, orthogonalize

__all__ = ["PowerSgdState", "compresses", "matrix_shape", "orthogonalize", "powersgd"]


class PowerSgdState(NamedTuple):
    """State of `powersgd`: Q per compressed leaf, and a residual per leaf.

    Attributes:
      q: a tuple with one `(n, rank)` array per compressed leaf, in the leaves' order, in
        float32 (float64 for float64 params): the previous step's Q, the same on every
        device, from which the next power iteration starts; n is the whole leaf's last
        dimension, also where the leaf is split over a model axis (`powersgd`'s `specs`).
        For params with no leaves at all (`optax.tree_map_params` builds the state from
        such leafless placeholder params, and needs it to be a prefix of the real one) a
        zero scalar stands in.
      residual: the error-feedback memory e, shaped and typed like the params. Leaves sent
        dense keep zeros there (a tree shaped like the params, which
        `optax.tree_map_params` maps, cannot hold None).

    Example:
      >>> import jax.numpy as jnp
      >>> from gradcomm.powersgd import powersgd
      >>> params = {"kernel": jnp.zeros((3, 3, 4, 8)), "bias": jnp.zeros(8)}
      >>> state = powersgd("data", rank=2).init(params)
      >>> [(q.shape, q.dtype.name) for q in state.q]  # the kernel, as a 36 x 8 matrix
      [((8, 2), 'float32')]
      >>> state.residual["bias"].shape
      (8,)
    """

    q: tuple[jax.Array, ...] | jax.Array
    residual: Any


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The matrix PowerSGD sees in a leaf of `shape`: `(prod(shape[:-1]), shape[-1])`.

    A flax `Dense` kernel `(in, out)` stays `(in, out)`; a conv kernel `(H, W, in, out)`
    becomes `(H * W * in, out)`. Vectors and scalars have none (None).

    Example:
      >>> from gradcomm.powersgd import matrix_shape
      >>> matrix_shape((3, 3, 16, 32)), matrix_shape((32,))
      ((144, 32), None)
    """
    if len(shape) < 2:
        return None
    return math.prod(int(d) for d in shape[:-1]), int(shape[-1])


def compresses(shape: Sequence[int], rank: int, min_compression_rate: float) -> bool:
    """Whether `powersgd` compresses a leaf of `shape` (else it sends the leaf dense).

    A leaf is compressed where its matrix view `m x n` (`matrix_shape`) holds
    `rank <= min(m, n)` and its compression rate `m n / (rank (m + n))` exceeds
    `min_compression_rate`, PyTorch's rule in its PowerSGD hook.

    Example:
      >>> from gradcomm.powersgd import compresses
      >>> compresses((12, 8), 2, 2.0), compresses((6, 4), 2, 2.0), compresses((7,), 2, 2.0)
      (True, False, False)
    """
    matrix = matrix_shape(shape)
    if matrix is None:
        return False
    m, n = matrix
    return rank <= min(m, n) and m * n > min_compression_rate * rank * (m + n)


def _check_rate(value: Any) -> None:
    number = isinstance(value, int | float | np.integer | np.floating)
    if isinstance(value, bool) or not number or not value > 0:
        raise ValueError(
            "min_compression_rate must be a positive number (a leaf is compressed where "
            f"m n / (rank (m + n)) exceeds it), got {value!r}"
            + _checks.static_hint(value, "min_compression_rate")
        )


def _initial_q(seed: int, index: int, n: int, rank: int, dtype: np.dtype) -> jax.Array:
    """Leaf `index`'s first Q: standard normal, from the seed and the index alone."""
    key = jax.random.fold_in(jax.random.key(seed), index)
    return jax.random.normal(key, (n, rank), dtype)


def powersgd(
    axis_name: _axes.AxisName = "data",
    rank: int = 2,
    *,
    min_compression_rate: float = 2.0,
    seed: int = 0,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """PowerSGD: the devices' mean gradient as a rank-`rank` approximation, with error feedback.

    Place it before the optimizer, which does Algorithm 2's momentum:
    `optax.chain(gradcomm.powersgd("data", rank=2), optax.sgd(0.1, momentum=0.9))`.
    Every leaf with two or more dimensions is viewed as a matrix `(prod(shape[:-1]),
    shape[-1])` (`matrix_shape`): a flax `Dense` kernel `(in, out)` as itself, a conv
    kernel `(H, W, in, out)` as `(H * W * in, out)`. Per such m x n leaf, on each device
    (Algorithm 1, one step of subspace iteration, and Algorithm 2):

        M = g + e;   P = orthogonalize(pmean(M Q));   Q = pmean(M^T P);
        update = P Q^T (the same bits on every device);   e = M - P Q^T.

    Q starts as a standard normal matrix drawn from `seed` and the leaf's position (the
    same on every device) and is kept in the state: each step warm-starts from the last.
    A leaf is compressed where `rank <= min(m, n)` and its compression rate
    `m n / (rank (m + n))` exceeds `min_compression_rate` (`compresses`; the rate rule
    is PyTorch's PowerSGD hook's); vectors, scalars and the other leaves are
    averaged dense (`lax.pmean`, as `allreduce`), with no residual.

    Communication: the P's of all compressed leaves, with the dense leaves, go in one
    `lax.pmean`, the Q's in a second. Per compressed leaf a ring all-reduce then sends
    `2 (N - 1) / N * rank * (m + n) * itemsize` bytes per device, `itemsize` that of the
    factors: 4 (float32) for float32, bfloat16 and float16 leaves, 8 for float64.

    Numerics: M, P and Q are computed in float32 (float64 for float64 leaves), the
    matrix products at `Precision.HIGHEST`; the update comes back in the leaf's dtype and
    the residual keeps its own, so a jitted step never retraces. `orthogonalize` is
    Gram-Schmidt run twice per column; a column of P that is exactly zero stays zero, so
    zero gradients give zero updates (not NaN), and where a column of the new Q is zero
    the previous Q's column is kept, so that a step of zero gradients does not stall the
    power iteration for good. Q's columns and P's are scaled by exact powers of two
    before products and norms, so float32 gradients as small as 1e-30 or as large as 1e30
    give the same result as unit ones, scaled (residual entries that fall below the
    normal range flush to zero on XLA:CPU). A NaN or infinity in any device's leaf makes
    that leaf's whole update NaN on every device, and its Q and every device's residual
    NaN from then on: guard the step with `gradcomm.apply_if_finite`, which skips it on
    every device and keeps the state.

    Tensor parallelism (`specs`): inside `jax.shard_map` over a mesh such as `('data',
    'model')`, a leaf split over `'model'` is a piece of a larger tensor, and powersgd
    computes what it computes on the whole tensor over `axis_name` alone: the whole shape
    decides `compresses`, Q is the whole `(n, rank)` one (the unsharded leaf's first draw,
    the same on every device), and each device gets its piece of `P Q^T` and keeps its
    piece of the residual. Where the matrix's rows are split (any dimension but the last;
    a middle one splits them into strided subsets, which changes nothing), each device
    holds its rows of P, `orthogonalize` sums its dot products over the split axes, and
    `Q = pmean(psum(M^T P))`. Where its columns (the last dimension) are split, `P =
    pmean(psum(M Q))` over them, each device computes the rows of Q for its columns, and
    an all-gather over the split axes puts the whole Q together. A factor summed over the split
    axes is the same on each of their devices, so each averages only its 1/k of the
    factor's rows over `axis_name` (`psum_scatter` over the split axes, then `pmean`,
    then `all_gather`): per device, a leaf split k ways sends `rank * (m + n) / k`
    numbers over `axis_name`, its share of the unsplit leaf's. Over the model axes: per
    row-split leaf, `5 rank - 2` scalar or `rank`-sized collectives (`orthogonalize`) and
    a reduce-scatter and an all-gather of the `(n, rank)` Q; per column-split one, the
    same of the `(m, rank)` P and an all-gather of the `(n, rank)` Q. The shard axes are
    read from the leaves' types (`shard_map`'s default `check_vma=True`); with
    `check_vma=False` on a mesh with axes beyond `axis_name`, `init` and `update` raise.
    Call `init` inside the same `shard_map` on each device's pieces of the params (the
    specs' axes are then bound, and the whole shapes known), or outside any map on the
    whole params: either gives the whole Q's, and residuals shaped like the params it
    sees (split them like the params when the state enters the map).

    Args:
      axis_name: the mesh axis (or tuple of axes) to average over.
      rank: r, the rank of the approximation: a compressed m x n leaf sends r (m + n)
        numbers instead of m n.
      min_compression_rate: leaves whose compression rate `m n / (rank (m + n))` does
        not exceed it are sent dense (PyTorch's default, 2).
      seed: seed of the first Q.
      specs: None, or a pytree of `PartitionSpec`s shaped like the params: the `in_specs`
        of `shard_map` for them. Needed for leaves of two or more dimensions split over
        mesh axes other than `axis_name`'s (tensor parallelism), where which dimension is
        split decides the algebra; entries naming `axis_name`'s axes are ignored, and a
        None stands for a leaf without one.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `PowerSgdState`.

    Raises:
      ValueError: at construction for a malformed axis name, a rank that is not a
        positive int, a min_compression_rate that is not a positive number, a seed that
        is not an int (these shape the program: with `optax.inject_hyperparams`, pass
        them in `static_args`), or specs holding anything but PartitionSpecs; at trace
        time for an unbound axis, a non-floating leaf, a state built for params of other
        shapes, a leaf of two or more dimensions split over a model axis with no spec in
        `specs` (or one that names other axes than it is split over), or `shard_map` with
        `check_vma=False` on a mesh with axes beyond `axis_name`.

    Example:
      >>> import jax, jax.numpy as jnp, gradcomm
      >>> tx = gradcomm.powersgd("data", rank=1)
      >>> u, v = jnp.arange(1.0, 5.0), jnp.array([1.0, -1.0, 2.0, 0.5, 0.0, 3.0])
      >>> grads = {"w": jnp.stack([jnp.outer(u, v), 3 * jnp.outer(u, v)]),  # one row
      ...          "b": jnp.array([[1.0, 2.0], [3.0, 4.0]])}                # per device
      >>> state = tx.init({"w": jnp.zeros((4, 6)), "b": jnp.zeros(2)})
      >>> [q.shape for q in state.q]  # w: 24 / (1 * (4 + 6)) = 2.4 > 2, compressed
      [(6, 1)]
      >>> out, state = jax.jit(jax.vmap(lambda g: tx.update(g, state), axis_name="data"))(grads)
      >>> out["b"][0]  # a vector: the dense mean
      Array([2., 3.], dtype=float32)
      >>> bool(jnp.allclose(out["w"][0], 2 * jnp.outer(u, v), rtol=1e-5))  # rank 1: exact
      True

    References:
      Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
      Distributed Optimization", NeurIPS 2019: Algorithm 1 (the rank-r compressor, warm
      start) and Algorithm 2 (error feedback; momentum left to the optimizer).
    """
    _axes.check_axis_name(axis_name)
    _checks.check_int(rank, "rank", minimum=1)
    _check_rate(min_compression_rate)
    _checks.check_int(seed, "seed")
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    for spec in jax.tree.leaves(specs, is_leaf=is_spec):
        if not is_spec(spec):
            raise ValueError(
                f"specs must be None or a pytree of PartitionSpecs shaped like the params "
                f"(the in_specs of shard_map), but it holds {spec!r}"
            )

    def compressed_ids(shapes: Sequence[tuple[int, ...]]) -> list[int]:
        return [
            i for i, shape in enumerate(shapes) if compresses(shape, rank, min_compression_rate)
        ]

    def init_fn(params: Any) -> PowerSgdState:
        leaves, names, _ = _checks.named_leaves(params)
        residual = jax.tree.map(jnp.zeros_like, params)
        if not leaves:  # leafless params (optax.tree_map_params' placeholder)
            return PowerSgdState(q=jnp.zeros([], jnp.float32), residual=residual)
        splits = _split.splits(leaves, names, params, specs, axis_name)
        qs = []
        for i in compressed_ids([split.shape for split in splits]):
            _, n = matrix_shape(splits[i].shape)
            dtype = _numeric.compute_dtype(jnp.result_type(leaves[i]))
            qs.append(_initial_q(seed, i, n, rank, dtype))
        return PowerSgdState(q=tuple(qs), residual=residual)

    def check_residuals(leaves: list[jax.Array], state: PowerSgdState) -> None:
        """Raises unless the residuals are shaped like `leaves`."""
        shapes = [tuple(np.shape(x)) for x in leaves]
        residuals = [tuple(np.shape(x)) for x in jax.tree.leaves(state.residual)]
        if residuals != shapes:
            raise ValueError(
                f"powersgd's state was built for other params (residuals shaped "
                f"{residuals}) than these updates (shaped {shapes}): build the state with "
                f"tx.init(params) from params shaped like the updates"
            )

    def check_qs(splits: list[_split.Split], ids: list[int], state: PowerSgdState) -> None:
        """Raises unless the Q's are those of params shaped like the (whole) leaves."""
        shapes = [split.shape for split in splits]
        want = [(matrix_shape(shapes[i])[1], rank) for i in ids]
        standin = not isinstance(state.q, tuple)  # leafless params
        got = None if standin else [tuple(np.shape(x)) for x in state.q]
        if got != want and not (standin and not splits):
            raise ValueError(
                f"powersgd's state was built for other params (Q's {got}) than these "
                f"updates (whole leaves shaped {shapes}, needing Q's {want}): build the "
                f"state with tx.init(params) from params shaped like the updates"
            )

    def step(
        leaves: list[jax.Array], names: list[str], state: PowerSgdState
    ) -> tuple[list[jax.Array], PowerSgdState]:
        check_residuals(leaves, state)
        structure = jax.tree.structure(state.residual)
        tree = jax.tree.unflatten(structure, leaves)
        splits = _split.splits(leaves, names, tree, specs, axis_name)
        ids = compressed_ids([split.shape for split in splits])
        check_qs(splits, ids, state)
        residuals = jax.tree.leaves(state.residual)
        old_qs = state.q if ids else ()  # () for the leafless params' stand-in
        dense_ids = [i for i in range(len(leaves)) if i not in set(ids)]
        ms, ps = [], []
        with jax.named_scope("compress"):
            for i, q in zip(ids, old_qs, strict=True):
                split = splits[i]
                ct = _numeric.compute_dtype(jnp.result_type(leaves[i], residuals[i], q))
                acc = sparse.accumulate(residuals[i].astype(ct), leaves[i].astype(ct))
                ms.append(acc.reshape(matrix_shape(leaves[i].shape)))
                q = q.astype(ct)
                q = q * inverse_scales(q, 0)
                if split.cols:  # the rows of Q for this device's columns
                    n_local = ms[-1].shape[1]
                    q = lax.dynamic_slice_in_dim(q, _split.piece_start(split, n_local), n_local)
                ps.append(_split.sum_part(jnp.matmul(ms[-1], q, precision=HIGHEST), split.cols))
        with jax.named_scope("exchange"):
            means = lax.pmean([leaves[i] for i in dense_ids] + ps, axis_name)
        dense, ps = means[: len(dense_ids)], means[len(dense_ids) :]
        with jax.named_scope("compress"):
            local_qs = []
            for j, (i, m, p) in enumerate(zip(ids, ms, ps, strict=True)):
                p = _split.whole(p, splits[i].cols, m.shape[0])
                ps[j] = p = orthogonalize(p, axes=splits[i].rows)
                local_q = jnp.matmul(m.T, p, precision=HIGHEST)
                local_qs.append(_split.sum_part(local_q, splits[i].rows))
        with jax.named_scope("exchange"):
            new_qs = lax.pmean(local_qs, axis_name)
        new_qs = [
            _split.whole(q, splits[i].rows, m.shape[1])
            for i, m, q in zip(ids, ms, new_qs, strict=True)
        ]
        out, new_residuals, kept_qs = list(leaves), list(residuals), []
        with jax.named_scope("combine"):
            for i, m, p, q, old in zip(ids, ms, ps, new_qs, old_qs, strict=True):
                approx = jnp.matmul(p, q.T, precision=HIGHEST)
                out[i] = approx.astype(leaves[i].dtype).reshape(leaves[i].shape)
                new_residuals[i] = sparse.as_residual(m - approx, residuals[i])
                q = _split.whole(q, splits[i].cols, old.shape[0])  # every device's rows of Q
                # A zero column of Q would stay zero in every later step: keep the old one.
                kept = jnp.where(jnp.any(q != 0, axis=0), q, old.astype(q.dtype))
                kept_qs.append(kept.astype(old.dtype))
            for i, mean in zip(dense_ids, dense, strict=True):
                out[i] = mean
        new_state = PowerSgdState(
            q=tuple(kept_qs) if ids else state.q,
            residual=jax.tree.unflatten(structure, new_residuals),
        )
        return out, new_state

    return _transform.leafwise("powersgd", axis_name, init_fn, step)


def _pattern(options: Mapping[str, Any], s: perfmodel.Setting) -> list[perfmodel.Collective]:
    """Two all-reduces: the P factors with the leaves sent dense, then the Q factors."""
    rank, rate = options["rank"], options["min_compression_rate"]
    side = max(math.isqrt(s.params), 1)
    p = q = dense = 0
    for shape in s.shapes or [(side, side)]:
        matrix = matrix_shape(shape)
        if matrix is not None and compresses(shape, rank, rate):
            p, q = p + rank * matrix[0], q + rank * matrix[1]
        else:
            dense += math.prod(shape)
    return [
        perfmodel.Collective("allreduce", s.nodes, float((p + dense) * s.itemsize)),
        perfmodel.Collective("allreduce", s.nodes, float(q * s.itemsize)),
    ]


registry.register(registry.Method(
    powersgd, "before", title="PowerSGD", paper="Vogels et al., NeurIPS 2019", page="powersgd",
    collectives=_pattern,
))  # fmt: skip
