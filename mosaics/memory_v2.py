"""Parts of the Memory Mosaics v2 block ("Memory Mosaics at scale", Zhang & Bottou, 2025).

- :class:`AdaptiveBandwidth`: beta = beta1 n^alpha + beta0 per head, with n the number of
  memory entries a query sees; beta0 = e^{min(theta0, 10)}, beta1 = e^{min(theta1, 10)}
  (thetas init 1.5), alpha = min(|theta2|, 1) (init 1/3).
- :class:`GatedKeys`: input-dependent key averaging kbar_t = g_t k~_t + lambda_t kbar_{t-1},
  g_t = exp(W_g x_t), lambda_t = exp(-|W_lambda x_t + b_h|), per head, then k_t = kbar_t /
  |kbar_t|. The per-head offset b_h (init: the v1 decay rates 0.5 .. 5) is this project's
  addition, so that a fresh v2 block starts with v1's range of memory lengths; W_g and
  W_lambda start at zero (g = 1, lambda_h = e^{-b_h}: exactly the v1 average).
- :class:`SwiGLUMemory`: the v2 persistent memory, W2 (SiLU(W1 x) * W3 x).
- :class:`Positions` / :func:`document_positions`: where the tokens of one forward call sit
  (absolute positions, documents, the long-term gap of this call), from which each memory
  derives the interval of entries every query sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .gated_leaky import gated_leaky_average, gated_leaky_step
from .unit_norm import unit_vectors

THETA_CAP = 10.0
NORM_EPS = 1e-6


class AdaptiveBandwidth(nn.Module):
    """Per-head, per-query bandwidth beta_h(n) = beta1_h n^alpha_h + beta0_h."""

    def __init__(self, n_head: int) -> None:
        super().__init__()
        self.theta0 = nn.Parameter(torch.empty(n_head))
        self.theta1 = nn.Parameter(torch.empty(n_head))
        self.theta2 = nn.Parameter(torch.empty(n_head))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """thetas 1.5, 1.5 and alpha = 1/3."""
        self.theta0.fill_(1.5)
        self.theta1.fill_(1.5)
        self.theta2.fill_(1.0 / 3.0)

    def forward(self, visible: Tensor) -> Tensor:
        """(T,) or (B, T) counts of visible memory entries -> (H, T) or (B, H, T) bandwidths."""
        beta0 = torch.exp(self.theta0.clamp(max=THETA_CAP))
        beta1 = torch.exp(self.theta1.clamp(max=THETA_CAP))
        alpha = self.theta2.abs().clamp(max=1.0)
        n = visible.to(beta0.dtype).unsqueeze(-2)  # (..., 1, T)
        shape = (-1, 1)
        return beta1.view(shape) * n.pow(alpha.view(shape)) + beta0.view(shape)


def visible_entries(T: int, offset: int = 0, window: int | None = None, gap: int = 1,
                    device: torch.device | None = None) -> Tensor:
    """(T,) number of memory entries s the query at position p = offset + t sees when s ranges
    over [p - window + 1, p - gap] (window None: from 0), clamped at 0.

    v1 and the plain contextual memory: gap 1 (strict past), no window -> n = p. Short-term
    memory over the last h keys: window h, gap 1 -> min(p, h - 1). Long-term memory over keys
    older than m: gap m -> max(p - m + 1, 0)."""
    p = torch.arange(offset, offset + T, device=device)
    hi = p - gap  # newest visible entry
    lo = torch.zeros_like(p) if window is None else (p - window + 1).clamp(min=0)
    return (hi - lo + 1).clamp(min=0)


@dataclass
class Positions:
    """The n tokens of one forward call.

    Attributes:
        start: absolute position of the first token (the cache length when decoding).
        gap: the long-term gap m of this call (drawn per training batch).
        documents: (B, n) non-decreasing document ids, or None (one document).
        doc_starts: (B, n) absolute position of the first token of each token's document.
        restart: (B,) bool, whether token 0 begins a new document (so a decoding state from
            before it is dropped), or None.
    """

    start: int = 0
    gap: int = 1
    documents: Tensor | None = None
    doc_starts: Tensor | None = None
    restart: Tensor | None = None


def document_positions(starts: Tensor, offset: int = 0, last_start: Tensor | None = None,
                       last_id: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Document ids and first positions from the (B, n) bool flags ``starts`` (True where a
    token begins a new document) of tokens at absolute positions offset .. offset + n - 1.

    ``last_start`` / ``last_id`` (B,): the document in progress before the first token
    (decoding; default: a document starting at 0 with id 0). Returns (ids, doc_starts), each
    (B, n) int64: ids non-decreasing, doc_starts[b, t] = the latest start <= t."""
    B, n = starts.shape
    pos = torch.arange(offset, offset + n, device=starts.device).expand(B, n)
    prev_start = (torch.zeros(B, dtype=torch.long, device=starts.device)
                  if last_start is None else last_start.long())
    prev_id = torch.zeros_like(prev_start) if last_id is None else last_id.long()
    marked = torch.where(starts, pos, torch.full_like(pos, -1)).cummax(dim=1).values
    doc_starts = torch.where(marked >= 0, marked, prev_start.view(B, 1))
    ids = prev_id.view(B, 1) + starts.long().cumsum(dim=1)
    return ids, doc_starts


def visible_interval(n: int, pos: Positions | None, window: int | None, gap: int,
                     device: torch.device) -> tuple[Tensor, Tensor]:
    """(lo, hi), each (B or 1, n) absolute positions: the query at absolute position p sees
    the memory entries s with lo <= s <= hi, hi = p - gap, lo = max(document start,
    p - window + 1) (empty when hi < lo)."""
    start = 0 if pos is None else pos.start
    p = torch.arange(start, start + n, device=device).view(1, n)
    hi = p - gap
    if pos is not None and pos.doc_starts is not None:
        lo = pos.doc_starts.to(device)
    else:
        lo = torch.zeros_like(p)
    if window is not None:
        lo = torch.maximum(lo, p - window + 1)
    return lo, hi


class GatedKeys(nn.Module):
    """Gated, input-dependent leaky averages of per-head key features, then unit norm."""

    def __init__(self, n_embd: int, n_head: int, chunk: int = 16) -> None:
        super().__init__()
        self.n_head, self.chunk = n_head, chunk
        self.gate = nn.Linear(n_embd, n_head, bias=False)  # log g_t = W_g x_t
        self.decay = nn.Linear(n_embd, n_head, bias=False)  # a_t = |W_lambda x_t + b|
        self.decay_offset = nn.Parameter(torch.empty(n_head))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.decay.weight)
        self.decay_offset.copy_(torch.linspace(0.5, 5.0, self.n_head))

    def rates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T, d) inputs -> gains g_t and log-decays a_t, each (B, H, T)."""
        gain = torch.exp(self.gate(x)).transpose(1, 2)
        log_decay = (self.decay(x) + self.decay_offset).abs().transpose(1, 2)
        return gain, log_decay

    def averages(self, x: Tensor, features: Tensor, state: Tensor | None = None,
                 documents: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Un-normalised averages kbar (B, H, T, hs) of key features k~ (B, H, T, hs) gated by
        inputs x (B, T, d), continuing ``state`` (B, H, hs); and the last one (B, H, hs)."""
        gain, log_decay = self.rates(x)
        gain, log_decay = gain.to(features.dtype), log_decay.to(features.dtype)
        if features.shape[2] == 1 and state is not None:  # one decoding step
            last = gated_leaky_step(features[:, :, 0], gain[:, :, 0], log_decay[:, :, 0], state)
            return last.unsqueeze(2), last
        return gated_leaky_average(features, gain, log_decay, self.chunk, state, documents)

    def forward(self, x: Tensor, features: Tensor, state: Tensor | None = None,
                documents: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Unit keys (B, H, T, hs) and the new un-normalised state (B, H, hs)."""
        kbar, last = self.averages(x, features, state, documents)
        return unit_vectors(kbar, NORM_EPS), last


class SwiGLUMemory(nn.Module):
    """Persistent memory of v2: y = W2 (SiLU(W1 x) * W3 x), hidden width ``hidden``. Same
    call as the v1 persistent memory (``(y, state)``); it keeps no decoding state."""

    def __init__(self, n_embd: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(n_embd, hidden, bias=False)
        self.w3 = nn.Linear(n_embd, hidden, bias=False)
        self.w2 = nn.Linear(hidden, n_embd, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, state: dict | None = None,
                pos: Positions | None = None) -> tuple[Tensor, dict | None]:
        """(B, T, d) -> (B, T, d); ``state`` is passed through (``{}`` while decoding); a
        position-wise map, so ``pos`` (documents) changes nothing."""
        y = self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))
        return y, (None if state is None else {})
