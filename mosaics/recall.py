"""How a contextual memory answers its queries, in training, on the prompt and while decoding.

The memory holds one entry (k_s, v_s) per position s; the query at t sees the entries S_t of
:func:`mosaics.positions.visible_interval`: the strict past s < t (the v1 block), or an
interval lo_t <= s <= hi_t (a short-term window, the long-term gap, documents, padding).
:func:`recall` is the block's one retrieval call: the new queries, the entries they add and
the decoding memory so far in; the retrievals and the memory to keep out. A whole sequence
goes to the kernel's ``forward`` (the strict past) or ``attend`` (intervals); decoding to its
``step``, which takes the same intervals (None: the strict past); ALiBi to the biased
retrieval of :mod:`mosaics.kernels.position_bias`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .cache import KernelMemory
from .compilation import compiling, eager_boundary, kernel_traceable
from .kernels import Kernel
from .kernels.position_bias import biased_retrieval
from .positions import Positions, visible_interval


@dataclass(frozen=True)
class Visibility:
    """What one contextual memory's queries see.

    Attributes:
        intervals: per-query intervals through ``Kernel.attend`` (windows, gaps, documents,
            an adaptive bandwidth: the v2 options); False: the strict past.
        window: a short-term memory's h: the query at p sees s >= p - h + 1; None: no window.
        long: a long-term memory: the query at p sees s <= p - m, m the drawn gap.
        slopes: the ALiBi slopes m_h (H,) on the scores, or None.
        bandwidth: the adaptive bandwidth, (..., n) visible counts -> (..., H, n) per-query
            bandwidths, or None (one per head).
    """

    intervals: bool = False
    window: int | None = None
    long: bool = False
    slopes: Tensor | None = None
    bandwidth: Callable[[Tensor], Tensor] | None = None


def recall(kernel: Kernel, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
           see: Visibility, pos: Positions | None = None, memory: KernelMemory | None = None,
           base: int = 0, use_cache: bool = False) -> tuple[Tensor, KernelMemory | None, int]:
    """The retrievals of n new queries and the memory to keep.

    Args:
        queries: (B, H, n, hs) unit keys of the new positions p0 .. p0 + n - 1.
        keys, values: (B, H, n, hs) the entries they add: those of positions 0 .. n - 1 for a
            whole sequence (``memory`` None), else p0 - 1 .. p0 + n - 2 (v_{p-1} is finished
            by x_p).
        beta: (H,) bandwidths (the kernel's parametrization).
        memory, base: the decoding memory so far, its first entry at absolute position base.
        use_cache: return the memory after these tokens (None otherwise).
    Returns:
        (y (B, H, n, hs), memory or None, base).
    """
    padded = pos is not None and pos.doc_starts is not None
    first_call = memory is None
    if see.intervals or (padded and see.slopes is None):
        return _intervals(kernel, queries, keys, values, beta, see, pos, memory, base,
                          use_cache)
    if padded:  # ALiBi over the entries of each query's document
        memory = KernelMemory(keys, values) if first_call else memory.append(keys, values)
        y = biased_documents(kernel, queries, memory, beta, see.slopes, pos)
        if use_cache and first_call:  # v_{n-1} waits for x_n
            memory = memory.drop_last()
        return y, memory if use_cache else None, 0
    if first_call:  # a whole sequence: the strict past
        y = _whole_sequence(kernel, queries, values, beta, see.slopes)
        if not use_cache:
            return y, None, 0
        return y, kernel.memory_of(queries[:, :, :-1], values[:, :, :-1], beta), 0
    if see.slopes is None:  # decoding: query i at p0 + i sees the entries 0 .. p0 + i - 1
        y, memory = kernel.step(memory, queries, keys, values, beta)
        return y, memory, 0
    memory = memory.append(keys, values)
    y = biased_retrieval(kernel, queries, memory.keys, memory.values, beta, see.slopes,
                         len(memory) - queries.shape[2])
    return y, memory, 0


def _whole_sequence(kernel: Kernel, keys: Tensor, values: Tensor, beta: Tensor,
                    slopes: Tensor | None) -> Tensor:
    """The strict-past retrieval of a whole sequence (B, H, T, hs), with ALiBi when
    ``slopes`` are given."""
    if slopes is None:
        if compiling() and not kernel_traceable(kernel):
            return eager_boundary(kernel, keys, values, beta)
        return kernel(keys, values, beta)
    y = biased_retrieval(kernel, keys[:, :, 1:], keys[:, :, :-1], values[:, :, :-1], beta,
                         slopes, 0)
    return F.pad(y, (0, 0, 1, 0))  # row 0: no memory


def biased_documents(kernel: Kernel, queries: Tensor, memory: KernelMemory, beta: Tensor,
                     slopes: Tensor, pos: Positions) -> Tensor:
    """ALiBi retrieval where the query at p sees the entries lo <= s <= p - 1 of its own
    document (lo = ``pos.doc_starts``, after padding): queries (B, H, n, hs), entries at
    absolute positions 0 .. S - 1 -> (B, H, n, hs). The scores beta k_p . k_s - m_h (p - s)
    use distances, which a shift of the document leaves alone, so each run of queries sharing
    a start L is the whole-sequence retrieval of the entries L .. S - 1 (rows with the same
    starts go together)."""
    B, H, n, _ = queries.shape
    lo = pos.doc_starts.to(queries.device).expand(B, n)
    y = queries.new_zeros(B, H, n, memory.values.shape[-1]).to(memory.values.dtype)
    starts, group = torch.unique(lo, dim=0, return_inverse=True)
    for g, row_lo in enumerate(starts.tolist()):
        rows = (group == g).nonzero().view(-1)
        i0 = 0
        while i0 < n:  # a run i0 .. i1 - 1 of queries with one start L
            L, i1 = row_lo[i0], i0 + 1
            while i1 < n and row_lo[i1] == L:
                i1 += 1
            first = max(i0, L - pos.start + 1)  # the query at p = L sees nothing
            if first < i1:
                part = biased_retrieval(
                    kernel, queries[rows][:, :, first:i1], memory.keys[rows][:, :, L:],
                    memory.values[rows][:, :, L:], beta, slopes, pos.start + first - 1 - L)
                y[rows, :, first:i1] = part.to(y.dtype)
            i0 = i1
    return y


def _intervals(kernel: Kernel, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
               see: Visibility, pos: Positions | None, memory: KernelMemory | None, base: int,
               use_cache: bool) -> tuple[Tensor, KernelMemory | None, int]:
    """Retrieval over per-query visible intervals: the memory holds entries base .. base +
    len - 1 and the query at p sees lo <= s <= hi."""
    n = queries.shape[2]
    gap = pos.gap if see.long and pos is not None else 1
    lo, hi = visible_interval(n, pos, see.window, gap, queries.device)
    if see.bandwidth is not None:
        beta = see.bandwidth((hi - lo + 1).clamp(min=0))
    if memory is not None:  # decoding
        y, memory = kernel.step(memory, queries, keys, values, beta, lo, hi, base)
    else:  # the visible intervals plan the retrieval from their values: eager when compiled
        attend = eager_boundary if compiling() else (lambda fn, *args: fn(*args))
        y = attend(kernel.attend, queries, keys, values, beta, lo.clamp(min=0), hi)
        memory = KernelMemory(keys[:, :, :-1], values[:, :, :-1])  # v_{n-1} waits for x_n
    if not use_cache:
        return y, None, base
    start = n + (0 if pos is None else pos.start)  # absolute position of the next token
    return (y, *_trim(memory, base, start, see.window))


def _trim(memory: KernelMemory, base: int, next_pos: int,
          window: int | None) -> tuple[KernelMemory, int]:
    """Drop the entries no later step reads, in batches (the kept ones move to a fresh buffer
    at the next append).

    Short-term memory: the entries older than the next query's window (the query at p sees
    s >= p - h + 1) once they are as many as the window itself; one entry more is kept, the
    one that leaves the window at the next step (a kernel's running sums subtract it then). A
    memory without a window whose kernel keeps running sums over intervals (``sums.hi``: the
    last entry they hold, per row): the entries up to ``sums.hi``, since a later query's
    interval either starts where the sums start (the same document) or after ``sums.hi`` (a
    new one); what stays is about the long-term gap, so the cache no longer grows with the
    context."""
    if window is None:
        if memory.sums is None or memory.sums.hi is None:
            return memory, base
        first = int(memory.sums.hi.min()) + 1
        drop = first - base
        if drop < max(64, len(memory) - drop):
            return memory, base
        return memory.drop_first(drop), first
    first = next_pos - window  # oldest entry the next step reads
    drop = first - base
    if drop < window:
        return memory, base
    return memory.drop_first(drop), first
