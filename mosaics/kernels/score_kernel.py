"""Score-normalizer kernels: w_t. = normalizer(beta * cos(k_t, k_s), s < t).

A :class:`ScoreKernel` subclass only says how a block of cosine rows becomes weights
(:meth:`ScoreKernel.weights`) and how a weight gradient flows back to the cosines and the
bandwidth (:meth:`ScoreKernel.weights_backward`). The retrievals built on those two methods
(fp32 weights, memory linear in T per query chunk, a hand-written backward) are ops that take
the kernel as their normalizer: :func:`~mosaics.ops.score_retrieval.score_retrieval` for the
strict past and :func:`~mosaics.ops.score_retrieval.interval_score_retrieval` for visible
intervals. Kernels of the form [a (c - m) - shift]_+^r / sum (the entmax family, relumax, the
fixed-bandwidth ReLU) subclass :class:`PowerKernel` instead, whose tiled retrieval fuses the
weights, their backward and the GEMMs per tile of query rows
(:func:`~mosaics.ops.score_retrieval.power_retrieval`; the Triton kernel of
:func:`~mosaics.ops.power_attention.power_attention` where the fused path serves the call).
A decoding step that sees the whole memory takes :meth:`Kernel.decode_row`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..cache import KernelMemory
from ..ops.entmax import block_max, entmax_power, pad_to_block, work_dtype
from ..ops.intervals import attend_plan, causal_offset, check_attend_args, shared_slice
from ..ops.power_attention import power_attention
from ..ops.score_retrieval import (
    TILE_ROWS,
    _block_argmax,
    _IntervalTiles,
    _PastTiles,
    _Tiles,
    interval_score_retrieval,
    power_retrieval,
    score_retrieval,
)
from ..ops.triton_backend import fused_expected, fused_reason, note_path
from .base import Kernel

CHUNK_ELEMENTS = 2**21  # target size of one (B, H, rows, keys) fp32 block, ~8 MB
FUSED_MAX_HEAD = 128  # largest head or value size of the fused Triton kernels


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

    def weights_backward(self, p: Tensor, dp: Tensor, cos: Tensor, beta: Tensor,
                         mask: Tensor) -> tuple[Tensor, Tensor]:
        """Gradients (d cos (B, H, n, S), d beta summed to beta's shape: (1, H, 1, 1), or
        (B or 1, H, n, 1) per row) given the weights p and dp."""
        dz = self.score_backward(p, dp, cos * beta, mask)
        return dz * beta, (dz * cos).sum_to_size(beta.shape)

    def retrieval(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                  offset: int) -> Tensor:
        """:func:`retrieve` for this kernel (default: the generic chunked retrieval,
        :func:`~mosaics.ops.score_retrieval.score_retrieval`)."""
        return score_retrieval(queries, keys, values, beta, self, offset)

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
            return self.decode_row(queries, state.keys, state.values, beta), state
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
        can see (:func:`~mosaics.ops.score_retrieval.interval_score_retrieval`)."""
        beta4 = check_attend_args(queries, keys, values, beta, lo, hi)
        B, H = queries.shape[:2]
        if queries.shape[2] == 1 and beta4.shape[0] == 1 and not _needs_grad(
                queries, keys, values, beta):
            cols = shared_slice(lo, hi, keys.shape[2])
            if cols is not None:  # decoding, one interval for the whole batch: a slice
                a, b = cols[0], max(cols)
                return self.decode_row(queries, keys[:, :, a:b], values[:, :, a:b],
                                       beta4.reshape(H))
        offset = causal_offset(lo, hi)
        if beta.dim() == 1 and offset is not None:
            return retrieve(self, queries, keys, values, beta, offset)
        fused = self.fused_retrieval(queries, keys, values, beta4, lo, hi)
        if fused is not None:
            return fused
        if type(self).tiled is ScoreKernel.tiled:  # no fused tiles: the generic chunks
            plan = attend_plan(lo, hi, keys.shape[2], B * H, self.chunk_elements)
            return interval_score_retrieval(queries, keys, values, beta4, lo, hi, self, plan)
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
        S entries (row chunks of :func:`~mosaics.ops.intervals.attend_plan`, at most
        TILE_ROWS rows)."""
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


# ----------------------------------------------------------------------------- power kernels
class PowerKernel(ScoreKernel):
    """Kernels whose weights are a power of shifted, scaled cosines c_ts = cos(k_t, k_s):

        w_ts = u_ts^r / N_t,   u_ts = [a_h (c_ts - m_t) - shift_t]_+,   N_t = sum_s u_ts^r,

    with a_h = ``score_scale`` * beta_h, m_t the row max of the cosines (``anchor`` None) or
    the constant ``anchor``, and shift_t from :meth:`row_shift`. ``entmax_gradient``: shift_t
    follows the scores so that N_t = 1 (alpha-entmax, alpha = 1 + 1/r), whose backward is
    dz = g dp - g sum(g dp) / sum(g), g = u^(r-1) N^(alpha-2); otherwise shift_t is fixed and
    du = (r / N) u^(r-1) (dp - <p, dp>), plus, when m_t is the row max, -sum_s du_ts at the
    arg max. The retrieval runs in tiles of query rows
    (:func:`~mosaics.ops.score_retrieval.power_retrieval`).
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

    def shift_rows_(self, cos: Tensor, a: Tensor, buffers: tuple[Tensor, Tensor] | None = None
                    ) -> tuple[Tensor | float, Tensor | float, Tensor | None]:
        """Masked cosines (..., W) (-inf masked, W a multiple of BLOCK), scales a (broadcast to
        the rows) -> u = [a (c - m) - shift]_+, in place.

        Returns (m, shift, arg max) per row (the arg max only where the gradient needs it).
        ``buffers``: two tensors shaped like ``cos`` that :meth:`row_shift` may overwrite.
        """
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
        return power_retrieval(queries, keys, values, beta, self, tiles)


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
