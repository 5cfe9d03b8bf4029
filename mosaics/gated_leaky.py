"""Gated leaky averages (Memory Mosaics v2): input-dependent gain and decay per step.

    kbar_t = g_t x_t + lambda_t kbar_{t-1},   lambda_t = exp(-a_t),  a_t >= 0

with per-head scalars g_t, a_t computed from the input (v2: g_t = exp(W_g x_t),
a_t = |W_lambda x_t|). Exact chunked form, the log-cumsum scan of gated linear attention:
inside a chunk of C steps with L_t = a_1 + ... + a_t (summed from the chunk start),

    kbar_t = sum_{s <= t} exp(-(L_t - L_s)) g_s x_s + exp(-L_t) kbar_start

where kbar_start is the state at the end of the previous chunk. The chunk-end states follow the
same recursion one level up (n = T / C chunks, decays exp(-L_C) per chunk), solved by an
n x n matrix of the same form. Every exponent is <= 0, so nothing overflows; cost O(T C d).

Documents: with ``documents`` (B, T) ids (non-decreasing along T), the average restarts at each
new document: every term above is multiplied by [document of s == document of t], so windows
that pack several stories do not carry one story's keys into the next.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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


def gated_leaky_average(x: Tensor, gain: Tensor, log_decay: Tensor, chunk: int = 16,
                        initial: Tensor | None = None,
                        documents: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """kbar_t = gain_t x_t + exp(-log_decay_t) kbar_{t-1}, kbar_{-1} = ``initial`` (or 0).

    Args:
        x: (B, H, T, D) inputs.
        gain: (B, H, T) per-step gains g_t.
        log_decay: (B, H, T) per-step a_t >= 0 (lambda_t = exp(-a_t)).
        chunk: C, the chunk length.
        initial: (B, H, D) state before step 0 (decoding continues a prefix), taken to belong
            to the document of step 0.
        documents: (B, T) non-decreasing document ids; the average restarts at each change.
    Returns:
        (B, H, T, D) the averages kbar_t, and (B, H, D) the last one.
    """
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


def gated_leaky_step(x: Tensor, gain: Tensor, log_decay: Tensor, state: Tensor) -> Tensor:
    """One decoding step: (B, H, D) x, (B, H) gain and log-decay, (B, H, D) previous state."""
    return gain.unsqueeze(-1) * x + torch.exp(-log_decay).unsqueeze(-1) * state


def gated_leaky_reference(x: Tensor, gain: Tensor, log_decay: Tensor,
                          initial: Tensor | None = None,
                          documents: Tensor | None = None) -> Tensor:
    """The recursion as an explicit loop over time, restarting at document changes (tests)."""
    state = torch.zeros_like(x[:, :, 0]) if initial is None else initial
    out = []
    for t in range(x.shape[2]):
        if documents is not None and t > 0:
            same = (documents[:, t] == documents[:, t - 1]).to(x.dtype).view(-1, 1, 1)
            state = state * same
        state = gated_leaky_step(x[:, :, t], gain[:, :, t], log_decay[:, :, t], state)
        out.append(state)
    return torch.stack(out, dim=2)
