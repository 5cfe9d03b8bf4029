"""r-ReLUmax (max-anchored normalized ReLU):

    u_ts = [b + s_ts - max_{s' < t} s_ts']_+,  s_ts = beta cos(k_t, k_s),
    w_ts = u_ts^r / sum_{s' < t} u_ts'^r,      s < t.

The best-matching entry always has u = b > 0, so the support is never empty (unlike the
fixed-bandwidth ``epanechnikov_fixed``), and the weights are invariant to shifting all scores.
Options (``kernel_kwargs``): ``r`` > 0 (default 1), ``b`` > 0 (default 1), ``parametrization``:
"formula" (default: the scale is the memory's beta) or the scores of ``relumax`` in the
published code of "Sparse Attention as Compact Kernel Regression": "regbench-code"
(``memory_mosaics.py``, its in-context language learning runs) scales the keys by sqrt(beta),
so raw = beta c, then forms u = [(raw - max raw) / h^2 + 1]_+ with 1 / h^2 = beta, i.e. the
scale is beta^2 (e^4 at the initial beta e^2, up to e^20); "synthetic-code"
(``memory_mosaics_eft.py``, its Sort and MQMTAR runs) forms [(c - max c) / h^2 + 1]_+ from
unit keys, the formula's scale beta.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import register_kernel
from .epanechnikov_fixed import PARAMETRIZATIONS, power_normalize_backward
from .score_kernel import PowerKernel, check_choice, check_positive


@register_kernel("relumax")
class ReLUMaxKernel(PowerKernel):
    """Max-anchored ReLU weights [b + s - max s]_+^r, normalized over the strict past: u =
    [beta (c - max c) + b]_+ in :class:`PowerKernel` terms (anchor: the row max, shift -b)."""

    def __init__(self, r: float = 1.0, b: float = 1.0, parametrization: str = "formula") -> None:
        super().__init__()
        self.r = check_positive(self.name, "r", r)
        self.b = check_positive(self.name, "b", b)
        self.parametrization = check_choice(self.name, "parametrization", parametrization,
                                            PARAMETRIZATIONS)
        self.power = self.r

    def bandwidth(self, beta: Tensor) -> Tensor:
        """beta, or (regbench-code) beta^2."""
        return beta.square() if self.parametrization == "regbench-code" else beta

    def fused_form(self) -> tuple[float | None, float | None, bool] | None:
        return (None, -self.b, False)

    def row_shift(self, x: Tensor, bmax: Tensor | None,
                  buffers: tuple[Tensor, Tensor] | None) -> float:
        return -self.b

    def weights_backward(self, p: Tensor, dp: Tensor, cos: Tensor, beta: Tensor,
                         mask: Tensor) -> tuple[Tensor, Tensor]:
        """u = [beta (c - m) + b]_+ with m = max c, rounded exactly as :meth:`weights` forms
        it (so p / u is 1 / N to the last bit: a u recomputed from beta c - max(beta c) is off
        by ~beta eps, which matters for entries near the edge of the support in fp32)."""
        masked = cos.masked_fill(~mask, float("-inf"))
        top = masked.argmax(dim=-1, keepdim=True)
        m = masked.gather(-1, top)
        m = torch.where(torch.isfinite(m), m, 0.0)
        u = ((masked - m) * beta + self.b).clamp_min(0.0)
        du = power_normalize_backward(p, dp, u, self.r)
        dbeta = (du * (cos - m)).sum_to_size(beta.shape)
        du = du.scatter_add(-1, top, -du.sum(dim=-1, keepdim=True))  # m moves with c_top
        return du * beta, dbeta

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, r={self.r:g}, b={self.b:g}, "
                f"parametrization={self.parametrization!r}")
