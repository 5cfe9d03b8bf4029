"""Ops of :mod:`mosaics.ops` against their plain references, value and gradient, float64:
look-ahead values, causal attention, bank attention. The leaky average, unit vectors and the
linear cross-entropy have files of their own (test_leaky_average.py, test_unit_vectors.py,
test_linear_cross_entropy.py)."""

from __future__ import annotations

import pytest
import torch

from mosaics import ops

torch.manual_seed(0)
B, H, T, D = 2, 3, 23, 5


def _leaves(*shapes, positive: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(len(shapes))
    out = []
    for shape in shapes:
        t = torch.randn(*shape, generator=g, dtype=torch.float64)
        out.append((t.abs() + 0.05 if positive else t).requires_grad_())
    return out


def _same_value_and_grad(fast, slow, leaves: list[torch.Tensor]) -> None:
    y_fast, y_slow = fast(*leaves), slow(*leaves)
    torch.testing.assert_close(y_fast, y_slow, rtol=1e-9, atol=1e-9)
    g = torch.randn_like(y_slow)
    for a, b in zip(torch.autograd.grad(y_fast, leaves, g), torch.autograd.grad(y_slow, leaves, g),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("previous", [False, True])
@pytest.mark.parametrize("n", [1, T])
def test_lookahead_values(previous, n):
    v, c, prev = _leaves((B, H, n, D), (H,), (B, H, 1, D))
    leaves = [v, c, prev] if previous else [v, c]
    _same_value_and_grad(ops.lookahead_values, ops.lookahead_values_reference, leaves)


@pytest.mark.parametrize("T_", [7, 300])
def test_causal_attention(T_):
    q, k, v = _leaves((B, H, T_, D), (B, H, T_, D), (B, H, T_, D))
    _same_value_and_grad(lambda *t: ops.causal_attention(*t, scale=0.7, block=64),
                         lambda *t: ops.causal_attention_reference(*t, scale=0.7), [q, k, v])


@pytest.mark.parametrize("P", [40, 1000])
def test_bank_attention(P):
    q, k, v = _leaves((H, 30, D), (H, P, D), (H, P, D))
    _same_value_and_grad(ops.bank_attention, ops.bank_attention_reference, [q, k, v])
    with torch.no_grad():  # few rows while decoding: the batched-GEMV form
        torch.testing.assert_close(ops.bank_attention(q[:, :2], k, v),
                                   ops.bank_attention_reference(q[:, :2], k, v))
