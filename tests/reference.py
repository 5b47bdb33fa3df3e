"""NumPy float64 references, written straight from the papers' equations."""

from __future__ import annotations

import numpy as np


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Eq. 8 of the Adasum paper on one leaf; a zero operand gets coefficient 1."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ab, aa, bb = np.vdot(a, b), np.vdot(a, a), np.vdot(b, b)
    ca = 1 - ab / (2 * aa) if aa > 0 else 1.0
    cb = 1 - ab / (2 * bb) if bb > 0 else 1.0
    return ca * a + cb * b


def adasum_tree(values: list[np.ndarray]) -> np.ndarray:
    """Eq. 9: the balanced binary tree in index order, for a power-of-two count."""
    if len(values) == 1:
        return np.asarray(values[0], np.float64)
    half = len(values) // 2
    return adasum_pair(adasum_tree(values[:half]), adasum_tree(values[half:]))


def adasum(values: list[np.ndarray]) -> np.ndarray:
    """Adasum over N devices: for N = P + r, device P + i first folds into device i."""
    n = len(values)
    p = 1 << (n.bit_length() - 1)
    folded = [adasum_pair(values[i], values[p + i]) if i < n - p else values[i] for i in range(p)]
    return adasum_tree(folded)


def adam_first_update(g: np.ndarray, lr: float, eps: float) -> np.ndarray:
    """Adam's first update from zero moments, bias-corrected (Kingma and Ba, Algorithm 1):
    m_hat = g and v_hat = g^2, so -lr g / (|g| + eps)."""
    g = np.asarray(g, np.float64)
    return -lr * g / (np.sqrt(g * g) + eps)


def terngrad_clip(g: np.ndarray, c: float | None) -> np.ndarray:
    """TernGrad eq. 21: clip at c standard deviations (no clipping where sigma is 0)."""
    g = np.asarray(g, np.float64)
    sigma = g.std()
    if c is None or sigma == 0:
        return g
    return np.clip(g, -c * sigma, c * sigma)


def terngrad_moments(gs: list[np.ndarray], c: float | None, scale: float):
    """Mean and variance of the average over devices of s * sign(g) * Bernoulli(|g| / s).

    Eqs. 1-4: each device's estimate has mean g and variance s|g| - g^2; the devices draw
    independently and the average divides by N.
    """
    clipped = [terngrad_clip(g, c) for g in gs]
    n = len(gs)
    mean = sum(clipped) / n
    variance = sum(scale * np.abs(g) - g**2 for g in clipped) / n**2
    return mean, variance


def topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x| (ties towards lower indices), as lax.top_k picks them."""
    return np.argsort(-np.abs(np.ravel(x)), kind="stable")[:k]


def lags_step(residuals: list[np.ndarray], updates: list[np.ndarray], k: int):
    """LAGS-SGD Algorithm 1 / eq. 5 for one leaf on P devices.

    acc_p = residual_p + update_p; each device sends TopK(acc_p, k) and keeps the rest;
    the output is (1/P) sum_p TopK(acc_p, k). Returns (output, new residuals, sent).
    """
    sent, new_residuals = [], []
    for r, u in zip(residuals, updates, strict=True):
        acc = (np.asarray(r) + np.asarray(u)).ravel()  # in the leaf's dtype, like the code
        idx = topk_indices(acc, k)
        s = np.zeros_like(acc)
        s[idx] = acc[idx]
        sent.append(s)
        kept = acc.copy()
        kept[idx] = 0
        new_residuals.append(kept.reshape(np.shape(r)))
    output = np.sum([s.astype(np.float64) for s in sent], axis=0) / len(updates)
    return output.reshape(np.shape(updates[0])), new_residuals, sent


def lags_delta(accs: list[np.ndarray], k: int) -> float:
    """Eq. 20 with E|x - RandK(x, k)|^2 = (1 - k/d)|x|^2."""
    accs = [np.asarray(a, np.float64).ravel() for a in accs]
    total = np.sum(accs, axis=0)
    sent = np.zeros_like(total)
    for a in accs:
        idx = topk_indices(a, k)
        sent[idx] += a[idx]
    expected = (1 - k / total.size) * np.sum(total**2)
    return float(np.sum((total - sent) ** 2) / expected) if expected > 0 else 0.0


def gradient_dropping_step(residuals, grads, k, local):
    """Aji et al. Algorithm 1 plus section 3, divided by N, for one leaf on N nodes.

    E_n = residual_n + L_n; S_n = TopK(E_n, k); G = sum_n S_n; C_n = G (None),
    G + L_n ("sum") or G - S_n + L_n ("compensated"); all divided by N.
    Returns (C per node, new residuals, S per node).
    """
    n = len(grads)
    out, new_residuals, sent = [], [], []
    for r, g in zip(residuals, grads, strict=True):
        acc = (np.asarray(r) + np.asarray(g)).ravel()
        idx = topk_indices(acc, k)
        s = np.zeros_like(acc)
        s[idx] = acc[idx]
        kept = acc.copy()
        kept[idx] = 0
        sent.append(s)
        new_residuals.append(kept.reshape(np.shape(g)))
    total = np.sum([s.astype(np.float64) for s in sent], axis=0)
    for g, s in zip(grads, sent, strict=True):
        c = total.copy()
        if local == "sum":
            c += np.ravel(g)
        elif local == "compensated":
            c += np.ravel(g) - s
        out.append((c / n).reshape(np.shape(g)))
    return out, new_residuals, sent


def per_shard(step, grads, n, keep):
    """`step(residuals, updates, c)` (a reference.py paper step for one leaf) run on each of
    an FSDP leaf's n shards as a leaf of its own, c = `keep(shard size)`: returns device
    j's output on shard j and every device's whole residual, per step."""
    steps, size = grads.shape[0], grads[0, 0].size
    s = size // n
    residuals = [np.zeros(size, grads.dtype) for _ in range(n)]
    outs, kept = [], []
    for t in range(steps):
        flat = [grads[t, d].ravel() for d in range(n)]
        out = []
        for j in range(n):
            part = slice(j * s, (j + 1) * s)
            mean, new, _ = step([r[part] for r in residuals], [f[part] for f in flat], keep(s))
            out.append(np.ravel(mean[j] if isinstance(mean, list) else mean))
            for r, piece in zip(residuals, new, strict=True):
                r[part] = np.ravel(piece)
        outs.append(out)
        kept.append([r.copy() for r in residuals])
    return np.asarray(outs), np.asarray(kept)
