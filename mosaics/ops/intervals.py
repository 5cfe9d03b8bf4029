"""Per-query visible intervals: checks, chunk plans and masks of the interval retrievals.

Query i sees the memory entries lo[i] <= j <= hi[i]. The interval ops (and the kernels'
``attend``) cut the queries into chunks that each see a narrow band of columns
(:func:`attend_plan`), run one dense block per chunk (:func:`run_plan`) and mask it
(:func:`bounds_mask`); :func:`causal_offset` recognises the strict past and its gaps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

MIN_ATTEND_ROWS = 32  # fewest query rows per chunk of attend() that the width cap allows


def check_attend_args(queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
                      lo: Tensor, hi: Tensor) -> Tensor:
    """Check the arguments of ``Kernel.attend``; returns beta as a (B or 1, H, n or 1, 1)
    view (n for a bandwidth per query, 1 for one per head)."""
    if queries.dim() != 4 or keys.dim() != 4 or values.dim() != 4:
        raise ValueError("attend needs queries (B, H, n, hs), keys (B, H, S, hs) and values "
                         f"(B, H, S, hv); got {tuple(queries.shape)}, {tuple(keys.shape)}, "
                         f"{tuple(values.shape)}")
    B, H, n, hs = queries.shape
    if keys.shape[:2] != (B, H) or keys.shape[3] != hs or values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"attend: keys {tuple(keys.shape)} and values {tuple(values.shape)} "
                         f"must be (B, H, S, .) with B, H = {B}, {H} and keys' last size {hs} "
                         f"(queries {tuple(queries.shape)})")
    for name, bound in (("lo", lo), ("hi", hi)):
        if (bound.dim() != 2 or bound.shape[0] not in (1, B) or bound.shape[1] != n
                or bound.dtype.is_floating_point or bound.dtype == torch.bool):
            raise ValueError(f"attend: {name} must be an integer tensor of shape ({B} or 1, "
                             f"{n}), got {bound.dtype} {tuple(bound.shape)}")
        if bound.device != queries.device:
            raise ValueError(f"attend: {name} is on {bound.device}, the queries on "
                             f"{queries.device}; move the bounds to the queries' device")
    if beta.dim() == 1 and beta.shape[0] == H:
        return beta.view(1, H, 1, 1)
    if beta.dim() == 3 and beta.shape[0] in (1, B) and beta.shape[1:] == (H, n):
        return beta.unsqueeze(-1)
    raise ValueError(f"attend: beta must have shape (H,) = ({H},) or one bandwidth per query "
                     f"({B} or 1, {H}, {n}), got {tuple(beta.shape)}")


def attend_plan(lo: Tensor, hi: Tensor, S: int, batch_heads: int, elements: int,
                max_rows: int | None = None) -> list[tuple[int, int, int, int]]:
    """Query chunks of ``Kernel.attend``: (a, b, c0, c1) for rows a..b-1, which together
    see only the memory columns c0..c1-1; chunks whose rows see nothing are left out.

    Rows per chunk: r solves r (w + r) = elements / batch_heads, w the widest interval, so for
    intervals that move forward with i (windows, gaps, documents) one block of
    batch_heads x r x (c1 - c0) scores stays near ``elements``; and r <= max(32, w / 4): the
    rows of a window of w entries see w + r - 1 columns between them, so a chunk computes up
    to (w + r) / w times the visible scores (w / 4 measured faster than the memory bound
    alone at w = 256, T = 1024 and 4096). A chunk that still spans more than 4x
    ``elements`` (intervals out of order) is halved until it does not; ``max_rows`` caps the
    rows per chunk (fused tiles). The bounds are read on the host (one small device-to-host
    copy).
    """
    n = lo.shape[1]
    if n == 0 or S == 0:
        return []
    first, last = lo.clamp_min(0), hi.clamp_max(S - 1)
    seen = first <= last
    left = torch.where(seen, first, S).amin(0).tolist()  # per row over the batch
    right = torch.where(seen, last, -1).amax(0).tolist()
    widest = max((r - f + 1 for f, r in zip(left, right)), default=0)
    if widest <= 0:
        return []
    budget = max(1, elements // max(1, batch_heads))
    rows = int((math.sqrt(widest * widest + 4 * budget) - widest) / 2)
    rows = max(1, min(n, rows, max(MIN_ATTEND_ROWS, widest // 4), max_rows or n))
    plan, todo = [], [(a, min(n, a + rows)) for a in range(0, n, rows)]
    while todo:
        a, b = todo.pop(0)
        c0, c1 = min(left[a:b]), max(right[a:b]) + 1
        if c1 <= c0:
            continue
        if b - a > 1 and (b - a) * (c1 - c0) > 4 * budget:
            mid = (a + b) // 2
            todo[:0] = [(a, mid), (mid, b)]
            continue
        plan.append((a, b, c0, c1))
    return plan


def causal_offset(lo: Tensor, hi: Tensor) -> int | None:
    """d when every query i (of every batch row) sees exactly the entries 0..i+d, i.e.
    lo <= 0 and hi[i] = i + d (the strict past: d = -1, a gap of m: d = -m); else None.
    Kernels answer such intervals with their strict-past paths."""
    if lo.shape[1] == 0:
        return None
    offset = hi - torch.arange(hi.shape[1], device=hi.device)
    same = (offset == offset[:1, :1]).all() & (lo <= 0).all()
    return int(offset[0, 0]) if bool(same) else None


def run_plan(plan: list[tuple[int, int, int, int]], n: int, zeros: Callable[[int], Tensor],
             chunk: Callable[..., Tensor], chunk_args: Callable[[int, int, int, int], tuple],
             recompute: bool = False) -> Tensor:
    """The retrievals of every query chunk of :func:`attend_plan`, in row order along dim 2:
    ``chunk(*chunk_args(a, b, c0, c1))`` for each planned chunk and ``zeros(m)`` for the m
    rows between them that see nothing. ``recompute``: run each chunk under activation
    checkpointing (its intermediates are recomputed in backward instead of kept)."""
    from torch.utils.checkpoint import checkpoint

    parts, done = [], 0
    for a, b, c0, c1 in plan:
        if a > done:
            parts.append(zeros(a - done))
        args = chunk_args(a, b, c0, c1)
        parts.append(checkpoint(chunk, *args, use_reentrant=False) if recompute
                     else chunk(*args))
        done = b
    if done < n:
        parts.append(zeros(n - done))
    return torch.cat(parts, dim=2)


def shared_slice(lo: Tensor, hi: Tensor, S: int) -> tuple[int, int] | None:
    """(a, b): the memory columns a..b-1 (b <= a: none) that one decoding query sees in every
    batch row, when its interval is the same across the batch; None otherwise. One small
    device-to-host read."""
    first, last, top, end = torch.stack([lo.amin(), lo.amax(), hi.amin(), hi.amax()]).tolist()
    if first != last or top != end:
        return None
    return max(first, 0), min(top, S - 1) + 1


def interval_bounds(bound: Tensor, a: int, b: int, c0: int) -> Tensor:
    """Rows a..b-1 of (B or 1, n) interval bounds, relative to memory column c0."""
    return bound[:, a:b] - c0


def bounds_mask(lo: Tensor, hi: Tensor, width: int) -> Tensor:
    """(B or 1, 1, rows, width) boolean mask, True where lo[i] <= j <= hi[i], for (B or 1,
    rows) bounds and columns j = 0..width-1."""
    j = torch.arange(width, device=lo.device)
    return ((j >= lo.unsqueeze(-1)) & (j <= hi.unsqueeze(-1))).unsqueeze(1)


def interval_mask(lo: Tensor, hi: Tensor, a: int, b: int, c0: int, c1: int) -> Tensor:
    """:func:`bounds_mask` of rows a..b-1 over the memory columns c0..c1-1."""
    return bounds_mask(interval_bounds(lo, a, b, c0), interval_bounds(hi, a, b, c0), c1 - c0)
