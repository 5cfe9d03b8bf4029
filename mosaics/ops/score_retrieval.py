"""Retrieval through a kernel's score normalizer, beside its plain reference:

    y_i = sum_j w_ij v_j,   w_i. = normalizer(beta cos(q_i, k_j) over the visible j),

for (B, H, n, hs) unit queries, (B, H, S, hs) unit keys and (B, H, S, hv) values. Three
forms, each an autograd Function with a hand-written backward that takes the kernel (an
object with the normalizer's methods: :class:`ScoreNormalizer`, :class:`PowerNormalizer`) as
an argument:

- :func:`score_retrieval`: the strict past j <= i + offset, optionally with an ALiBi bias,
  chunk by chunk of query rows, with any normalizer's ``weights`` / ``weights_backward``;
- :func:`interval_score_retrieval`: the same over per-query intervals lo_i <= j <= hi_i with a
  bandwidth per head or per query, in the row chunks of a plan
  (:func:`~.intervals.attend_plan`);
- :func:`power_retrieval`: the weights [a (c - m) - shift]_+^r / N of the power kernels (the
  entmax family, relumax, epanechnikov_fixed), fused with their backward and the GEMMs per
  tile of query rows (:class:`_Tiles`: the strict past, :class:`_PastTiles`, or intervals,
  :class:`_IntervalTiles`).

All of them compute the weights in fp32 under any autocast (fp64 inputs stay fp64) and return
the values' dtype; they save only the inputs (and a few numbers per row, e.g. entmax
thresholds) and recompute each chunk's weights in backward, so no n x S matrix is ever alive
(peak extra memory ~ a few chunk x S fp32 blocks). The backward: dV = W^T dY, dW = dY V^T,
then the normalizer's own weight backward (no autograd through iterative solvers), then
dQ = beta dS K, dK = beta dS^T Q, dbeta = sum(dS * cos) for scores S = beta * cos.

:func:`score_retrieval_reference` is the map written densely (scores, mask, any
differentiable normalizer, product; autograd throughout). The power form's reference is
:func:`~.power_attention.power_attention_reference`, the same map as its fused Triton kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .entmax import BLOCK, entmax_power, work_dtype
from .intervals import interval_mask

TILE_ROWS = 96  # most query rows per tile of the power and kNN kernels (see _tile_rows)


class ScoreNormalizer(Protocol):
    """What the chunked retrievals need of a kernel: a score kernel of
    :mod:`mosaics.kernels` (``weights`` / ``weights_backward`` of a block of cosines, see
    :class:`mosaics.kernels.base.Kernel`) and the size of one chunk."""

    chunk_elements: int

    def weights(self, cos: Tensor, beta: Tensor, mask: Tensor) -> Tensor: ...

    def weights_backward(self, p: Tensor, dp: Tensor, cos: Tensor, beta: Tensor,
                         mask: Tensor) -> tuple[Tensor, Tensor]: ...


class PowerNormalizer(Protocol):
    """What :func:`power_retrieval` needs of a kernel
    (:class:`mosaics.kernels.score_kernel.PowerKernel`): w = u^r / N, u = [a (c - m) -
    shift]_+ with a = ``score_scale`` beta, m the row max (``anchor`` None) or ``anchor``,
    shift (and, anchored at the row max, its arg max) per row from ``shift_rows_`` (in place
    on masked cosines), ``entmax_gradient``: the shift follows the scores (N = 1)."""

    chunk_elements: int
    power: float
    score_scale: float
    anchor: float | None
    entmax_gradient: bool

    def shift_rows_(self, cos: Tensor, a: Tensor, buffers: tuple[Tensor, Tensor] | None = None
                    ) -> tuple[Tensor | float, Tensor | float, Tensor | None]: ...


def score_retrieval(queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                    normalizer: ScoreNormalizer, offset: int,
                    slopes: Tensor | None = None) -> Tensor:
    """y_i = sum_j w_ij v_j over j <= i + offset, chunk by chunk (:class:`_ChunkedRetrieval`).

    Args:
        queries: (B, H, n, hs); keys: (B, H, S, hs); values: (B, H, S, hv); beta: (H,).
        normalizer: the kernel whose weights turn the cosines into w.
        offset: query i sees the entries j <= i + offset.
        slopes: optional (H,) ALiBi slopes: scores beta cos - m_h (t_i - j), t_i = i + offset
            + 1 (no gradient to the slopes).
    Returns:
        (B, H, n, hv) in the values' dtype; rows that see no entry are 0.
    """
    return _ChunkedRetrieval.apply(queries, keys, values, beta, normalizer, offset, slopes)


def interval_score_retrieval(queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                             lo: Tensor, hi: Tensor, normalizer: ScoreNormalizer,
                             plan: list[tuple[int, int, int, int]]) -> Tensor:
    """y_i = sum_j w_ij v_j over lo[i] <= j <= hi[i], in the row chunks (a, b, c0, c1) of
    ``plan`` (:class:`_IntervalRetrieval`); beta (B or 1, H, n or 1, 1), bounds (B or 1, n).
    Rows outside the plan are 0."""
    return _IntervalRetrieval.apply(queries, keys, values, beta, lo, hi, normalizer, plan)


def power_retrieval(queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                    normalizer: PowerNormalizer, tiles: Callable[..., _Tiles]) -> Tensor:
    """The power kernels' retrieval tile by tile (:class:`_PowerRetrieval`): beta (B or 1, H,
    n or 1, 1); ``tiles(q, k, v, n_buffers)`` makes the :class:`_Tiles` (strict past or
    intervals) of the flattened (B H, ., .) rows."""
    return _PowerRetrieval.apply(queries, keys, values, beta, normalizer, tiles)


def score_retrieval_reference(queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                              lo: Tensor, hi: Tensor,
                              normalize: Callable[[Tensor, Tensor], Tensor],
                              slopes: Tensor | None = None, pos0: int = 0) -> Tensor:
    """The retrievals above written densely: z = beta q k^T (- m_h (t_i - j) with ``slopes``,
    t_i = i + ``pos0``), w = normalize(z, visible) with visible (B or 1, 1, n, S) True where
    lo[i] <= j <= hi[i], y = w V. ``beta``: (H,) or (B or 1, H, n); ``normalize``: a
    differentiable map of (B, H, n, S) scores and the mask to weights, 0 where masked (and on
    rows without a visible entry). The strict past of :func:`score_retrieval` is lo = 0,
    hi = i + offset, pos0 = offset + 1. Work dtype as above, autograd throughout."""
    B, H, n, _ = queries.shape
    S = keys.shape[2]
    wd = work_dtype(queries.dtype)
    bw = beta.to(wd).view(1, H, 1, 1) if beta.dim() == 1 else beta.to(wd).unsqueeze(-1)
    z = bw * (queries.to(wd) @ keys.to(wd).transpose(-1, -2))
    j = torch.arange(S, device=queries.device)
    if slopes is not None:
        lag = (torch.arange(n, device=queries.device) + pos0).view(n, 1) - j
        z = z - slopes.to(wd).view(1, H, 1, 1) * lag
    visible = ((j >= lo.unsqueeze(-1)) & (j <= hi.unsqueeze(-1))).unsqueeze(1)
    return (normalize(z, visible) @ values.to(wd)).to(values.dtype)


def _chunks(n: int, S: int, offset: int, rows: int):
    """(first row, end row, visible keys) of each query chunk that sees at least one key."""
    for a in range(0, n, rows):
        b = min(n, a + rows)
        width = min(S, b + offset)  # the last row b - 1 sees j <= b - 1 + offset
        if width > 0:
            yield a, b, width


def _rows_per_chunk(kernel: ScoreNormalizer, batch_heads: int, S: int) -> int:
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
    kernel's ``weights`` / ``weights_backward`` (O(n) saved: the inputs; each chunk's cosines
    and weights are recomputed in backward).

    ``slopes`` (H,), optional: the ALiBi bias, scores beta cos - m (t - j), given to the
    kernel as the shifted cosines cos' = cos - (m / beta)(t - j); its bandwidth gradient then
    gains sum d cos' (m / beta^2)(t - j)."""

    @staticmethod
    def forward(ctx, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                kernel: ScoreNormalizer, offset: int, slopes: Tensor | None = None) -> Tensor:
        B, H, n, _ = queries.shape
        S = keys.shape[2]
        wd = work_dtype(queries.dtype)
        out = values.new_zeros(B, H, n, values.shape[-1])
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v = queries.to(wd), keys.to(wd), values.to(wd)
            bb = beta.to(wd).view(1, H, 1, 1)
            shift = None if slopes is None else slopes.to(wd).view(1, H, 1, 1) / bb
            chunks = list(_chunks(n, S, offset, _rows_per_chunk(kernel, B * H, S)))
            for a, b, width in chunks:
                mask = _chunk_mask(a, b, width, offset, q.device)
                cos = q[:, :, a:b] @ k[:, :, :width].transpose(-1, -2)
                if shift is not None:
                    cos = cos - shift * _distances(a, b, width, offset, q.device).to(wd)
                p = kernel.weights(cos, bb, mask)
                out[:, :, a:b] = (p @ v[:, :, :width]).to(out.dtype)
        ctx.kernel, ctx.offset = kernel, offset
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
            for a, b, width in chunks:
                mask = _chunk_mask(a, b, width, offset, q.device)
                qc, kc, vc, gc = q[:, :, a:b], k[:, :, :width], v[:, :, :width], go[:, :, a:b]
                dist = None if shift is None else _distances(a, b, width, offset, q.device).to(wd)
                if ctx.block is not None:
                    cos, p = ctx.block
                else:
                    cos = qc @ kc.transpose(-1, -2)
                    if dist is not None:
                        cos = cos - shift * dist
                    p = kernel.weights(cos, bb, mask)
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
    query rows (:func:`~.intervals.attend_plan`), with the kernel's ``weights``
    and ``weights_backward`` on (B, H, rows, columns) blocks, masks
    (B or 1, 1, rows, columns) and bandwidths (B or 1, H, rows or 1, 1).

    Saved: the inputs; backward recomputes each chunk's
    cosines and weights, then dV = W^T dY, dW = dY V^T, (d cos, d beta) from the kernel,
    dQ = d cos K, dK = d cos^T Q (d cos already holds the bandwidth).
    """

    @staticmethod
    def forward(ctx, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor, lo: Tensor,
                hi: Tensor, kernel: ScoreNormalizer,
                plan: list[tuple[int, int, int, int]]) -> Tensor:
        B, H, n, _ = queries.shape
        wd = work_dtype(queries.dtype)
        out = values.new_zeros(B, H, n, values.shape[-1])
        with torch.autocast(queries.device.type, enabled=False):
            q, k, v, bw = queries.to(wd), keys.to(wd), values.to(wd), beta.to(wd)
            for a, b, c0, c1 in plan:
                mask = interval_mask(lo, hi, a, b, c0, c1)
                cos = q[:, :, a:b] @ k[:, :, c0:c1].transpose(-1, -2)
                p = kernel.weights(cos, _beta_rows(bw, a, b), mask)
                out[:, :, a:b] = (p @ v[:, :, c0:c1]).to(out.dtype)
        ctx.kernel, ctx.plan = kernel, plan
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
            for a, b, c0, c1 in ctx.plan:
                mask = interval_mask(lo, hi, a, b, c0, c1)
                qc, kc, vc, gc = q[:, :, a:b], k[:, :, c0:c1], v[:, :, c0:c1], go[:, :, a:b]
                bb = _beta_rows(bw, a, b)
                if ctx.block is not None:
                    cos, p = ctx.block
                else:
                    cos = qc @ kc.transpose(-1, -2)
                    p = kernel.weights(cos, bb, mask)
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

    def __init__(self, kernel: ScoreNormalizer, q: Tensor, k: Tensor, v: Tensor, offset: int,
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
    the row chunks of :func:`~.intervals.attend_plan` (rows capped at TILE_ROWS)."""

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


def _tile_rows(kernel: ScoreNormalizer, batch_heads: int, n: int, S: int) -> int:
    """Query rows per tile: at most ``chunk_elements`` scores and TILE_ROWS rows. Per tile
    there is a fixed cost (~100 small ops) and a wasted triangle of rows^2 / 2 masked scores;
    64-96 rows measured fastest for forward + backward (``bench/kernel_speed.py``)."""
    return max(1, min(_rows_per_chunk(kernel, batch_heads, S), TILE_ROWS))


class _PowerRetrieval(torch.autograd.Function):
    """Retrieval with a :class:`PowerNormalizer`, tile by tile of query rows (:class:`_Tiles`:
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
                kernel: PowerNormalizer, tiles: Callable[..., _Tiles]) -> Tensor:
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
                m, shift, top = kernel.shift_rows_(
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
