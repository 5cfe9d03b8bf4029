"""r-ReLUmax (max-anchored normalized ReLU):

    u_ts = [b + s_ts - max_{s' < t} s_ts']_+,  s_ts = beta cos(k_t, k_s),
    w_ts = u_ts^r / sum_{s' < t} u_ts'^r,      s < t.

The best-matching entry always has u = b > 0, so the support is never empty (unlike the
fixed-bandwidth ``epanechnikov_fixed``), and the weights are invariant to shifting all scores.
Options (``kernel_kwargs``): ``r`` > 0 (default 1), ``b`` > 0 (default 1).
"""

from __future__ import annotations

from torch import Tensor

from .base import register_kernel
from .epanechnikov_fixed import power_normalize_backward
from .normalizers import shifted_scores
from .score_kernel import PowerKernel, check_positive


@register_kernel("relumax")
class ReLUMaxKernel(PowerKernel):
    """Max-anchored ReLU weights [b + s - max s]_+^r, normalized over the strict past: u =
    [beta (c - max c) + b]_+ in :class:`PowerKernel` terms (anchor: the row max, shift -b)."""

    def __init__(self, r: float = 1.0, b: float = 1.0) -> None:
        super().__init__()
        self.r = check_positive(self.name, "r", r)
        self.b = check_positive(self.name, "b", b)
        self.power = self.r

    def row_shift(self, x: Tensor, bmax: Tensor | None,
                  buffers: tuple[Tensor, Tensor] | None) -> float:
        return -self.b

    def _u(self, z: Tensor, mask: Tensor) -> Tensor:
        return (self.b + shifted_scores(z, mask)).clamp_min(0.0)  # masked: -inf -> 0

    def score_backward(self, p: Tensor, dp: Tensor, z: Tensor, mask: Tensor) -> Tensor:
        du = power_normalize_backward(p, dp, self._u(z, mask), self.r)
        top = z.masked_fill(~mask, float("-inf")).argmax(dim=-1, keepdim=True)
        return du.scatter_add(-1, top, -du.sum(dim=-1, keepdim=True))

    def extra_repr(self) -> str:
        return f"name={self.name!r}, r={self.r:g}, b={self.b:g}"
