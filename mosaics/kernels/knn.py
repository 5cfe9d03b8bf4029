"""k-nearest-neighbour kernels: only the k highest scores of each row get weight.

    gaussian_knn:  w_ts = softmax over the top-k of {beta * cos(k_t, k_s) : s < t}, 0 elsewhere
    uniform_knn:   w_ts = 1 / min(k, t) on the top-k, 0 elsewhere

Option (``kernel_kwargs``): ``k`` (default 16). Exactly min(k, t) entries are selected (ties
broken by ``topk``). The uniform weights are piecewise constant in the scores, so keys and
bandwidth get no gradient through them (values do).

Training retrieval: :func:`mosaics.ops.topk_retrieval.top_k_retrieval`, one score GEMM per
tile of query rows and the exact top k of each row from its block maxima, then only the k
selected entries per row.

On CUDA (or with ``MOSAICS_FUSED=1``) the training / prompt retrieval and ``attend`` with one
bandwidth per head take the fused Triton kernels of
:func:`mosaics.ops.knn_attention.knn_attention` instead (ties at the k-th score go to the
lowest columns there); float64, k above ``MAX_K`` (below the memory length), per-query
bandwidths and ALiBi stay here. Decoding one row keeps :meth:`~.base.Kernel.decode_row`.

Short memories (at most ``dense_keys_per_k`` x k keys and ``chunk_elements`` scores in all)
take :func:`mosaics.ops.topk_retrieval.dense_top_k_retrieval`: the whole score matrix, one
top-k per row, the weights scattered into a dense (n, S) matrix and every product a batched
GEMM. A gathered or scattered row costs far more per number than a GEMM, while the dense
form's work grows with S instead of k: measured (``bench/knn_bound.py``, one thread), the
dense form is 1.7-3.3x faster up to S = 4 k, about even at 8 k and slower beyond.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..ops.entmax import entmax_backward, shifted_scores
from ..ops.knn_attention import knn_attention, knn_unsupported
from ..ops.score_retrieval import _Tiles
from ..ops.topk_retrieval import dense_top_k_retrieval, top_k_retrieval, top_k_support
from ..ops.triton_backend import fused_expected, fused_reason, note_path
from .base import register_kernel
from .score_kernel import ScoreKernel, check_positive_int


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
            return dense_top_k_retrieval(queries, keys, values, beta, self, offset)
        return self.tiled(queries, keys, values, beta.view(1, -1, 1, 1),
                          self.past_tiles(offset))

    def tiled(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
              tiles: Callable[..., _Tiles]) -> Tensor:
        return top_k_retrieval(queries, keys, values, beta, self, tiles)

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
