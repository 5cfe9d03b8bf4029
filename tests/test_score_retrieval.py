"""The score retrievals of :mod:`mosaics.ops` against their plain references, value and
gradient, float64: the chunked strict-past and interval retrievals with a kernel's normalizer
(``score_retrieval``, ``interval_score_retrieval`` / ``score_retrieval_reference``), the power
kernels' tiles (``power_retrieval`` / ``power_attention_reference``) and the kNN kernels' tiled
and dense forms (``top_k_retrieval``, ``dense_top_k_retrieval`` /
``knn_attention_reference``)."""

from __future__ import annotations

import pytest
import torch
from test_ops import _same_value_and_grad

from mosaics import ops
from mosaics.kernels import get_kernel
from mosaics.ops.intervals import attend_plan

B, H, T, D = 2, 3, 23, 5


def _leaves(*shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(len(shapes))
    return [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]


def _unit_leaves(*shapes) -> list[torch.Tensor]:
    """Unit rows (queries, keys) as float64 leaves."""
    g = torch.Generator().manual_seed(100 + len(shapes))
    return [torch.nn.functional.normalize(torch.randn(*s, generator=g, dtype=torch.float64),
                                          dim=-1).requires_grad_() for s in shapes]


def _bandwidth(*shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return (1.0 + 3.0 * torch.rand(*shape, generator=g, dtype=torch.float64)).requires_grad_()


def _windows(n: int, S: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, n) intervals of up to ``width`` entries ending near each row; one row sees none."""
    g = torch.Generator().manual_seed(11)
    hi = (torch.arange(n) * (S - 1) // max(n - 1, 1)).expand(B, n) - torch.randint(
        0, 3, (B, n), generator=g)
    lo = hi - torch.randint(0, width, (B, n), generator=g)
    lo[0, 2], hi[0, 2] = 5, 4
    return lo, hi


def _softmax(z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    top = z.detach().masked_fill(~mask, float("-inf")).amax(-1, keepdim=True)
    e = torch.where(mask, (z - top.nan_to_num(0.0, neginf=0.0)).exp(), 0.0)
    return e / e.sum(-1, keepdim=True).clamp_min(1e-300)


def _relu_max(z: torch.Tensor, mask: torch.Tensor, r: float = 1.5, b: float = 1.0):
    top = z.masked_fill(~mask, float("-inf")).amax(-1, keepdim=True)
    u = torch.where(mask, z - torch.where(top.isfinite(), top, 0.0) + b, 0.0).clamp_min(0.0)
    p = torch.where(u > 0, torch.where(u > 0, u, 1.0).pow(r), 0.0)
    return p / p.sum(-1, keepdim=True).clamp_min(1e-300)


SCORE_KERNELS = {  # name, kernel options, the normalizer of the scores written out
    "gaussian": ({}, _softmax),
    "entmax": ({"alpha": 1.5}, lambda z, m: ops.entmax_reference(z, 1.5, m)),
    "epanechnikov": ({}, lambda z, m: ops.entmax_reference(z, 2.0, m)),
    "relumax": ({"r": 1.5}, _relu_max),
}


@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("chunks", [1, 5])
@pytest.mark.parametrize("offset", [-1, 3])
@pytest.mark.parametrize("name", list(SCORE_KERNELS))
def test_score_retrieval(name, offset, chunks, alibi):
    options, normalize = SCORE_KERNELS[name]
    kernel = get_kernel(name, **options)
    S = T + 3
    if chunks > 1:  # about 5 query rows per chunk
        kernel.chunk_elements = B * H * S * 5
    q, k = _unit_leaves((B, H, T, D), (B, H, S, D))
    (v,) = _leaves((B, H, S, D))
    beta = _bandwidth(H)
    slopes = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64) if alibi else None
    hi = (torch.arange(T) + offset).view(1, T)
    _same_value_and_grad(
        lambda q, k, v, b: ops.score_retrieval(q, k, v, b, kernel, offset, slopes),
        lambda q, k, v, b: ops.score_retrieval_reference(
            q, k, v, b, torch.zeros_like(hi), hi, normalize, slopes, pos0=offset + 1),
        [q, k, v, beta])


@pytest.mark.parametrize("per_query", [False, True])
@pytest.mark.parametrize("name", list(SCORE_KERNELS))
def test_interval_score_retrieval(name, per_query):
    options, normalize = SCORE_KERNELS[name]
    kernel = get_kernel(name, **options)
    S = 40
    q, k = _unit_leaves((B, H, T, D), (B, H, S, D))
    (v,) = _leaves((B, H, S, D))
    beta = _bandwidth(B, H, T) if per_query else _bandwidth(H)
    lo, hi = _windows(T, S, 12)
    plan = attend_plan(lo, hi, S, B * H, B * H * 6 * 20)
    assert len(plan) > 1

    def fast(q, k, v, b):
        b4 = b.unsqueeze(-1) if per_query else b.view(1, H, 1, 1)
        return ops.interval_score_retrieval(q, k, v, b4, lo, hi, kernel, plan)

    _same_value_and_grad(fast, lambda q, k, v, b: ops.score_retrieval_reference(
        q, k, v, b, lo, hi, normalize), [q, k, v, beta])


POWER_KERNELS = {"entmax": {"alpha": 1.5}, "epanechnikov": {}, "triweight": {},
                 "relumax": {"r": 1.5}, "epanechnikov_fixed": {"r": 2.0}}


@pytest.mark.parametrize("per_query", [False, True])
@pytest.mark.parametrize("form", ["past", "intervals"])
@pytest.mark.parametrize("name", list(POWER_KERNELS))
def test_power_retrieval(name, form, per_query):
    kernel = get_kernel(name, **POWER_KERNELS[name])
    S, offset = T + 3, 2
    kernel.chunk_elements = B * H * S * 5  # tiles of about 5 query rows
    q, k = _unit_leaves((B, H, T, D), (B, H, S, D))
    (v,) = _leaves((B, H, S, D))
    beta = _bandwidth(B, H, T) if per_query else _bandwidth(H)
    if form == "past":
        hi = (torch.arange(T) + offset).view(1, T)
        lo, tiles = torch.zeros_like(hi), kernel.past_tiles(offset)
    else:
        lo, hi = _windows(T, S, 12)
        tiles = kernel.interval_tiles(lo, hi, S, B, H)
    anchor, shift, entmax = kernel.fused_form()

    def beta4(b):
        return b.unsqueeze(-1) if per_query else b.view(1, H, 1, 1)

    _same_value_and_grad(
        lambda q, k, v, b: ops.power_retrieval(q, k, v, beta4(b), kernel, tiles),
        lambda q, k, v, b: ops.power_attention_reference(
            q, k, v, (kernel.score_scale * beta4(b)).expand(B, H, T, 1), lo, hi,
            r=kernel.power, anchor=anchor, shift=shift, entmax=entmax),
        [q, k, v, beta])


@pytest.mark.parametrize("form", ["dense", "past", "intervals"])
@pytest.mark.parametrize("uniform", [False, True])
def test_top_k_retrieval(uniform, form):
    kernel = get_kernel("uniform_knn" if uniform else "gaussian_knn", k=3)
    n, S, offset = (T, T + 3, 2) if form == "dense" else (40, 300, 260)  # 300: block search
    q, k = _unit_leaves((B, H, n, D), (B, H, S, D))
    (v,) = _leaves((B, H, S, D))
    beta = _bandwidth(H)
    lo = hi = None
    if form == "dense":
        def fast(q, k, v, b):
            return ops.dense_top_k_retrieval(q, k, v, b, kernel, offset)
    else:
        if form == "intervals":
            lo, hi = _windows(n, S, 200)
            tiles = kernel.interval_tiles(lo, hi, S, B, H)
        else:
            tiles = kernel.past_tiles(offset)

        def fast(q, k, v, b):
            return ops.top_k_retrieval(q, k, v, b.view(1, H, 1, 1), kernel, tiles)

    def slow(q, k, v, b):
        return ops.knn_attention_reference(q, k, v, b, offset, 3, uniform, lo, hi)

    if uniform:  # weights constant in the scores: only the values get a gradient
        _same_value_and_grad(lambda v: fast(q, k, v, beta), lambda v: slow(q, k, v, beta), [v])
    else:
        _same_value_and_grad(fast, slow, [q, k, v, beta])
