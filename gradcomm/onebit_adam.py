"""1-bit Adam: Adam whose momentum travels as signs after a warm-up with a frozen variance.

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang and He, "1-bit Adam: Communication
Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021, Algorithm 1.

For the first `warmup_steps` steps it is Adam on the gradient averaged by an all-reduce.
Then the variance is frozen (the paper's observation: it changes little after a warm-up,
so Adam becomes a linear, preconditioned momentum SGD), and each step averages the
momentum instead of the gradient, compressed to one bit an entry:

    m_i = b1 m + (1 - b1) g_i                 (each device, its own gradient)
    m = compressed_mean(m_i)                  (the same on every device)
    x = x - lr m / (sqrt(v) + eps)

The compressed mean is a reduce-scatter and an all-gather of signs with error feedback on
both sides (`gradcomm._compressed`): each device sends the signs of `m_i + e_i` with one
scale per tensor, its L2 norm over the square root of its size, and keeps the error
`e_i`; the device that owns a slice averages what it receives, adds its own error, and
sends the signs of that with one scale per slice, keeping the new error. Zero goes as +1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomm import _axes, _checks, _compressed, _packing, _transform, perfmodel, registry, wire


class OnebitAdamState(NamedTuple):
    """State of `onebit_adam`.

    Attributes:
      count: the number of steps taken.
      mu: the momentum (float32), the same on every device.
      nu: the variance (float32), the same on every device; frozen after the warm-up.
      errors: the error feedback memory, per device, float32, shaped like the params:
        what this device's encoding lost (`errors.worker`) and what the encoding of the
        mean slices it owns lost (`errors.server`, zeros elsewhere).
    """

    count: jax.Array
    mu: Any
    nu: Any
    errors: _compressed.Errors


def _encode_signs(
    rows: Sequence[jax.Array], leg: _compressed.Leg, counts: Sequence[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Rows to sign bits, eight to a byte, and a scale per tensor (the worker's) or per
    slice (the server's): the L2 norm over the square root of the entries (not padding)."""
    sums = [jnp.sum(r * r, axis=-1) for r in rows]
    if leg == "worker":
        rms = [
            jnp.sqrt(jnp.sum(s) / jnp.maximum(jnp.sum(c), 1))
            for s, c in zip(sums, counts, strict=True)
        ]
        scales = jnp.broadcast_to(jnp.stack(rms), (*rows[0].shape[:-1], len(rows)))
    else:
        rms = [jnp.sqrt(s / jnp.maximum(c, 1)) for s, c in zip(sums, counts, strict=True)]
        scales = jnp.stack(rms, axis=-1)
    bits = jnp.concatenate([r >= 0 for r in rows], axis=-1)  # sign(0) goes as +1
    return _packing.pack(bits.reshape(*bits.shape[:-1], 8, -1), 2, jnp.uint8), scales


def _decode_signs(words: jax.Array, scales: jax.Array, widths: Sequence[int]) -> list[jax.Array]:
    bits = _packing.unpack(words, 2).reshape(*words.shape[:-1], -1)
    signs = jnp.where(bits != 0, 1.0, -1.0).astype(jnp.float32)
    return [
        signs[..., a:b] * scales[..., i, None]
        for i, (a, b) in enumerate(_compressed.bounds(widths))
    ]


SIGNS = _compressed.Codec(_encode_signs, _decode_signs, multiple=8)
_SPLIT_FIX = (
    "Its scales are per tensor (each device's) and per slice of the flattened tensor (each "
    "server's). Keep the leaves it steps replicated over the model axes (split only "
    "activations), or use optax.adam with gradcomm.allreduce or gradcomm.low_precision, "
    "which give each piece the whole tensor's result"
)


def onebit_adam(
    axis_name: _axes.AxisName = "data",
    learning_rate: optax.ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    warmup_steps: int = 100,
    bias_correction: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """1-bit Adam (Tang et al. 2021, Algorithm 1): it replaces Adam, and averages for you.

    Give it each device's own gradients; it returns the update, the same on every
    device. Steps 1 to `warmup_steps` are Adam on the all-reduced gradient; after them
    the variance is frozen and the momentum is averaged in one bit an entry, with error
    feedback on both sides of a reduce-scatter and an all-gather (module docstring).

        step = parallel.train_step(loss, onebit_adam("data", 1e-3), mesh)

    Args:
      axis_name: the mesh axis (or tuple of axes) to average over.
      learning_rate: the step size, a float (or a float scalar array, as
        `optax.inject_hyperparams` passes it) or an optax schedule of the step count.
      b1: the momentum's decay.
      b2: the variance's decay (during the warm-up).
      eps: added to the square root of the variance.
      weight_decay: decoupled weight decay (as `optax.adamw`), times the learning rate;
        needs the params.
      warmup_steps: the steps (at least 1) of plain Adam before the variance freezes (DeepSpeed
        advises 15-25% of the run; the paper's BERT-Large pre-training uses 23k of 152k).
      bias_correction: divide the momentum and the variance by Adam's `1 - b^t` (the
        variance's `t` stops at the warm-up's end), so that the warm-up is
        `optax.adam`'s (or `optax.adamw`'s) step on the mean gradient. DeepSpeed's
        implementation corrects neither (False).

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is an `OnebitAdamState`;
      `parallel.train_step` keeps its error feedback per device, the rest replicated.

    Raises:
      ValueError: at construction for a malformed option; at trace time for gradients
        that are not floating point, for weight decay without params, and for a leaf
        split over mesh axes besides `axis_name` (tensor parallelism): its scales need
        the whole tensor, which no device holds there.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradcomm.onebit_adam import onebit_adam
      >>> tx = onebit_adam("data", learning_rate=0.1, warmup_steps=1)
      >>> grads = jnp.array([[1.0, -2.0, 3.0, 0.5], [3.0, -2.0, -1.0, 0.5]])  # per device
      >>> def two_steps(g):
      ...     state = tx.init(g)
      ...     first, state = tx.update(g, state)  # Adam on the mean gradient [2, -2, 1, .5]
      ...     second, state = tx.update(g, state)  # the momentum as signs
      ...     return first, second
      >>> first, second = jax.jit(jax.vmap(two_steps, axis_name="data"))(grads)
      >>> first[0]  # Adam's first step: -lr sign(mean gradient), up to rounding
      Array([-0.09999934,  0.09999934, -0.09999934, -0.09999934], dtype=float32)
      >>> second  # the same on both devices: the momentum's signs, one scale per tensor
      Array([[-0.07060531,  0.07060531, -0.14121062, -0.28242123],
             [-0.07060531,  0.07060531, -0.14121062, -0.28242123]], dtype=float32)

    References:
      Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
      Convergence Speed", ICML 2021, arXiv 2102.02888: Algorithm 1 (warm-up, frozen
      variance, error-compensated compression on workers and servers); DeepSpeed's
      `OnebitAdam` (the scale: a tensor's L2 norm over the square root of its size).
    """
    _axes.check_axis_name(axis_name)
    _checks.check_int(warmup_steps, "warmup_steps", minimum=1)
    for name, value, low, high in [("b1", b1, 0, 1), ("b2", b2, 0, 1)]:
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value < high:
            raise ValueError(f"{name} must be a float in [{low}, {high}), got {value!r}")
    for name, value in [("eps", eps), ("weight_decay", weight_decay)]:
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{name} must be a float >= 0, got {value!r}")
    scalar = (  # a float array of rank 0: optax.inject_hyperparams passes a traced one
        isinstance(learning_rate, jax.Array)
        and not learning_rate.shape
        and jnp.issubdtype(learning_rate.dtype, jnp.floating)
    )
    if not (callable(learning_rate) or scalar) and (
        isinstance(learning_rate, bool) or not isinstance(learning_rate, int | float)
    ):
        raise ValueError(
            f"learning_rate must be a float or an optax schedule, got {learning_rate!r}"
        )

    def init(params: Any) -> OnebitAdamState:
        _checks.check_float_leaves(params, "onebit_adam")
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
        # Per device: typed as varying where init runs inside the map (a scan's carry).
        errors = jax.tree.map(lambda e: _axes.vary(e, axis_name), _compressed.Errors(zeros, zeros))
        return OnebitAdamState(_transform.zero_count(), zeros, zeros, errors)

    @wire.branch("warm-up all-reduce", first=warmup_steps)
    def warm(operands: tuple[Any, ...]) -> tuple[Any, ...]:
        grads, mu, nu, errors = operands
        g = jax.tree.map(lambda x: lax.pmean(x.astype(jnp.float32), axis_name), grads)
        mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, mu, g)
        nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, nu, g)
        return mu, nu, errors

    @wire.branch("1-bit momentum")
    def compressed(operands: tuple[Any, ...]) -> tuple[Any, ...]:
        grads, mu, nu, errors = operands
        local = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x.astype(jnp.float32), mu, grads)
        leaves, treedef = jax.tree.flatten(local)
        flat = _compressed.Errors(*(treedef.flatten_up_to(e) for e in errors))
        means, flat = _compressed.compressed_mean(
            leaves, axis_name, SIGNS, flat, who="onebit_adam", fix=_SPLIT_FIX
        )
        errors = _compressed.Errors(*(treedef.unflatten(e) for e in flat))
        return treedef.unflatten(means), nu, errors

    def update(
        updates: Any, state: OnebitAdamState, params: Any = None, **extra: Any
    ) -> tuple[Any, OnebitAdamState]:
        del extra
        _checks.check_float_leaves(updates, "onebit_adam")
        if weight_decay and params is None:
            raise ValueError(
                "onebit_adam with weight_decay needs the params: tx.update(grads, state, params)"
            )
        _axes.axis_size(axis_name)  # raises, naming the bound axes, where it is not bound
        errors = jax.tree.map(lambda e: _axes.vary(e, axis_name), state.errors)
        operands = (updates, state.mu, state.nu, errors)
        mu, nu, errors = lax.cond(state.count < warmup_steps, warm, compressed, operands)
        count = optax.safe_increment(state.count)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        if bias_correction:
            m_hat = optax.tree.bias_correction(mu, b1, count)
            v_hat = optax.tree.bias_correction(nu, b2, jnp.minimum(count, warmup_steps))
        else:
            m_hat, v_hat = mu, nu
        step = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), m_hat, v_hat)
        if weight_decay:
            step = jax.tree.map(lambda s, p: s + weight_decay * p, step, params)
        out = jax.tree.map(lambda s, g: (-lr * s).astype(g.dtype), step, updates)
        return out, OnebitAdamState(count, mu, nu, errors)

    return optax.GradientTransformationExtraArgs(init, update)


def _pattern(options: Mapping[str, Any], s: perfmodel.Setting) -> list[perfmodel.Collective]:
    """After the warm-up: an all-to-all and an all-gather of one bit an entry (the scales,
    a float32 per leaf and device, aside)."""
    return [perfmodel.Collective(k, s.nodes, s.params / 8) for k in ("alltoall", "allgather")]


registry.register(registry.Method(
    onebit_adam, "optimizer", title="1-bit Adam", paper="Tang et al., ICML 2021",
    page="onebit_adam", collectives=_pattern,
))  # fmt: skip
