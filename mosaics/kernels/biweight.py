"""Biweight kernel, adaptive bandwidth: w_t. = 1.5-entmax(beta * cos(k_t, k_s), s < t).

1.5-entmax(z)_s = [z_s / 2 - tau]_+^2: the Nadaraya-Watson estimator with K(u) = (1 - u^2)_+^2
and a per-query bandwidth. No options.
"""

from __future__ import annotations

from .base import register_kernel
from .entmax_kernel import EntmaxKernel


@register_kernel("biweight")
class BiweightKernel(EntmaxKernel):
    """1.5-entmax over the strict past (Newton on the threshold, converged to rounding)."""

    def __init__(self) -> None:
        super().__init__(alpha=1.5)
