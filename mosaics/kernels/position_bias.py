"""ALiBi: a linear position bias on the kernel scores, for any score-based kernel.

The query at t scores memory entry s < t with

    z_ts = beta_h cos(k_t, k_s) - m_h (t - s),

and the kernel's normalizer turns the biased scores into weights (softmax for the Gaussian
kernel, alpha-entmax for epanechnikov / biweight / triweight, top-k for the kNN kernels, the
normalized ReLU for relumax and epanechnikov_fixed). m_h are the standard per-head slopes of
Press et al. (2022), :func:`alibi_slopes`. Every score-based kernel is a function of
z = beta * cos (and of beta alone), so the bias enters as shifted cosines
cos' = cos - m (t - s) / beta given to the kernel's own ``weights`` / ``weights_backward``.

The retrieval is the score kernels' chunked one (a (B, H, rows, S) block at a time, each
recomputed in backward) with the bias added per chunk, differentiable through the kernel's
hand-written weight backward; it serves the v1 contextual memory in training, prefill and
decoding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops.score_retrieval import _ChunkedRetrieval
from .base import Kernel
from .score_kernel import PowerKernel


def alibi_slopes(n_head: int) -> Tensor:
    """The ALiBi slopes m_h, (H,): 2^(-8 h / H) for h = 1..H when H is a power of two; else
    those of the nearest lower power of two n, followed by every other slope of 2n."""
    if not isinstance(n_head, int) or n_head < 1:
        raise ValueError(f"alibi_slopes: n_head must be a positive integer, got {n_head!r}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    n = 2 ** int(math.floor(math.log2(n_head)))
    slopes = geometric(n) + geometric(2 * n)[::2][: n_head - n]
    return torch.tensor(slopes, dtype=torch.float64)


def supports_score_bias(kernel: Kernel) -> bool:
    """Whether ``kernel`` exposes its normalizer as ``weights(cos, beta, mask)`` with
    ``weights_backward`` (every built-in kernel but FSKA, whose weights are feature maps)."""
    return kernel.has_weights()


def biased_retrieval(kernel: Kernel, queries: Tensor, keys: Tensor, values: Tensor,
                     beta: Tensor, slopes: Tensor, offset: int) -> Tensor:
    """y_i = sum_j w_ij v_j, w_i. = kernel normalizer of beta cos(q_i, k_j) - m (t_i - j)
    over the entries j <= i + offset, with t_i = i + offset + 1 (the query's position when the
    entries sit at positions 0..S-1).

    Args:
        queries: (B, H, n, hs) unit queries; keys: (B, H, S, hs); values: (B, H, S, hv).
        beta: (H,) bandwidths; slopes: (H,) ALiBi slopes m_h; offset: query i sees j <= i +
            offset (0: the strict past of a whole sequence given as queries 1..T-1).
    Returns:
        (B, H, n, hv) in the values' dtype; a row that sees no entry is 0. The kernel's fused
        path where it serves the call (``ScoreKernel.fused_retrieval``), else the chunked
        retrieval of the score kernels (``mosaics.ops.score_retrieval._ChunkedRetrieval``)
        with the bias; either saves O(n) for backward.
    """
    H = queries.shape[1]
    if beta.shape != (H,) or slopes.shape != (H,):
        raise ValueError(f"beta and slopes must have shape (H,) = ({H},), got "
                         f"{tuple(beta.shape)} and {tuple(slopes.shape)}")
    if isinstance(kernel, PowerKernel) and kernel.fused_skip_reason(queries, keys, values) is None:
        hi = (torch.arange(queries.shape[2], device=queries.device) + int(offset)).view(1, -1)
        return kernel.fused_retrieval(queries, keys, values, beta.view(1, H, 1, 1),
                                      torch.zeros_like(hi), hi, slopes=slopes.detach(),
                                      pos0=int(offset) + 1)
    return _ChunkedRetrieval.apply(queries, keys, values, beta, kernel, int(offset),
                                   slopes.detach())
