"""kNN retrieval in PyTorch: only the k highest scores of each query row get weight.

    s_ij = q_i . k_j over the visible j, selected: the min(k, #visible) largest s_ij,
    gaussian_knn:  w_ij = softmax of beta_h s_ij over the selected,
    uniform_knn:   w_ij = 1 / #selected,
    y_i = sum_j w_ij v_j  (0 for a row that sees nothing).

The same map as the fused Triton kernels of :func:`~.knn_attention.knn_attention` (ties at
the k-th score broken by ``topk`` here, to the lowest columns there), for what those do not
serve: float64, k above their ``MAX_K``, per-query bandwidths, CPU without Triton. Its plain
reference is :func:`~.knn_attention.knn_attention_reference`. Both forms take the kernel
(:class:`TopKNormalizer`) as an argument; the uniform weights are piecewise constant in the
scores, so queries, keys and bandwidth get no gradient through them (values do).

:func:`top_k_retrieval` (:class:`_TopKRetrieval`): one score GEMM per tile of query rows
(:class:`~.score_retrieval._Tiles`), then the k best entries of each row, found exactly
without a top-k over the whole row: the k-th largest of the row's 16 strided block maxima is a
lower bound of its k-th largest entry, so the top k lie in the blocks whose max reaches that
bound (about k of them), and a top-k over those blocks alone gives them
(:func:`top_k_blocks`). Everything after that works on the k selected entries per row
(gathers of k key / value rows and scatter-adds), and the backward needs no score matrix.

:func:`dense_top_k_retrieval` (:class:`_DenseTopKRetrieval`), for short memories: the whole
score matrix, one top-k per row, the weights scattered into a dense (n, S) matrix and every
product a batched GEMM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .entmax import BLOCK, block_max, entmax_backward, work_dtype
from .score_retrieval import _flat_rows, _Tiles


class TopKNormalizer(Protocol):
    """What the kNN retrievals need of a kernel (:mod:`mosaics.kernels.knn`): ``k`` entries
    per row, ``uniform`` (the 1 / count weights, else the softmax), ``top_weights`` of the
    selected entries' cosines, and the size of one chunk of gathered numbers."""

    k: int
    uniform: bool
    chunk_elements: int

    def top_weights(self, cos: Tensor, beta: Tensor) -> Tensor: ...


def top_k_retrieval(queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                    normalizer: TopKNormalizer, tiles: Callable[..., _Tiles]) -> Tensor:
    """The kNN retrieval over the :class:`~.score_retrieval._Tiles` that ``tiles(q, k, v,
    n_buffers)`` makes (the strict past with an offset, or visible intervals), with beta
    (B or 1, H, n or 1, 1): (B, H, n, hv) in the values' dtype."""
    return _TopKRetrieval.apply(queries, keys, values, beta, normalizer, tiles)


def dense_top_k_retrieval(queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                          normalizer: TopKNormalizer, offset: int) -> Tensor:
    """The kNN retrieval over the strict past j <= i + offset through dense (B H, n, S)
    matrices, beta (H,): (B, H, n, hv) in the values' dtype."""
    return _DenseTopKRetrieval.apply(queries, keys, values, beta, normalizer, offset)


def top_k_support(x: Tensor, k: int) -> Tensor:
    """Boolean mask of the min(k, #finite) largest finite entries of each row of x."""
    vals, idx = x.topk(min(k, x.shape[-1]), dim=-1)
    return torch.zeros_like(x, dtype=torch.bool).scatter(-1, idx, torch.isfinite(vals))


def top_k_blocks(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, columns) of the k largest entries of each row of x (..., W), W a multiple of
    BLOCK and k <= W, searched only in the strided blocks whose max reaches the k-th largest
    block max (exact: each of the k best blocks holds an entry at least that large)."""
    nb = x.shape[-1] // BLOCK
    if 4 * k > nb:
        return x.topk(k, dim=-1)
    bmax = block_max(x)
    kth = bmax.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    c = int((bmax >= kth).sum(dim=-1).max())
    if 2 * c > nb:
        return x.topk(k, dim=-1)
    blocks = bmax.topk(c, dim=-1, sorted=False).indices  # (..., c)
    cand = x.unflatten(-1, (BLOCK, nb)).gather(
        -1, blocks.unsqueeze(-2).expand(*blocks.shape[:-1], BLOCK, c)).flatten(-2)
    vals, pos = cand.topk(k, dim=-1)
    return vals, (pos // c) * nb + blocks.gather(-1, pos % c)


class _DenseTopKRetrieval(torch.autograd.Function):
    """Strict-past retrieval with a kNN kernel through dense (BH, n, S) matrices, for short
    memories: cos = Q K^T (entries past i + offset at -inf), the top min(k, S) of each row,
    their weights p scattered into W, y = W V. Saved: W. Backward: dV = W^T dY and, for
    weights that move with the scores (gaussian_knn), dP = dY V^T, dZ = W (dP - <W, dP>)
    (softmax on the fixed support), dbeta = sum(dZ cos), dcos = beta dZ, dQ = dcos K,
    dK = dcos^T Q."""

    @staticmethod
    def forward(ctx, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                kernel: TopKNormalizer, offset: int) -> Tensor:
        B, H, n, _ = queries.shape
        S = keys.shape[2]
        wd = work_dtype(queries.dtype)
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v = (x.to(wd).reshape(B * H, x.shape[2], x.shape[3])
                       for x in (queries, keys, values))
            cos = _masked_cos(q, k, offset)
            top, idx = cos.topk(min(kernel.k, S), dim=-1)
            b = beta.detach().to(wd).view(1, H).expand(B, H).reshape(B * H, 1, 1)
            w = torch.zeros_like(cos).scatter_(-1, idx, kernel.top_weights(top, b))
            out = torch.bmm(w, v)
        ctx.kernel, ctx.offset = kernel, offset
        ctx.save_for_backward(queries, keys, values, beta, w)
        return out.view(B, H, n, -1).to(values.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # noqa: ANN205
        queries, keys, values, beta, w = ctx.saved_tensors
        B, H, n, _ = queries.shape
        wd = w.dtype
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v = (x.to(wd).reshape(B * H, x.shape[2], x.shape[3])
                       for x in (queries, keys, values))
            g = grad_out.to(wd).reshape(B * H, n, -1)
            dv = torch.bmm(w.transpose(1, 2), g)
            if not ctx.kernel.uniform:
                dz = torch.bmm(g, v.transpose(1, 2))
                dz.sub_((w * dz).sum(-1, keepdim=True)).mul_(w)  # 0 off the support
                cos = _masked_cos(q, k, ctx.offset).nan_to_num_(0.0, neginf=0.0)
                dbeta = (dz * cos).sum((1, 2)).view(B, H).sum(0)
                dz.mul_(beta.to(wd).view(1, H).expand(B, H).reshape(B * H, 1, 1))
                dq, dk = torch.bmm(dz, k), torch.bmm(dz.transpose(1, 2), q)
            else:  # uniform weights are constant in the scores
                dq, dk, dbeta = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(beta)
        return (dq.view(queries.shape).to(queries.dtype), dk.view(keys.shape).to(keys.dtype),
                dv.view(values.shape).to(values.dtype), dbeta.to(beta.dtype), None, None)


def _masked_cos(q: Tensor, k: Tensor, offset: int) -> Tensor:
    """Q K^T (BH, n, S) with the entries j > i + offset at -inf."""
    cos = torch.bmm(q, k.transpose(1, 2))
    i = torch.arange(q.shape[1], device=q.device).view(-1, 1)
    j = torch.arange(k.shape[1], device=q.device).view(1, -1)
    return cos.masked_fill_(j > i + offset, float("-inf"))


def _flat_index(idx: Tensor, S: int) -> Tensor:
    """Columns (BH, n, k) of per-head key rows -> rows of the (BH S, D) flattened keys."""
    return idx + torch.arange(idx.shape[0], device=idx.device).view(-1, 1, 1) * S


def _weighted_rows(x: Tensor, rows: Tensor, w: Tensor) -> Tensor:
    """sum_j w[i, j] x[rows[i, j]] for (N, k) rows and weights: (N, D), one fused bag-sum."""
    return F.embedding_bag(rows, x, per_sample_weights=w, mode="sum")


class _TopKRetrieval(torch.autograd.Function):
    """Retrieval with a kNN kernel over :class:`_Tiles` (the strict past with an offset, or
    visible intervals; beta (B or 1, H, n or 1, 1)): per tile of query rows the score GEMM and the
    exact top k (:func:`top_k_blocks`); saved: the k columns and cosines per row. The weights,
    the output and the whole backward work on those k entries: bag-sums of k key or value rows
    (``embedding_bag``), one gather of k value rows per query and index-adds into dK and dV,
    in row chunks of about ``chunk_elements`` gathered numbers."""

    @staticmethod
    def forward(ctx, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                kernel: TopKNormalizer, tiles: Callable[..., _Tiles]) -> Tensor:
        B, H, n, _ = queries.shape
        S, hv = keys.shape[2], values.shape[-1]
        wd = work_dtype(queries.dtype)
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v = (x.to(wd).reshape(B * H, x.shape[2], x.shape[3])
                       for x in (queries, keys, values))
            top = min(kernel.k, S)
            cos = q.new_full((B * H, n, top), float("-inf"))
            idx = torch.zeros(B * H, n, top, dtype=torch.long, device=q.device)
            grid = tiles(q, k, v, 1)
            for lo, hi, c0, c1 in grid:
                s = grid.scores(q, lo, hi, c0, c1)
                kk = min(top, s.shape[-1])
                cos[:, lo:hi, :kk], idx[:, lo:hi, :kk] = top_k_blocks(s, kk)
                idx[:, lo:hi, :kk] += c0
            rows = _flat_index(idx.clamp_(max=max(S - 1, 0)), S).view(B * H * n, top)  # p = 0
            p = kernel.top_weights(cos, _flat_rows(beta.detach().to(wd), B, H)) if top else cos
            out = (_weighted_rows(v.reshape(-1, hv), rows, p.view(B * H * n, top)) if S > 0
                   else q.new_zeros(B * H * n, hv))
        ctx.kernel, ctx.rows = kernel, (cos, rows, p)
        ctx.save_for_backward(queries, keys, values, beta)
        return out.view(B, H, n, hv).to(values.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # noqa: ANN205
        queries, keys, values, beta = ctx.saved_tensors
        kernel = ctx.kernel
        cos, rows, p = ctx.rows
        B, H, n, hs = queries.shape
        S, hv = keys.shape[2], values.shape[-1]
        wd = work_dtype(queries.dtype)
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v = (x.to(wd).reshape(B * H * x.shape[2], x.shape[3])
                       for x in (queries, keys, values))
            g = grad_out.to(wd).reshape(B * H * n, hv)
            top = rows.shape[-1]
            p, cos = p.view(B * H * n, top), cos.view(B * H * n, top)
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            dbeta = q.new_zeros(B * H * n)
            bb = _flat_rows(beta.to(wd), B, H).expand(B * H, n, 1).reshape(-1, 1)  # per flat row
            scores_move = not kernel.uniform
            chunk = max(1, kernel.chunk_elements // max(1, top * max(hs, hv)))
            buf = q.new_empty(min(chunk, B * H * n) * top * max(hs, hv))
            for lo in range(0, B * H * n if S > 0 else 0, chunk):
                hi = min(B * H * n, lo + chunk)
                ix, pc, gc = rows[lo:hi], p[lo:hi], g[lo:hi]
                flat = ix.reshape(-1)
                outer = buf[:flat.numel() * hv].view(hi - lo, top, hv)
                dv.index_add_(0, flat, torch.mul(pc.unsqueeze(-1), gc.unsqueeze(1), out=outer)
                              .view(-1, hv))
                if not scores_move:
                    continue
                picked = torch.index_select(v, 0, flat, out=outer.view(-1, hv))
                dp = torch.bmm(picked.view(hi - lo, top, hv), gc.unsqueeze(-1)).squeeze(-1)
                dz = entmax_backward(pc, dp, 1.0)  # softmax on the fixed support
                dbeta[lo:hi] = (dz * torch.where(pc > 0, cos[lo:hi], 0.0)).sum(-1)
                dz.mul_(bb[lo:hi])  # d cos = beta dz
                dq[lo:hi] = _weighted_rows(k, ix, dz)
                outer = buf[:flat.numel() * hs].view(hi - lo, top, hs)
                dk.index_add_(0, flat, torch.mul(dz.unsqueeze(-1), q[lo:hi].unsqueeze(1),
                                                 out=outer).view(-1, hs))
        return (dq.view(queries.shape).to(queries.dtype), dk.view(keys.shape).to(keys.dtype),
                dv.view(values.shape).to(values.dtype),
                dbeta.view(B, H, n, 1).sum_to_size(beta.shape).to(beta.dtype), None, None)
