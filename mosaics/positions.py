"""Where the tokens of one forward call sit, and which memory entries each query sees.

A contextual memory holds one entry (k_s, v_s) per position s. The query at absolute position
p sees the entries lo <= s <= hi with

    hi = p - gap                         (gap 1: the strict past; the long-term memory: m)
    lo = max(document start, p - h + 1)  (h: the short-term window; no window: 0)

:class:`Positions` carries what these need for one call (the start, the gap drawn for the
batch, the documents); :func:`visible_interval` turns it into (lo, hi).

Padding (``attention_mask``) is told in the same terms: a real token that follows a pad starts
a document, and the pads add nothing to the leaky sums (``keep``). A left-padded row is then
its prompt as one document starting at its first real token: every count of the memory
(lo, the adaptive bandwidth's n = hi - lo + 1, windows, ALiBi distances t - s) is relative to
that start, so each row's outputs are those of its unpadded prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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
        keep: (B, n) bool, False at padding (``attention_mask`` 0): those tokens' key inputs
            are zeroed, so they add nothing to the leaky sums; None without padding.
    """

    start: int = 0
    gap: int = 1
    documents: Tensor | None = None
    doc_starts: Tensor | None = None
    restart: Tensor | None = None
    keep: Tensor | None = None


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
