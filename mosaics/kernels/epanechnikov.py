"""Epanechnikov kernel, adaptive bandwidth: w_t. = sparsemax(beta * cos(k_t, k_s), s < t).

sparsemax(z)_s = [z_s - tau]_+ with tau such that the row sums to one: the Nadaraya-Watson
estimator with K(u) = (1 - u^2)_+ and a per-query bandwidth (alpha-entmax with alpha = 2).
No options.
"""

from __future__ import annotations

from .base import register_kernel
from .entmax_kernel import EntmaxKernel


@register_kernel("epanechnikov")
class EpanechnikovKernel(EntmaxKernel):
    """sparsemax over the strict past (exact: Newton from a lower bound stops on the sort-based
    threshold)."""

    def __init__(self) -> None:
        super().__init__(alpha=2.0)
