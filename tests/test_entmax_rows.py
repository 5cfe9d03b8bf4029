"""The decoding step's row solvers against the masked training normalizers."""

from __future__ import annotations

import pytest
import torch

from mosaics.kernels.entmax_rows import SORTED_ROW_SOLVERS
from mosaics.ops.entmax import entmax_forward


def dense(weights: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    """(..., c) candidate weights at ``index`` -> (..., width) rows."""
    return torch.zeros(*weights.shape[:-1], width, dtype=weights.dtype).scatter_(-1, index,
                                                                                 weights)


def rows(kind: str, S: int, dtype: torch.dtype) -> torch.Tensor:
    """(2, 3, 1, S) score rows: spread out (a few candidates), tied near the top (more
    candidates than a first guess would take) or a single entry."""
    g = torch.Generator().manual_seed(S)
    if kind == "spread":
        return (torch.randn(2, 3, 1, S, generator=g) * 4.0).to(dtype)
    if kind == "crowded":  # ~S / 2 entries within 1 of the max, as with repeated tokens
        z = torch.randn(2, 3, 1, S, generator=g) * 0.3
        z[..., ::2] -= 5.0
        return z.to(dtype)
    return torch.randn(2, 3, 1, S, generator=g).to(dtype)


@pytest.mark.parametrize("alpha", sorted(SORTED_ROW_SOLVERS))
@pytest.mark.parametrize("kind,S", [("spread", 7), ("spread", 640), ("crowded", 96),
                                    ("crowded", 641), ("single", 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_solvers_match_the_masked_normalizer(alpha, kind, S, dtype):
    z = rows(kind, S, dtype)
    weights, index = SORTED_ROW_SOLVERS[alpha](z)
    got = dense(weights, index, S)
    want = entmax_forward(z, alpha)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(got, want, atol=tol, rtol=0)
    assert torch.equal(got > 0, want > 0)  # the same support: exact zeros elsewhere
    torch.testing.assert_close(got.sum(-1), torch.ones_like(got.sum(-1)))
    # every candidate beyond the support has weight exactly 0
    assert bool((weights >= 0).all())
