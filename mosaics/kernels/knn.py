"""k-nearest-neighbour kernels: only the k highest scores of each row get weight.

    gaussian_knn:  w_ts = softmax over the top-k of {beta * cos(k_t, k_s) : s < t}, 0 elsewhere
    uniform_knn:   w_ts = 1 / min(k, t) on the top-k, 0 elsewhere

Option (``kernel_kwargs``): ``k`` (default 16). Exactly min(k, t) entries are selected (ties
broken by ``topk``). The uniform weights are piecewise constant in the scores, so keys and
bandwidth get no gradient through them (values do).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import register_kernel
from .normalizers import entmax_backward, shifted_scores
from .score_kernel import ScoreKernel, check_positive_int


def top_k_support(x: Tensor, k: int) -> Tensor:
    """Boolean mask of the min(k, #finite) largest finite entries of each row of x."""
    vals, idx = x.topk(min(k, x.shape[-1]), dim=-1)
    return torch.zeros_like(x, dtype=torch.bool).scatter(-1, idx, torch.isfinite(vals))


class _KNNKernel(ScoreKernel):
    def __init__(self, k: int = 16) -> None:
        super().__init__()
        self.k = check_positive_int(self.name, "k", k)

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


@register_kernel("uniform_knn")
class UniformKNNKernel(_KNNKernel):
    """Uniform weights 1 / min(k, t) on the k best-scoring memory entries."""

    def score_weights(self, z: Tensor, mask: Tensor) -> Tensor:
        support = top_k_support(shifted_scores(z, mask), self.k).to(z.dtype)
        return support / support.sum(dim=-1, keepdim=True).clamp_min(1.0)

    def score_backward(self, p: Tensor, dp: Tensor, z: Tensor, mask: Tensor) -> Tensor:
        return torch.zeros_like(p)
