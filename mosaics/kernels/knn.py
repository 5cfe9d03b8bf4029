"""k-nearest-neighbour kernels: only the k highest scores of each row get weight.

    gaussian_knn:  w_ts = softmax over the top-k of {beta * cos(k_t, k_s) : s < t}, 0 elsewhere
    uniform_knn:   w_ts = 1 / min(k, t) on the top-k, 0 elsewhere

Option (``kernel_kwargs``): ``k`` (default 16). Exactly min(k, t) entries are selected (ties
broken by ``topk``). The uniform weights are piecewise constant in the scores, so keys and
bandwidth get no gradient through them (values do).

Training retrieval (:class:`_TopKRetrieval`): one score GEMM per tile of query rows, then the
k best entries of each row, found exactly without a top-k over the whole row: the k-th largest
of the row's 16 strided block maxima is a lower bound of its k-th largest entry, so the top k
lie in the blocks whose max reaches that bound (about k of them), and a top-k over those
blocks alone gives them. Everything after that works on the k selected entries per row
(gathers of k key / value rows and scatter-adds), and the backward needs no score matrix.

On CUDA (or with ``MOSAICS_FUSED=1``) the training / prompt retrieval and ``attend`` with one
bandwidth per head take the fused Triton kernels of
:func:`mosaics.ops.knn_attention.knn_attention` instead (ties at the k-th score go to the
lowest columns there); float64, k above ``MAX_K`` (below the memory length), per-query
bandwidths and ALiBi stay here. Decoding one row keeps :func:`~.base.decode_row`.

Short memories (:class:`_DenseTopKRetrieval`: at most ``dense_keys_per_k`` x k keys and
``chunk_elements`` scores in all): the whole score matrix, one top-k per row, the weights
scattered into a dense (n, S) matrix and every product a batched GEMM. A gathered or
scattered row costs far more per number than a GEMM, while the dense form's work grows with
S instead of k: measured (``bench/knn_bound.py``, one thread), the dense form is 1.7-3.3x
faster up to S = 4 k, about even at 8 k and slower beyond.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..ops.entmax import BLOCK, block_max, entmax_backward, shifted_scores, work_dtype
from ..ops.knn_attention import knn_attention, knn_unsupported
from ..ops.score_retrieval import _flat_rows, _Tiles
from ..ops.triton_backend import fused_expected, fused_reason, note_path
from .base import register_kernel
from .score_kernel import ScoreKernel, check_positive_int


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


class _KNNKernel(ScoreKernel):
    dense_keys_per_k: float = 6.0  # the dense form up to this many keys per selected entry
    uniform: bool = False  # the 1 / count weights (uniform_knn) instead of the softmax

    def __init__(self, k: int = 16) -> None:
        super().__init__()
        self.k = check_positive_int(self.name, "k", k)

    def top_weights(self, cos: Tensor, beta: Tensor) -> Tensor:
        """(..., k) weights of the selected entries from their cosines (-inf: none)."""
        raise NotImplementedError

    def fused(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor, offset: int = 0,
              lo: Tensor | None = None, hi: Tensor | None = None) -> Tensor | None:
        """:func:`~mosaics.ops.knn_attention.knn_attention` (Triton) where the switch and the
        inputs allow it, else None (the chunked path); the path taken goes to ``note_path``."""
        reason = fused_reason(queries, keys, values)
        if reason is None:
            reason = knn_unsupported(queries, keys, values, self.k)
        note_path(self.name, reason, expected=fused_expected(queries))
        if reason is not None:
            return None
        return knn_attention(queries, keys, values, beta, offset, self.k, self.uniform, lo, hi)

    def fused_retrieval(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                        lo: Tensor, hi: Tensor, slopes: Tensor | None = None,
                        pos0: int = 0) -> Tensor | None:
        """:meth:`attend` over the intervals lo[i] <= j <= hi[i] through :meth:`fused`, for
        one bandwidth per head ((1, H, 1, 1)) and no ALiBi bias; else None."""
        H = queries.shape[1]
        if slopes is not None or beta.shape != (1, H, 1, 1):
            why = "an ALiBi bias" if slopes is not None else "a bandwidth per query"
            note_path(self.name, f"{why} (the fused kNN kernels take one per head)",
                      expected=fused_expected(queries))
            return None
        return self.fused(queries, keys, values, beta.view(H), lo=lo, hi=hi)

    def retrieval(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                  offset: int) -> Tensor:
        y = self.fused(queries, keys, values, beta, offset)
        if y is not None:
            return y
        B, H, n, _ = queries.shape
        S = keys.shape[2]
        dense_ok = self.dense_keys_per_k * self.k >= S
        if 0 < B * H * n * S <= self.chunk_elements and dense_ok:
            return _DenseTopKRetrieval.apply(queries, keys, values, beta, self, offset)
        return self.tiled(queries, keys, values, beta.view(1, -1, 1, 1),
                          self.past_tiles(offset))

    def tiled(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
              tiles: Callable[..., _Tiles]) -> Tensor:
        return _TopKRetrieval.apply(queries, keys, values, beta, self, tiles)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, k={self.k}"


@register_kernel("gaussian_knn")
class GaussianKNNKernel(_KNNKernel):
    """Softmax restricted to the k best-scoring memory entries (truncated Gaussian kNN)."""

    def score_weights(self, z: Tensor, mask: Tensor) -> Tensor:
        x = shifted_scores(z, mask)
        support = top_k_support(x, self.k)
        e = torch.where(support, x.exp(), 0.0)
        return e / e.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)

    def score_backward(self, p: Tensor, dp: Tensor, z: Tensor, mask: Tensor) -> Tensor:
        return entmax_backward(p, dp, 1.0)  # softmax on a fixed support: p (dp - <p, dp>)

    def top_weights(self, cos: Tensor, beta: Tensor) -> Tensor:
        e = ((cos - cos.amax(dim=-1, keepdim=True).nan_to_num(0.0, neginf=0.0)) * beta).exp()
        return e / e.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)


@register_kernel("uniform_knn")
class UniformKNNKernel(_KNNKernel):
    """Uniform weights 1 / min(k, t) on the k best-scoring memory entries."""

    uniform = True

    def score_weights(self, z: Tensor, mask: Tensor) -> Tensor:
        support = top_k_support(shifted_scores(z, mask), self.k).to(z.dtype)
        return support / support.sum(dim=-1, keepdim=True).clamp_min(1.0)

    def score_backward(self, p: Tensor, dp: Tensor, z: Tensor, mask: Tensor) -> Tensor:
        return torch.zeros_like(p)

    def top_weights(self, cos: Tensor, beta: Tensor) -> Tensor:
        found = torch.isfinite(cos).to(cos.dtype)
        return found / found.sum(dim=-1, keepdim=True).clamp_min(1.0)


class _DenseTopKRetrieval(torch.autograd.Function):
    """Strict-past retrieval with a kNN kernel through dense (BH, n, S) matrices, for short
    memories: cos = Q K^T (entries past i + offset at -inf), the top min(k, S) of each row,
    their weights p scattered into W, y = W V. Saved: W. Backward: dV = W^T dY and, for
    weights that move with the scores (gaussian_knn), dP = dY V^T, dZ = W (dP - <W, dP>)
    (softmax on the fixed support), dbeta = sum(dZ cos), dcos = beta dZ, dQ = dcos K,
    dK = dcos^T Q."""

    @staticmethod
    def forward(ctx, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                kernel: _KNNKernel, offset: int) -> Tensor:
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
            if isinstance(ctx.kernel, GaussianKNNKernel):
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
                kernel: _KNNKernel, tiles: Callable[..., _Tiles]) -> Tensor:
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
            scores_move = isinstance(kernel, GaussianKNNKernel)
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
