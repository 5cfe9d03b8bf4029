"""alpha-entmax of :mod:`mosaics.ops.entmax` (the threshold solver with its hand-written
backward) against its plain reference ``entmax_reference``, value and gradient, float64: masked
entries, a row without a valid entry, alpha <= 2 (Newton) and alpha > 2 (bisection)."""

from __future__ import annotations

import pytest
import torch

from mosaics import ops

B, H = 2, 3


def _same_value_and_grad(fast, slow, z: torch.Tensor) -> None:
    y_fast, y_slow = fast(z), slow(z)
    torch.testing.assert_close(y_fast, y_slow, rtol=1e-9, atol=1e-9)
    g = torch.randn_like(y_slow)
    torch.testing.assert_close(torch.autograd.grad(y_fast, z, g)[0],
                               torch.autograd.grad(y_slow, z, g)[0], rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("alpha", [2.0, 1.5, 4 / 3, 3.0])
def test_entmax(alpha, masked):
    g = torch.Generator().manual_seed(1)
    z = (3.0 * torch.randn(B, H, 7, 37, generator=g, dtype=torch.float64)).requires_grad_()
    mask = None
    if masked:
        mask = torch.rand(7, 37, generator=torch.Generator().manual_seed(3)) > 0.3
        mask[4] = False  # a row without a valid entry: all 0
    _same_value_and_grad(lambda z: ops.entmax(z, alpha, mask),
                         lambda z: ops.entmax_reference(z, alpha, mask), z)
