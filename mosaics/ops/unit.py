"""Unit vectors, u = x / max(|x|, eps), and the look-ahead values built from them.

Both memories normalise every key, query and value to the unit sphere (their per-head scales
go on smaller tensors: the c_proj columns and the persistent banks). Autograd through
``F.normalize`` runs several passes over the tensor in the backward; the closed form

    u = x / |x|,   dx = (g - u <g, u>) / |x|

needs three. Where |x| < eps the map is x / eps and the gradient is g / eps, as in
``F.normalize``.

Look-ahead values mix each raw value with the next one, then normalise:

    v_s = unit((1 - c) v~_{s+1} + c v~_s)       (v~ past the end := 0)

:func:`unit_vectors` and :func:`lookahead_values` are the entry points, ``*_reference`` the
formulas.
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


def unit_vectors_reference(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / max(|x|, eps)`` through autograd."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)


class _LookaheadValues(torch.autograd.Function):
    """Unit look-ahead values of a whole sequence, v~_T := 0, in one function: backward
    d vbar = (g - u <g, u>) / |vbar|, dv~_s = c d vbar_s + (1 - c) d vbar_{s-1} (one lerp),
    dc = sum_s <v~_s - v~_{s+1}, d vbar_s>; no padded copy, no zero-filled slice gradients."""

    @staticmethod
    def forward(ctx, v: Tensor, c: Tensor, eps: float) -> Tensor:
        w = c.view(1, -1, 1, 1).to(v.dtype)
        vbar = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        torch.lerp(v[:, :, 1:], v[:, :, :-1], w, out=vbar[:, :, :-1])
        last = v[:, :, -1:]
        torch.lerp(torch.zeros_like(last), last, w, out=vbar[:, :, -1:])
        u, inv, norm = unit_forward(vbar, eps)
        ctx.save_for_backward(v, c, u, inv, norm > eps)
        return u

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        v, c, u, inv, active = ctx.saved_tensors
        dot = (g * u).sum(-1, keepdim=True) * active  # no radial part where |vbar| < eps
        dvbar = torch.addcmul(g, u, dot, value=-1.0).mul_(inv)
        dv = dc = None
        if ctx.needs_input_grad[0]:
            w = c.view(1, -1, 1, 1).to(dvbar.dtype)
            dv = torch.empty_like(dvbar)
            torch.lerp(dvbar[:, :, :-1], dvbar[:, :, 1:], w, out=dv[:, :, 1:])
            first = dvbar[:, :, :1]
            torch.lerp(torch.zeros_like(first), first, w, out=dv[:, :, :1])
        if ctx.needs_input_grad[1]:
            acc = torch.promote_types(g.dtype, torch.float32)
            dc = ((v[:, :, :-1] - v[:, :, 1:]) * dvbar[:, :, :-1]).sum((0, 2, 3), dtype=acc)
            dc += (v[:, :, -1:] * dvbar[:, :, -1:]).sum((0, 2, 3), dtype=acc)
            dc = dc.to(c.dtype)
        return dv, dc, None


def lookahead_values(v: Tensor, mix: Tensor, previous: Tensor | None = None,
                     eps: float = 1e-6) -> Tensor:
    """Unit values v_s = unit((1 - c) v~_{s+1} + c v~_s) from raw values v~ (B, H, n, hs) and
    the (H,) (or (1, H, 1, 1)) mix c.

    Without ``previous``: the values of entries 0..n-1 of a whole sequence, v~_n := 0.
    With ``previous`` (B, H, 1, hs), the raw value before v~_0 (decoding): the n values it
    and v~_0..v~_{n-2} finish, for the entries -1..n-2.
    """
    if previous is None:
        if torch.compiler.is_compiling():  # plain ops: the compiler fuses them, derives the grad
            w = mix.view(1, -1, 1, 1).to(v.dtype)
            following = torch.cat([v[:, :, 1:], torch.zeros_like(v[:, :, :1])], dim=2)
            return unit_vectors_reference(torch.lerp(following, v, w), eps)
        return _LookaheadValues.apply(v, mix, eps)
    w = mix if mix.dim() == 4 else mix.view(1, -1, 1, 1)
    w = w if w.dtype == v.dtype else w.to(v.dtype)
    if v.shape[2] == 1:
        return unit_vectors(torch.lerp(v, previous, w), eps)
    pending = torch.cat([previous, v], dim=2)
    return unit_vectors(torch.lerp(pending[:, :, 1:], pending[:, :, :-1], w), eps)


def lookahead_values_reference(v: Tensor, mix: Tensor, previous: Tensor | None = None,
                               eps: float = 1e-6) -> Tensor:
    """:func:`lookahead_values` written out: pad, mix neighbours, normalise."""
    c = mix.view(1, -1, 1, 1)
    if previous is None:
        seq, nxt = v, torch.cat([v[:, :, 1:], torch.zeros_like(v[:, :, :1])], dim=2)
    else:
        seq, nxt = torch.cat([previous, v[:, :, :-1]], dim=2), v
    return unit_vectors_reference((1 - c) * nxt + c * seq, eps)
