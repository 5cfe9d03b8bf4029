"""alpha-entmax of score rows that see every memory entry: the decoding step's normalizer.

The training solvers (:mod:`mosaics.ops.entmax`) handle masks, rows without any valid entry and
chunks of many rows. A decoding step has one row per (batch, head), every entry valid and at
least one of them. Only entries within 1 / (alpha - 1) of the row max can have weight, so
sparsemax (alpha = 2) and 1.5-entmax sort just those candidates (``topk``), solve for the
exact threshold on them and return their weights with their indices: the caller then reads
only their values (``SORTED_ROW_SOLVERS``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor


def top_candidates(z: Tensor, width: float) -> tuple[Tensor, Tensor]:
    """(z - row max, index) of the c largest entries of each row (..., S), sorted descending,
    where c is the largest number of entries within ``width`` of their row max over the rows:
    every entry that can have weight is among them.

    Counting first and then taking one ``topk`` of exactly c measured faster than a first
    ``topk`` of 32 followed by a wider one when a row has more candidates (one host sync
    either way), with few candidates and with the ~100 of greedy decoding's repeated tokens.
    """
    top = z.amax(dim=-1, keepdim=True)
    c = int((z > top - width).sum(dim=-1).amax())
    values, index = z.topk(c, dim=-1)
    return values - top, index


@functools.lru_cache(maxsize=64)
def _ranks(c: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """1, 2, ..., c (cached: decoding asks for the same few lengths every step)."""
    return torch.arange(1, c + 1, device=device, dtype=dtype)


def sparsemax_top(z: Tensor) -> tuple[Tensor, Tensor]:
    """sparsemax of each row of z (..., S): (weights (..., c), index (..., c)) of the
    candidates, [z - tau]_+ with tau = max_k (sum_{j<=k} z_(j) - 1) / k (z_(j) sorted
    descending, relative to the row max): every prefix k has sum_{j<=k} (z_(j) - tau) <= 1,
    with equality at the support size."""
    srt, index = top_candidates(z, 1.0)
    ranks = _ranks(srt.shape[-1], srt.device, srt.dtype)
    tau = srt.cumsum(dim=-1).sub_(1.0).div_(ranks).amax(dim=-1, keepdim=True)
    return (srt - tau).clamp_min_(0.0), index


def entmax15_top(z: Tensor) -> tuple[Tensor, Tensor]:
    """1.5-entmax of each row of z (..., S): (weights (..., c), index (..., c)) of the
    candidates, [x - tau]_+^2 / sum with x = (z - max) / 2 and the exact threshold tau_k =
    mean_k - sqrt((1 - k var_k) / k) over the top k, for the largest k with tau_k <= x_(k)."""
    srt, index = top_candidates(z, 2.0)
    srt = srt * 0.5
    ranks = _ranks(srt.shape[-1], srt.device, srt.dtype)
    mean = srt.cumsum(dim=-1) / ranks
    spread = ranks * ((srt * srt).cumsum(dim=-1) / ranks - mean * mean)
    tau_k = mean - ((1.0 - spread) / ranks).clamp_min(0.0).sqrt()
    size = (tau_k <= srt).sum(dim=-1, keepdim=True)
    p = (srt - tau_k.gather(-1, size - 1)).clamp_min(0.0).square()
    return p / p.sum(dim=-1, keepdim=True), index


# alpha -> exact solver of (..., S) rows with every entry valid, S >= 1: (weights, index)
SORTED_ROW_SOLVERS: dict[float, Callable[[Tensor], tuple[Tensor, Tensor]]] = {
    2.0: sparsemax_top, 1.5: entmax15_top}
