"""Both forms of the chunked leaky scan (sequential inside chunks on CPU, decay-matrix
products elsewhere) against the step-by-step recursion."""

from __future__ import annotations

import pytest
import torch

from mosaics.ops.leaky import _chunked_scan, leaky_average_reference


@pytest.mark.parametrize("sequential", [True, False])
@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (16, 4), (33, 8)])
@pytest.mark.parametrize("reverse", [False, True])
def test_chunked_scan_forms_match_the_recursion(sequential, T, chunk, reverse):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(2, T, 3, 5, generator=g, dtype=torch.float64).transpose(1, 2)  # split heads
    a = torch.tensor([0.05, 0.7, 3.0], dtype=torch.float64)
    got = _chunked_scan(x, a, chunk, reverse=reverse, sequential=sequential)
    want = (leaky_average_reference(x.flip(2), a).flip(2) if reverse
            else leaky_average_reference(x, a))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
