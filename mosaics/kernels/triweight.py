"""Triweight kernel, adaptive bandwidth: w_t. = (4/3)-entmax(beta * cos(k_t, k_s), s < t).

(4/3)-entmax(z)_s = [z_s / 3 - tau]_+^3: the Nadaraya-Watson estimator with
K(u) = (1 - u^2)_+^3 and a per-query bandwidth. tau by Newton's method from a lower bound
(:func:`~mosaics.ops.entmax.entmax_tau`), then renormalized. Option: ``n_iter`` (default 50), the
cap on Newton steps.
"""

from __future__ import annotations

from .base import register_kernel
from .entmax_kernel import EntmaxKernel


@register_kernel("triweight")
class TriweightKernel(EntmaxKernel):
    """4/3-entmax over the strict past."""

    def __init__(self, n_iter: int = 50) -> None:
        super().__init__(alpha=4.0 / 3.0, n_iter=n_iter)
