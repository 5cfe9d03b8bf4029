"""FSKA: flow-based spectral kernel attention in linear time.

The kernel is k(k_t, k_s) = g(k_t)^T g(k_s) with positive random features g built on
frequency pairs (w1, w2) drawn from a learned per-head spectral density (see
:mod:`.spectral_flow`). Retrieval over the strict past, with fp32 prefix state:

    S_t = sum_{s<t} g(k_s) v_s^T,   z_t = sum_{s<t} g(k_s),
    y_t = g(k_t)^T S_t / (g(k_t)^T z_t + eps),          y_0 = 0.

Bandwidth: the flow models the spectral density at unit bandwidth, u = f_h(z); the head's
learned bandwidth beta_h (from the memory block) scales it at run time, w = sqrt(beta_h) u.
At initialisation the flow is the identity, so w1, w2 ~ N(0, beta_h I) independently and the
expected kernel on unit keys is proportional to exp(beta_h cos) + 1 (the reference Gaussian
kernel plus a uniform floor). The KL regulariser acts on u only, so it shapes the density
without pulling on the bandwidth.

Frequencies are redrawn (reparameterised) on every training forward; in eval mode and for
decoding they come from a fixed seeded noise buffer ``eval_noise`` that is saved with the
model.

Paths of the strict-past retrieval (training and prompts): with the elu1 map, the fused
Triton scan of :mod:`mosaics.ops.linear_attention` where ``MOSAICS_FUSED`` allows it (CUDA by
default; :class:`_FusedElu1Attention`), else the segmented PyTorch scan
(:class:`_CosineFeatureAttention`); the exp map always takes its log-space chunked scan
(:func:`stable_causal_linear_attention`). ``mosaics.ops.triton_backend.PATHS["fska"]`` says
which ran last. Decoding steps keep their O(1) running sums.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from ..cache import FeatureSums, KernelMemory
from ..ops.leaky import chunk_grid, merge_chunks, split_chunks
from ..ops.linear_attention import fused_backward, fused_forward, linear_attention_unsupported
from ..ops.triton_backend import fused_expected, fused_reason, note_path
from .base import (
    Kernel,
    attend_plan,
    bounds_mask,
    causal_offset,
    check_attend_args,
    extend_mask,
    interval_bounds,
    register_kernel,
    run_plan,
)
from .spectral_flow import (
    SpectralFlow,
    SpectralMixturePrior,
    angle_features,
    elu1_features,
    exp_log_features,
    projections,
    spectral_kl,
)

POSITIVE_MAPS = ("elu1", "exp")


def causal_linear_attention(q_feat: Tensor, k_feat: Tensor, values: Tensor, chunk: int,
                            eps: float) -> Tensor:
    """Strict-past linear attention, chunked.

    Args:
        q_feat, k_feat: (B, H, T, F) non-negative query / key features.
        values: (B, H, T, D).
        chunk: chunk length C.
        eps: added to the denominator (a row with no memory gives 0).
    Returns:
        (B, H, T, D) with y_t = q_t^T S_t / (q_t^T z_t + eps), S_t = sum_{s<t} k_s v_s^T.
    Within a chunk the (C, C) strictly-lower weights are used directly; across chunks the
    per-chunk sums k^T v (B, H, T/C, F, D) are turned into exclusive prefix sums. Cost
    O(T (C + D) F); nothing of size T x F x D is formed.
    """
    T = q_feat.shape[2]
    C, n = chunk_grid(T, chunk)
    q, k, v = (split_chunks(x, C, n) for x in (q_feat, k_feat, values))
    mask = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, 0.0)  # (B, H, n, C, C), s < t
    num = scores @ v
    den = scores.sum(-1)
    if n > 1:
        chunk_s = k.transpose(-1, -2) @ v  # (B, H, n, F, D)
        chunk_z = k.sum(-2)  # (B, H, n, F)
        prev_s = torch.nn.functional.pad(chunk_s[:, :, :-1].cumsum(2), (0, 0, 0, 0, 1, 0))
        prev_z = torch.nn.functional.pad(chunk_z[:, :, :-1].cumsum(2), (0, 0, 1, 0))
        num = num + q @ prev_s
        den = den + (q @ prev_z.unsqueeze(-1)).squeeze(-1)
    return merge_chunks(num / (den.unsqueeze(-1) + eps), T)


def _chunked(fk: Tensor, v1: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Key features (B, H, nc, C, F) and values (B, H, nc, C, D+1), zero-padded to nc C."""
    B, H, S, D1 = v1.shape
    nc = -(-S // chunk)
    pad = nc * chunk - S
    return (torch.nn.functional.pad(fk, (0, 0, 0, pad)).view(B, H, nc, chunk, -1),
            torch.nn.functional.pad(v1, (0, 0, 0, pad)).view(B, H, nc, chunk, D1))


def _prefix_states(g: Tensor, vc: Tensor) -> Tensor:
    """P_c = sum over chunks c' < c of g^T [v, 1]: (B, H, nc + 1, F, D+1) float64, P_0 = 0.

    A loop of in-place adds over the chunks, not ``cumsum(2)`` + ``pad``: PyTorch's CPU cumsum
    over a non-last dimension is several times slower (docs/performance.md, "The v2 block with
    FSKA in linear time"; ``bench/long_context.py --models v2-fska gpt2``)."""
    states = g.transpose(-1, -2) @ vc  # (B, H, nc, F, D+1)
    B, H, nc, F, D1 = states.shape
    out = states.new_empty(B, H, nc + 1, F, D1, dtype=torch.float64)
    out[:, :, 0].zero_()
    for c in range(nc):
        torch.add(out[:, :, c], states[:, :, c], out=out[:, :, c + 1])
    return out


def _suffix_sums(x: Tensor) -> Tensor:
    """sum over c' >= c of x[:, :, c'] along dim 2, in place (faster than
    ``flip(2).cumsum(2).flip(2)``, as in :func:`_prefix_states`)."""
    for c in range(x.shape[2] - 2, -1, -1):
        x[:, :, c].add_(x[:, :, c + 1])
    return x


class _IntervalLinear(torch.autograd.Function):
    """[num, den] (B, H, n, D+1) of :func:`interval_linear_attention` from query features fq
    (B, H, n, F), key features fk (B, H, S, F) and values with a column of ones v1 (B, H, S,
    D+1). ``runs``: (sign, b, a, z, c), rows a..z-1 of bounds row b (all batch rows when
    ``shared``) add sign * f_i . P_c; ``tiles``: (a, b, c0, c1, mask) dense ends. Gradients
    are accumulated in place, one buffer per input (slicing under autograd would allocate a
    zero gradient of the whole input per slice)."""

    @staticmethod
    def forward(ctx, fq: Tensor, fk: Tensor, v1: Tensor, chunk: int, runs: list, tiles: list,
                shared: bool) -> Tensor:
        B, H, S, D1 = v1.shape
        g, vc = _chunked(fk, v1, chunk)
        prefix = _prefix_states(g, vc)
        acc = v1.new_zeros(B, H, fq.shape[2], D1, dtype=torch.float64)
        for sign, b, a, z, c in runs:
            rows = slice(None) if shared else slice(b, b + 1)
            acc[rows, :, a:z].add_(fq[rows, :, a:z].double() @ prefix[rows, :, c], alpha=sign)
        out = acc.to(v1.dtype)
        for a, b, c0, c1, mask in tiles:
            w = torch.where(mask, fq[:, :, a:b] @ fk[:, :, c0:c1].transpose(-1, -2), 0.0)
            out[:, :, a:b] += w @ v1[:, :, c0:c1]
        ctx.save_for_backward(fq, fk, v1)  # the prefix states are recomputed in backward
        ctx.chunk, ctx.runs, ctx.tiles, ctx.shared = chunk, runs, tiles, shared
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out: Tensor):  # noqa: ANN205
        fq, fk, v1 = ctx.saved_tensors
        chunk = ctx.chunk
        B, H, S, D1 = v1.shape
        g, vc = _chunked(fk, v1, chunk)
        prefix = _prefix_states(g, vc)
        d_fq, d_fk, d_v1 = torch.zeros_like(fq), torch.zeros_like(fk), torch.zeros_like(v1)
        for a, b, c0, c1, mask in ctx.tiles:
            q, k, v, do = fq[:, :, a:b], fk[:, :, c0:c1], v1[:, :, c0:c1], d_out[:, :, a:b]
            w = torch.where(mask, q @ k.transpose(-1, -2), 0.0)
            d_w = torch.where(mask, do @ v.transpose(-1, -2), 0.0)
            d_v1[:, :, c0:c1] += w.transpose(-1, -2) @ do
            d_fq[:, :, a:b] += d_w @ k
            d_fk[:, :, c0:c1] += d_w.transpose(-1, -2) @ q
        d64 = d_out.double()
        acc = torch.zeros_like(fq, dtype=torch.float64)
        for sign, b, a, z, c in ctx.runs:
            rows = slice(None) if ctx.shared else slice(b, b + 1)
            acc[rows, :, a:z].add_(d64[rows, :, a:z] @ prefix[rows, :, c].transpose(-1, -2),
                                   alpha=sign)
        # the prefix's own memory takes its gradient: a fresh buffer of that size costs more
        # in page faults than the whole loop (docs/performance.md)
        d_prefix = prefix.zero_()
        for sign, b, a, z, c in ctx.runs:
            rows = slice(None) if ctx.shared else slice(b, b + 1)
            d_prefix[rows, :, c].add_(fq[rows, :, a:z].double().transpose(-1, -2)
                                      @ d64[rows, :, a:z], alpha=sign)
        d_fq += acc.to(fq.dtype)
        # P_c = sum_{c' < c} states_c': states_c' collects the gradients of every later P
        nc = prefix.shape[2] - 1
        d_states = _suffix_sums(d_prefix[:, :, 1:]).to(v1.dtype)
        d_g = (vc @ d_states.transpose(-1, -2)).view(B, H, nc * chunk, -1)[:, :, :S]
        d_vc = (g @ d_states).view(B, H, nc * chunk, D1)[:, :, :S]
        return d_fq, d_fk.add_(d_g), d_v1.add_(d_vc), None, None, None, None


def _runs(e: Tensor, sign: int) -> list[tuple[int, int, int, int, int]]:
    """(sign, b, a, z, c): the rows a..z-1 of bounds row b where ``e`` (B', n) holds one value
    c > 0 (a few small device-to-host copies)."""
    out, n = [], e.shape[1]
    for b, row in enumerate(e):
        edges = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
        starts = [0, *edges]
        for a, z, c in zip(starts, [*edges, n], row[starts].tolist(), strict=True):
            if c > 0:
                out.append((sign, b, a, z, c))
    return out


def interval_linear_attention(fq: Tensor, fk: Tensor, values: Tensor, lo: Tensor, hi: Tensor,
                              chunk: int, eps: float, elements: int) -> Tensor:
    """y_i = sum_j w_ij v_j / (sum_j w_ij + eps), w_ij = f_i . g_j over lo[i] <= j <= hi[i], in
    time linear in the interval lengths.

    Args:
        fq: (B, H, n, F) non-negative query features; fk: (B, H, S, F) key features.
        values: (B, H, S, D).
        lo, hi: (B or 1, n) integer bounds (clamped to the memory).
        chunk: C, the grid of key chunks; elements: the size of one dense block.
    Returns:
        (B, H, n, D); rows that see nothing are 0.

    The interval splits into the whole key chunks it covers, c = ceil(lo / C) .. floor((hi + 1)
    / C) - 1, and two ends of fewer than C entries each. The whole chunks come from exclusive
    prefix sums of the chunk states, P_c = sum_{c' < c} sum_{j in c'} g_j [v_j, 1]^T, as
    f_i . P_hi - f_i . P_lo (float64, so the difference of two long sums keeps fp32 precision
    for a short interval at the end of a long memory); the two ends are dense masked products.
    The values carry a column of ones, so numerator and denominator come out together. Cost
    O(n (F D + C (F + D))), against O(n w (F + D)) dense for intervals of w entries.
    """
    B, H, S, D = values.shape
    first, last = lo.clamp_min(0), hi.clamp_max(S - 1)
    c_lo = torch.div(first + chunk - 1, chunk, rounding_mode="floor")  # first whole chunk
    e_hi = torch.div(last + 1, chunk, rounding_mode="floor")  # one past the last whole chunk
    whole = c_lo < e_hi
    zero = torch.zeros_like(c_lo)
    runs = _runs(torch.where(whole, e_hi, zero), 1) + _runs(torch.where(whole, c_lo, zero), -1)
    # the two ends: lo .. (first whole chunk) - 1, and what follows the whole chunks
    ends = [(first, torch.minimum(last, c_lo * chunk - 1)),
            (torch.where(whole, e_hi, c_lo) * chunk, last)]
    tiles = []
    for a_b, z_b in ends:
        for a, b, c0, c1 in attend_plan(a_b, z_b, S, B * H, elements):
            mask = bounds_mask(interval_bounds(a_b, a, b, c0), interval_bounds(z_b, a, b, c0),
                               c1 - c0)
            tiles.append((a, b, c0, c1, mask))
    v1 = torch.cat([values, values.new_ones(B, H, S, 1)], dim=-1)  # [v, 1]
    total = _IntervalLinear.apply(fq, fk, v1, chunk, runs, tiles, whole.shape[0] == 1 and B > 1)
    num, den = total[..., :D], total[..., D:]
    return num / (den.clamp_min(0.0) + eps).clamp_min(torch.finfo(den.dtype).tiny)


SEGMENT_ELEMENTS = 2**18  # features per segment of the elu1 retrieval (B H rows x M'), ~1 MB


class _Workspace:
    """Named flat buffers reused across the segments of one call (``take`` returns a view):
    fresh segment-sized temporaries would each be mapped from the OS when large."""

    def __init__(self, like: Tensor) -> None:
        self.like, self.buffers = like, {}

    def take(self, name: str, *shape: int) -> Tensor:
        size = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < size:
            buf = self.buffers[name] = self.like.new_empty(size)
        return buf[:size].view(shape)


class _CosineFeatureAttention(torch.autograd.Function):
    """Strict-past linear attention with the paper's positive features g = ELU(phi) + 1,
    phi(x) = (4M)^-1/2 [cos a1 + cos a2 ; sin a1 + sin a2], a_i = W_i x, in segments.

    With augmented values v' = [v, 1], o_t = sum_{s<t} (g_t . g_s) v'_s and
    y_t = o_t[:D] / (o_t[D] + eps). Forward, per segment of L positions (chunks of C): the
    features, the strictly-lower (C, C) blocks A = g g^T, per-chunk states g^T v' and their
    prefix P (starting from the carried state S), o = A v' + g P. Saved: the inputs and S at
    each segment start (M' x (D + 1) numbers per segment); no T x M' tensor is kept.
    Backward, segments in reverse, carrying R = sum over later positions of g_t do_t^T:
    do = [dy / den, -(dy . y) / den], dA = do v'^T (strictly lower), dg = (dA + dA^T) g +
    do P^T + v' R_c^T, dv' = A^T do + g R_c, then the feature map's backward,
    dphi = dg min(g, 1) (the derivative of ELU + 1), da_i = (4M)^-1/2 (cos a_i dphi_sin -
    sin a_i dphi_cos), dx = da W, dW = da^T x.
    """

    @staticmethod
    def forward(ctx, x: Tensor, values: Tensor, w1: Tensor, w2: Tensor, chunk: int,
                eps: float) -> Tensor:
        B, H, T, hs = x.shape
        seg = _Segments(x, values, w1, w2, chunk)
        y = x.new_empty(B * H, T, values.shape[-1])
        den = x.new_empty(B * H, T, 1)
        state = x.new_zeros(B * H, seg.F, seg.D + 1)
        starts = []
        for lo, hi in seg:
            starts.append(state)
            g, _, _ = seg.features(lo, hi)
            o, _, _, state = seg.outputs(g, seg.values(lo, hi), state)
            torch.add(o[:, :hi - lo, seg.D:], eps, out=den[:, lo:hi])
            torch.div(o[:, :hi - lo, :seg.D], den[:, lo:hi], out=y[:, lo:hi])
        ctx.chunk = chunk
        y = y.view(B, H, T, -1)
        ctx.save_for_backward(x, values, w1, w2, torch.stack(starts), y, den)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor):  # noqa: ANN205
        x, values, w1, w2, starts, y, den = ctx.saved_tensors
        B, H, T, hs = x.shape
        seg = _Segments(x, values, w1, w2, ctx.chunk)
        dy, y = dy.reshape(B * H, T, seg.D), y.reshape(B * H, T, seg.D)
        dx, dv = torch.empty_like(seg.x), torch.empty_like(seg.v)
        dw = torch.zeros_like(seg.w)  # (B H, 2M, hs)
        carried = torch.zeros_like(starts[0])  # R: sum over later positions of g_t do_t^T
        for i, (lo, hi) in reversed(list(enumerate(seg))):
            g, cos_a, sin_a = seg.features(lo, hi)
            vs = seg.values(lo, hi)
            A, prefix, _ = seg.blocks(g, vs, starts[i])
            do = seg.output_grad(dy[:, lo:hi], y[:, lo:hi], den[:, lo:hi], g.shape[1])
            dg, dvs, carried = seg.grads(g, vs, do, A, prefix, carried)
            dv[:, lo:hi] = dvs[:, :hi - lo, :seg.D]
            da = seg.angle_grad(dg, g, cos_a, sin_a)
            torch.bmm(da[:, :hi - lo], seg.w, out=dx[:, lo:hi])
            dw.baddbmm_(da.transpose(1, 2), seg.rows(lo, hi))
        M = w1.shape[1]
        dw = dw.view(B, H, 2 * M, hs).sum(0)
        return (dx.view(x.shape), dv.view(values.shape), dw[:, :M], dw[:, M:], None, None)


class _Segments:
    """The segments of one elu1 retrieval and their in-place arithmetic (see
    :class:`_CosineFeatureAttention`); rows are (B H, T, .) and every segment holds a whole
    number of chunks (the last one padded with zero rows, which only feed padded queries)."""

    def __init__(self, x: Tensor, values: Tensor, w1: Tensor, w2: Tensor, chunk: int) -> None:
        B, H, T, hs = x.shape
        self.x, self.v = x.reshape(B * H, T, hs), values.reshape(B * H, T, values.shape[-1])
        self.w = torch.cat([w1, w2], dim=1).repeat(B, 1, 1)  # (B H, 2M, hs)
        self.T, self.M, self.F, self.D = T, w1.shape[1], 2 * w1.shape[1], values.shape[-1]
        self.C = C = max(1, min(chunk, T))
        per = max(1, SEGMENT_ELEMENTS // (B * H * self.F * C))
        self.L = C * min(per, -(-T // C))
        self.mask = torch.ones(C, C, dtype=x.dtype, device=x.device).tril_(-1)
        self.ws = _Workspace(x)

    def __iter__(self):
        return iter([(lo, min(lo + self.L, self.T)) for lo in range(0, self.T, self.L)])

    def _padded(self, name: str, src: Tensor, lo: int, hi: int, width: int) -> Tensor:
        """Rows lo..hi of src in a buffer of a whole number of chunks (zero rows after)."""
        n = -(-(hi - lo) // self.C) * self.C
        out = self.ws.take(name, src.shape[0], n, width)
        out[:, :hi - lo, :src.shape[-1]] = src[:, lo:hi]
        out[:, hi - lo:] = 0.0
        return out

    def rows(self, lo: int, hi: int) -> Tensor:
        return self._padded("x", self.x, lo, hi, self.x.shape[-1])

    def values(self, lo: int, hi: int) -> Tensor:
        """[v, 1] for rows lo..hi: one product gives the numerator and the normaliser."""
        v = self._padded("v", self.v, lo, hi, self.D + 1)
        v[:, :hi - lo, self.D] = 1.0
        return v

    def features(self, lo: int, hi: int) -> tuple[Tensor, Tensor, Tensor]:
        """(g, cos a, sin a) of rows lo..hi, each (B H, n C, 2M)."""
        xs, M = self.rows(lo, hi), self.M
        shape = (xs.shape[0], xs.shape[1], self.F)
        a = torch.bmm(xs, self.w.transpose(1, 2), out=self.ws.take("sin", *shape))
        cos_a = torch.cos(a, out=self.ws.take("cos", *shape))
        sin_a = torch.sin(a, out=a)
        g = self.ws.take("g", *shape)
        torch.add(cos_a[..., :M], cos_a[..., M:], out=g[..., :M])
        torch.add(sin_a[..., :M], sin_a[..., M:], out=g[..., M:])
        g.div_(math.sqrt(4 * M))
        return torch.nn.functional.elu_(g).add_(1.0), cos_a, sin_a

    def _chunks(self, t: Tensor) -> Tensor:
        return t.view(-1, self.C, t.shape[-1])

    def _prefix(self, name: str, per_chunk: Tensor, first: Tensor, reverse: bool) -> Tensor:
        """Exclusive running sums over the chunks of a segment, starting from ``first``."""
        per_chunk = per_chunk.view(first.shape[0], -1, *first.shape[1:])
        out = self.ws.take(name, *per_chunk.shape)
        order = range(per_chunk.shape[1] - 1, -1, -1) if reverse else range(per_chunk.shape[1])
        prev = None
        for c in order:
            if prev is None:
                out[:, c] = first
            else:
                torch.add(out[:, prev], per_chunk[:, prev], out=out[:, c])
            prev = c
        return out

    def blocks(self, g: Tensor, v: Tensor, state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(A, prefix P, next state) of one segment: the strictly-lower blocks A = g g^T of its
        chunks and the state before each chunk, P_c = S + sum_{c' < c} g_c'^T v'_c'."""
        gc, vc = self._chunks(g), self._chunks(v)
        A = torch.bmm(gc, gc.transpose(1, 2), out=self.ws.take("A", gc.shape[0], self.C, self.C))
        A.mul_(self.mask)
        per_chunk = torch.bmm(gc.transpose(1, 2), vc,
                              out=self.ws.take("state", gc.shape[0], self.F, self.D + 1))
        prefix = self._prefix("prefix", per_chunk, state, reverse=False)
        return A, prefix, prefix[:, -1] + per_chunk.view(prefix.shape)[:, -1]

    def outputs(self, g: Tensor, v: Tensor, state: Tensor):
        """(o, A, prefix P, next state) of one segment: o = A v' + g P."""
        A, prefix, state = self.blocks(g, v, state)
        gc, vc = self._chunks(g), self._chunks(v)
        o = torch.bmm(A, vc, out=self.ws.take("o", *vc.shape))
        o.baddbmm_(gc, prefix.view(-1, self.F, self.D + 1))
        return o.view(v.shape), A, prefix, state

    def output_grad(self, dy: Tensor, y: Tensor, den: Tensor, rows: int) -> Tensor:
        """do = [dy / den, -(dy . y) / den] for the segment's rows (0 on padding rows)."""
        n, D = dy.shape[1], self.D
        do = self.ws.take("do", dy.shape[0], rows, D + 1)
        do[:, n:] = 0.0
        torch.div(dy, den, out=do[:, :n, :D])
        prod = torch.mul(do[:, :n, :D], y, out=self.ws.take("prod", dy.shape[0], n, D))
        torch.sum(prod, -1, keepdim=True, out=do[:, :n, D:]).neg_()
        return do

    def grads(self, g: Tensor, v: Tensor, do: Tensor, A: Tensor, prefix: Tensor,
              carried: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(dg, dv', carried R for the segment before) of one segment's o = A v' + g P."""
        gc, vc, doc = self._chunks(g), self._chunks(v), self._chunks(do)
        dA = torch.bmm(doc, vc.transpose(1, 2), out=self.ws.take("dA", *A.shape))
        dA.mul_(self.mask)
        per_chunk = torch.bmm(gc.transpose(1, 2), doc,
                              out=self.ws.take("state", gc.shape[0], self.F, self.D + 1))
        later = self._prefix("later", per_chunk, carried, reverse=True)  # R_c
        both = torch.add(dA, dA.transpose(1, 2), out=self.ws.take("dA2", *A.shape))
        dg = torch.bmm(both, gc, out=self.ws.take("dg", *gc.shape))
        dg.baddbmm_(doc, prefix.view(-1, self.F, self.D + 1).transpose(1, 2))
        dg.baddbmm_(vc, later.view(-1, self.F, self.D + 1).transpose(1, 2))
        dv = torch.bmm(A.transpose(1, 2), doc, out=self.ws.take("dv", *vc.shape))
        dv.baddbmm_(gc, later.view(-1, self.F, self.D + 1))
        first = per_chunk.view(later.shape)[:, 0]
        return dg.view(g.shape), dv.view(v.shape), later[:, 0] + first

    def angle_grad(self, dg: Tensor, g: Tensor, cos_a: Tensor, sin_a: Tensor) -> Tensor:
        """d loss / d a from d loss / d g (ELU' = min(g, 1)), into the "cos" buffer."""
        M = self.M
        dphi = dg.mul_(g.clamp_(max=1.0)).div_(math.sqrt(4 * M))
        d_cos, d_sin = dphi[..., :M], dphi[..., M:]
        da = self.ws.take("da", *cos_a.shape)
        for half in (slice(0, M), slice(M, 2 * M)):
            torch.mul(cos_a[..., half], d_sin, out=da[..., half])
            da[..., half].addcmul_(sin_a[..., half], d_cos, value=-1.0)
        return da


class _FusedElu1Attention(torch.autograd.Function):
    """:class:`_CosineFeatureAttention`'s result through the fused Triton scan
    (:func:`mosaics.ops.linear_attention.fused_forward`, chunks of C rows): the elu1 features
    g = ELU(phi(x)) + 1 (B, H, T, 2M) in PyTorch (one GEMM and elementwise maps), then
    y_t = sum_{s<t} (g_t . g_s) v_s / (sum_{s<t} g_t . g_s + eps) in one pass each way.
    Saves x, v, w1, w2, y and den' (no T x M' tensor): backward recomputes g, gets dg and dv
    from :func:`~mosaics.ops.linear_attention.fused_backward` and dg's way back to x and the
    frequencies through autograd of the feature map."""

    @staticmethod
    def forward(ctx, x: Tensor, v: Tensor, w1: Tensor, w2: Tensor, eps: float,
                chunk: int) -> Tensor:
        y, den = fused_forward(elu1_features(x, w1, w2), None, v, eps, chunk)
        ctx.save_for_backward(x, v, w1, w2, y, den)
        ctx.chunk = chunk
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor):  # noqa: ANN205
        x, v, w1, w2, y, den = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (x, w1, w2)]
            g = elu1_features(*inputs)
        dg, _, dv = fused_backward(g.detach(), None, v, y, den, dy, ctx.chunk)
        dx, dw1, dw2 = torch.autograd.grad(g, inputs, dg)
        return dx, dv, dw1, dw2, None, None


NO_MEMORY = -1e30  # log-scale of an empty memory (finite, so differences stay defined)
MAX_PAIR_EXP = 80.0  # exponent cap of a pair's rescaling factor (e^80 < fp32 max)


def _row_reference(rho: Tensor, log_pairs: Tensor) -> Tensor:
    """nu = max(rho, max_j log_pairs[..., j]) over the last dim (which may be empty)."""
    if log_pairs.shape[-1] == 0:
        return rho
    return torch.maximum(rho, log_pairs.amax(-1))


def _pair_weights(pairs: Tensor, gq: Tensor, gk: Tensor, nu: Tensor, mask: Tensor) -> Tensor:
    """w_ij = (f_i.f_j) e^{gamma_i + gamma_j - nu_i} on the mask, 0 elsewhere."""
    scale = (gq.unsqueeze(-1) + gk.unsqueeze(-2) - nu.unsqueeze(-1)).clamp(max=MAX_PAIR_EXP)
    return torch.where(mask, pairs * torch.exp(scale), 0.0)


def _log_pairs(pairs: Tensor, gq: Tensor, gk: Tensor, mask: Tensor) -> Tensor:
    """log k(i, j) = gamma_i + gamma_j + log(f_i.f_j) on the mask, -inf elsewhere (no grad)."""
    logp = torch.log(pairs.detach()) + gq.unsqueeze(-1) + gk.unsqueeze(-2)
    return torch.where(mask, logp, float("-inf"))


def stable_causal_linear_attention(feat: Tensor, log_feat: Tensor, values: Tensor, chunk: int,
                                   eps: float) -> Tensor:
    """Strict-past linear attention with positive features g = exp(log_feat) of any magnitude.

    Args:
        feat: (B, H, T, F) the features rescaled per position, f_t = exp(log_feat_t - gamma_t)
            with gamma_t = max log_feat_t (so max f_t = 1); queries and keys share them.
        log_feat: (B, H, T, F) log g.
        values: (B, H, T, D).
        chunk, eps: as in :func:`causal_linear_attention`.
    Returns:
        (B, H, T, D): y_t = sum_{s<t} (g_t.g_s) v_s / (sum_{s<t} g_t.g_s + eps e^{nu_t}).

    Nothing is exponentiated unscaled. The prefix state of earlier chunks is kept per feature
    m relative to r_m = max_s log g_s[m] (a scan over T / C chunks), so a key is dropped from
    feature m only when another key exceeds it there by ~87 nats. Each query row t is
    computed relative to nu_t = max(max_m (log g_t[m] + r_m), max_{s<t in chunk}
    log g_t.g_s), an upper bound within log T of its largest term; every factor is then at most
    1 (pair factors are capped at e^80 in the few cases where f_t.f_s is tiny). Inside a chunk
    the pair products f_t.f_s come from one fp32 matmul and underflow below ~1e-38: far-apart
    pairs in the same chunk can be dropped at very large bandwidths. No future position enters
    any row's arithmetic.
    """
    T = feat.shape[2]
    C, n = chunk_grid(T, chunk)
    f, v = split_chunks(feat, C, n), split_chunks(values, C, n)
    L = split_chunks(log_feat, C, n, value=NO_MEMORY)
    gam = L.detach().amax(-1)  # (B, H, n, C)
    # per-feature prefix state of the chunks before c, relative to r[c]
    cmax = L.detach().amax(3)  # (B, H, n, F)
    fk = torch.exp(L - cmax.unsqueeze(3))
    chunk_s, chunk_z = fk.transpose(-1, -2) @ v, fk.sum(3)  # (B, H, n, F, D), (B, H, n, F)
    S, z = torch.zeros_like(chunk_s[:, :, 0]), torch.zeros_like(chunk_z[:, :, 0])
    r = torch.full_like(cmax[:, :, 0], NO_MEMORY)
    prev_s, prev_z, prev_r = [], [], []
    for c in range(n):
        prev_s.append(S)
        prev_z.append(z)
        prev_r.append(r)
        if c + 1 < n:
            r_new = torch.maximum(r, cmax[:, :, c])
            keep, add = torch.exp(r - r_new), torch.exp(cmax[:, :, c] - r_new)
            S = S * keep.unsqueeze(-1) + chunk_s[:, :, c] * add.unsqueeze(-1)
            z = z * keep + chunk_z[:, :, c] * add
            r = r_new
    r = torch.stack(prev_r, 2).unsqueeze(3)  # (B, H, n, 1, F)
    mask = torch.ones(C, C, dtype=torch.bool, device=feat.device).tril(-1)
    pairs = f @ f.transpose(-1, -2)  # (B, H, n, C, C)
    rho = (L.detach() + r).amax(-1)  # (B, H, n, C)
    nu = _row_reference(rho, _log_pairs(pairs, gam, gam, mask))
    w = _pair_weights(pairs, gam, gam, nu, mask)
    q_w = torch.exp(L + r - nu.unsqueeze(-1))  # (B, H, n, C, F), at most 1
    num = w @ v + q_w @ torch.stack(prev_s, 2)
    den = w.sum(-1) + (q_w @ torch.stack(prev_z, 2).unsqueeze(-1)).squeeze(-1)
    return merge_chunks(num / (den.unsqueeze(-1) + eps), T)


@register_kernel("fska")
class FSKAKernel(Kernel):
    """Flow-based spectral kernel attention (linear time, strict past).

    Args:
        num_features: M frequency pairs per head.
        flow_layers: affine couplings per head (0: fixed Gaussian random features).
        flow_hidden: hidden width of each coupling network.
        prior_components: Q components of the fixed spectral-mixture prior.
        lambda_spec: weight of the KL(flow || prior) term in the training loss.
        positive: ``"elu1"`` (the paper's ELU(phi) + 1, 2M features) or ``"exp"``
            (positive exponential features on the same frequencies, M features; sharper).
        chunk_size: chunk length C of the linear-attention scan.
        eps: denominator guard.
        seed: seed of the initial weights, the prior and the eval-time frequencies.
        linear_intervals: :meth:`attend` at one bandwidth per head with the elu1 map: None
            takes the cheaper of the dense chunks and the linear-time path, True / False
            always the one or the other.
    The per-head modules are created by :meth:`build` (the memory block calls it right after
    construction, so weights exist before a checkpoint is loaded).
    """

    def __init__(self, num_features: int = 96, flow_layers: int = 5, flow_hidden: int = 64,
                 prior_components: int = 10, lambda_spec: float = 1e-3,
                 positive: str = "elu1", chunk_size: int = 64, eps: float = 1e-20,
                 seed: int = 0, linear_intervals: bool | None = None) -> None:
        super().__init__()
        for key, value, low in (("num_features", num_features, 1), ("flow_layers", flow_layers, 0),
                                ("flow_hidden", flow_hidden, 1),
                                ("prior_components", prior_components, 1),
                                ("chunk_size", chunk_size, 1), ("seed", seed, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"fska kernel_kwargs: {key} must be an integer >= {low}, "
                                 f"got {value!r}")
        if linear_intervals not in (None, True, False):
            raise ValueError(f"fska kernel_kwargs: linear_intervals must be null, true or "
                             f"false, got {linear_intervals!r}")
        if positive not in POSITIVE_MAPS:
            raise ValueError(f"fska kernel_kwargs: positive must be one of {POSITIVE_MAPS}, "
                             f"got {positive!r}")
        for key, value in (("lambda_spec", lambda_spec), ("eps", eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"fska kernel_kwargs: {key} must be a number >= 0, "
                                 f"got {value!r}")
        self.num_features, self.flow_layers = num_features, flow_layers
        self.flow_hidden, self.prior_components = flow_hidden, prior_components
        self.positive, self.chunk_size = positive, chunk_size
        self.eps, self.seed = float(eps), seed
        self.regularization_weight = float(lambda_spec)
        self.n_head = self.head_size = 0
        self.flow: SpectralFlow | None = None
        self.prior: SpectralMixturePrior | None = None
        self._noise: Tensor | None = None  # training draw of the last forward
        self._kl: Tensor | None = None
        self._beta: Tensor | None = None  # bandwidth of the last forward (for prefill_state)
        self._eval_cache: tuple[tuple, Tensor] | None = None
        self._freq_cache: tuple[Tensor, Tensor, tuple[Tensor, Tensor]] | None = None
        self.linear_intervals = linear_intervals

    # -- construction -------------------------------------------------------------------
    def build(self, n_head: int, head_size: int) -> None:
        """Create the per-head flow, the prior and the eval-time noise (H, M, 2 hs)."""
        if self.flow is not None:
            if (n_head, head_size) != (self.n_head, self.head_size):
                raise ValueError(f"fska kernel already built for n_head={self.n_head}, "
                                 f"head_size={self.head_size}; make a new kernel instead")
            return
        g = torch.Generator().manual_seed(self.seed)
        self.n_head, self.head_size = n_head, head_size
        self.flow = SpectralFlow(n_head, head_size, self.flow_layers, self.flow_hidden, g)
        self.prior = SpectralMixturePrior(head_size, self.prior_components, g)
        noise = torch.randn(n_head, self.num_features, 2 * head_size, generator=g, device="cpu")
        self.register_buffer("eval_noise", noise)

    @property
    def feature_dim(self) -> int:
        """M' = size of g(x): 2M for elu1, M for exp."""
        return 2 * self.num_features if self.positive == "elu1" else self.num_features

    def _check(self, x: Tensor) -> None:
        if self.flow is None:
            raise RuntimeError("fska kernel is not built: call kernel.build(n_head, head_size) "
                               "after get_kernel (ContextualMemory does this)")
        if x.shape[1] != self.n_head or x.shape[-1] != self.head_size:
            raise ValueError(f"fska kernel built for n_head={self.n_head}, head_size="
                             f"{self.head_size}; got keys of shape {tuple(x.shape)}")

    # -- frequencies ---------------------------------------------------------------------
    def _unit_frequencies_eval(self) -> Tensor:
        """Flow output on the fixed eval noise (H, M, 2hs); cached while nothing changes."""
        tensors = [*self.flow.parameters(), self.eval_noise]
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return self.flow(self.eval_noise.to(self.flow.w_in.dtype))[0].float()
        if self._eval_cache is not None and self._eval_cache[0] == key:
            return self._eval_cache[1]
        u = self.flow(self.eval_noise.to(self.flow.w_in.dtype))[0].float()
        self._eval_cache = (key, u)
        return u

    def frequencies(self, beta: Tensor) -> tuple[Tensor, Tensor]:
        """(w1, w2), each (H, M, hs) fp32, at bandwidth beta (H,): w = sqrt(beta) f(z).

        Training: fresh z ~ N(0, I) and the KL estimate on these samples is stored for
        :meth:`regularization`. Eval: the fixed ``eval_noise`` draw.
        """
        w = self.unit_frequencies() * beta.float().sqrt().view(-1, 1, 1)
        return w[..., :self.head_size], w[..., self.head_size:]

    def unit_frequencies(self) -> Tensor:
        """u = f(z) (H, M, 2 hs) fp32 at unit bandwidth (see :meth:`frequencies`)."""
        if not self.training:
            return self._unit_frequencies_eval()
        z = torch.randn(self.eval_noise.shape, device=self.eval_noise.device,
                        dtype=self.flow.w_in.dtype)
        u, log_q = self.flow.sample(z)
        u = u.float()
        self._noise, self._kl = z, spectral_kl(log_q, u, self.prior)
        return u

    def features(self, x: Tensor, w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor | None]:
        """Features (B, H, T, M') fp32 and, for the exp map, log g (B, H, T, M).

        elu1: g = ELU(phi) + 1 (bounded) and None. exp: f = exp(log g - gamma) with
        gamma = max log g per position (so max f = 1), and log g itself.
        """
        if self.positive == "elu1":
            return elu1_features(x, w1, w2), None
        log_g = exp_log_features(x, w1, w2)
        gamma = log_g.detach().amax(-1, keepdim=True)
        return torch.exp(log_g - gamma), log_g

    def regularization(self) -> Tensor | None:
        """KL(flow || prior), Monte Carlo on the last training draw, mean over heads."""
        if not self.training or self._noise is None:
            return None
        kl = self._kl
        flow_trains = any(p.requires_grad for p in self.flow.parameters())
        if torch.is_grad_enabled() and flow_trains and not kl.requires_grad:
            # the forward ran without autograd (e.g. re-entrant checkpointing): recompute
            u, log_q = self.flow.sample(self._noise)
            kl = spectral_kl(log_q, u, self.prior)
        return kl

    # -- retrieval -----------------------------------------------------------------------
    def forward(self, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
        self._check(keys)
        self._beta = beta.detach()
        with torch.autocast(device_type=keys.device.type, enabled=False):
            w1, w2 = self.frequencies(beta)
            x = keys.float()
            reason = self._fused_reason(x, values.float())  # fp32, as the chunked paths
            note_path(self.name, reason, expected=fused_expected(x))
            if reason is None:
                return self._fused(x, values.float(), w1, w2).to(values.dtype)
            if self.positive == "elu1":
                y = _CosineFeatureAttention.apply(x, values.float(), w1, w2, self.chunk_size,
                                                  self.eps)
                return y.to(values.dtype)
            if torch.is_grad_enabled():  # recompute the features in backward: O(T M) less memory
                f, log_g = checkpoint(self.features, x, w1, w2, use_reentrant=False)
            else:
                f, log_g = self.features(x, w1, w2)
            v = values.float()
            if log_g is None:
                y = causal_linear_attention(f, f, v, self.chunk_size, self.eps)
            else:
                y = stable_causal_linear_attention(f, log_g, v, self.chunk_size, self.eps)
        return y.to(values.dtype)

    def _fused_reason(self, x: Tensor, values: Tensor) -> str | None:
        """None when :meth:`forward` takes the fused Triton scan, else why not: the switch
        and device (``MOSAICS_FUSED``, :func:`~mosaics.ops.triton_backend.fused_reason`),
        the shapes, or the exp map, whose log-space scan (per-feature running maxima of the
        state, a reference per row) the plain fp32 kernel does not do."""
        if self.positive != "elu1":
            return (f"positive={self.positive!r} keeps its features in log space; only the "
                    "elu1 map has a fused scan")
        return fused_reason(x, values) or linear_attention_unsupported(x, None, values)

    @torch.compiler.disable  # Triton launches from a module loaded by path: run them eagerly
    def _fused(self, x: Tensor, v: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        """The strict-past retrieval through the fused kernels (:class:`_FusedElu1Attention`),
        in chunks of ``chunk_size`` rows when that is a power of two from 16 to 128 (a
        ``tl.dot`` side; the per-chunk blocks stay in registers), else of 64."""
        c = self.chunk_size
        chunk = c if 16 <= c <= 128 and c & (c - 1) == 0 else 64
        return _FusedElu1Attention.apply(x.contiguous(), v.contiguous(), w1, w2, self.eps, chunk)

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
               lo: Tensor, hi: Tensor) -> Tensor:
        """Retrieval over per-query intervals lo[i] <= j <= hi[i] (see :meth:`Kernel.attend`):

            y_i = sum_j k_ij v_j / (sum_j k_ij + eps),   k_ij = g(q_i) . g(k_j),

        Every interval and bandwidth is honoured exactly:

        - one bandwidth per head (H,): the features of all queries and keys once; the strict
          past (queries = keys) is :meth:`forward`; with the elu1 map, other intervals run in
          linear time (:func:`interval_linear_attention`: differences of chunk prefix states
          plus the two partial chunks at the ends) when that computes less than the dense
          form (``_linear_pays``), which is chunk by chunk of query rows over the columns each
          chunk sees, one (rows, columns) product each, cost O(n (h + chunk) M') for windows
          of h;
        - one per query (B or 1, H, n): the frequencies sqrt(beta_i) u differ per query, so
          the keys' features are recomputed for every (query, key) pair of a chunk: cost
          O(n (h + chunk) M) sines and cosines (elu1) or exponentials (exp), far more.

        The exp map works relative to each row's largest k_ij (as :meth:`forward` does, so
        eps acts on the rescaled sum); elu1 on k_ij itself. Frequencies as in
        :meth:`forward` (fresh in training, fixed in eval); each chunk is recomputed in
        backward (activation checkpointing).
        """
        self._check(queries)
        beta4 = check_attend_args(queries, keys, values, beta, lo, hi)
        B, H, n, _ = queries.shape
        per_query = beta.dim() == 3
        if not per_query and queries is keys and causal_offset(lo, hi) == -1:
            return self.forward(keys, values, beta)  # the strict past: the chunked scan
        features = self.feature_dim if per_query else 1
        plan = attend_plan(lo, hi, keys.shape[2], B * H * features, self.chunk_elements)
        with torch.autocast(device_type=queries.device.type, enabled=False):
            u = self.unit_frequencies()
            u1, u2 = u[..., :self.head_size], u[..., self.head_size:]
            q, k, v = queries.float(), keys.float(), values.float()
            if per_query:  # angles at unit bandwidth, scaled per query inside each chunk
                qa, ka = projections(q, u1, u2), projections(k, u1, u2)
                scale = beta4.float().sqrt()  # (B or 1, H, n, 1)
                chunk = self._pair_chunk
            else:
                root = beta.float().sqrt().view(-1, 1, 1)
                w1, w2 = u1 * root, u2 * root
                if self.positive == "elu1" and self._linear_pays(plan, n, k.shape[2],
                                                                 v.shape[-1]):
                    y = self._linear(q, k if queries is not keys else None, v, w1, w2, lo, hi)
                    return y.to(values.dtype)
                qa = self.features(q, w1, w2)
                ka = qa if queries is keys else self.features(k, w1, w2)
                scale = None
                chunk = self._feature_chunk
            def args(a: int, b: int, c0: int, c1: int) -> tuple:
                return ([x[:, :, a:b] for x in qa if x is not None],
                        [x[:, :, c0:c1] for x in ka if x is not None], v[:, :, c0:c1],
                        interval_bounds(lo, a, b, c0), interval_bounds(hi, a, b, c0),
                        None if scale is None else scale[:, :, a:b])

            y = run_plan(plan, n, lambda m: v.new_zeros(B, H, m, v.shape[-1]), chunk, args,
                         torch.is_grad_enabled())
        return y.to(values.dtype)

    def attend_step(self, memory: KernelMemory, query: Tensor, beta: Tensor, lo: Tensor,
                    hi: Tensor, base: int) -> tuple[Tensor, KernelMemory] | None:
        """A decoding step over visible intervals in O(1) features per token (elu1 map, one
        bandwidth per head, eval frequencies; otherwise None: :meth:`attend`).

        The memory keeps the running sums over the entries the last step saw, in float64
        (``memory.sums``): S = sum_j g(k_j) v_j^T (B, H, M', hv), z = sum_j g(k_j) (B, H, M'),
        and that interval's absolute bounds lo, hi (B,). The step adds the entries
        that entered (lo .. hi grows at hi) and subtracts those that left (a window's oldest),
        each entry once; a row whose new interval starts past the old one (a new document), or
        whose entries to subtract are no longer stored, restarts from its interval. Then
        y = g(q) S / (g(q) . z + eps), as :meth:`attend`."""
        if (self.training or self.positive != "elu1" or beta.dim() != 1
                or self.linear_intervals is False or torch.is_grad_enabled()):
            return None
        self._check(query)
        keys, values = memory.keys, memory.values
        B, H, S, hv = values.shape
        # entries before base may be held by the sums alone (a windowless memory drops them)
        lo = lo.reshape(-1).expand(B)
        hi = hi.reshape(-1).expand(B).clamp(max=base + S - 1)
        hi = torch.maximum(hi, lo - 1)  # an empty interval: lo .. lo - 1
        f = self.feature_dim
        with torch.autocast(device_type=query.device.type, enabled=False):
            w1, w2 = self._eval_frequencies(beta)
            run = memory.sums
            if run is not None and run.hi is not None:  # updated in place below
                sums, zs, cur_lo, cur_hi = run.S.contiguous(), run.z, run.lo, run.hi
                # a row restarts when its interval starts past the sums, or when the entries
                # it should subtract are no longer stored
                restart = (lo > cur_hi) | ((lo > cur_lo) & (cur_lo < base))
                if bool(restart.any()):
                    keep = (~restart).to(sums.dtype)
                    sums, zs = sums * keep.view(B, 1, 1, 1), zs * keep.view(B, 1, 1)
                    cur_lo = torch.where(restart, lo, cur_lo)
                    cur_hi = torch.where(restart, lo - 1, cur_hi)
            else:
                sums = values.new_zeros(B, H, f, hv, dtype=torch.float64)
                zs = values.new_zeros(B, H, f, dtype=torch.float64)
                cur_lo, cur_hi = lo, lo - 1
            # the entries that enter (weight +1) and leave (-1), and the query: one feature call
            rows, signs, vals = [], [], []
            for start, stop, sign in ((cur_hi + 1, hi + 1, 1.0), (cur_lo, lo, -1.0)):
                moves = stop > start  # the rows with entries to add (or subtract)
                if not bool(moves.any()):
                    continue
                a, b = int(start[moves].min()), int(stop[moves].max())
                if a < base:
                    raise RuntimeError(f"fska attend_step: entry {a} is needed but the memory "
                                       f"starts at {base}; rebuild the cache from the prompt")
                j = torch.arange(a, b, device=query.device)
                inside = (j >= start.view(B, 1)) & (j < stop.view(B, 1))  # (B, m)
                rows.append(keys[:, :, a - base:b - base])
                signs.append(inside.to(torch.float64) * sign)
                vals.append(values[:, :, a - base:b - base])
            x = torch.cat([*(r.to(query.dtype) for r in rows), query], 2) if rows else query
            g = elu1_features(x.float(), w1, w2).double()  # (B, H, m + 1, M')
            fq = g[:, :, -1:]
            if rows:
                fk = g[:, :, :-1] * torch.cat(signs, 1).view(B, 1, -1, 1)
                v = torch.cat(vals, 2).double()
                m = fk.shape[2]
                sums.view(B * H, f, hv).baddbmm_(fk.transpose(-1, -2).reshape(B * H, f, m),
                                                 v.reshape(B * H, m, hv))
                zs.add_(fk.sum(-2))
            den = (fq @ zs.unsqueeze(-1) + self.eps).clamp_min(torch.finfo(torch.float32).tiny)
            y = (fq @ sums) / den
        return y.to(values.dtype), replace(memory, sums=FeatureSums(sums, zs, lo=lo, hi=hi))

    def _linear(self, q: Tensor, k: Tensor | None, v: Tensor, w1: Tensor, w2: Tensor,
                lo: Tensor, hi: Tensor) -> Tensor:
        """:func:`interval_linear_attention` on the elu1 features of q and k (None: k = q),
        all of it recomputed in backward under autograd. Measured on v2 FSKA at T 4096
        (``bench/long_context.py``, one run each): the peak of a training step 1.14x GPT-2's
        at 0.46x its tokens/s; recomputing only the features, 1.36x at 0.50x; nothing,
        1.53x at 0.53x."""
        def run(q: Tensor, k: Tensor | None, v: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
            fq = elu1_features(q, w1, w2)
            fk = fq if k is None else elu1_features(k, w1, w2)
            return interval_linear_attention(fq, fk, v, lo, hi, self.chunk_size, self.eps,
                                             self.chunk_elements)

        if torch.is_grad_enabled():
            return checkpoint(run, q, k, v, w1, w2, use_reentrant=False)
        return run(q, k, v, w1, w2)

    def _linear_pays(self, plan: list[tuple[int, int, int, int]], n: int, S: int,
                     hv: int) -> bool:
        """Whether :func:`interval_linear_attention` is the faster, by multiply-adds: S F hv for
        the chunk states and n (4 F hv + 2 C (F + hv)) for the rows (float64 prefix products
        counted twice), against sum rows x columns x (F + hv) for the dense chunks of
        ``plan``, plus, under autograd, the whole-input zero gradient that each chunk's slices
        allocate, n F + S (F + hv) per chunk. ``bench/attend.py --kernels fska`` checks the
        choice (windows of 256 and gaps, T 1024-8192). ``linear_intervals`` forces either."""
        if self.linear_intervals is not None:
            return self.linear_intervals
        f, c = self.feature_dim, self.chunk_size
        dense = sum((b - a) * (c1 - c0) for a, b, c0, c1 in plan) * (f + hv)
        if torch.is_grad_enabled():
            dense += len(plan) * (n * f + S * (f + hv))
        return S * f * (hv + 1) + n * (4 * f * (hv + 1) + 2 * c * (f + hv)) < dense

    def _feature_chunk(self, q: list[Tensor], k: list[Tensor], v: Tensor, lo: Tensor,
                       hi: Tensor, scale: None) -> Tensor:
        """One chunk at a bandwidth per head: q = [features (B, H, rows, M')] plus, for the
        exp map, [log g], the same for the keys' columns; lo, hi (B or 1, rows) relative to
        the first column."""
        mask = bounds_mask(lo, hi, v.shape[2])
        pairs = q[0] @ k[0].transpose(-1, -2)
        if self.positive == "elu1":
            w = torch.where(mask, pairs, 0.0)
        else:  # k_ij = (f_i . f_j) e^{gamma_i + gamma_j}, relative to the row's largest
            gq, gk = q[1].detach().amax(-1), k[1].detach().amax(-1)
            nu = _log_pairs(pairs, gq, gk, mask).amax(-1)
            w = _pair_weights(pairs, gq, gk, torch.where(torch.isfinite(nu), nu, 0.0), mask)
        return self._normalized(w, v)

    def _pair_chunk(self, q: list[Tensor], k: list[Tensor], v: Tensor, lo: Tensor, hi: Tensor,
                    scale: Tensor) -> Tensor:
        """One chunk at a bandwidth per query: the angles (W_1 x, W_2 x) at unit bandwidth of
        the chunk's queries (B, H, rows, M) and keys (B, H, cols, M), scale = sqrt(beta_i)
        (B or 1, H, rows, 1); the keys' features are formed per (query, key) pair."""
        mask = bounds_mask(lo, hi, v.shape[2])
        q1, q2 = q[0] * scale, q[1] * scale
        s = scale.unsqueeze(-1)  # (., H, rows, 1, 1) against keys (B, H, 1, cols, M)
        k1, k2 = k[0].unsqueeze(2) * s, k[1].unsqueeze(2) * s
        fq, fk = angle_features(q1, q2, self.positive), angle_features(k1, k2, self.positive)
        if self.positive == "elu1":
            w = torch.where(mask, (fk @ fq.unsqueeze(-1)).squeeze(-1), 0.0)
        else:
            log_k = torch.logsumexp(fq.unsqueeze(-2) + fk, dim=-1).masked_fill(~mask,
                                                                               float("-inf"))
            nu = log_k.detach().amax(-1, keepdim=True)
            w = torch.exp(log_k - torch.where(torch.isfinite(nu), nu, 0.0))
        return self._normalized(w, v)

    def _normalized(self, w: Tensor, v: Tensor) -> Tensor:
        """(w V) / (sum_j w + eps), 0 on rows without weight."""
        den = (w.sum(-1, keepdim=True) + self.eps).clamp_min(torch.finfo(w.dtype).tiny)
        return (w @ v) / den

    def _eval_frequencies(self, beta: Tensor) -> tuple[Tensor, Tensor]:
        """(w1, w2) at the eval noise and bandwidth beta; outside autograd, kept while the
        flow's output and beta stay the same (a decoding step asks for them per memory)."""
        u = self._unit_frequencies_eval()
        tracked = torch.is_grad_enabled() and beta.requires_grad
        hit = self._freq_cache
        if (not tracked and hit is not None and hit[0] is u and hit[1].shape == beta.shape
                and hit[1].device == beta.device and torch.equal(hit[1], beta)):
            return hit[2]
        w = u * beta.float().sqrt().view(-1, 1, 1)
        out = (w[..., :self.head_size], w[..., self.head_size:])
        if not tracked and not u.requires_grad:
            self._freq_cache = (u, beta.detach().clone(), out)
        return out

    @staticmethod
    def _add_to_sums(sums: FeatureSums, f: Tensor, log_g: Tensor | None,
                     v: Tensor) -> FeatureSums:
        """Add keys (features f or log g, (B, H, m, M')) with values v (B, H, m, hs)."""
        if log_g is None:
            return FeatureSums(sums.S + f.transpose(-1, -2) @ v, sums.z + f.sum(-2))
        if log_g.shape[2] == 0:
            return replace(sums)
        r = torch.maximum(sums.r, log_g.amax(2))  # (B, H, M)
        keep = torch.exp(sums.r - r)
        fk = torch.exp(log_g - r.unsqueeze(2))
        return FeatureSums(sums.S * keep.unsqueeze(-1) + fk.transpose(-1, -2) @ v,
                           sums.z * keep + fk.sum(-2), r)

    def memory_of(self, keys: Tensor, values: Tensor) -> KernelMemory:
        """The running sums of (B, H, m, hs) entries, in fp32, at the eval frequencies and the
        bandwidth of the last forward: S = sum_j g(k_j) v_j^T (B, H, M', hs), z = sum_j g(k_j)
        (B, H, M'); the exp map keeps them relative to r (B, H, M), the per-feature running
        max of the keys' log g. No entry is stored."""
        self._check(keys)
        if self._beta is None:
            raise RuntimeError("fska memory_of needs the bandwidth of a preceding forward "
                               "call; run the kernel's forward on the prompt first")
        B, H, _, hv = values.shape
        f = self.feature_dim
        zeros = FeatureSums(keys.new_zeros(B, H, f, hv, dtype=torch.float32),
                            keys.new_zeros(B, H, f, dtype=torch.float32))
        if self.positive == "exp":
            zeros.r = torch.full((B, H, f), NO_MEMORY, device=keys.device, dtype=torch.float32)
        with torch.autocast(device_type=keys.device.type, enabled=False):
            w1, w2 = self._eval_frequencies(self._beta)
            fk, log_g = self.features(keys.float(), w1, w2)
            sums = self._add_to_sums(zeros, fk, log_g, values.float())
        return KernelMemory(keys[:, :, :0], values[:, :, :0], sums)

    def extend(self, state: KernelMemory, queries: Tensor, keys: Tensor, values: Tensor,
               beta: Tensor) -> tuple[Tensor, KernelMemory]:
        """O(1)-per-token decoding step with the fixed eval frequencies."""
        self._check(queries)
        self._beta = beta.detach()
        sums = state.sums
        n, m = queries.shape[2], keys.shape[2]
        with torch.autocast(device_type=queries.device.type, enabled=False):
            w1, w2 = self._eval_frequencies(beta)
            fq, lq = self.features(queries.float(), w1, w2)
            fk, lk = self.features(keys.float(), w1, w2)
            v = values.float()
            mask = extend_mask(n, 0, m, queries.device)  # (n, m)
            pairs = fq @ fk.transpose(-1, -2)  # (B, H, n, m)
            if lq is None:
                w = pairs.masked_fill(~mask, 0.0)
                num, den = fq @ sums.S + w @ v, fq @ sums.z.unsqueeze(-1)
            else:  # relative to nu_i, as in stable_causal_linear_attention
                gq, gk = lq.amax(-1), lk.amax(-1)
                r = sums.r.unsqueeze(2)  # (B, H, 1, M)
                nu = _row_reference((lq + r).amax(-1), _log_pairs(pairs, gq, gk, mask))
                w = _pair_weights(pairs, gq, gk, nu, mask)
                q_w = torch.exp(lq + r - nu.unsqueeze(-1))
                num, den = q_w @ sums.S + w @ v, q_w @ sums.z.unsqueeze(-1)
            den = den.squeeze(-1) + w.sum(-1)
            y = num / (den.unsqueeze(-1) + self.eps)
            new = replace(state, sums=self._add_to_sums(sums, fk, lk, v))
        return y.to(values.dtype), new

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, num_features={self.num_features}, positive="
                f"{self.positive!r}, flow_layers={self.flow_layers}, "
                f"lambda_spec={self.regularization_weight}, chunk_size={self.chunk_size}")
