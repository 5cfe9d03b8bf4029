"""Leaky averages, the keys' memory of the past:

    kbar_t = g_t x_t + lambda_t kbar_{t-1},   lambda_t = exp(-a_t),   kbar_{-1} = initial or 0

:func:`leaky_average` is the one entry point; :func:`leaky_average_reference` is the same
recursion one step at a time. The log-decay a is a per-head constant (H,) (Memory Mosaics v1,
g_t = 1) or per step (B, H, T) with gains g_t (gated keys); with ``documents`` the sum restarts
where the document id changes. Forms, chosen inside :func:`leaky_average`:

- one decoding step (T = 1 continuing ``initial``): one fused multiply-add, in place without
  gradients;
- constant decay, g = 1: an exact chunked scan. A sequence is cut into chunks of C positions;
  inside a chunk the recursion runs position by position on all chunks at once, and the sums at
  chunk ends are carried across chunks by a (T/C) x (T/C) leaky average with decay lambda^C:
  O((T + (T/C)^2) D) work, with a closed-form backward (:class:`_LeakyAverage`);
- gated or with documents: the log-cumsum chunked form of gated linear attention. Inside a
  chunk with L_t = a_1 + ... + a_t, kbar_t = sum_{s <= t} exp(-(L_t - L_s)) g_s x_s +
  exp(-L_t) kbar_start; the chunk-end states follow the same recursion one level up. Every
  exponent is <= 0, so nothing overflows; documents multiply each term by [doc_s == doc_t].

The chunking helpers are shared with FSKA's chunked linear attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def leaky_average(x: Tensor, log_decay: Tensor, *, gain: Tensor | None = None,
                  initial: Tensor | None = None, documents: Tensor | None = None,
                  chunk: int = 16, decay: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """kbar_t = g_t x_t + exp(-a_t) kbar_{t-1} along time.

    Args:
        x: (B, H, T, D) inputs x_t.
        log_decay: a, (H,) per head or (B, H, T) per step; lambda = exp(-a).
        gain: (B, H, T) per-step gains g_t, or None (g = 1).
        initial: (B, H, D) sum before position 0 (decoding continues it), taken to belong to
            the document of position 0; written in place for a one-token step without
            gradients.
        documents: (B, T) non-decreasing document ids: the sum restarts where they change.
        chunk: chunk length C of the chunked forms.
        decay: exp(-log_decay) when already at hand, (H, 1) (decoding reuses it).
    Returns:
        (B, H, T, D) sums and the (B, H, D) last one.
    """
    B, H, T, D = x.shape
    if initial is not None and T == 1:  # one decoding step
        if decay is None or log_decay.dim() != 1:
            a = log_decay.view(H, 1) if log_decay.dim() == 1 else log_decay
            decay = torch.exp(-a.to(x.dtype))  # (H, 1) or (B, H, 1)
        step = x[:, :, 0] if gain is None else x[:, :, 0] * gain.to(x.dtype)
        grad = torch.is_grad_enabled() and (x.requires_grad or initial.requires_grad
                                            or decay.requires_grad or step.requires_grad)
        last = torch.addcmul(step, initial, decay, out=None if grad else initial)
        return last.unsqueeze(2), last
    if gain is None and log_decay.dim() == 1 and documents is None:
        out = _LeakyAverage.apply(x, log_decay, chunk)
        if initial is not None:  # + lambda^(t + 1) kbar_{-1}
            steps = torch.arange(1, T + 1, device=x.device, dtype=x.dtype)
            ramp = torch.exp(-log_decay.to(x.dtype).view(H, 1) * steps)
            out = out + initial.unsqueeze(2) * ramp.view(1, H, T, 1)
        return out, out[:, :, -1].contiguous()
    if gain is None:
        gain = x.new_ones(B, H, T)
    if log_decay.dim() == 1:
        log_decay = log_decay.to(x.dtype).view(1, H, 1).expand(B, H, T)
    out, last = _gated_chunked(x, gain, log_decay, chunk, initial, documents)
    return out, last.contiguous()


def leaky_average_reference(x: Tensor, log_decay: Tensor, *, gain: Tensor | None = None,
                            initial: Tensor | None = None,
                            documents: Tensor | None = None) -> Tensor:
    """:func:`leaky_average` as an explicit loop over time (slow; the tests' oracle)."""
    B, H, T, _ = x.shape
    a = log_decay.view(1, H, 1).expand(B, H, T) if log_decay.dim() == 1 else log_decay
    g = torch.ones_like(a) if gain is None else gain
    state = torch.zeros_like(x[:, :, 0]) if initial is None else initial
    out = []
    for t in range(T):
        if documents is not None and t > 0:
            state = state * (documents[:, t] == documents[:, t - 1]).to(x.dtype).view(-1, 1, 1)
        state = g[:, :, t, None] * x[:, :, t] + torch.exp(-a[:, :, t, None]) * state
        out.append(state)
    return torch.stack(out, dim=2)


def decay_rate(p: Tensor, scale: float = 10.0) -> Tensor:
    """Per-head log-decay a = scale * |p|, so lambda = exp(-a). Shape (H,)."""
    return p.abs() * scale


# ------------------------------------------------------------------ constant decay, g = 1
def chunk_grid(T: int, chunk: int) -> tuple[int, int]:
    """(C, n): chunk length C = clamp(chunk, 1, T) and n = ceil(T / C) chunks."""
    C = max(1, min(chunk, T))
    return C, -(-T // C)


def split_chunks(x: Tensor, C: int, n: int, value: float = 0.0) -> Tensor:
    """(B, H, T, D) -> (B, H, n, C, D), the n C - T positions past T filled with ``value``."""
    B, H, T, D = x.shape
    if n * C > T:
        x = F.pad(x, (0, 0, 0, n * C - T), value=value)
    return x.reshape(B, H, n, C, D)


def merge_chunks(x: Tensor, T: int) -> Tensor:
    """(B, H, n, C, D) -> (B, H, T, D), dropping the padding of :func:`split_chunks`."""
    B, H, n, C, D = x.shape
    out = x.reshape(B, H, n * C, D)
    return out[:, :, :T] if n * C > T else out


def _decay_matrix(a: Tensor, n: int, stride: int = 1) -> Tensor:
    """(H, n, n) lower-triangular matrix D[i, j] = exp(-a * stride * (i - j)) for j <= i."""
    idx = torch.arange(n, device=a.device)
    lag = (idx[:, None] - idx[None, :]).to(a.dtype)
    mask = lag >= 0
    d = torch.exp(-a.view(-1, 1, 1) * stride * lag.clamp(min=0))
    return d * mask


def _chunked_scan(x: Tensor, a: Tensor, chunk: int, reverse: bool = False,
                  sequential: bool | None = None) -> Tensor:
    """out_t = x_t + lambda out_{t-1} (or out_t = x_t + lambda out_{t+1} with ``reverse``),
    zero outside [0, T), for (B, H, T, D) x and (H,) log-decay a of x's dtype.

    On CPU the recursion inside a chunk runs one position at a time, in place on a copy of x:
    C - 1 ``addcmul_`` over (B, H, n, D) slices, one pass over the data (measured faster than
    the C x C decay-matrix product, B H n tiny GEMMs). Other devices keep the matrix product:
    one batched GEMM instead of C - 1 kernel launches (``sequential`` forces either form).
    """
    B, H, T, D = x.shape
    C, n = chunk_grid(T, chunk)
    if sequential if sequential is not None else x.device.type == "cpu":
        out = x.new_empty(B, H, n * C, D)
        out[:, :, :T].copy_(x)
        if n * C > T:  # zeros past the end change neither direction inside [0, T)
            out[:, :, T:].zero_()
        within = out.view(B, H, n, C, D)
        lam = torch.exp(-a).view(1, H, 1, 1)
        for i in range(C - 2, -1, -1) if reverse else range(1, C):
            within.select(3, i).addcmul_(within.select(3, i + 1 if reverse else i - 1), lam)
    else:
        xc = split_chunks(x, C, n)  # zero padding, as above
        within_decay = _decay_matrix(a, C)
        if reverse:
            within_decay = within_decay.transpose(-1, -2)
        within = torch.matmul(within_decay[:, None], xc)  # (H, 1, C, C) @ (B, H, n, C, D)
        out = within.view(B, H, n * C, D)
    if n > 1:
        # the full sums at chunk ends (starts, in reverse), carried across chunks with lambda^C
        across = _decay_matrix(a, n, stride=C)
        edge = within[:, :, :, 0] if reverse else within[:, :, :, -1]
        carried = torch.matmul(across.transpose(-1, -2) if reverse else across, edge)
        steps = torch.arange(1, C + 1, device=x.device, dtype=x.dtype)
        if reverse:  # sum entering chunk m from the right: full sum at the start of chunk m+1
            enter = F.pad(carried[:, :, 1:], (0, 0, 0, 1))
            steps = steps.flip(0)  # lambda^(C - i)
        else:  # sum entering chunk m: full sum at the end of chunk m-1, times lambda^(i + 1)
            enter = F.pad(carried[:, :, :-1], (0, 0, 1, 0))
        ramp = torch.exp(-a.view(H, 1) * steps)
        within.addcmul_(enter.unsqueeze(3), ramp.view(1, H, 1, C, 1))
    return out[:, :, :T] if n * C > T else out


class _LeakyAverage(torch.autograd.Function):
    """Chunked leaky sum with a closed-form backward.

    With delta_t = dL/dx_t = g_t + lambda delta_{t+1} (the same scan run backwards) and
    dL/dlambda = sum_t <delta_t, out_{t-1}>, the backward is one reverse scan and one dot
    product instead of autograd through the decay matrices and their GEMMs.
    """

    @staticmethod
    def forward(ctx, x: Tensor, a: Tensor, chunk: int) -> Tensor:
        out = _chunked_scan(x, a.to(x.dtype), chunk)
        ctx.save_for_backward(out, a)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        out, a = ctx.saved_tensors
        delta = _chunked_scan(g, a.to(g.dtype), ctx.chunk, reverse=True)
        grad_a = None
        if ctx.needs_input_grad[1]:
            acc = torch.promote_types(g.dtype, torch.float32)
            d_lambda = (delta[:, :, 1:] * out[:, :, :-1]).sum((0, 2, 3), dtype=acc)
            grad_a = (-torch.exp(-a.to(acc)) * d_lambda).to(a.dtype)  # lambda = e^{-a}
        return (delta if ctx.needs_input_grad[0] else None), grad_a, None



# ------------------------------------------------------------------ gated, documents
def _segment_decay(cum: Tensor) -> Tensor:
    """(..., m) cumulative log-decays -> (..., m, m) matrix exp(-(cum_t - cum_s)) for s <= t,
    0 above the diagonal."""
    diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # [t, s] = cum_t - cum_s
    m = cum.shape[-1]
    upper = torch.ones(m, m, dtype=torch.bool, device=cum.device).triu(1)
    return torch.exp(-diff.masked_fill(upper, float("inf")))


def _same(doc: Tensor) -> Tensor:
    """(..., m) document ids -> (..., m, m) float mask [doc_t == doc_s]."""
    return (doc.unsqueeze(-1) == doc.unsqueeze(-2)).float()


def _gated_chunked(x: Tensor, gain: Tensor, log_decay: Tensor, chunk: int = 16,
                        initial: Tensor | None = None,
                        documents: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The gated form of :func:`leaky_average` (per-step gains and decays, documents), exact
    in chunks (module docstring); gain and log_decay (B, H, T)."""
    B, H, T, D = x.shape
    C = max(1, min(chunk, T))
    n = -(-T // C)
    pad = n * C - T
    gx = x * gain.unsqueeze(-1).to(x.dtype)
    a = log_decay.to(x.dtype)
    if pad:  # past the end: no input (g = 0) and no decay (a = 0), so the state is kept
        gx = F.pad(gx, (0, 0, 0, pad))
        a = F.pad(a, (0, pad))
    gx = gx.reshape(B, H, n, C, D)
    cum = a.reshape(B, H, n, C).cumsum(-1)  # L_t inside each chunk
    within = _segment_decay(cum)
    if documents is not None:
        doc = documents if not pad else F.pad(documents, (0, pad), mode="replicate")
        doc = doc.reshape(B, 1, n, C)
        within = within * _same(doc).to(within.dtype)
    local = within @ gx  # (B, H, n, C, D): the chunk's own inputs only
    ends = local[:, :, :, -1]  # (B, H, n, D)
    total = cum[..., -1]  # (B, H, n): log-decay across each chunk
    # state at the end of chunk i: S_i = sum_{j <= i} exp(-(M_i - M_j)) e_j + exp(-M_i) S_-1
    across = total.cumsum(-1)
    chains = _segment_decay(across)
    keep_initial = torch.exp(-across)
    if documents is not None:
        end_doc = doc[..., -1]  # (B, 1, n)
        chains = chains * _same(end_doc).to(chains.dtype)
        keep_initial = keep_initial * (end_doc == doc[:, :, :1, 0]).to(chains.dtype)
    state = chains @ ends
    if initial is not None:
        state = state + keep_initial.unsqueeze(-1) * initial.unsqueeze(2)
    start = torch.cat([initial.unsqueeze(2) if initial is not None
                       else torch.zeros_like(state[:, :, :1]), state[:, :, :-1]], dim=2)
    carry = torch.exp(-cum)
    if documents is not None:  # the carried state belongs to the previous chunk's last step
        before = torch.cat([doc[:, :, :1, :1], doc[:, :, :-1, -1:]], dim=2)  # (B, 1, n, 1)
        carry = carry * (doc == before).to(carry.dtype)
    out = local + carry.unsqueeze(-1) * start.unsqueeze(3)
    out = out.reshape(B, H, n * C, D)[:, :, :T]
    return out, state[:, :, -1]
