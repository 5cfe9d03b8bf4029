"""The fused unit-vector map against autograd through ``F.normalize``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mosaics.ops import unit_vectors


def test_matches_normalize_forward_and_backward() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    x[0, 1, 2] = 0.0  # a zero row: below eps, the map is x / eps
    x[1, 0, 3] *= 1e-8
    g = torch.randn_like(x)
    ours_in, ref_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = unit_vectors(ours_in, 1e-6)
    ref = F.normalize(ref_in, dim=-1, eps=1e-6)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(torch.autograd.grad((ours * g).sum(), ours_in)[0],
                               torch.autograd.grad((ref * g).sum(), ref_in)[0])


def test_gradcheck() -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(unit_vectors, (x,))


def test_bf16_rows_are_unit() -> None:
    x = (torch.randn(4, 64) * 300).bfloat16()
    y = unit_vectors(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float().norm(dim=-1), torch.ones(4), atol=1e-2, rtol=0)
