"""Shared machinery of "score-normalizer" kernels: w_t. = normalizer(beta * cos(k_t, k_s), s < t).

A :class:`ScoreKernel` subclass only says how a block of cosine rows becomes weights
(:meth:`ScoreKernel.weights`) and how a weight gradient flows back to the cosines and the
bandwidth (:meth:`ScoreKernel.weights_backward`). This module turns that into the strict-past
retrieval y = W V for training and decoding, with

- fp32 weights under any autocast (fp64 inputs stay fp64), output in the values' dtype;
- memory linear in T per query chunk: queries are processed in chunks of rows, only the
  inputs (and optionally a few numbers per row, e.g. entmax thresholds) are saved for
  backward and each chunk's weights are recomputed there, so no T x T matrix is ever alive
  (peak extra memory ~ a few chunk x T fp32 blocks);
- a hand-written backward: dV = W^T dY, dW = dY V^T, then the kernel's own weight backward
  (no autograd through sorting or iterative solvers), then
  dQ = beta dS K, dK = beta dS^T Q, dbeta = sum(dS * cos) for scores S = beta * cos.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .base import Kernel, KernelState, append_memory
from .normalizers import work_dtype

CHUNK_ELEMENTS = 2**21  # target size of one (B, H, rows, keys) fp32 block, ~8 MB


class ScoreKernel(Kernel):
    """Base class of kernels whose weights normalize the scores beta * cos over s < t.

    Subclasses implement :meth:`score_weights` / :meth:`score_backward` (functions of the
    scores z = beta * cos), or override :meth:`weights` / :meth:`weights_backward` when the
    bandwidth enters in another way. ``chunk_elements`` bounds the size of one query chunk.
    """

    chunk_elements: int = CHUNK_ELEMENTS

    # --- what a subclass defines -----------------------------------------------------------
    def score_weights(self, z: Tensor, mask: Tensor) -> Tensor:
        """(..., n, S) work-dtype scores, (n, S) bool mask -> weights; 0 where masked."""
        raise NotImplementedError

    def score_backward(self, p: Tensor, dp: Tensor, z: Tensor, mask: Tensor) -> Tensor:
        """Gradient w.r.t. the scores z given weights p and their gradient dp."""
        raise NotImplementedError

    def weights(self, cos: Tensor, beta: Tensor, mask: Tensor) -> Tensor:
        """(B, H, n, S) cosines, (1, H, 1, 1) bandwidth, (n, S) mask -> (B, H, n, S) weights."""
        return self.score_weights(cos * beta, mask)

    def weights_and_state(self, cos: Tensor, beta: Tensor,
                          mask: Tensor) -> tuple[Tensor, Tensor | None]:
        """Weights plus an optional small per-row state (B, H, n, c) kept for backward."""
        return self.weights(cos, beta, mask), None

    def weights_from_state(self, cos: Tensor, beta: Tensor, mask: Tensor,
                           state: Tensor | None) -> Tensor:
        """Recompute the weights in backward, helped by the state of :meth:`weights_and_state`."""
        return self.weights(cos, beta, mask)

    def weights_backward(self, p: Tensor, dp: Tensor, cos: Tensor, beta: Tensor,
                         mask: Tensor) -> tuple[Tensor, Tensor]:
        """Gradients (d cos (B, H, n, S), d beta (H,)) given the weights p and dp."""
        dz = self.score_backward(p, dp, cos * beta, mask)
        return dz * beta, (dz * cos).sum(dim=(0, 2, 3))

    # --- the Kernel interface --------------------------------------------------------------
    def forward(self, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
        B, H, T, _ = keys.shape
        out = values.new_zeros(B, H, T, values.shape[-1])
        if T < 2:
            return out
        y = retrieve(self, keys[:, :, 1:], keys[:, :, :-1], values[:, :, :-1], beta, 0)
        return torch.cat([out[:, :, :1], y], dim=2)

    def extend(self, state: KernelState, queries: Tensor, keys: Tensor, values: Tensor,
               beta: Tensor) -> tuple[Tensor, KernelState]:
        state = append_memory(state, keys, values)
        offset = state["keys"].shape[2] - queries.shape[2]
        y = retrieve(self, queries, state["keys"], state["values"], beta, offset)
        return y, state


def retrieve(kernel: ScoreKernel, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
             offset: int) -> Tensor:
    """y_i = sum_j w_ij v_j where query i sees memory entries j <= i + offset.

    Args:
        queries: (B, H, n, hs); keys: (B, H, S, hs); values: (B, H, S, hv); beta: (H,).
    Returns:
        (B, H, n, hv) in the values' dtype; rows with no visible entry are 0.
    """
    if beta.dim() != 1 or beta.shape[0] != queries.shape[1]:
        raise ValueError(f"beta must have shape (H,) = ({queries.shape[1]},), "
                         f"got {tuple(beta.shape)}")
    return _ChunkedRetrieval.apply(queries, keys, values, beta, kernel, int(offset))


def _chunks(n: int, S: int, offset: int, rows: int):
    """(first row, end row, visible keys) of each query chunk that sees at least one key."""
    for a in range(0, n, rows):
        b = min(n, a + rows)
        width = min(S, b + offset)  # the last row b - 1 sees j <= b - 1 + offset
        if width > 0:
            yield a, b, width


def _rows_per_chunk(kernel: ScoreKernel, batch_heads: int, S: int) -> int:
    return max(1, kernel.chunk_elements // max(1, batch_heads * S))


def _chunk_mask(a: int, b: int, width: int, offset: int, device: torch.device) -> Tensor:
    i = torch.arange(a, b, device=device).view(-1, 1)
    j = torch.arange(width, device=device).view(1, -1)
    return j <= i + offset


class _ChunkedRetrieval(torch.autograd.Function):
    @staticmethod
    def forward(ctx, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                kernel: ScoreKernel, offset: int) -> Tensor:
        B, H, n, _ = queries.shape
        S = keys.shape[2]
        wd = work_dtype(queries.dtype)
        out = values.new_zeros(B, H, n, values.shape[-1])
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v = queries.to(wd), keys.to(wd), values.to(wd)
            bb = beta.to(wd).view(1, H, 1, 1)
            states: list[Tensor | None] = []
            chunks = list(_chunks(n, S, offset, _rows_per_chunk(kernel, B * H, S)))
            for a, b, width in chunks:
                mask = _chunk_mask(a, b, width, offset, q.device)
                cos = q[:, :, a:b] @ k[:, :, :width].transpose(-1, -2)
                p, state = kernel.weights_and_state(cos, bb, mask)
                states.append(state)
                out[:, :, a:b] = (p @ v[:, :, :width]).to(out.dtype)
        ctx.kernel, ctx.offset, ctx.states = kernel, offset, states  # O(n) per-row states
        # a single chunk is small by construction: keep it rather than recompute it
        keep = len(chunks) == 1 and any(ctx.needs_input_grad[:4])
        ctx.block = (cos, p) if keep else None
        ctx.save_for_backward(queries, keys, values, beta)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # noqa: ANN205
        queries, keys, values, beta = ctx.saved_tensors
        kernel, offset = ctx.kernel, ctx.offset
        B, H, n, _ = queries.shape
        S = keys.shape[2]
        wd = work_dtype(queries.dtype)
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v = queries.to(wd), keys.to(wd), values.to(wd)
            go = grad_out.to(wd)
            bb = beta.to(wd).view(1, H, 1, 1)
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            dbeta = torch.zeros(H, dtype=wd, device=q.device)
            chunks = _chunks(n, S, offset, _rows_per_chunk(kernel, B * H, S))
            for (a, b, width), state in zip(chunks, ctx.states):
                mask = _chunk_mask(a, b, width, offset, q.device)
                qc, kc, vc, gc = q[:, :, a:b], k[:, :, :width], v[:, :, :width], go[:, :, a:b]
                if ctx.block is not None:
                    cos, p = ctx.block
                else:
                    cos = qc @ kc.transpose(-1, -2)
                    p = kernel.weights_from_state(cos, bb, mask, state)
                dv[:, :, :width] += p.transpose(-1, -2) @ gc
                dp = gc @ vc.transpose(-1, -2)
                dcos, db = kernel.weights_backward(p, dp, cos, bb, mask)
                dcos = dcos.masked_fill(~mask, 0.0)
                dbeta += db
                dq[:, :, a:b] += dcos @ kc
                dk[:, :, :width] += dcos.transpose(-1, -2) @ qc
        return (dq.to(queries.dtype), dk.to(keys.dtype), dv.to(values.dtype),
                dbeta.to(beta.dtype), None, None)


def check_positive_int(kernel: str, name: str, value: object) -> int:
    """``value`` as an int >= 1, or a ValueError naming the kernel option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"kernel {kernel!r}: {name} must be an integer >= 1, got {value!r} "
                         f"(set kernel_kwargs={{'{name}': 16}} for example)")
    return value


def check_positive(kernel: str, name: str, value: object) -> float:
    """``value`` as a float > 0, or a ValueError naming the kernel option."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"kernel {kernel!r}: {name} must be a number > 0, got {value!r}")
    return float(value)
