"""Textbook Adam/AdamW in float64: the oracle of the fused kernels and of the
optimizers built on them."""

from __future__ import annotations

import numpy as np


def adam_step64(p, g, m, v, vmax, *, lr, beta1, beta2, eps, wd, decoupled, step):
    """One Adam (``decoupled=False``: L2 weight decay added to the gradient) or
    AdamW step in float64 at step number ``step`` (1 for the first); ``vmax``
    is the AMSGrad running maximum or None. Returns the new ``p, m, v, vmax``."""
    if decoupled:
        p = p * (1.0 - lr * wd)
    else:
        g = g + wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    vv = v
    if vmax is not None:
        vmax = np.maximum(vmax, v)
        vv = vmax
    denom = np.sqrt(vv) / np.sqrt(1.0 - beta2 ** step) + eps
    p = p - lr / (1.0 - beta1 ** step) * m / denom
    return p, m, v, vmax
