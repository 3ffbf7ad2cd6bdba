"""Non-negative least squares, for step-cost fits: the simulator's calibration and the TBT-SLO
token budget's online fit."""
from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| subject to x >= 0 (Lawson and Hanson's active-set method).

    Solved on unit-norm columns: a step cost's features span 9 orders of magnitude (1 per step, up to
    1e6 attention products), and so do their coefficients; no single tolerance fits them unscaled."""
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    n = a.shape[1]
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 1e-10 * max(1.0, float(np.linalg.norm(b)))
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ x)
        if free.all() or (gradient[~free] <= tol).all():
            break
        free[np.argmax(np.where(free, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            # step from x towards z until the first free coefficient reaches 0, and fix it there
            blocked = np.flatnonzero(free & (z <= 0))
            steps = x[blocked] / (x[blocked] - z[blocked])
            x = x + steps.min() * (z - x)
            x[blocked[np.argmin(steps)]] = 0.0
            free &= x > 0
            x[~free] = 0.0
    return x / norms
