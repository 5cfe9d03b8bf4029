"""Gaussian kernel: w_ts = softmax_s(beta * cos(k_t, k_s)) over s < t.

On unit vectors exp(-beta/2 ||k_t - k_s||^2) = exp(beta cos - beta), so this is the
Nadaraya-Watson estimator with a Gaussian kernel of bandwidth 1/sqrt(beta). It runs on
PyTorch's fused attention: queries at positions 1..T-1 against keys at 0..T-2 with
``is_causal=True`` is exactly "s < t", with no explicit mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Kernel, KernelState, append_memory, extend_mask, register_kernel


@register_kernel("gaussian")
class GaussianKernel(Kernel):
    """Softmax attention over the strict past (the reference Memory Mosaics kernel)."""

    def forward(self, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
        B, H, T, hs = keys.shape
        if T < 2:
            return keys.new_zeros(B, H, T, values.shape[-1])
        q = keys[:, :, 1:] * beta.view(1, H, 1, 1).to(keys.dtype)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, keys[:, :, :-1], values[:, :, :-1],
                                           is_causal=True, scale=1.0, dropout_p=p)
        return F.pad(y, (0, 0, 1, 0))  # row 0: no memory, output 0

    def extend(self, state: KernelState, queries: Tensor, keys: Tensor, values: Tensor,
               beta: Tensor) -> tuple[Tensor, KernelState]:
        state = append_memory(state, keys, values)
        n, total = queries.shape[2], state["keys"].shape[2]
        mask = extend_mask(n, total - keys.shape[2], keys.shape[2], queries.device)
        H = queries.shape[1]
        scores = (queries.float() @ state["keys"].float().transpose(-1, -2)) * beta.view(1, H, 1, 1)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no memory -> 0
        return (weights @ state["values"].float()).to(values.dtype), state
