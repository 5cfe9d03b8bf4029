"""Strict-past (causal) softmax attention, with a CPU form that skips the masked half.

    y = softmax(scale q k^T + causal mask) v          (causal_attention_reference)

PyTorch's CPU flash-attention kernel cuts keys into blocks of 512, so below about a thousand
positions ``is_causal=True`` computes the full T x T scores and masks half of them. Here the
queries are cut into blocks of b rows: block i attends its own b keys causally and the i b
keys before them without a mask, and the two partial results merge by their log-sum-exps,

    lse = logaddexp(lse_past, lse_diag),
    out = e^{lse_past - lse} out_past + e^{lse_diag - lse} out_diag.

The backward calls the fused backward once per part with the merged (out, lse); that is exact,
since a flash backward only needs P = exp(S - lse) and D = rowsum(dO * O) of the whole row.
Score entries computed: b^2 n (n + 1) / 2 instead of T^2 (n = T / b blocks). Used on CPU
without dropout below ``max_len`` positions (``bench/causal_attention.py`` measures where it
pays); on GPU the fused kernels skip masked blocks themselves.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _BlockedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float, block: int) -> Tensor:
        B, H, T, _ = q.shape
        # (B, T, H, hv) storage seen as (B, H, T, hv), the layout the fused kernel returns
        out = q.new_empty(B, T, H, v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(B, H, T, dtype=torch.promote_types(q.dtype, torch.float32))
        for s in range(0, T, block):
            e = min(s + block, T)
            o_diag, l_diag = _FWD(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], 0.0, True,
                                  scale=scale)
            if s == 0:
                out[:, :, s:e] = o_diag
                lse[:, :, s:e] = l_diag
                continue
            o_past, l_past = _FWD(q[:, :, s:e], k[:, :, :s], v[:, :, :s], 0.0, False,
                                  scale=scale)
            l_all = torch.logaddexp(l_past, l_diag)
            lse[:, :, s:e] = l_all
            w_diag = (l_diag - l_all).exp_().unsqueeze(-1)
            w_past = (l_past - l_all).exp_().unsqueeze(-1)
            out[:, :, s:e] = torch.addcmul(o_diag * w_diag.to(o_diag.dtype), o_past,
                                           w_past.to(o_past.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.block = scale, block
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        scale, block, T = ctx.scale, ctx.block, q.shape[2]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # last block first: its diagonal and past parts cover every key once, so they are
        # written, and the other blocks add to them (no zero fill)
        for i, s in enumerate(reversed(range(0, T, block))):
            e = min(s + block, T)
            rows = (d_out[:, :, s:e], q[:, :, s:e])
            saved = (out[:, :, s:e], lse[:, :, s:e])
            gq, gk, gv = _BWD(*rows, k[:, :, s:e], v[:, :, s:e], *saved, 0.0, True, scale=scale)
            parts = [(slice(s, e), gk, gv)]
            if s > 0:
                pq, pk, pv = _BWD(*rows, k[:, :, :s], v[:, :, :s], *saved, 0.0, False,
                                  scale=scale)
                gq += pq
                parts.append((slice(0, s), pk, pv))
            for keys, gk_part, gv_part in parts:
                if i == 0:
                    dk[:, :, keys] = gk_part
                    dv[:, :, keys] = gv_part
                else:
                    dk[:, :, keys] += gk_part
                    dv[:, :, keys] += gv_part
            dq[:, :, s:e] = gq
        return dq, dk, dv, None, None


@functools.cache
def blocked_attention_available() -> bool:
    """Whether this torch's private CPU flash-attention ops behave as the blocked path needs
    (checked once on a tiny fp64 case against the public call, forward and backward)."""
    if _FWD is None or _BWD is None:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode(False):
            q, k, v = (torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64,
                                   requires_grad=True) for _ in range(3))
        # the first call may come from generation (no_grad or inference_mode): check anyway
        with torch.inference_mode(False), torch.enable_grad(), \
                torch.autocast("cpu", enabled=False):
            fast = _BlockedCausal.apply(q, k, v, 0.5, 3)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
            grads = torch.autograd.grad(fast.sum(), (q, k, v))
            ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
        return all(torch.allclose(a, b, atol=1e-9) for a, b in
                   zip((fast, *grads), (ref, *ref_grads)))
    except (RuntimeError, TypeError, ValueError):
        return False


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, dropout_p: float = 0.0,
                     block: int = 128, max_len: int = 768) -> Tensor:
    """softmax(scale q k^T + causal mask) v for (B, H, T, hs) q, k and (B, H, T, hv) v.

    Same result as ``F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)``.
    On CPU without dropout and T < max_len it runs in n = max(ceil(T / block), 4) even query
    blocks of b = ceil(T / n) rows when b >= block / 2 (module docstring); ``block=0`` always
    makes one call.
    """
    length = q.shape[2]
    n = max(-(-length // block), 4) if block > 0 else 1
    b = -(-length // n)
    blocked = (block > 0 and 2 * b >= block and q.device.type == "cpu" and dropout_p == 0.0
               and length < max_len and k.shape[2] == length
               and blocked_attention_available())
    if not blocked:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              dropout_p=dropout_p)
    if torch.is_autocast_enabled("cpu"):  # as F.scaled_dot_product_attention under autocast
        dtype = torch.get_autocast_dtype("cpu")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.autocast("cpu", enabled=False):
        return _BlockedCausal.apply(q, k, v, scale, b)


def _chunk_mask(lo: Tensor, hi: Tensor, a: int, b: int, c0: int, c1: int,
                dtype: torch.dtype) -> Tensor:
    """Additive (B or 1, 1, b - a, c1 - c0) mask: 0 where lo[i] <= c0 + j <= hi[i], -inf
    elsewhere; a row that sees nothing keeps column 0 (the fused kernel has no empty rows; the
    caller zeroes such rows)."""
    j = torch.arange(c0, c1, device=lo.device)
    sees = (j >= lo[:, a:b, None]) & (j <= hi[:, a:b, None])
    sees[..., :1] |= ~sees.any(-1, keepdim=True)
    return torch.zeros(sees.shape, dtype=dtype, device=lo.device).masked_fill_(
        ~sees, float("-inf")).unsqueeze(1)


class _IntervalAttention(torch.autograd.Function):
    """softmax(q k^T + interval mask) v over row chunks (a, b, c0, c1): rows a..b-1 against
    keys c0..c1-1, one fused CPU call each way per chunk. Saves q, k, v, the output and its
    log-sum-exp only; each chunk's mask is rebuilt in backward, and the gradients of the keys
    and values are summed into one buffer (slicing them per chunk under autograd would
    allocate a full-size zero gradient per chunk)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor,
                plan: list[tuple[int, int, int, int]]) -> Tensor:
        B, H, n, _ = q.shape
        out = q.new_zeros(B, n, H, v.shape[-1]).transpose(1, 2)
        lse = q.new_zeros(B, H, n, dtype=torch.promote_types(q.dtype, torch.float32))
        for a, b, c0, c1 in plan:
            mask = _chunk_mask(lo, hi, a, b, c0, c1, q.dtype)
            out[:, :, a:b], lse[:, :, a:b] = _FWD(q[:, :, a:b], k[:, :, c0:c1], v[:, :, c0:c1],
                                                  0.0, False, attn_mask=mask, scale=1.0)
        ctx.save_for_backward(q, k, v, out, lse, lo, hi)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, lo, hi = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, c0, c1 in ctx.plan:
            mask = _chunk_mask(lo, hi, a, b, c0, c1, q.dtype)
            gq, gk, gv = _BWD(d_out[:, :, a:b], q[:, :, a:b], k[:, :, c0:c1], v[:, :, c0:c1],
                              out[:, :, a:b], lse[:, :, a:b], 0.0, False, attn_mask=mask,
                              scale=1.0)
            dq[:, :, a:b] = gq
            dk[:, :, c0:c1] += gk
            dv[:, :, c0:c1] += gv
        return dq, dk, dv, None, None, None


def interval_attention(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor,
                       plan: list[tuple[int, int, int, int]]) -> Tensor | None:
    """softmax_j(q_i . k_j) v over lo[i] <= j <= hi[i] for (B, H, n, hs) q, (B, H, S, hs) k,
    (B, H, S, hv) v and (B or 1, n) integer bounds; rows that see nothing (and rows outside
    the ``plan`` of row chunks, see ``ops.intervals.attend_plan``) are 0.

    The fused CPU form of a per-chunk masked ``scaled_dot_product_attention``: the same
    result, with O(n) memory saved for backward and the key and value gradients accumulated
    in place (one v2 short-term layer at T 4096 spent 2.5 s of its 10 s step filling per-chunk
    zero gradients). Returns None where it does not apply (not CPU, or the private fused ops
    missing, or values of another head size than the keys); the caller then takes its own
    path."""
    if (q.device.type != "cpu" or v.shape[-1] != k.shape[-1]
            or not blocked_attention_available()):
        return None
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.autocast("cpu", enabled=False):
        y = _IntervalAttention.apply(q, k, v, lo, hi, plan)
    S = k.shape[2]
    sees = (lo.clamp_min(0) <= hi.clamp_max(S - 1)).view(lo.shape[0], 1, -1, 1)
    return torch.where(sees, y, 0.0)


def causal_attention_reference(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """softmax(scale q k^T) v over s <= t, written out."""
    T, S = q.shape[2], k.shape[2]
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    scores = (scale * q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
