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

:func:`call_positions` builds the :class:`Positions` of a model call from the config, the
cache, the document ids and the mask (:func:`padding_starts`, :func:`document_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .cache import DocumentState
from .compilation import compiling, eager_boundary

if TYPE_CHECKING:
    from .cache import MosaicsCache
    from .configuration_mosaics import MosaicsConfig


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


def padding_starts(attention_mask: Tensor | None, n: int, start: int,
                   last_real: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """Where ``attention_mask`` makes this call's n tokens (at absolute positions start ..
    start + n - 1) begin again after padding.

    ``attention_mask``: (B, n) for this call's tokens, or (B, start + n) for every token so
    far (what ``generate`` passes); 0 marks padding. ``last_real`` (B,): whether the token
    before this call was real, when the mask does not say (default: real). Returns None when
    no real token follows a pad (no padding, or right padding only), else (real, begins),
    each (B, n) bool: begins_t = real_t and not real_{t-1}."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[1] not in (n, start + n):
        raise ValueError(
            f"attention_mask must be (batch, tokens) with one column per token of this call "
            f"({n}) or per token so far ({start + n}, the cache's {start} included), got "
            f"shape {tuple(attention_mask.shape)}")
    first = attention_mask.shape[1] - n  # column of this call's token 0
    real = attention_mask[:, first:] != 0
    if first > 0:  # the columns of tokens t - 1
        previous = attention_mask[:, first - 1:-1] != 0
    else:
        before = (torch.ones_like(real[:, :1]) if last_real is None
                  else last_real.view(-1, 1).to(real.device))
        previous = torch.cat([before, real[:, :-1]], dim=1)
    begins = real > previous  # real, after a pad
    if not bool(begins.any()):
        return None
    return real, begins


def call_positions(config: MosaicsConfig, input_ids: Tensor | None,
                   document_ids: Tensor | None, shape: torch.Size, cache: MosaicsCache | None,
                   device: torch.device, attention_mask: Tensor | None = None,
                   training: bool = False) -> tuple[Positions | None, DocumentState | None]:
    """Where the n tokens of one forward call (``shape`` (B, n)) sit, for the v2 memory
    options and for padding, and the document in progress for the cache to keep.

    The absolute start is the cache length; the long-term gap is drawn per batch in training
    (``config.long_term_gap_range``); documents restart, with ``document_masking``, after each
    separator token or where ``document_ids`` change, and, with padding (``attention_mask``
    0), at every real token that follows a pad, the pads adding nothing to the leaky sums.
    Returns (positions, or None for v1 without padding; the cache's new
    :class:`~mosaics.cache.DocumentState`, or None when there is no cache or nothing to
    track).
    """
    B, n = shape
    start = 0 if cache is None else cache.seen_tokens
    docs = cache.documents if cache is not None else None
    padding = padding_starts(attention_mask, n, start,
                             None if docs is None else docs.last_real)
    tracked = config.document_masking or padding is not None or docs is not None
    seen = None  # (B,) whether a row had a real token before this call
    if tracked:  # (assumed where nothing records it)
        seen = (docs.seen_real if docs is not None and docs.seen_real is not None
                else torch.full((B,), start > 0, dtype=torch.bool, device=device))
    if padding is not None and start > 0:
        first = attention_mask.shape[1] - n
        if first > 0:
            seen = (attention_mask[:, :first] != 0).any(1).to(device)
        real, begins = padding
        after_real = seen.view(B, 1) | (real.long().cumsum(1) - real.long() > 0)
        if bool((begins & after_real).any()) or (docs is None and not config.uses_visibility):
            raise ValueError(
                "attention_mask has padding between real tokens in a call that continues "
                "a cache (e.g. a right-padded prompt continued by generate): left-pad the "
                "prompts (tokenizer.padding_side = 'left'), so that the padding of each "
                "row comes before its first real token, in the first call")
    if not config.uses_visibility and not tracked:
        return None, None
    gap = config.long_term_gap
    if training and config.long_term_gap_range is not None:
        low, high = config.long_term_gap_range
        if compiling():  # drawn eagerly (the same stream), kept a tensor: no recompiles
            gap = eager_boundary(torch.randint, low, high + 1, ())
        else:
            gap = int(torch.randint(low, high + 1, ()))
    pos = Positions(start=start, gap=gap)
    if not tracked:
        return pos, None
    first = torch.ones(B, dtype=torch.bool, device=device)  # token 0 starts one
    given = document_ids is not None and config.document_masking
    if given:
        document_ids = document_ids.to(device)
        prev = None if docs is None else docs.last_id_given
        if prev is not None:
            first = document_ids[:, 0] != prev
        starts = torch.cat([first[:, None], document_ids[:, 1:] != document_ids[:, :-1]], 1)
    elif config.document_masking:
        if input_ids is None or config.separator_id is None:
            raise ValueError("document_masking needs the documents: pass input_ids with "
                             "document_separator_id (or eos_token_id) set in the config, "
                             "or document_ids (B, T)")
        sep = input_ids == config.separator_id
        if docs is not None and docs.last_is_separator is not None:
            first = docs.last_is_separator
        starts = torch.cat([first[:, None], sep[:, :-1]], dim=1)
    else:  # documents from the padding alone; without a cache, token 0 starts one
        starts = torch.zeros(B, n, dtype=torch.bool, device=device)
        starts[:, 0] = start == 0
    real = None
    if padding is not None:
        real, begins = padding
        starts = starts | begins.to(device)
        pos.keep = real.to(device)
    ids, doc_starts = document_positions(starts, start, None if docs is None else docs.start,
                                         None if docs is None else docs.id)
    # the leaky sums restart at documents; padding alone needs no restart where only pads
    # came before (they add nothing): a prompt's first real tokens, or a decoding call's
    # token 0 (``restart`` drops the state there)
    holes = padding is not None and bool(
        (begins[:, 1:] if start > 0 else
         begins & ((real.long().cumsum(1) - real.long()) > 0)).any())
    if config.document_masking or given or holes:
        pos.documents = ids
    pos.doc_starts = doc_starts
    pos.restart = starts[:, 0] if start > 0 else None
    documents = None
    if cache is not None:
        documents = DocumentState(
            start=doc_starts[:, -1], id=ids[:, -1],
            last_id_given=document_ids[:, -1] if given else None,
            last_is_separator=(input_ids[:, -1] == config.separator_id
                               if config.document_masking and not given else None),
            last_real=(attention_mask[:, -1].to(device) != 0 if attention_mask is not None
                       else None if docs is None else docs.last_real),
            seen_real=seen if attention_mask is None
            else seen | (attention_mask[:, -n:] != 0).any(1).to(device))
    return pos, documents
