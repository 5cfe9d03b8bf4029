"""Linear attention over positive random features (the maths of FSKA's retrieval).

With features g(x) >= 0 of unit keys (the maps of this module: the paper's ELU(phi) + 1 on
frequency pairs, or the exp map kept in log space),

    y_i = sum_{j in S_i} (g(q_i) . g(k_j)) v_j / (sum_{j in S_i} g(q_i) . g(k_j) + eps),

for the strict past S_i = {j < i} (:func:`chunked_causal_linear_attention`, the segmented
elu1 scan :class:`CosineFeatureAttention`, the fused Triton scan
:class:`FusedElu1Attention`, the log-space :func:`stable_causal_linear_attention`) and for
intervals lo_i <= j <= hi_i in linear time (:func:`interval_linear_attention`).
:func:`interval_linear_attention_reference` is the dense form of all of them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .intervals import attend_plan, bounds_mask, interval_bounds
from .leaky import chunk_grid, merge_chunks, split_chunks
from .linear_attention import (
    elu1_unsupported,
    fused_backward,
    fused_elu1_backward,
    fused_elu1_forward,
    fused_forward,
)


def interval_linear_attention_reference(fq: Tensor, fk: Tensor, values: Tensor, lo: Tensor,
                                        hi: Tensor, eps: float) -> Tensor:
    """Dense y_i = sum_j w_ij v_j / (sum_j w_ij + eps), w_ij = fq_i . fk_j on lo_i <= j <= hi_i:
    fq (B, H, n, F), fk (B, H, S, F), values (B, H, S, D), bounds (B or 1, n)."""
    j = torch.arange(fk.shape[2], device=fk.device)
    mask = ((j >= lo.unsqueeze(-1)) & (j <= hi.unsqueeze(-1))).unsqueeze(1)
    w = torch.where(mask, fq @ fk.transpose(-1, -2), 0.0)
    return (w @ values) / (w.sum(-1, keepdim=True) + eps)


def projections(x: Tensor, w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor]:
    """W1 x, W2 x for x (B, H, T, hs) and w (H, M, hs) -> (B, H, T, M) each."""
    return (torch.einsum("bhtd,hmd->bhtm", x, w1), torch.einsum("bhtd,hmd->bhtm", x, w2))


def cosine_features(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """phi(x) = (4M)^-1/2 [cos W1x + cos W2x ; sin W1x + sin W2x]: (B, H, T, 2M)."""
    return angle_cosine_features(*projections(x, w1, w2))


def angle_cosine_features(a1: Tensor, a2: Tensor) -> Tensor:
    """phi from the angles a_i = W_i x (..., M): (4M)^-1/2 [cos a1 + cos a2 ; sin a1 + sin a2]."""
    phi = torch.cat([torch.cos(a1) + torch.cos(a2), torch.sin(a1) + torch.sin(a2)], dim=-1)
    return phi / math.sqrt(4 * a1.shape[-1])


def angle_features(a1: Tensor, a2: Tensor, positive: str) -> Tensor:
    """The positive map from the angles a_i = W_i x (..., M): ``"elu1"``: g = ELU(phi) + 1
    (..., 2M); ``"exp"``: log g = logaddexp(a1, a2) - log(4M) / 2 (..., M)."""
    if positive == "elu1":
        return F.elu(angle_cosine_features(a1, a2)) + 1.0
    return torch.logaddexp(a1, a2) - 0.5 * math.log(4 * a1.shape[-1])


def elu1_features(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """The paper's positive map ELU(phi(x)) + 1: (B, H, T, 2M)."""
    return F.elu(cosine_features(x, w1, w2)) + 1.0


def exp_log_features(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """log g(x) of the exp map: logaddexp(W1 x, W2 x) - log(4M)/2, shape (B, H, T, M).

    Kept in log space: exp(W x) overflows fp32 once |w| > 88, so callers rescale per row
    (see :func:`stable_causal_linear_attention`).
    """
    a1, a2 = projections(x, w1, w2)
    return torch.logaddexp(a1, a2) - 0.5 * math.log(4 * w1.shape[-2])


def chunked_causal_linear_attention(q_feat: Tensor, k_feat: Tensor, values: Tensor, chunk: int,
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
        prev_s = F.pad(chunk_s[:, :, :-1].cumsum(2), (0, 0, 0, 0, 1, 0))
        prev_z = F.pad(chunk_z[:, :, :-1].cumsum(2), (0, 0, 1, 0))
        num = num + q @ prev_s
        den = den + (q @ prev_z.unsqueeze(-1)).squeeze(-1)
    return merge_chunks(num / (den.unsqueeze(-1) + eps), T)


def _chunked(fk: Tensor, v1: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Key features (B, H, nc, C, F) and values (B, H, nc, C, D+1), zero-padded to nc C."""
    B, H, S, D1 = v1.shape
    nc = -(-S // chunk)
    pad = nc * chunk - S
    return (F.pad(fk, (0, 0, 0, pad)).view(B, H, nc, chunk, -1),
            F.pad(v1, (0, 0, 0, pad)).view(B, H, nc, chunk, D1))


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


class CosineFeatureAttention(torch.autograd.Function):
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
    :class:`CosineFeatureAttention`); rows are (B H, T, .) and every segment holds a whole
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
        return F.elu_(g).add_(1.0), cos_a, sin_a

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


def fused_precision(x: Tensor) -> str | None:
    """The fused scan's products for keys x (:class:`FusedElu1Attention`): ``"bf16"`` (bf16
    operands, fp32 accumulation and states) for bf16 / fp16 keys or under a bf16 / fp16
    autocast on x's device, else None (fp32 operands: IEEE, or TF32 where PyTorch allows)."""
    half = (torch.bfloat16, torch.float16)
    device = x.device.type
    if x.dtype in half or (torch.is_autocast_enabled(device)
                           and torch.get_autocast_dtype(device) in half):
        return "bf16"
    return None


class FusedElu1Attention(torch.autograd.Function):
    """:class:`CosineFeatureAttention`'s result through the fused Triton scan, chunks of C rows:
    y_t = sum_{s<t} (g_t . g_s) v_s / (sum_{s<t} g_t . g_s + eps) in one pass each way, with
    the products of ``precision`` (see :mod:`mosaics.ops.linear_attention`; None: fp32
    operands, "bf16": bf16 operands, both with fp32 accumulation and states).

    The elu1 features g = ELU(phi(x)) + 1 are computed inside the chunk kernels from the keys
    and the frequencies, forward and backward
    (:func:`~mosaics.ops.linear_attention.fused_elu1_forward`, ``fused_elu1_backward``: no
    (B, H, T, 2M) tensor). Where those do not apply
    (:func:`~mosaics.ops.linear_attention.elu1_unsupported`: a head size past 128) g is
    formed in PyTorch and the plain fused scan runs on it, its gradient taken back to x and
    the frequencies through autograd of the feature map. Saves x, v, w1, w2, y and den'."""

    @staticmethod
    def forward(ctx, x: Tensor, v: Tensor, w1: Tensor, w2: Tensor, eps: float,
                chunk: int, precision: str | None = None) -> Tensor:
        in_kernel = elu1_unsupported(x, w1, v) is None
        if in_kernel:
            y, den = fused_elu1_forward(x, w1, w2, v, eps, chunk, precision)
        else:
            y, den = fused_forward(elu1_features(x, w1, w2), None, v, eps, chunk, precision)
        ctx.save_for_backward(x, v, w1, w2, y, den)
        ctx.chunk, ctx.precision, ctx.in_kernel = chunk, precision, in_kernel
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor):  # noqa: ANN205
        x, v, w1, w2, y, den = ctx.saved_tensors
        if ctx.in_kernel:
            dx, dw1, dw2, dv = fused_elu1_backward(x, w1, w2, v, y, den, dy, ctx.chunk,
                                                   ctx.precision)
            return dx, dv, dw1, dw2, None, None, None
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (x, w1, w2)]
            g = elu1_features(*inputs)
        dg, _, dv = fused_backward(g.detach(), None, v, y, den, dy, ctx.chunk, ctx.precision)
        dx, dw1, dw2 = torch.autograd.grad(g, inputs, dg)
        return dx, dv, dw1, dw2, None, None, None


NO_MEMORY = -1e30  # log-scale of an empty memory (finite, so differences stay defined)
MAX_PAIR_EXP = 80.0  # exponent cap of a pair's rescaling factor (e^80 < fp32 max)


def row_reference(rho: Tensor, log_pairs: Tensor) -> Tensor:
    """nu = max(rho, max_j log_pairs[..., j]) over the last dim (which may be empty)."""
    if log_pairs.shape[-1] == 0:
        return rho
    return torch.maximum(rho, log_pairs.amax(-1))


def pair_weights(pairs: Tensor, gq: Tensor, gk: Tensor, nu: Tensor, mask: Tensor) -> Tensor:
    """w_ij = (f_i.f_j) e^{gamma_i + gamma_j - nu_i} on the mask, 0 elsewhere."""
    scale = (gq.unsqueeze(-1) + gk.unsqueeze(-2) - nu.unsqueeze(-1)).clamp(max=MAX_PAIR_EXP)
    return torch.where(mask, pairs * torch.exp(scale), 0.0)


def log_pairs(pairs: Tensor, gq: Tensor, gk: Tensor, mask: Tensor) -> Tensor:
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
        chunk, eps: as in :func:`chunked_causal_linear_attention`.
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
    nu = row_reference(rho, log_pairs(pairs, gam, gam, mask))
    w = pair_weights(pairs, gam, gam, nu, mask)
    q_w = torch.exp(L + r - nu.unsqueeze(-1))  # (B, H, n, C, F), at most 1
    num = w @ v + q_w @ torch.stack(prev_s, 2)
    den = w.sum(-1) + (q_w @ torch.stack(prev_z, 2).unsqueeze(-1)).squeeze(-1)
    return merge_chunks(num / (den.unsqueeze(-1) + eps), T)
