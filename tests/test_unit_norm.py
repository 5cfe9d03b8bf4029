"""The fused scaled unit-vector map against autograd through ``F.normalize``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mosaics.unit_norm import scaled_unit


def _reference(x: torch.Tensor, scale: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = F.normalize(x, dim=-1, eps=eps)
    return y if scale is None else y * scale


@pytest.mark.parametrize("with_scale", [False, True])
def test_matches_normalize_forward_and_backward(with_scale: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    x[0, 1, 2] = 0.0  # a zero row: below eps, the map is x / eps
    x[1, 0, 3] *= 1e-8
    scale = torch.rand(1, 3, 1, 1, dtype=torch.float64) + 0.5 if with_scale else None
    g = torch.randn_like(x)
    inputs = [x.clone().requires_grad_()] + ([scale.clone().requires_grad_()] if with_scale else [])
    ref_inputs = [t.clone().detach().requires_grad_() for t in inputs]
    ours = scaled_unit(inputs[0], inputs[1] if with_scale else None, 1e-6)
    ref = _reference(ref_inputs[0], ref_inputs[1] if with_scale else None, 1e-6)
    torch.testing.assert_close(ours, ref)
    for a, b in zip(torch.autograd.grad((ours * g).sum(), inputs),
                    torch.autograd.grad((ref * g).sum(), ref_inputs), strict=True):
        torch.testing.assert_close(a, b)


def test_gradcheck() -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    s = torch.rand(1, 3, 1, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: scaled_unit(a, b), (x, s))
    assert torch.autograd.gradcheck(lambda a: scaled_unit(a), (x,))


def test_bf16_rows_are_unit_and_scale_shape_is_checked() -> None:
    x = (torch.randn(4, 64) * 300).bfloat16()
    y = scaled_unit(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float().norm(dim=-1), torch.ones(4), atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match="last dim"):
        scaled_unit(x, torch.ones(64))
