"""kNN retrieval: weight only the k highest scores of each query row, fused (Triton).

    s_ij = q_i . k_j over the visible j (lo_i <= j <= hi_i; the strict past: j <= i + offset),
    selected: the min(k, #visible) largest s_ij of row i,
    gaussian:  w_ij = exp(beta_h (s_ij - m_i)) / sum over the selected (m_i their max),
    uniform:   w_ij = 1 / #selected,
    y_i = sum_j w_ij v_j  (0 for a row that sees nothing).

Ties at the k-th value go to the lowest columns (the reference sorts stably), so exactly
min(k, #visible) entries are selected. Uniform weights are piecewise constant in the scores:
queries, keys and beta get no gradient through them (values do).

:func:`knn_attention` runs the kernels of ``triton_kernels/knn_attention.py`` (compiled on CUDA,
interpreted on CPU): per block of query rows the k-th largest score by a running top-k merged
block by block, then the weighted values; O(n) saved per row (max, sum, k-th value, last tied
column) and a backward that recomputes the scores tile by tile. :func:`knn_attention_reference`
is the dense PyTorch form (a (n, S) score matrix per head).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .power_attention import block_sees
from .triton_backend import cdiv, kernel_source, pinned_tiles, pow2_at_least, triton_module

_KERNELS = kernel_source(__file__, "knn_attention")
MAX_K = 64  # the largest k with a top-k tile (k >= the key count needs none)
MAX_HEAD = 128  # the largest head size (queries / keys and values)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INTERPRETED_BLOCK = 64  # tiles under the interpreter (CPU tensors)
# Triton's own bitonic top-k (tl.topk, tl.bitonic_merge) on CUDA; under the interpreter, where
# its integer reductions run element by element, the same network from min / max
# (which the compiler in turn handles badly). True also runs Triton's under the interpreter.
LIBRARY_SORT_ON_CPU = False
# A key block whose scores enter no row's top k is skipped; one that adds at most this many
# entries to every row is inserted value by value (a row max, a count and a shift per step),
# and only a block that adds more to some row runs the bitonic top-k and merge (~4 steps'
# instructions; counted in bench/work_model.py, not timed).
MERGE_INSERTS = 4


def knn_unsupported(q: Tensor, k: Tensor, v: Tensor, k_top: int) -> str | None:
    """None when :func:`knn_attention` takes these inputs, else why not."""
    for name, x in (("queries", q), ("keys", k), ("values", v)):
        if x.dtype not in _DTYPES:
            return f"{name} are {x.dtype} (fused kNN takes float32, bfloat16 or float16)"
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD:
        return f"head size {max(q.shape[-1], v.shape[-1])} > {MAX_HEAD}"
    if MAX_K < k_top < k.shape[2]:
        return f"k = {k_top} > {MAX_K} (and below the {k.shape[2]} memory entries)"
    return None


def _check(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, k_top: int,
           lo: Tensor | None, hi: Tensor | None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("knn_attention needs q (B, H, n, hs), k (B, H, S, hs), v (B, H, S, hv);"
                         f" got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, n, hs = q.shape
    if k.shape[:2] != (B, H) or k.shape[3] != hs or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"knn_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         f"(B, H, S, .) with B, H = {B}, {H} and k's last size {hs}")
    if beta.shape != (H,):
        raise ValueError(f"knn_attention: beta must have shape (H,) = ({H},), got "
                         f"{tuple(beta.shape)}")
    if isinstance(k_top, bool) or not isinstance(k_top, int) or k_top < 1:
        raise ValueError(f"knn_attention: k_top must be an integer >= 1, got {k_top!r}")
    if (lo is None) != (hi is None):
        raise ValueError("knn_attention: give both lo and hi (per-row intervals) or neither")
    for name, b in (("lo", lo), ("hi", hi)):
        if b is not None and (b.dim() != 2 or b.shape[0] not in (1, B) or b.shape[1] != n
                              or b.dtype.is_floating_point or b.dtype == torch.bool):
            raise ValueError(f"knn_attention: {name} must be an integer tensor of shape "
                             f"({B} or 1, {n}), got {b.dtype} {tuple(b.shape)}")
    reason = knn_unsupported(q, k, v, k_top)
    if reason is not None:
        raise ValueError(f"knn_attention: {reason}; use knn_attention_reference or the "
                         "kernel's chunked path (MOSAICS_FUSED=0)")


def _on_device(x: Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it the tensors'."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _config(q: Tensor, v_size: int, k_top: int, S: int) -> dict:
    """Block sizes and flags shared by the forward and backward kernels (the backward must
    recompute the forward's scores bit for bit, so it takes the forward's). The tiles pinned
    for "knn" (:func:`~.triton_backend.use_tiles`, ``MOSAICS_TILES``), else 64 x 64 on CUDA
    (32 x 64 above head size 64), 64 x 64 under the interpreter."""
    select_all = k_top >= S
    k_pad = 2 if select_all else pow2_at_least(k_top, 2)
    wide = max(q.shape[-1], v_size) > 64
    precision = "ieee" if q.dtype == torch.float32 or not q.is_cuda else "native"
    tf32 = q.is_cuda and q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    products = "tf32" if tf32 else precision  # scores stay exact fp32 (the selection)
    pinned = pinned_tiles("knn")
    if pinned is not None:
        block_m, block_n, warps = pinned["BLOCK_M"], pinned["BLOCK_N"], pinned["num_warps"]
    elif q.is_cuda:  # 64 x 64 tiles; 32-row ones for head sizes above 64 (shared memory)
        block_m = block_n = 32 if wide else 64
        warps = 4
    else:
        block_m = block_n = _INTERPRETED_BLOCK
        warps = 4
    return {"BLOCK_M": block_m, "BLOCK_N": max(block_n, k_pad), "K_PAD": k_pad,
            "num_warps": warps,
            "num_stages": 2 if wide and q.dtype == torch.float32 else 3,  # fp32 tiles: smem
            "SELECT_ALL": select_all, "LOG_K": k_pad.bit_length() - 1,
            "LIBRARY_SORT": q.is_cuda or LIBRARY_SORT_ON_CPU, "INSERTS": MERGE_INSERTS,
            "PRECISION": precision, "PRODUCTS": products}


class _KNNAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, offset: int, k_top: int,
                uniform: bool, lo: Tensor | None, hi: Tensor | None) -> Tensor:
        B, H, n, hs = q.shape
        S, hv = k.shape[2], v.shape[3]
        mod = triton_module(_KERNELS, q.device)
        q, k, v = (x.contiguous() for x in (q, k, v))
        b32 = beta.detach().to(torch.float32).contiguous()
        bounds = lo is not None
        lo32 = lo.to(torch.int32).contiguous() if bounds else q.new_zeros(1, dtype=torch.int32)
        hi32 = hi.to(torch.int32).contiguous() if bounds else lo32
        lo_stride = n if bounds and lo32.shape[0] > 1 else 0
        cfg = _config(q, hv, k_top, S)
        out = torch.empty(B, H, n, hv, dtype=v.dtype, device=q.device)
        stats = torch.empty(B * H, 3, n, dtype=torch.float32, device=q.device)
        jt = torch.empty(B * H, n, dtype=torch.int32, device=q.device)
        if n > 0 and B * H > 0:
            grid = (cdiv(n, cfg["BLOCK_M"]), B * H)
            with _on_device(q):
                mod._knn_fwd[grid](
                    q, k, v, b32, lo32, hi32, out, stats, jt, n, S, H, hs, hv, int(offset),
                    k_top, lo_stride, HS_PAD=pow2_at_least(hs, 16), HV_PAD=pow2_at_least(hv, 16),
                    UNIFORM=bool(uniform), HAS_BOUNDS=bounds,
                    LOG_N=cfg["BLOCK_N"].bit_length() - 1, **cfg)
        ctx.save_for_backward(q, k, v, beta, out, stats, jt, lo32, hi32)
        ctx.args = (int(offset), k_top, bool(uniform), bounds, lo_stride)
        ctx.cfg = cfg
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # noqa: ANN205
        q, k, v, beta, out, stats, jt, lo32, hi32 = ctx.saved_tensors
        offset, k_top, uniform, bounds, lo_stride = ctx.args
        B, H, n, hs = q.shape
        S, hv = k.shape[2], v.shape[3]
        mod = triton_module(_KERNELS, q.device)
        cfg = dict(ctx.cfg)
        for key in ("K_PAD", "SELECT_ALL", "LOG_K", "LIBRARY_SORT", "INSERTS"):
            cfg.pop(key)
        pads = {"HS_PAD": pow2_at_least(hs, 16), "HV_PAD": pow2_at_least(hv, 16)}
        g = grad_out.to(v.dtype).contiguous()
        b32 = beta.detach().to(torch.float32).contiguous()
        delta = (g.float() * out.float()).sum(-1).contiguous()  # sum_j p_ij dp_ij
        dk = torch.zeros_like(k) if uniform else torch.empty_like(k)
        dv = torch.empty_like(v)
        dq = torch.zeros_like(q)
        dbeta = torch.zeros_like(beta)
        if n == 0 or S == 0 or B * H == 0:
            return dq, torch.zeros_like(k), torch.zeros_like(v), dbeta, *(None,) * 5
        common = (n, S, H, hs, hv, offset, lo_stride)
        first = last = lo32  # with intervals: the query blocks that see each key block
        if bounds:
            sees = block_sees(lo32, hi32, S, cfg["BLOCK_M"], cfg["BLOCK_N"])
            idx = torch.arange(sees.shape[1], device=q.device).view(1, -1, 1)
            first = torch.where(sees, idx, sees.shape[1]).amin(1).to(torch.int32).contiguous()
            last = torch.where(sees, idx, -1).amax(1).to(torch.int32).contiguous()
        with _on_device(q):
            mod._knn_bwd_dkdv[(cdiv(S, cfg["BLOCK_N"]), B * H)](
                q, k, v, b32, lo32, hi32, stats, jt, g, delta, dk, dv, first, last, *common,
                first.shape[-1] if bounds and first.shape[0] > 1 else 0,
                UNIFORM=uniform, HAS_BOUNDS=bounds, **pads, **cfg)
            if not uniform:
                drow = torch.empty(B * H, n, dtype=torch.float32, device=q.device)
                mod._knn_bwd_dq[(cdiv(n, cfg["BLOCK_M"]), B * H)](
                    q, k, v, b32, lo32, hi32, stats, jt, g, delta, dq, drow, *common,
                    HAS_BOUNDS=bounds, **pads, **cfg)
                dbeta = drow.view(B, H, n).sum((0, 2)).to(beta.dtype)
        return dq, dk, dv, dbeta, None, None, None, None, None


def knn_attention(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, offset: int = -1,
                  k_top: int = 16, uniform: bool = False, lo: Tensor | None = None,
                  hi: Tensor | None = None) -> Tensor:
    """Fused kNN retrieval (module docstring).

    Args:
        q: (B, H, n, hs); k: (B, H, S, hs); v: (B, H, S, hv), float32 / bfloat16 / float16
            (mixed dtypes are promoted); beta: (H,) > 0; offset: query i sees j <= i + offset;
            k_top: entries per row (any k >= S, else at most ``MAX_K``); uniform: the 1 / count
            weights instead of the softmax; lo, hi: optional (B or 1, n) integer intervals
            lo_i <= j <= hi_i replacing the strict past (``offset`` is then ignored).
    Returns:
        (B, H, n, hv) in the values' dtype. Products accumulate in fp32: fp32 inputs multiply
        in full fp32 (the scores always; the others as TF32 where
        ``torch.backends.cuda.matmul.allow_tf32``), bf16 / fp16 ones in their dtype, with the
        weights and score gradients rounded to it before their products (as flash attention).
    """
    _check(q, k, v, beta, k_top, lo, hi)
    dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    out = _KNNAttention.apply(q.to(dt), k.to(dt), v.to(dt), beta, int(offset), k_top,
                              bool(uniform), lo, hi)
    return out.to(v.dtype)


def knn_attention_reference(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, offset: int = -1,
                            k_top: int = 16, uniform: bool = False, lo: Tensor | None = None,
                            hi: Tensor | None = None) -> Tensor:
    """Dense PyTorch form of :func:`knn_attention` (same arguments), in float32 (float64
    inputs stay float64): the (B, H, n, S) scores, a stable descending sort per row (ties to
    the lowest column), the top min(k, #visible) visible entries, their weights, W V."""
    B, H, n, _ = q.shape
    S = k.shape[2]
    wd = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(wd), k.to(wd), v.to(wd)
    s = q @ k.transpose(-1, -2)
    j = torch.arange(S, device=q.device).view(1, 1, 1, S)
    if lo is None:
        vis = j <= torch.arange(n, device=q.device).view(1, 1, n, 1) + offset
    else:
        vis = (j >= lo.view(-1, 1, n, 1)) & (j <= hi.view(-1, 1, n, 1))
    vis = vis.expand(B, H, n, S)
    masked = s.detach().masked_fill(~vis, float("-inf"))
    order = masked.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(S, device=q.device)
                                             .expand_as(order).contiguous())
    sel = vis & (rank < k_top)
    if uniform:
        w = sel.to(wd) / sel.sum(-1, keepdim=True).clamp_min(1).to(wd)
    else:
        m = masked.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
        z = beta.to(wd).view(1, H, 1, 1) * (s - m)
        e = torch.where(sel, z.masked_fill(~sel, 0.0).exp(), 0.0)
        w = e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(wd).tiny)
    return (w @ v).to(v.dtype)

