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
