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
  (no autograd through iterative solvers), then
  dQ = beta dS K, dK = beta dS^T Q, dbeta = sum(dS * cos) for scores S = beta * cos.

That generic path serves kernels written against the two methods above. Kernels of the form
[a (c - m) - shift]_+^r / sum (the entmax family, relumax, the fixed-bandwidth ReLU) subclass
:class:`PowerKernel` instead, whose tiled retrieval fuses the weights, their backward and the
GEMMs per tile of query rows (:class:`_PowerRetrieval`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..cache import KernelMemory
from ..ops.entmax import BLOCK, block_max, entmax_power, pad_to_block, work_dtype
from ..ops.power_attention import power_attention
from ..ops.triton_backend import fused_expected, fused_reason, note_path
from .base import (
    Kernel,
    attend_plan,
    causal_offset,
    check_attend_args,
    decode_row,
    interval_mask,
    shared_slice,
)

CHUNK_ELEMENTS = 2**21  # target size of one (B, H, rows, keys) fp32 block, ~8 MB
FUSED_MAX_HEAD = 128  # largest head or value size of the fused Triton kernels
TILE_ROWS = 96  # most query rows per tile of the power and kNN kernels (see _tile_rows)


class ScoreKernel(Kernel):
    """Base class of kernels whose weights normalize the scores beta * cos over s < t.

    Subclasses implement :meth:`score_weights` / :meth:`score_backward` (functions of the
    scores z = beta * cos), or override :meth:`weights` / :meth:`weights_backward` when the
    bandwidth enters in another way. ``chunk_elements`` bounds the size of one query chunk.
    """

    chunk_elements: int = CHUNK_ELEMENTS

    # --- what a subclass defines -----------------------------------------------------------
    def score_weights(self, z: Tensor, mask: Tensor) -> Tensor:
        """(..., n, S) work-dtype scores, bool mask broadcastable to them ((n, S) or
        (B or 1, 1, n, S)) -> weights; 0 where masked."""
        raise NotImplementedError

    def score_backward(self, p: Tensor, dp: Tensor, z: Tensor, mask: Tensor) -> Tensor:
        """Gradient w.r.t. the scores z given weights p and their gradient dp."""
        raise NotImplementedError

    def weights(self, cos: Tensor, beta: Tensor, mask: Tensor) -> Tensor:
        """(B, H, n, S) cosines, (1, H, 1, 1) or per-row (B or 1, H, n, 1) bandwidth, (n, S) or
        (B or 1, 1, n, S) mask -> (B, H, n, S) weights."""
        return self.score_weights(cos * beta, mask)

    def row_weights(self, cos: Tensor, beta: Tensor) -> tuple[Tensor, Tensor | None]:
        """Decoding: (B, H, 1, S) cosines of one query row that sees all S >= 1 entries,
        (1, H, 1, 1) bandwidth -> (weights, None) over all S entries, or (weights, index)
        over the c entries ``index`` (B, H, 1, c) when all others have weight 0. Default:
        :meth:`weights` with an all-true mask."""
        mask = torch.ones(1, cos.shape[-1], dtype=torch.bool, device=cos.device)
        return self.weights(cos, beta, mask), None

    def weights_backward(self, p: Tensor, dp: Tensor, cos: Tensor, beta: Tensor,
                         mask: Tensor) -> tuple[Tensor, Tensor]:
        """Gradients (d cos (B, H, n, S), d beta summed to beta's shape: (1, H, 1, 1), or
        (B or 1, H, n, 1) per row) given the weights p and dp."""
        dz = self.score_backward(p, dp, cos * beta, mask)
        return dz * beta, (dz * cos).sum_to_size(beta.shape)

    def retrieval(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                  offset: int) -> Tensor:
        """:func:`retrieve` for this kernel (default: the generic chunked autograd function)."""
        return _ChunkedRetrieval.apply(queries, keys, values, beta, self, offset)

    # --- the Kernel interface --------------------------------------------------------------
    def forward(self, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
        B, H, T, _ = keys.shape
        out = values.new_zeros(B, H, T, values.shape[-1])
        if T < 2:
            return out
        y = retrieve(self, keys[:, :, 1:], keys[:, :, :-1], values[:, :, :-1], beta, 0)
        return torch.cat([out[:, :, :1], y], dim=2)

    def step(self, memory: KernelMemory, queries: Tensor, keys: Tensor, values: Tensor,
             beta: Tensor, lo: Tensor | None = None, hi: Tensor | None = None,
             base: int = 0) -> tuple[Tensor, KernelMemory]:
        if lo is not None:
            return super().step(memory, queries, keys, values, beta, lo, hi, base)
        state = memory.append(keys, values)
        if queries.shape[2] == 1 and not _needs_grad(queries, keys, values, beta):
            return decode_row(self, queries, state.keys, state.values, beta), state
        offset = len(state) - queries.shape[2]
        return retrieve(self, queries, state.keys, state.values, beta, offset), state

    def fused_retrieval(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                        lo: Tensor, hi: Tensor, slopes: Tensor | None = None,
                        pos0: int = 0) -> Tensor | None:
        """The retrieval of :meth:`attend` (beta (B or 1, H, n or 1, 1)) through a fused Triton
        kernel (:mod:`mosaics.ops`), or None where this kernel has none or the fused path does
        not serve the call (see :mod:`mosaics.ops.triton_backend`). ``slopes`` (H,): an ALiBi
        bias beta cos - m_h (t_i - j) with query positions t_i = i + ``pos0``. Default: None."""
        return None

    def tiled(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
              tiles: Callable[..., _Tiles]) -> Tensor:
        """The kernel's fused retrieval over the :class:`_Tiles` that ``tiles(q, k, v,
        n_buffers)`` makes, with beta (B or 1, H, n or 1, 1). Optional: a kernel that does not
        override it takes the generic chunked path in :meth:`attend`."""
        raise NotImplementedError(f"kernel {self.name!r} has no fused tiles")

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
               lo: Tensor, hi: Tensor) -> Tensor:
        """Retrieval over per-query intervals lo[i] <= j <= hi[i] (see :meth:`Kernel.attend`)
        with a bandwidth per head or per query. Intervals 0..i+d with one bandwidth per head
        (the strict past, a gap) take the kernel's strict-past path (:func:`retrieve` with
        offset d); other intervals and per-query bandwidths the kernel's fused tiles
        (:meth:`tiled`) where it has them, else chunks of query rows over the columns they
        can see (:class:`_IntervalRetrieval`)."""
        beta4 = check_attend_args(queries, keys, values, beta, lo, hi)
        B, H = queries.shape[:2]
        if queries.shape[2] == 1 and beta4.shape[0] == 1 and not _needs_grad(
                queries, keys, values, beta):
            cols = shared_slice(lo, hi, keys.shape[2])
            if cols is not None:  # decoding, one interval for the whole batch: a slice
                a, b = cols[0], max(cols)
                return decode_row(self, queries, keys[:, :, a:b], values[:, :, a:b],
                                  beta4.reshape(H))
        offset = causal_offset(lo, hi)
        if beta.dim() == 1 and offset is not None:
            return retrieve(self, queries, keys, values, beta, offset)
        fused = self.fused_retrieval(queries, keys, values, beta4, lo, hi)
        if fused is not None:
            return fused
        if type(self).tiled is ScoreKernel.tiled:  # no fused tiles: the generic chunks
            plan = attend_plan(lo, hi, keys.shape[2], B * H, self.chunk_elements)
            return _IntervalRetrieval.apply(queries, keys, values, beta4, lo, hi, self, plan)
        tiles = (self.past_tiles(offset) if offset is not None
                 else self.interval_tiles(lo, hi, keys.shape[2], B, H))
        return self.tiled(queries, keys, values, beta4, tiles)

    def past_tiles(self, offset: int) -> Callable[..., _Tiles]:
        """The ``tiles`` argument of :meth:`tiled` for the strict past with an offset."""
        def tiles(q: Tensor, k: Tensor, v: Tensor, n_buffers: int) -> _Tiles:
            return _PastTiles(self, q, k, v, offset, n_buffers)
        return tiles

    def interval_tiles(self, lo: Tensor, hi: Tensor, S: int, batch: int,
                       heads: int) -> Callable[..., _Tiles]:
        """The ``tiles`` argument of :meth:`tiled` for the intervals lo[i] <= j <= hi[i] over
        S entries (row chunks of :func:`~.base.attend_plan`, at most TILE_ROWS rows)."""
        plan = attend_plan(lo, hi, S, batch * heads, self.chunk_elements, max_rows=TILE_ROWS)

        def tiles(q: Tensor, k: Tensor, v: Tensor, n_buffers: int) -> _Tiles:
            return _IntervalTiles(q, k, v, lo, hi, plan, batch, n_buffers)
        return tiles


def _needs_grad(*tensors: Tensor) -> bool:
    """Whether autograd will want gradients of any of these tensors here."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


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
    return kernel.retrieval(queries, keys, values, beta, int(offset))


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


def _distances(a: int, b: int, width: int, offset: int, device: torch.device) -> Tensor:
    """(rows, width) t_i - j for query rows a..b-1 at positions t_i = i + offset + 1 and
    entries j at 0..width-1, clamped at 0 (where the mask hides the entry)."""
    i = torch.arange(a, b, device=device).view(-1, 1)
    return (i + offset + 1 - torch.arange(width, device=device).view(1, -1)).clamp_min(0)


class _ChunkedRetrieval(torch.autograd.Function):
    """y_i = sum_j w_ij v_j over j <= i + offset, chunk by chunk of query rows, with any
    kernel's ``weights`` / ``weights_backward`` (O(n) saved: the inputs and the kernels'
    per-row states; each chunk's cosines and weights are recomputed in backward).

    ``slopes`` (H,), optional: the ALiBi bias, scores beta cos - m (t - j), given to the
    kernel as the shifted cosines cos' = cos - (m / beta)(t - j); its bandwidth gradient then
    gains sum d cos' (m / beta^2)(t - j)."""

    @staticmethod
    def forward(ctx, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                kernel: Kernel, offset: int, slopes: Tensor | None = None) -> Tensor:
        B, H, n, _ = queries.shape
        S = keys.shape[2]
        wd = work_dtype(queries.dtype)
        out = values.new_zeros(B, H, n, values.shape[-1])
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v = queries.to(wd), keys.to(wd), values.to(wd)
            bb = beta.to(wd).view(1, H, 1, 1)
            shift = None if slopes is None else slopes.to(wd).view(1, H, 1, 1) / bb
            states: list[Tensor | None] = []
            chunks = list(_chunks(n, S, offset, _rows_per_chunk(kernel, B * H, S)))
            for a, b, width in chunks:
                mask = _chunk_mask(a, b, width, offset, q.device)
                cos = q[:, :, a:b] @ k[:, :, :width].transpose(-1, -2)
                if shift is not None:
                    cos = cos - shift * _distances(a, b, width, offset, q.device).to(wd)
                p, state = kernel.weights_and_state(cos, bb, mask)
                states.append(state)
                out[:, :, a:b] = (p @ v[:, :, :width]).to(out.dtype)
        ctx.kernel, ctx.offset, ctx.states = kernel, offset, states  # O(n) per-row states
        # a single chunk is small by construction: keep it rather than recompute it
        keep = len(chunks) == 1 and any(ctx.needs_input_grad[:4])
        ctx.block = (cos, p) if keep else None
        ctx.save_for_backward(queries, keys, values, beta, slopes)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # noqa: ANN205
        queries, keys, values, beta, slopes = ctx.saved_tensors
        kernel, offset = ctx.kernel, ctx.offset
        B, H, n, _ = queries.shape
        S = keys.shape[2]
        wd = work_dtype(queries.dtype)
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v = queries.to(wd), keys.to(wd), values.to(wd)
            go = grad_out.to(wd)
            bb = beta.to(wd).view(1, H, 1, 1)
            shift = None if slopes is None else slopes.to(wd).view(1, H, 1, 1) / bb
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            dbeta = torch.zeros(H, dtype=wd, device=q.device)
            chunks = _chunks(n, S, offset, _rows_per_chunk(kernel, B * H, S))
            for (a, b, width), state in zip(chunks, ctx.states):
                mask = _chunk_mask(a, b, width, offset, q.device)
                qc, kc, vc, gc = q[:, :, a:b], k[:, :, :width], v[:, :, :width], go[:, :, a:b]
                dist = None if shift is None else _distances(a, b, width, offset, q.device).to(wd)
                if ctx.block is not None:
                    cos, p = ctx.block
                else:
                    cos = qc @ kc.transpose(-1, -2)
                    if dist is not None:
                        cos = cos - shift * dist
                    p = kernel.weights_from_state(cos, bb, mask, state)
                dv[:, :, :width] += p.transpose(-1, -2) @ gc
                dp = gc @ vc.transpose(-1, -2)
                dcos, db = kernel.weights_backward(p, dp, cos, bb, mask)
                dcos = dcos.masked_fill(~mask, 0.0)
                dbeta += db.reshape(H)
                if dist is not None:  # cos' = cos - (m / beta) dist
                    dbeta += (dcos * dist).sum(dim=(0, 2, 3)) * (shift / bb).view(H)
                dq[:, :, a:b] += dcos @ kc
                dk[:, :, :width] += dcos.transpose(-1, -2) @ qc
        return (dq.to(queries.dtype), dk.to(keys.dtype), dv.to(values.dtype),
                dbeta.to(beta.dtype), None, None, None)


class _IntervalRetrieval(torch.autograd.Function):
    """y_i = sum_j w_ij v_j over the visible columns lo[i] <= j <= hi[i], chunk by chunk of
    query rows (:func:`~.base.attend_plan`), with the kernel's :meth:`ScoreKernel.weights`
    and :meth:`ScoreKernel.weights_backward` on (B, H, rows, columns) blocks, masks
    (B or 1, 1, rows, columns) and bandwidths (B or 1, H, rows or 1, 1).

    Saved: the inputs and the kernels' small per-row states; backward recomputes each chunk's
    cosines and weights, then dV = W^T dY, dW = dY V^T, (d cos, d beta) from the kernel,
    dQ = d cos K, dK = d cos^T Q (d cos already holds the bandwidth).
    """

    @staticmethod
    def forward(ctx, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor, lo: Tensor,
                hi: Tensor, kernel: ScoreKernel, plan: list[tuple[int, int, int, int]]) -> Tensor:
        B, H, n, _ = queries.shape
        wd = work_dtype(queries.dtype)
        out = values.new_zeros(B, H, n, values.shape[-1])
        states: list[Tensor | None] = []
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v, bw = queries.to(wd), keys.to(wd), values.to(wd), beta.to(wd)
            for a, b, c0, c1 in plan:
                mask = interval_mask(lo, hi, a, b, c0, c1)
                cos = q[:, :, a:b] @ k[:, :, c0:c1].transpose(-1, -2)
                p, state = kernel.weights_and_state(cos, _beta_rows(bw, a, b), mask)
                states.append(state)
                out[:, :, a:b] = (p @ v[:, :, c0:c1]).to(out.dtype)
        ctx.kernel, ctx.plan, ctx.states = kernel, plan, states
        keep = len(plan) == 1 and any(ctx.needs_input_grad[:4])  # one small block: keep it
        ctx.block = (cos, p) if keep else None
        ctx.save_for_backward(queries, keys, values, beta, lo, hi)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # noqa: ANN205
        queries, keys, values, beta, lo, hi = ctx.saved_tensors
        kernel = ctx.kernel
        wd = work_dtype(queries.dtype)
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v, bw = queries.to(wd), keys.to(wd), values.to(wd), beta.to(wd)
            go = grad_out.to(wd)
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            dbeta = torch.zeros_like(bw)
            for (a, b, c0, c1), state in zip(ctx.plan, ctx.states):
                mask = interval_mask(lo, hi, a, b, c0, c1)
                qc, kc, vc, gc = q[:, :, a:b], k[:, :, c0:c1], v[:, :, c0:c1], go[:, :, a:b]
                bb = _beta_rows(bw, a, b)
                if ctx.block is not None:
                    cos, p = ctx.block
                else:
                    cos = qc @ kc.transpose(-1, -2)
                    p = kernel.weights_from_state(cos, bb, mask, state)
                dv[:, :, c0:c1] += p.transpose(-1, -2) @ gc
                dcos, db = kernel.weights_backward(p, gc @ vc.transpose(-1, -2), cos, bb, mask)
                dcos = dcos.masked_fill(~mask, 0.0)
                if bw.shape[2] > 1:
                    dbeta[:, :, a:b] += db
                else:
                    dbeta += db
                dq[:, :, a:b] += dcos @ kc
                dk[:, :, c0:c1] += dcos.transpose(-1, -2) @ qc
        return (dq.to(queries.dtype), dk.to(keys.dtype), dv.to(values.dtype),
                dbeta.to(beta.dtype), None, None, None, None)


def _beta_rows(beta: Tensor, a: int, b: int) -> Tensor:
    """Rows a..b-1 of a (B or 1, H, n, 1) per-query bandwidth; a (., H, 1, 1) one as is."""
    return beta[:, :, a:b] if beta.shape[2] > 1 else beta


# ----------------------------------------------------------------------------- power kernels
class PowerKernel(ScoreKernel):
    """Kernels whose weights are a power of shifted, scaled cosines c_ts = cos(k_t, k_s):

        w_ts = u_ts^r / N_t,   u_ts = [a_h (c_ts - m_t) - shift_t]_+,   N_t = sum_s u_ts^r,

    with a_h = ``score_scale`` * beta_h, m_t the row max of the cosines (``anchor`` None) or
    the constant ``anchor``, and shift_t from :meth:`row_shift`. ``entmax_gradient``: shift_t
    follows the scores so that N_t = 1 (alpha-entmax, alpha = 1 + 1/r), whose backward is
    dz = g dp - g sum(g dp) / sum(g), g = u^(r-1) N^(alpha-2); otherwise shift_t is fixed and
    du = (r / N) u^(r-1) (dp - <p, dp>), plus, when m_t is the row max, -sum_s du_ts at the
    arg max. The retrieval runs in tiles of query rows (:class:`_PowerRetrieval`).
    """

    power: float = 1.0
    score_scale: float = 1.0
    anchor: float | None = None
    entmax_gradient: bool = False

    def row_shift(self, x: Tensor, bmax: Tensor | None,
                  buffers: tuple[Tensor, Tensor] | None) -> Tensor | float:
        """shift_t for scaled cosines x = a (c - m) ((..., W), -inf masked, W a multiple of
        BLOCK); ``bmax``: their :func:`block_max` (anchored kernels); ``buffers``: two tensors
        shaped like x that may be overwritten."""
        raise NotImplementedError

    def shift_rows_(self, cos: Tensor, a: Tensor) -> tuple[Tensor | float, Tensor | float,
                                                           Tensor | None]:
        """Masked cosines (..., W) (-inf masked, W a multiple of BLOCK) -> u, in place.

        Returns (m, shift, arg max) per row (the arg max only where the gradient needs it).
        """
        return self._shift_rows_(cos, a, None)

    def _shift_rows_(self, cos: Tensor, a: Tensor, buffers: tuple[Tensor, Tensor] | None):
        arg = None
        if self.anchor is None:
            bmax = block_max(cos)
            m = bmax.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, 0.0)
            if not self.entmax_gradient:
                arg = _block_argmax(cos, bmax)
            cos.sub_(m).mul_(a)
            bmax = bmax.sub_(m).mul_(a)  # the block maxima of the scaled scores, exactly
        else:
            m, bmax = self.anchor, None
            cos.sub_(m).mul_(a)
        shift = self.row_shift(cos, bmax, buffers)
        cos.sub_(shift).clamp_min_(0.0)
        return m, shift, arg

    def weights(self, cos: Tensor, beta: Tensor, mask: Tensor) -> Tensor:
        """The weights of a block of cosine rows (no autograd: see :meth:`weights_backward`)."""
        width = cos.shape[-1]
        cos, beta = cos.detach(), beta.detach()
        u = pad_to_block(cos.to(work_dtype(cos.dtype)).masked_fill(~mask, float("-inf")))
        self.shift_rows_(u, self.score_scale * beta.to(u.dtype))
        p = entmax_power(u, self.power)[..., :width]
        return p / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)

    def fused_form(self) -> tuple[float | None, float | None, bool] | None:
        """(anchor, shift, entmax) of this kernel in :func:`~mosaics.ops.power_attention.
        power_attention` terms, or None when it has no fused form (the default: a subclass
        with its own :meth:`row_shift`)."""
        return None

    def fused_skip_reason(self, queries: Tensor, keys: Tensor, values: Tensor) -> str | None:
        """Why the fused path does not serve this call (recorded and, where the switch asked
        for it, logged once), or None when it does."""
        reason = fused_reason(queries, keys, values)
        if reason is None:
            if self.fused_form() is None:
                reason = f"{type(self).__name__} has no fused form (its own row_shift)"
            elif torch.float64 in (queries.dtype, keys.dtype, values.dtype):
                reason = "float64 inputs (the chunked path is the float64 reference)"
            elif max(queries.shape[-1], values.shape[-1]) > FUSED_MAX_HEAD:
                reason = f"head size above {FUSED_MAX_HEAD}"
        note_path(self.name, reason, expected=fused_expected(queries))
        return reason

    def fused_retrieval(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                        lo: Tensor, hi: Tensor, slopes: Tensor | None = None,
                        pos0: int = 0) -> Tensor | None:
        form = self.fused_form()
        if self.fused_skip_reason(queries, keys, values) is not None:
            return None
        B, H, n, _ = queries.shape
        a = (self.score_scale * beta).expand(B, H, n, 1).reshape(B * H, n)
        bias = None  # beta cos - m (t - j) = beta (cos - (m / beta)(t - j))
        if slopes is not None:
            bias = (slopes.view(1, H, 1, 1) / beta).expand(B, H, n, 1).reshape(B * H, n)
        anchor, shift, entmax = form
        return power_attention(queries, keys, values, a, lo, hi, r=self.power, anchor=anchor,
                               shift=shift, entmax=entmax, bias=bias, pos0=pos0)

    def retrieval(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                  offset: int) -> Tensor:
        if self.fused_skip_reason(queries, keys, values) is None:
            n = queries.shape[2]
            hi = (torch.arange(n, device=queries.device) + offset).view(1, n)
            return self.fused_retrieval(queries, keys, values, beta.view(1, -1, 1, 1),
                                        torch.zeros_like(hi), hi)
        return self.tiled(queries, keys, values, beta.view(1, -1, 1, 1),
                          self.past_tiles(offset))

    def tiled(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
              tiles: Callable[..., _Tiles]) -> Tensor:
        return _PowerRetrieval.apply(queries, keys, values, beta, self, tiles)


def _block_argmax(x: Tensor, bmax: Tensor) -> Tensor:
    """(..., 1) column of the row max of x from its :func:`block_max` (one short gather)."""
    nb = bmax.shape[-1]
    block = bmax.argmax(dim=-1, keepdim=True)
    inside = x.unflatten(-1, (BLOCK, nb)).gather(-1, block.unsqueeze(-2).expand(
        *block.shape[:-1], BLOCK, 1)).argmax(dim=-2)
    return inside * nb + block


class _Tiles:
    """Tiles of query rows over (B H, n, .) flattened rows for a fused retrieval: (a, b, c0,
    c1) for rows a..b-1 over the key columns c0..c1-1, the keys and values padded with zero
    rows so that every tile reads a multiple of BLOCK columns, and the buffers the tiles reuse.

    Buffers are allocated once per call: a fresh tile-sized temporary per tile and pass costs
    more than the pass itself when the allocator maps it from the OS. Every GEMM writes a
    whole contiguous buffer (into a strided slice, CPU ``bmm`` falls back to one matrix
    product per batch entry, measured 2-4x slower at (16, 63, 64) x (16, 64, 512)).
    Subclasses say which tiles there are and mask what a tile's rows may not see.
    """

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, tiles: list[tuple[int, int, int, int]],
                 n_buffers: int) -> None:
        self.bh, self.n, self.S = q.shape[0], q.shape[1], k.shape[1]
        self.tiles = tiles
        self.width = max((_round_up(c1 - c0, BLOCK) for _, _, c0, c1 in tiles), default=BLOCK)
        end = max((c0 + _round_up(c1 - c0, BLOCK) for _, _, c0, c1 in tiles), default=0)
        self.k, self.v = _pad_rows(k, BLOCK, end), _pad_rows(v, BLOCK, end)
        self.rows = max((b - a for a, b, _, _ in tiles), default=1)
        self.buffers = [q.new_empty(self.bh * self.rows * self.width) for _ in range(n_buffers)]
        self.small = q.new_empty(0)  # forward: rows x hv; backward: head size x widest tile

    def __iter__(self):
        return iter(self.tiles)

    def view(self, i: int, rows: int, width: int) -> Tensor:
        """Buffer i as a contiguous (B H, rows, width rounded up to BLOCK) tensor."""
        wp = _round_up(width, BLOCK)
        return self.buffers[i][:self.bh * rows * wp].view(self.bh, rows, wp)

    def narrow(self, rows: int, cols: int, capacity: int) -> Tensor:
        """The small buffer as a contiguous (B H, rows, cols) tensor; allocated for ``capacity``
        numbers per batch entry the first time it is too small."""
        size = self.bh * rows * cols
        if self.small.numel() < size:
            self.small = self.small.new_empty(self.bh * max(capacity, rows * cols))
        return self.small[:size].view(self.bh, rows, cols)

    def scores(self, q: Tensor, a: int, b: int, c0: int, c1: int) -> Tensor:
        """Cosines of query rows a..b-1 with keys c0..c1-1 in buffer 0, -inf where a row may not
        look and on the padding up to a multiple of BLOCK columns."""
        s = self.view(0, b - a, c1 - c0)
        torch.bmm(q[:, a:b], self.k[:, c0:c0 + s.shape[-1]].transpose(1, 2), out=s)
        self.mask_(s, a, b, c0, c1)
        return s

    def mask_(self, s: Tensor, a: int, b: int, c0: int, c1: int) -> None:
        raise NotImplementedError

    def keys(self, c0: int, width: int) -> Tensor:
        """The (B H, width, hs) key rows of a tile that starts at column c0."""
        return self.k[:, c0:c0 + width]

    def weighted_values(self, p: Tensor, c0: int, scale: Tensor, out: Tensor) -> None:
        """out = (p V) / scale for a tile of weights p (B H, rows, width) from column c0."""
        hv = self.v.shape[-1]
        tmp = torch.bmm(p, self.v[:, c0:c0 + p.shape[-1]],
                        out=self.narrow(p.shape[1], hv, self.rows * hv))
        torch.div(tmp, scale, out=out)

    def value_products(self, g: Tensor, c0: int, width: int, out: Tensor) -> Tensor:
        """g V^T (B H, rows, width) for output gradients g (B H, rows, hv), columns from c0."""
        return torch.bmm(g, self.v[:, c0:c0 + width].transpose(1, 2), out=out)

    def add_outer(self, acc_t: Tensor, rows_t: Tensor, p: Tensor, c0: int) -> None:
        """acc_t[..., c0:c0 + width] += rows_t p: (B H, d, S) += (B H, d, rows) (B H, rows,
        width)."""
        d = max(self.k.shape[-1], self.v.shape[-1])
        tmp = torch.bmm(rows_t, p, out=self.narrow(rows_t.shape[1], p.shape[-1], d * self.width))
        acc_t[..., c0:c0 + p.shape[-1]].add_(tmp)


class _PastTiles(_Tiles):
    """The strict past with an offset: row i sees the keys j <= i + offset, in tiles of
    :func:`_tile_rows` rows over keys 0..(the last row's horizon)."""

    def __init__(self, kernel: ScoreKernel, q: Tensor, k: Tensor, v: Tensor, offset: int,
                 n_buffers: int) -> None:
        n, S = q.shape[1], k.shape[1]
        rows = _tile_rows(kernel, q.shape[0], n, S)
        super().__init__(q, k, v, [(a, b, 0, w) for a, b, w in _chunks(n, S, offset, rows)],
                         n_buffers)
        self.offset = offset
        self.masks: dict[tuple[int, int, int, int], Tensor] = {}

    def mask_(self, s: Tensor, a: int, b: int, c0: int, c1: int) -> None:
        """-inf where j > i + offset and on the padding: only the last key block is touched."""
        start = min(max(a + self.offset + 1, 0), c1)  # first column some row may not see
        if start < s.shape[-1]:
            s[..., start:].add_(self._mask(b - a, s.shape[-1] - start, a + self.offset - start,
                                           c1 - start, s))

    def _mask(self, rows: int, cols: int, lag: int, limit: int, like: Tensor) -> Tensor:
        """(rows, cols) additive mask: -inf where column jj > row ii + lag or jj >= limit."""
        key = (rows, cols, lag, limit)
        if key not in self.masks:
            ii = torch.arange(rows, device=like.device).view(-1, 1)
            jj = torch.arange(cols, device=like.device).view(1, -1)
            self.masks[key] = torch.zeros((), dtype=like.dtype, device=like.device).masked_fill(
                (jj > ii + lag) | (jj >= limit), float("-inf")).expand(rows, cols).contiguous()
        return self.masks[key]


class _IntervalTiles(_Tiles):
    """Visible intervals: row i (of batch row b) sees the keys lo[b, i] <= j <= hi[b, i], in
    the row chunks of :func:`~.base.attend_plan` (rows capped at TILE_ROWS)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor,
                 plan: list[tuple[int, int, int, int]], batch: int, n_buffers: int) -> None:
        super().__init__(q, k, v, plan, n_buffers)
        self.lo, self.hi, self.batch = lo, hi, batch

    def mask_(self, s: Tensor, a: int, b: int, c0: int, c1: int) -> None:
        wp = s.shape[-1]
        hidden = ~interval_mask(self.lo, self.hi, a, b, c0, c0 + wp)  # (B or 1, 1, rows, wp)
        if c1 - c0 < wp:
            hidden = hidden | (torch.arange(wp, device=s.device) >= c1 - c0)
        s.view(self.batch, -1, b - a, wp).masked_fill_(hidden, float("-inf"))


def _pad_rows(x: Tensor, m: int, least: int = 0) -> Tensor:
    """(B H, S, d) with zero rows appended up to a multiple of m, and to at least ``least``."""
    pad = max(-x.shape[1] % m, least - x.shape[1])
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad > 0 else x


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tile_rows(kernel: ScoreKernel, batch_heads: int, n: int, S: int) -> int:
    """Query rows per tile: at most ``chunk_elements`` scores and TILE_ROWS rows. Per tile
    there is a fixed cost (~100 small ops) and a wasted triangle of rows^2 / 2 masked scores;
    64-96 rows measured fastest for forward + backward (``bench/kernel_speed.py``)."""
    return max(1, min(_rows_per_chunk(kernel, batch_heads, S), TILE_ROWS))


class _PowerRetrieval(torch.autograd.Function):
    """Retrieval with a :class:`PowerKernel`, tile by tile of query rows (:class:`_Tiles`:
    the strict past with an offset, or visible intervals), with one bandwidth per head or
    one per query.

    Forward per tile: score GEMM into a reused buffer, the tile's mask, in-place
    u = [a (c - m) - shift]_+ (shift solved per row by the kernel), u^r, its row sums N and
    the output GEMM. Saved: the inputs, (m, shift, N) per row, the output.
    Backward per tile: the same scores and u, then dV^T += (dY / N)^T u^r, dP = dY V^T,
    dZ = h (dP - c) in place (h = u^(r-1)), dQ = beta kappa dZ K, dK^T += (beta kappa Q)^T dZ
    and dbeta from dQ's rows: five GEMMs and a few in-place passes over the tile.

    ``beta``: (B or 1, H, n or 1, 1); ``tiles(q, k, v, n_buffers)`` makes the :class:`_Tiles`
    of the flattened (B H, ., .) rows. The elementwise passes stay eager, in place:
    ``torch.compile`` of the same chain measured no faster on CPU, after a long first compile.
    """

    @staticmethod
    def forward(ctx, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                kernel: PowerKernel, tiles: Callable[..., _Tiles]) -> Tensor:
        B, H, n, _ = queries.shape
        hv = values.shape[-1]
        wd = work_dtype(queries.dtype)
        r = kernel.power
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v = (x.to(wd).reshape(B * H, x.shape[2], x.shape[3])
                       for x in (queries, keys, values))
            a = kernel.score_scale * _flat_rows(beta.detach().to(wd), B, H)
            grid = tiles(q, k, v, 3)
            out = q.new_zeros(B * H, n, hv)
            stats = q.new_zeros(3, B * H, n, 1)  # m, shift, N
            arg = torch.zeros(B * H, n, 1, dtype=torch.long, device=q.device)
            for lo, hi, c0, c1 in grid:
                u = grid.scores(q, lo, hi, c0, c1)
                m, shift, top = kernel._shift_rows_(
                    u, _rows(a, lo, hi),
                    (grid.view(1, hi - lo, c1 - c0), grid.view(2, hi - lo, c1 - c0)))
                p = u if r == 1 else entmax_power(u, r, out=grid.view(1, hi - lo, c1 - c0))
                total = p.sum(dim=-1, keepdim=True)
                grid.weighted_values(p, c0, total.clamp_min(torch.finfo(wd).tiny),
                                     out[:, lo:hi])
                stats[0, :, lo:hi], stats[1, :, lo:hi], stats[2, :, lo:hi] = m, shift, total
                if top is not None:
                    arg[:, lo:hi] = top + c0
        ctx.kernel, ctx.tiles, ctx.rows = kernel, tiles, (stats, out, arg)
        ctx.save_for_backward(queries, keys, values, beta)
        return out.view(B, H, n, hv).to(values.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # noqa: ANN205
        queries, keys, values, beta = ctx.saved_tensors
        kernel = ctx.kernel
        stats, y, arg = ctx.rows
        B, H, n, hs = queries.shape
        S, hv = keys.shape[2], values.shape[-1]
        wd = work_dtype(queries.dtype)
        r, entmax_rule = kernel.power, kernel.entmax_gradient
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v = (x.to(wd).reshape(B * H, x.shape[2], x.shape[3])
                       for x in (queries, keys, values))
            g = grad_out.to(wd).reshape(B * H, n, hv)
            bb = _flat_rows(beta.to(wd), B, H)
            a = kernel.score_scale * bb
            m, shift, total = stats
            kappa, inv = _row_factors(total, r, entmax_rule)
            g_n = g * inv
            q_k = q * (kappa * bb)
            c_fixed = None if entmax_rule else (g * y).sum(dim=-1, keepdim=True)
            dq = torch.zeros_like(q)
            grid = ctx.tiles(q, k, v, 3)
            dk_t = q.new_zeros(B * H, hs, grid.k.shape[1])
            dv_t = q.new_zeros(B * H, hv, grid.k.shape[1])
            dbeta = q.new_zeros(B * H, n, 1)
            row_sum = q.new_zeros(B * H, n, 1)
            for lo, hi, c0, c1 in grid:
                u = grid.scores(q, lo, hi, c0, c1)
                u.sub_(m[:, lo:hi]).mul_(_rows(a, lo, hi)).sub_(shift[:, lo:hi]).clamp_min_(0.0)
                width = u.shape[-1]
                spare = grid.view(1, hi - lo, width)
                p = u if r == 1 else entmax_power(u, r, out=spare)
                grid.add_outer(dv_t, g_n[:, lo:hi].transpose(1, 2), p, c0)
                dp = grid.value_products(g[:, lo:hi], c0, width, grid.view(2, hi - lo, width))
                h, spare = _power_derivative_(u, r, spare)
                if entmax_rule:  # c = sum(h dp) / sum(h)
                    c = torch.mul(h, dp, out=spare).sum(dim=-1, keepdim=True).div_(
                        h.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(wd).tiny))
                else:  # c = <p, dp> = dY . Y
                    c = c_fixed[:, lo:hi]
                dz = dp.sub_(c).mul_(h)
                dq_raw = torch.bmm(dz, grid.keys(c0, width))
                inner = (dq_raw * q[:, lo:hi]).sum(dim=-1, keepdim=True)
                if not entmax_rule:  # d/dbeta of u: c - m; sum_s dz_ts = 0 for entmax
                    row_sum[:, lo:hi] = dz.sum(dim=-1, keepdim=True)
                    inner -= m[:, lo:hi] * row_sum[:, lo:hi]
                dbeta[:, lo:hi] = kappa[:, lo:hi] * inner
                dq[:, lo:hi] = dq_raw * (kappa[:, lo:hi] * _rows(bb, lo, hi))
                grid.add_outer(dk_t, q_k[:, lo:hi].transpose(1, 2), dz, c0)
            dk = dk_t[..., :S].transpose(1, 2).contiguous()
            if kernel.anchor is None and not entmax_rule and S > 0:  # m_t = max_s c_ts moves
                _add_max_gradient(dq, dk, q, k, arg, -(kappa * bb) * row_sum)
        dbeta = dbeta.view(B, H, n, 1).sum_to_size(beta.shape)
        return (dq.view(queries.shape).to(queries.dtype), dk.view(keys.shape).to(keys.dtype),
                dv_t[..., :S].transpose(1, 2).reshape(values.shape).to(values.dtype),
                dbeta.to(beta.dtype), None, None)


def _flat_rows(beta: Tensor, batch: int, heads: int) -> Tensor:
    """(B or 1, H, n or 1, 1) bandwidths as (B H, n or 1, 1), matching (B H, n, .) rows."""
    return beta.expand(batch, heads, *beta.shape[2:]).reshape(batch * heads, beta.shape[2], 1)


def _rows(x: Tensor, a: int, b: int) -> Tensor:
    """Rows a..b-1 of a (B H, n, 1) per-row number; a (B H, 1, 1) one as is."""
    return x[:, a:b] if x.shape[1] > 1 else x


def _row_factors(total: Tensor, r: float, entmax_rule: bool) -> tuple[Tensor, Tensor]:
    """(kappa, 1 / N) per row, 0 on rows without weight (N = 0): kappa = N^(alpha - 2) for
    entmax (g = u^(r-1) kappa, alpha - 2 = 1/r - 1), r / N otherwise."""
    valid = total > 0
    safe = torch.where(valid, total, 1.0)
    inv = torch.where(valid, 1.0 / safe, 0.0)
    kappa = safe.pow(1.0 / r - 1.0) if entmax_rule else r * inv
    return torch.where(valid, kappa, 0.0), inv


def _power_derivative_(u: Tensor, r: float, spare: Tensor) -> tuple[Tensor, Tensor]:
    """h = u^(r-1) on u > 0 (0 elsewhere) and the buffer left free, one of (u, spare)."""
    if r == 1:
        return torch.sign(u, out=u), spare
    if r == 2:
        return u, spare
    torch.pow(u, r - 1, out=spare)
    if r < 1:  # 0^(r-1) = inf off the support
        spare.nan_to_num_(nan=0.0, posinf=0.0)
    return spare, u


def _add_max_gradient(dq: Tensor, dk: Tensor, q: Tensor, k: Tensor, arg: Tensor,
                      coef: Tensor) -> None:
    """dc_{t, j_t} += coef_t at the row arg max j_t: dq_t += coef_t k_{j_t},
    dk_{j_t} += coef_t q_t (in place)."""
    idx = arg.expand(-1, -1, q.shape[-1])
    dq.add_(coef * k.gather(1, idx))
    dk.scatter_add_(1, idx, coef * q)


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


def check_choice(kernel: str, name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` as one of ``choices``, or a ValueError naming the kernel option."""
    if value not in choices:
        raise ValueError(f"kernel {kernel!r}: {name} must be one of {', '.join(choices)}; got "
                         f"{value!r} (set kernel_kwargs={{'{name}': {choices[0]!r}}})")
    return str(value)
