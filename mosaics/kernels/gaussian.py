"""Gaussian kernel: w_ts = softmax_s(beta * cos(k_t, k_s)) over s < t.

On unit vectors exp(-beta/2 ||k_t - k_s||^2) = exp(beta cos - beta), so this is the
Nadaraya-Watson estimator with a Gaussian kernel of bandwidth 1/sqrt(beta). It runs on
fused causal attention: queries at positions 1..T-1 against keys at 0..T-2 with a causal
mask is exactly "s < t". On CPU, ``causal_attention`` skips the masked half of the scores in
blocks of up to ``causal_block`` queries (0 turns that off), which PyTorch's kernel does not below
about a thousand positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import (
    Kernel,
    KernelState,
    append_memory,
    batched_rows,
    extend_mask,
    register_kernel,
    work_precision,
)
from .causal_attention import causal_attention


@register_kernel("gaussian")
class GaussianKernel(Kernel):
    """Softmax attention over the strict past (the reference Memory Mosaics kernel)."""

    def __init__(self, causal_block: int = 128) -> None:
        super().__init__()
        if isinstance(causal_block, bool) or not isinstance(causal_block, int) or causal_block < 0:
            raise ValueError(f"kernel 'gaussian': causal_block must be an integer >= 0 (0: one "
                             f"fused call), got {causal_block!r}")
        self.causal_block = causal_block

    def forward(self, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
        B, H, T, hs = keys.shape
        if T < 2:
            return keys.new_zeros(B, H, T, values.shape[-1])
        q = keys[:, :, 1:] * beta.view(1, H, 1, 1).to(keys.dtype)
        p = self.dropout if self.training else 0.0
        y = causal_attention(q, keys[:, :, :-1], values[:, :, :-1], scale=1.0, dropout_p=p,
                             block=self.causal_block)
        # row 0: no memory, output 0. Padded as (B, T, H, hs), the fused kernel's output layout,
        # so merging the heads afterwards is a view instead of a copy
        return F.pad(y.transpose(1, 2), (0, 0, 0, 0, 1, 0)).transpose(1, 2)

    def extend(self, state: KernelState, queries: Tensor, keys: Tensor, values: Tensor,
               beta: Tensor) -> tuple[Tensor, KernelState]:
        state = append_memory(state, keys, values)
        n, total = queries.shape[2], state["keys"].shape[2]
        if n == 1:
            return decode_softmax(queries, state["keys"], state["values"], beta), state
        mask = extend_mask(n, total - keys.shape[2], keys.shape[2], queries.device)
        H = queries.shape[1]
        scores = (queries.float() @ state["keys"].float().transpose(-1, -2)) * beta.view(1, H, 1, 1)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no memory -> 0
        return (weights @ state["values"].float()).to(values.dtype), state

    def extra_repr(self) -> str:
        return f"name={self.name!r}, causal_block={self.causal_block}"


def decode_softmax(query: Tensor, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
    """One decoding query against the whole memory: softmax(beta q K^T) V.

    Args:
        query: (B, H, 1, hs); keys, values: (B, H, S, hs) (views of the preallocated
            buffers: ``bmm`` reads them in place); beta: (H,).
    Returns:
        (B, H, 1, hs) in the values' dtype, 0 for an empty memory; fp32 (fp64 stays fp64)
        inside. Two batched GEMVs and a softmax: at one query row the fused attention
        kernel's set-up costs more than the work (measured 2x).
    """
    B, H, _, hv = values.shape
    if keys.shape[2] == 0:
        return values.new_zeros(B, H, 1, hv)
    q = work_precision(query) * work_precision(beta).view(1, H, 1, 1)
    scores = torch.bmm(batched_rows(q), batched_rows(work_precision(keys)).transpose(1, 2))
    y = torch.bmm(torch.softmax(scores, dim=-1), batched_rows(work_precision(values)))
    y = y.view(B, H, 1, hv)
    return y if y.dtype == values.dtype else y.to(values.dtype)
