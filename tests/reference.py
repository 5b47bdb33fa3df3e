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
