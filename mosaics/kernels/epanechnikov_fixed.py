"""Normalized ReLU, fixed bandwidth (Epanechnikov-like kernel without adaptive support):

    u_ts = [1 - beta (1 - cos(k_t, k_s))]_+,   w_ts = u_ts^r / sum_{s' < t} u_ts'^r,   s < t.

On unit keys 1 - cos = |k_t - k_s|^2 / 2, so u is the kernel (1 - |k_t - k_s|^2 / h^2)_+ with
h^2 = 2 / beta: a memory entry farther than h from the query gets no weight. When every entry is
that far (empty support, 0/0) the row's output is 0, as for position 0.

Options (``kernel_kwargs``): ``r`` > 0 (default 1); ``parametrization``: "formula" (default,
the kernel above with the memory's beta) or the scores of ``norm_relu`` in the published code
of "Sparse Attention as Compact Kernel Regression", which has two memory blocks:

- "regbench-code" (``memory_mosaics.py``, its in-context language learning runs): keys scaled
  by sqrt(beta), so raw = beta c, then u = [raw / (h^2 / 2) + 1 - 2 / h^2]_+ with 1 / h^2 =
  beta, i.e. u = [2 beta^2 c + 1 - 2 beta]_+. Normalized, that is the kernel above at the
  bandwidth beta' = 2 beta^2 / (2 beta^2 - 2 beta + 1): a support c > (2 beta - 1) /
  (2 beta^2) that never starts above c = 1/2 (beta 1) and widens as beta grows (c > 0.13 at
  the initial beta e^2, where the formula's starts at c > 0.86).
- "synthetic-code" (``memory_mosaics_eft.py``, its Sort and MQMTAR runs): u = [c]_+, the
  bandwidth computed but unused, i.e. the kernel above at beta' = 1 whatever beta is (no
  gradient reaches the bandwidth).

Both give an empty row uniform weights over its past; here it stays 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import register_kernel
from .score_kernel import PowerKernel, check_choice, check_positive

PARAMETRIZATIONS = ("formula", "regbench-code", "synthetic-code")


def power_normalize_backward(p: Tensor, dp: Tensor, u: Tensor, r: float) -> Tensor:
    """Gradient w.r.t. u of w = u^r / sum(u^r): r (p / u) (dp - <p, dp>) on u > 0, else 0."""
    inner = (p * dp).sum(dim=-1, keepdim=True)
    ratio = torch.where(u > 0, p / u.clamp_min(torch.finfo(u.dtype).tiny), 0.0)
    return r * ratio * (dp - inner)


@register_kernel("epanechnikov_fixed")
class EpanechnikovFixedKernel(PowerKernel):
    """[1 - beta (1 - cos)]_+^r normalized over the strict past; empty support outputs 0. In
    :class:`PowerKernel` terms u = [beta (c - 1) + 1]_+: anchor 1, shift -1, no solver."""

    anchor = 1.0

    def __init__(self, r: float = 1.0, parametrization: str = "formula") -> None:
        super().__init__()
        self.r = check_positive(self.name, "r", r)
        self.parametrization = check_choice(self.name, "parametrization", parametrization,
                                            PARAMETRIZATIONS)
        self.power = self.r

    def bandwidth(self, beta: Tensor) -> Tensor:
        """beta; (regbench-code) 2 beta^2 / (2 beta^2 - 2 beta + 1), whose denominator is
        >= 1/2 for every beta; (synthetic-code) 1."""
        if self.parametrization == "formula":
            return beta
        if self.parametrization == "synthetic-code":
            return beta * 0 + 1  # keeps beta's shape, dtype and graph (a zero gradient)
        return 2 * beta.square() / (2 * beta.square() - 2 * beta + 1)

    def fused_form(self) -> tuple[float | None, float | None, bool] | None:
        return (1.0, -1.0, False)

    def row_shift(self, x: Tensor, bmax: Tensor | None,
                  buffers: tuple[Tensor, Tensor] | None) -> float:
        return -1.0

    def _u(self, cos: Tensor, beta: Tensor, mask: Tensor) -> Tensor:
        u = (1.0 - beta * (1.0 - cos)).clamp_min(0.0)
        return u.masked_fill(~mask, 0.0)

    def weights_backward(self, p: Tensor, dp: Tensor, cos: Tensor, beta: Tensor,
                         mask: Tensor) -> tuple[Tensor, Tensor]:
        du = power_normalize_backward(p, dp, self._u(cos, beta, mask), self.r)
        return du * beta, (du * (cos - 1.0)).sum_to_size(beta.shape)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, r={self.r:g}, parametrization={self.parametrization!r}"
