"""The compiled sparsemax decoding row (mosaics/csrc/sparse_rows.cpp): exact against the
written-out row, taken by the epanechnikov kernel's decoding, and a clean fallback."""

from __future__ import annotations

import pytest
import torch
from test_generate import decode_one_by_one

from mosaics import MosaicsForCausalLM
from mosaics.cache import KernelMemory
from mosaics.kernels import get_kernel
from mosaics.kernels.base import decode_row
from mosaics.ops import sparse_rows

needs_ext = pytest.mark.skipif(sparse_rows.rows_extension() is None,
                               reason="the compiled CPU row does not build here")


def _memory(B: int, H: int, S: int, hs: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Unit keys in a decoding buffer (views with room behind), half of them near the query."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, S, hs, generator=g)
    keys[:, :, S // 2:] = keys[:, :, -1:] + 0.05 * keys[:, :, S // 2:]
    keys = torch.nn.functional.normalize(keys, dim=-1)
    values = torch.randn(B, H, S, hs, generator=g)
    memory = KernelMemory(keys[:, :, :0], values[:, :, :0]).append(keys, values)
    return memory.keys, memory.values, keys[:, :, -1:].clone()


@needs_ext
@pytest.mark.parametrize("B,S,scale", [(1, 1, 7.4), (2, 37, 7.4), (3, 300, 7.4),
                                       (2, 300, 22026.0), (1, 64, 0.01)])
def test_compiled_row_equals_the_reference(B, S, scale):
    keys, values, query = _memory(B, 4, S, 16, seed=S)
    assert keys.stride(1) != S * 16  # buffer views, not contiguous tensors
    beta = torch.linspace(0.5, 1.5, 4) * scale
    with torch.no_grad():
        got = sparse_rows.sparsemax_row(query, keys, values, beta)
    want = sparse_rows.sparsemax_row_reference(query.double(), keys.double(), values.double(),
                                               beta.double())
    assert got is not None
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-5)
    # the PyTorch row of the kernel agrees
    torch.testing.assert_close(decode_row(get_kernel("epanechnikov"), query, keys, values, beta),
                               got, rtol=1e-4, atol=2e-5)


def test_the_row_declines_what_it_does_not_serve():
    keys, values, query = _memory(1, 2, 10, 8, seed=1)
    beta = torch.ones(2)
    assert sparse_rows.sparsemax_row(query.double(), keys.double(), values.double(),
                                     beta.double()) is None  # fp64
    with torch.enable_grad():
        q = query.clone().requires_grad_()
        assert sparse_rows.sparsemax_row(q, keys, values, beta) is None  # gradients
    with torch.no_grad():  # rows not of contiguous numbers
        assert sparse_rows.sparsemax_row(query, keys.transpose(2, 3)[..., :8, :],
                                         values, beta) is None


@needs_ext
def test_epanechnikov_decoding_takes_the_compiled_row(tiny_config, monkeypatch):
    model = MosaicsForCausalLM(tiny_config(kernel="epanechnikov")).eval()
    ids = torch.randint(0, 61, (2, 12))
    calls = []
    original = sparse_rows.sparsemax_row
    import mosaics.kernels.entmax_kernel as entmax_module

    monkeypatch.setattr(entmax_module, "sparsemax_row",
                        lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        full = model(ids).logits
        steps, _ = decode_one_by_one(model, ids, 5)
    assert len(calls) == 7 * model.config.n_layer
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-5)


def test_without_the_compiled_row_decoding_falls_back(tiny_config, monkeypatch):
    monkeypatch.setattr(sparse_rows, "rows_extension", lambda: None)
    model = MosaicsForCausalLM(tiny_config(kernel="epanechnikov")).eval()
    ids = torch.randint(0, 61, (1, 9))
    with torch.no_grad():
        full = model(ids).logits
        steps, _ = decode_one_by_one(model, ids, 4)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-5)
