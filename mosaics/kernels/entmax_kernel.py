"""alpha-entmax kernel: w_t. = alpha-entmax(beta * cos(k_t, k_s), s < t), any alpha > 1.

alpha = 1 + 1/r is the adaptive-bandwidth Nadaraya-Watson estimator with the compact kernel
K(u) ~ (1 - u^2)_+^r: r = 1 Epanechnikov (sparsemax), r = 2 biweight (1.5-entmax), r = 3
triweight (4/3-entmax). The support adapts per query: p_ts = [(alpha-1) s_ts - tau_t]_+^r.

Options (``kernel_kwargs``): ``alpha`` (default 1.5) or ``r`` (alpha = 1 + 1/r), not both;
``n_iter`` (default 50) caps the Newton (alpha > 2: bisection) iterations of the threshold.

On CUDA the training forward and the prompt run through the project's fused Triton kernel
(:func:`mosaics.ops.power_attention`, alpha in (1, 2]; ``MOSAICS_FUSED=0`` switches it off).
With the ``adasplash`` package installed (``pip install -e ".[gpu]"``), its kernels
(:mod:`.adasplash_backend`) serve the strict past where the project's do not, or first with
``MOSAICS_ADASPLASH=1``; ``MOSAICS_ADASPLASH=0`` or ``use_adasplash = False`` on a kernel
keeps them off. The chunked path is the reference and serves CPU, decoding and every other
case.
"""

from __future__ import annotations

import os

from torch import Tensor

from ..ops.entmax import check_alpha, entmax_backward, entmax_exponent, entmax_tau
from ..ops.sparse_rows import sparsemax_row
from ..ops.triton_backend import fused_reason
from .adasplash_backend import ENV_SWITCH as ADASPLASH_SWITCH
from .adasplash_backend import retrieval as adasplash_retrieval
from .adasplash_backend import skip_reason as adasplash_skip_reason
from .base import register_kernel
from .entmax_rows import SORTED_ROW_SOLVERS
from .score_kernel import PowerKernel, check_positive, check_positive_int


@register_kernel("entmax")
class EntmaxKernel(PowerKernel):
    """alpha-entmax over the strict past: u = [(alpha - 1) beta (c - max c) - tau]_+, r = 1 /
    (alpha - 1), tau from :func:`~mosaics.ops.entmax.entmax_tau` (Newton from a block lower
    bound)."""

    entmax_gradient = True
    use_adasplash = True  # False: keep the chunked path on CUDA too

    def __init__(self, alpha: float | None = None, r: float | None = None,
                 n_iter: int = 50) -> None:
        super().__init__()
        if alpha is not None and r is not None:
            raise ValueError(f"kernel {self.name!r}: give either alpha or r (alpha = 1 + 1/r), "
                             f"not both (got alpha={alpha!r}, r={r!r})")
        if r is not None:
            alpha = 1.0 + 1.0 / check_positive(self.name, "r", r)
        alpha = 1.5 if alpha is None else alpha
        check_alpha(alpha)
        self.alpha = float(alpha)
        self.n_iter = check_positive_int(self.name, "n_iter", n_iter)
        self.power = entmax_exponent(self.alpha)
        self.score_scale = self.alpha - 1.0

    def forward(self, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
        """Strict-past retrieval (see :meth:`~.base.Kernel.forward`): the project's fused
        kernel where it serves the call (:meth:`fused_retrieval`); adasplash's where it does
        not, or first with ``MOSAICS_ADASPLASH=1``, when
        :func:`~.adasplash_backend.skip_reason` allows; else the chunked path."""
        prefer = os.environ.get(ADASPLASH_SWITCH, "").strip() == "1"
        if (prefer or fused_reason(keys, values) is not None) and adasplash_skip_reason(
                self, keys, values) is None:
            return adasplash_retrieval(keys, values, beta, self.alpha)
        return super().forward(keys, values, beta)

    def fused_form(self) -> tuple[float | None, float | None, bool] | None:
        """Anchor: the row max; shift: the threshold, solved (alpha <= 2 only)."""
        return (None, None, True) if self.alpha <= 2.0 else None

    def row_shift(self, x: Tensor, bmax: Tensor | None,
                  buffers: tuple[Tensor, Tensor] | None) -> Tensor:
        return entmax_tau(x, self.alpha, self.n_iter, bmax, buffers)

    def score_backward(self, p: Tensor, dp: Tensor, z: Tensor, mask: Tensor) -> Tensor:
        return entmax_backward(p, dp, self.alpha)

    def row_weights(self, cos: Tensor, beta: Tensor) -> tuple[Tensor, Tensor | None]:
        solve = SORTED_ROW_SOLVERS.get(self.alpha)  # decoding: exact, on the top entries only
        return super().row_weights(cos, beta) if solve is None else solve(cos * beta)

    def decode_row(self, query: Tensor, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
        """Sparsemax (alpha 2): the compiled row on CPU where it applies
        (:func:`~mosaics.ops.sparse_rows.sparsemax_row`), else the PyTorch row."""
        y = sparsemax_row(query, keys, values, beta) if self.alpha == 2.0 else None
        return super().decode_row(query, keys, values, beta) if y is None else y

    def extra_repr(self) -> str:
        return f"name={self.name!r}, alpha={self.alpha:g}"
