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

from ..cache import KernelMemory
from ..ops.causal import causal_attention, interval_attention
from ..ops.intervals import (
    attend_plan,
    bounds_mask,
    causal_offset,
    check_attend_args,
    interval_bounds,
    run_plan,
    shared_slice,
)
from .base import Kernel, batched_rows, extend_mask, register_kernel, work_precision


@register_kernel("gaussian")
class GaussianKernel(Kernel):
    """Softmax attention over the strict past (the reference Memory Mosaics kernel)."""

    compile_traceable = True

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

    def weights(self, cos: Tensor, beta: Tensor, mask: Tensor) -> Tensor:
        """softmax(beta * cos) over the unmasked entries; a row with none is 0."""
        z = (cos * beta).masked_fill(~mask, float("-inf"))
        return torch.softmax(z, dim=-1).nan_to_num(0.0)

    def weights_backward(self, p: Tensor, dp: Tensor, cos: Tensor, beta: Tensor,
                         mask: Tensor) -> tuple[Tensor, Tensor]:
        dz = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
        return dz * beta, (dz * cos.masked_fill(~mask, 0.0)).sum_to_size(beta.shape)

    def row_weights(self, cos: Tensor, beta: Tensor) -> tuple[Tensor, None]:
        """softmax(beta * cos) over all S entries of one decoding row."""
        return torch.softmax(cos * beta, dim=-1), None

    def decode_row(self, query: Tensor, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
        """:func:`decode_softmax`."""
        return decode_softmax(query, keys, values, beta)

    def step(self, memory: KernelMemory, queries: Tensor, keys: Tensor, values: Tensor,
             beta: Tensor, lo: Tensor | None = None, hi: Tensor | None = None,
             base: int = 0) -> tuple[Tensor, KernelMemory]:
        if lo is not None:
            return super().step(memory, queries, keys, values, beta, lo, hi, base)
        state = memory.append(keys, values)
        n, total = queries.shape[2], len(state)
        if n == 1:
            return self.decode_row(queries, state.keys, state.values, beta), state
        mask = extend_mask(n, total - keys.shape[2], keys.shape[2], queries.device)
        H = queries.shape[1]
        scores = (queries.float() @ state.keys.float().transpose(-1, -2)) * beta.view(1, H, 1, 1)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no memory -> 0
        return (weights @ state.values.float()).to(values.dtype), state

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
               lo: Tensor, hi: Tensor) -> Tensor:
        """softmax_j(beta_i cos(q_i, k_j)) over lo[i] <= j <= hi[i] (see :meth:`Kernel.attend`).

        Per chunk of query rows (:func:`~mosaics.ops.intervals.attend_plan`): the fused
        attention of the scaled queries beta_i q_i against the columns the chunk sees, with a
        boolean mask (B or 1, 1, rows, columns); see :func:`interval_softmax`. Runs in the dtype of
        :meth:`forward` (autocast's for the fused attention), with the same dropout.

        Intervals 0..i+d with d <= 0 (the strict past, a gap of -d) take the causal path of
        :meth:`forward` instead: rows -d.. against the keys before them with a causal mask,
        no mask tensor at all.

        On CPU without dropout all chunks run in one autograd Function
        (:func:`~mosaics.ops.causal.interval_attention`: O(n) saved, masks rebuilt in
        backward). Elsewhere, memory: the fused backward keeps each chunk's mask. When
        all chunks' masks together would exceed ``chunk_elements`` numbers (long documents,
        rather than a short window), each chunk is recomputed in backward instead
        (activation checkpointing: one more forward per chunk, O(n) saved).
        """
        beta4 = check_attend_args(queries, keys, values, beta, lo, hi)
        B, H, n, _ = queries.shape
        scale = beta4.to(queries.dtype)
        drop = self.dropout if self.training else 0.0
        offset = causal_offset(lo, hi)
        if offset is not None and offset <= 0:
            return self._causal_attend(queries, keys, values, scale, -offset, drop)
        cols = shared_slice(lo, hi, keys.shape[2]) if n == 1 and drop == 0.0 else None
        if cols is not None:  # decoding, one interval for the whole batch: a slice
            a, b = cols
            if b <= a:
                return values.new_zeros(B, H, 1, values.shape[-1])
            return decode_softmax(queries, keys[:, :, a:b], values[:, :, a:b], scale)
        if n == 1 and drop == 0.0:  # decoding, an interval per row (e.g. left padding)
            return decode_softmax_rows(queries, keys, values, scale, lo, hi)
        plan = attend_plan(lo, hi, keys.shape[2], B * H, self.chunk_elements)
        if drop == 0.0:
            y = interval_attention(queries * scale, keys, values, lo, hi, plan)
            if y is not None:
                return y.to(values.dtype)
        masks = max(lo.shape[0], hi.shape[0]) * sum((b - a) * (c1 - c0) for a, b, c0, c1 in plan)
        recompute = masks > self.chunk_elements and torch.is_grad_enabled() and any(
            t.requires_grad for t in (queries, keys, values, beta))
        def args(a: int, b: int, c0: int, c1: int) -> tuple:
            return (queries[:, :, a:b], keys[:, :, c0:c1], values[:, :, c0:c1],
                    scale if scale.shape[2] == 1 else scale[:, :, a:b],
                    interval_bounds(lo, a, b, c0), interval_bounds(hi, a, b, c0), drop)

        y = run_plan(plan, n, lambda m: values.new_zeros(B, H, m, values.shape[-1]),
                     interval_softmax, args, recompute)
        return y.to(values.dtype)

    def _causal_attend(self, queries: Tensor, keys: Tensor, values: Tensor, scale: Tensor,
                       gap: int, dropout: float) -> Tensor:
        """Query i sees the entries 0..i-gap (gap >= 0): queries gap.. against keys
        0..n-gap-1 with a causal mask (top-left aligned: row r sees j <= r); rows < gap are 0.
        ``scale``: (B or 1, H, n or 1, 1) bandwidths."""
        B, H, n, _ = queries.shape
        hv = values.shape[-1]
        width = min(keys.shape[2], n - gap)
        if width <= 0:
            return values.new_zeros(B, H, n, hv)
        q = queries[:, :, gap:] * (scale if scale.shape[2] == 1 else scale[:, :, gap:])
        y = causal_attention(q, keys[:, :, :width], values[:, :, :width], scale=1.0,
                             dropout_p=dropout, block=self.causal_block)
        return F.pad(y, (0, 0, gap, 0)).to(values.dtype)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, causal_block={self.causal_block}"


def decode_softmax(query: Tensor, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
    """One decoding query against the whole memory: softmax(beta q K^T) V.

    Args:
        query: (B, H, 1, hs); keys, values: (B, H, S, hs) (views of the preallocated
            buffers: ``bmm`` reads them in place); beta: (H,), or (B or 1, H, 1, 1) for a
            bandwidth per query row.
    Returns:
        (B, H, 1, hs) in the values' dtype, 0 for an empty memory; fp32 (fp64 stays fp64)
        inside. Two batched GEMVs and a softmax: at one query row the fused attention
        kernel's set-up costs more than the work (measured 2x).
    """
    B, H, _, hv = values.shape
    if keys.shape[2] == 0:
        return values.new_zeros(B, H, 1, hv)
    q = work_precision(query) * work_precision(beta).view(-1, H, 1, 1)
    scores = torch.bmm(batched_rows(q), batched_rows(work_precision(keys)).transpose(1, 2))
    y = torch.bmm(torch.softmax(scores, dim=-1), batched_rows(work_precision(values)))
    y = y.view(B, H, 1, hv)
    return y if y.dtype == values.dtype else y.to(values.dtype)


def decode_softmax_rows(query: Tensor, keys: Tensor, values: Tensor, beta: Tensor, lo: Tensor,
                        hi: Tensor) -> Tensor:
    """:func:`decode_softmax` where batch row b sees the entries lo[b] <= j <= hi[b] only
    ((B or 1, 1) bounds): the scores of the columns the rows span together, the others set
    to -inf before the softmax. (B, H, 1, hv); a row that sees nothing gets 0."""
    B, H, _, hv = values.shape
    a, b = max(int(lo.min()), 0), min(int(hi.max()) + 1, keys.shape[2])
    if b <= a:
        return values.new_zeros(B, H, 1, hv)
    q = work_precision(query) * work_precision(beta).view(-1, H, 1, 1)
    k, v = work_precision(keys[:, :, a:b]), work_precision(values[:, :, a:b])
    scores = torch.bmm(batched_rows(q), batched_rows(k).transpose(1, 2)).view(B, H, 1, b - a)
    col = torch.arange(a, b, device=keys.device).view(1, -1)
    seen = (col >= lo.view(-1, 1)) & (col <= hi.view(-1, 1))  # (B or 1, b - a)
    scores = scores.masked_fill(~seen.view(-1, 1, 1, b - a), float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0).view(B * H, 1, b - a)
    y = torch.bmm(weights, batched_rows(v)).view(B, H, 1, hv)
    return y if y.dtype == values.dtype else y.to(values.dtype)


def interval_softmax(q: Tensor, k: Tensor, v: Tensor, scale: Tensor, lo: Tensor, hi: Tensor,
                     dropout: float = 0.0) -> Tensor:
    """softmax_j(scale_i q_i . k_j) v over the columns lo[i] <= j <= hi[i], 0 where none.

    Args:
        q: (B, H, n, hs); k, v: (B, H, S, hs), (B, H, S, hv); scale: (B or 1, H, n or 1, 1);
        lo, hi: (B or 1, n) integer bounds relative to k's first column.
    One fused attention call with a boolean mask (B or 1, 1, n, S). A row that sees nothing
    gets one column unmasked (the fused kernel returns NaN for a fully masked row) and its
    output set to 0, so no NaN reaches the gradients either.
    """
    mask = bounds_mask(lo, hi, k.shape[2])
    sees = mask.any(-1, keepdim=True)
    mask[..., :1] |= ~sees
    y = F.scaled_dot_product_attention(q * scale, k, v, attn_mask=mask, dropout_p=dropout,
                                       scale=1.0)
    return torch.where(sees, y, 0.0)
