"""What the kernel interface declares: the decoding row of every kernel with a score
normalizer, the bandwidth ``memory_of`` is given, and the flags the model reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mosaics.compilation import kernel_traceable
from mosaics.kernels import Kernel, available_kernels, get_kernel
from mosaics.kernels.position_bias import supports_score_bias

pytest.importorskip("entmax")

H, S, HS = 3, 11, 4


def _kernel(name: str) -> Kernel:
    kernel = get_kernel(name, **({"num_features": 6, "flow_hidden": 8} if name == "fska" else {}))
    kernel.build(H, HS)
    return kernel.eval()


@pytest.mark.parametrize("name", available_kernels())
def test_row_weights_are_the_normalizer_on_one_row(name: str) -> None:
    kernel = _kernel(name)
    assert supports_score_bias(kernel) == kernel.has_weights() == (name != "fska")
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(2, H, 1, HS, generator=g, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(2, H, S, HS, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(2, H, S, HS, generator=g, dtype=torch.float64)
    cos = q @ k.transpose(-1, -2)
    beta = torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64)
    if not kernel.has_weights():
        with pytest.raises(NotImplementedError):
            kernel.row_weights(cos, beta.view(1, H, 1, 1))
        return
    w, index = kernel.row_weights(cos, beta.view(1, H, 1, 1))
    if index is not None:
        w = w.new_zeros(cos.shape).scatter_(-1, index, w)
    mask = torch.ones(1, S, dtype=torch.bool)
    torch.testing.assert_close(w, kernel.weights(cos, beta.view(1, H, 1, 1), mask))
    torch.testing.assert_close(kernel.decode_row(q, k, v, beta), w @ v)


def test_gaussian_row_is_the_softmax() -> None:
    cos = torch.rand(1, H, 1, S, dtype=torch.float64)
    beta = torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64).view(1, H, 1, 1)
    w, index = get_kernel("gaussian").row_weights(cos, beta)
    assert index is None
    torch.testing.assert_close(w, torch.softmax(beta * cos, dim=-1))


def test_compile_traceable_is_declared_on_the_kernel() -> None:
    assert not Kernel.compile_traceable
    assert [n for n in available_kernels() if kernel_traceable(get_kernel(n))] == ["gaussian"]


def test_memory_of_takes_the_bandwidth() -> None:
    """The default memory holds the entries whatever the bandwidth."""
    kernel = get_kernel("epanechnikov")
    keys, values = torch.randn(1, H, 5, HS), torch.randn(1, H, 5, HS)
    memory = kernel.memory_of(keys, values, torch.ones(H))
    torch.testing.assert_close(memory.keys, keys)
    torch.testing.assert_close(memory.values, values)
