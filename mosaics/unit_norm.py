"""Unit vectors, u = x / max(|x|, eps), with a hand-written backward.

Both memories normalise every key, query and value to the unit sphere (their per-head scales
go on smaller tensors: the c_proj columns and the persistent banks). Autograd through
``F.normalize`` runs several passes over the tensor in the backward; the closed form

    u = x / |x|,   dx = (g - u <g, u>) / |x|

needs three. Where |x| < eps the map is x / eps and the gradient is g / eps, as in
``F.normalize``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def unit_forward(x: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(u, 1 / max(|x|, eps), |x|), the norms (..., 1) accumulated in at least fp32."""
    full = x.dtype in (torch.float32, torch.float64)
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True,
                                    dtype=x.dtype if full else torch.float32)
    inv = norm.clamp_min(eps).reciprocal()
    if not full:
        inv = inv.to(x.dtype)
    return x * inv, inv, norm


class _UnitVectors(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, eps: float) -> Tensor:
        u, inv, norm = unit_forward(x, eps)
        ctx.save_for_backward(u, inv, norm > eps)
        return u

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        u, inv, active = ctx.saved_tensors
        dot = (g * u).sum(-1, keepdim=True) * active  # no radial part where |x| < eps
        return torch.addcmul(g, u, dot, value=-1.0) * inv, None


def unit_vectors(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / max(|x|_2, eps)`` along the last dim, any shape (without the autograd function
    when no gradient is needed: the same numbers, less per-call overhead when decoding)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _UnitVectors.apply(x, eps)
    if x.dtype in (torch.float32, torch.float64):  # the numbers of unit_forward, in place
        return x * torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(eps).reciprocal_()
    return unit_forward(x, eps)[0]
