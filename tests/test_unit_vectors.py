"""Unit vectors, x / max(|x|, eps), against autograd through ``F.normalize`` and the plain
reference :func:`mosaics.ops.unit_vectors_reference`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mosaics.ops import unit_vectors, unit_vectors_reference


def test_matches_normalize_and_the_reference_forward_and_backward() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 23, 5, dtype=torch.float64)
    # rows below eps, where the map is x / eps: zero, scaled down, all entries 1e-9
    x[0, 1, 2] = 0.0
    x[1, 0, 3] *= 1e-8
    x[0, 0, 0] = 1e-9
    g = torch.randn_like(x)
    ours_in, norm_in, ref_in = (x.clone().requires_grad_() for _ in range(3))
    ours = unit_vectors(ours_in, 1e-6)
    wants = (F.normalize(norm_in, dim=-1, eps=1e-6), unit_vectors_reference(ref_in, 1e-6))
    grad = torch.autograd.grad((ours * g).sum(), ours_in)[0]
    for want, leaf in zip(wants, (norm_in, ref_in), strict=True):
        torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(grad, torch.autograd.grad((want * g).sum(), leaf)[0],
                                   rtol=1e-8, atol=1e-8)
    with torch.no_grad():  # without gradients: the same numbers, no autograd function
        torch.testing.assert_close(unit_vectors(x, 1e-6), wants[0], rtol=1e-9, atol=1e-9)


def test_gradcheck() -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(unit_vectors, (x,))


def test_bf16_rows_are_unit() -> None:
    x = (torch.randn(4, 64) * 300).bfloat16()
    y = unit_vectors(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float().norm(dim=-1), torch.ones(4), atol=1e-2, rtol=0)
