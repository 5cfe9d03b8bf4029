"""Scaled unit vectors, y = s * x / max(|x|, eps), with a hand-written backward.

Both memories normalise every key, query and value to the unit sphere (their per-head scales
go on smaller tensors: the c_proj columns and the persistent banks). Autograd through
``F.normalize(x) * s`` runs about ten passes over the tensor in the backward; the closed form

    u = x / |x|,   dx = s (g - u <g, u>) / |x|,   ds = sum <g, u>

needs four. Measured on (4, 8, 512, 32) fp32, 2 threads, forward + backward: 1.46 ms
against 2.55 ms for autograd (python bench/throughput.py shows the effect on a whole step).
Where |x| < eps the map is x / eps and the gradient is s g / eps, as in ``F.normalize``.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _ScaledUnit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor | None, eps: float) -> Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)  # half inputs accumulate in fp32
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc)
        inv = norm.clamp_min(eps).reciprocal().to(x.dtype)  # (..., 1)
        u = x * inv
        ctx.save_for_backward(u, inv, norm > eps, scale)
        return u if scale is None else u * scale

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        u, inv, active, scale = ctx.saved_tensors
        g_dot_u = (g * u).sum(-1, keepdim=True)
        grad_scale = None
        if scale is not None and ctx.needs_input_grad[1]:
            grad_scale = g_dot_u.sum_to_size(scale.shape)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gs = g if scale is None else g * scale
            dot = g_dot_u * active if scale is None else g_dot_u * active * scale
            grad_x = torch.addcmul(gs, u, dot, value=-1.0) * inv
        return grad_x, grad_scale, None


def scaled_unit(x: Tensor, scale: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """``scale * x / max(|x|_2, eps)`` along the last dim; ``scale`` broadcasts against ``x``
    except in the last dim (e.g. (1, H, 1, 1) for per-head scales), or is ``None`` for 1."""
    if scale is not None and scale.shape[-1] != 1:
        raise ValueError(f"scale must be 1 in the last dim (got shape {tuple(scale.shape)})")
    if scale is not None:
        scale = scale.to(x.dtype)
    return _ScaledUnit.apply(x, scale, eps)
