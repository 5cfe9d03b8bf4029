"""The adasplash adapter (mosaics/kernels/adasplash_backend.py), checked on CPU.

adasplash's Triton kernels need CUDA, so the backend slot gets a dense PyTorch function with
the same call contract: out_i = sum_{j <= i} alpha-entmax(q_i . k_j / sqrt(D), j <= i)_j v_j
(inclusive causal mask, scores scaled by 1/sqrt(D), as adasplash does). The adapter's side of
the mapping (strict-past shift, beta folded into the queries, padding, dtypes, row 0) is then
compared with each kernel's own chunked forward.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from mosaics import MosaicsConfig, MosaicsForCausalLM, get_kernel
from mosaics.kernels import adasplash_backend as ab

try:
    from entmax import entmax_bisect
except ImportError:  # the oracle below stands in for the package
    entmax_bisect = None


class _Bisect(torch.autograd.Function):
    """alpha-entmax over the last dim by bisection on tau, with the closed-form backward
    dz = g dp - g sum(g dp) / sum(g), g = p^(2 - alpha) on the support."""

    @staticmethod
    def forward(ctx, z: Tensor, alpha: float) -> Tensor:
        x = (alpha - 1.0) * z
        top = x.amax(dim=-1, keepdim=True)
        lo, hi = top - 1.0, top.clone()  # sum p(lo) >= 1 >= sum p(hi) = 0
        for _ in range(80):
            mid = 0.5 * (lo + hi)
            total = (x - mid).clamp_min(0.0).pow(1.0 / (alpha - 1.0)).sum(-1, keepdim=True)
            lo, hi = torch.where(total >= 1.0, mid, lo), torch.where(total >= 1.0, hi, mid)
        p = (x - lo).clamp_min(0.0).pow(1.0 / (alpha - 1.0))
        p = p / p.sum(-1, keepdim=True)
        ctx.alpha = alpha
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, dp: Tensor):  # noqa: ANN205
        (p,) = ctx.saved_tensors
        g = torch.where(p > 0, p.clamp_min(1e-30).pow(2.0 - ctx.alpha), 0.0)
        gdp = g * dp
        return gdp - g * gdp.sum(-1, keepdim=True) / g.sum(-1, keepdim=True), None


def oracle_entmax(z: Tensor, alpha: float) -> Tensor:
    if entmax_bisect is not None:
        return entmax_bisect(z, alpha=alpha, dim=-1, n_iter=60)
    return _Bisect.apply(z, alpha)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, alpha: float) -> Tensor:
    """The backend contract written densely: (B, H, N, D) each, inclusive causal mask."""
    N, D = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    causal = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
    return oracle_entmax(scores.masked_fill(~causal, float("-inf")), alpha) @ v


class Recorder:
    """A backend that checks the contract's input conditions and counts its calls."""

    def __init__(self, fn=dense_attention) -> None:  # noqa: ANN001
        self.fn, self.calls = fn, []

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, alpha: float) -> Tensor:
        assert q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype
        N, D = q.shape[-2:]
        assert N >= ab.MIN_LENGTH and N & (N - 1) == 0 and D in ab.HEAD_DIMS
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        self.calls.append((tuple(q.shape), q.dtype, alpha))
        return self.fn(q, k, v, alpha)


KERNELS = [("epanechnikov", {}, 2.0), ("biweight", {}, 1.5), ("triweight", {}, 4.0 / 3.0),
           ("entmax", {}, 1.5), ("entmax", {"alpha": 1.25}, 1.25),
           ("entmax", {"r": 0.8}, 2.25)]
FUSED = [k for k in KERNELS if k[2] <= 2.0]


def _inputs(T: int, H: int = 3, hs: int = 8, hv: int = 8, B: int = 2,
            dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.nn.functional.normalize(torch.randn(B, H, T, hs, generator=g, dtype=dtype),
                                         dim=-1)
    values = torch.randn(B, H, T, hv, generator=g, dtype=dtype)
    beta = (torch.rand(H, generator=g, dtype=dtype) * 6 + 2)
    probe = torch.randn(B, H, T, hv, generator=g, dtype=dtype)
    return keys, values, beta, probe


def _run(kernel, keys: Tensor, values: Tensor, beta: Tensor, probe: Tensor):  # noqa: ANN001
    k, v, b = (x.detach().clone().requires_grad_() for x in (keys, values, beta))
    out = kernel(k, v, b)
    if out.requires_grad:  # T = 1: the output is a constant 0
        (out * probe).sum().backward()
    return out.detach(), k.grad, v.grad, b.grad


def _close(a: Tensor, b: Tensor, dtype: torch.dtype) -> None:
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(a, b, rtol=tol * 10, atol=tol)


@pytest.mark.parametrize("name,kwargs,alpha", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 2, 7, 66])
def test_adapter_matches_chunked_kernel(name: str, kwargs: dict, alpha: float,
                                        dtype: torch.dtype, T: int) -> None:
    kernel = get_kernel(name, **kwargs)
    keys, values, beta, probe = _inputs(T, dtype=dtype, hv=12 if T == 7 else 8)
    expected = _run(kernel, keys, values, beta, probe)  # CPU without a backend: chunked path
    backend = Recorder()
    with ab.use_backend(backend):
        assert ab.skip_reason(kernel, keys, values) is None
        got = _run(kernel, keys, values, beta, probe)
    assert len(backend.calls) == (1 if T >= 2 else 0)
    if backend.calls:
        assert backend.calls[0][1] == dtype and backend.calls[0][2] == alpha
    assert got[0].dtype == dtype and got[0].shape == values.shape
    assert torch.all(got[0][:, :, 0] == 0)
    if T >= 2:
        assert got[0][:, :, 1:].abs().amax() > 0.1
    for g, e in zip(got, expected):
        if e is None:  # T = 1: nothing depends on the inputs
            assert g is None or torch.all(g == 0)
        else:
            _close(g, e, dtype)


def test_row_one_copies_value_zero_and_sparsity_is_kept() -> None:
    kernel = get_kernel("epanechnikov")
    keys, values, beta, _ = _inputs(40, H=2)
    with ab.use_backend(Recorder()):
        out = kernel(keys, values, beta * 4)
    torch.testing.assert_close(out[:, :, 1], values[:, :, 0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, get_kernel("epanechnikov")(keys, values, beta * 4),
                               rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("wrong", ["alpha", "scale", "mask"])
def test_a_wrong_mapping_is_caught(wrong: str) -> None:
    """The comparison above has teeth: a backend off by the alpha, the score scale or one
    position of the mask gives a clearly different retrieval."""

    def bad(q: Tensor, k: Tensor, v: Tensor, alpha: float) -> Tensor:
        if wrong == "alpha":
            return dense_attention(q, k, v, 1.0 + (alpha - 1.0) / 2)
        if wrong == "scale":
            return dense_attention(q / math.sqrt(q.shape[-1]), k, v, alpha)
        N = q.shape[-2]  # strict mask: the adapter's shift applied twice
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(
            ~torch.ones(N, N, dtype=torch.bool).tril(-1), float("-inf"))
        return torch.nan_to_num(oracle_entmax(scores, alpha)) @ v

    keys, values, beta, _ = _inputs(20)
    for name, kwargs, _alpha in FUSED[:3]:
        kernel = get_kernel(name, **kwargs)
        expected = kernel(keys, values, beta)
        with ab.use_backend(Recorder(bad)):
            got = kernel(keys, values, beta)
        assert (got - expected).abs().amax() > 1e-2, name


def test_fallbacks_keep_the_chunked_path(monkeypatch: pytest.MonkeyPatch) -> None:
    keys, values, beta, _ = _inputs(9)
    backend = Recorder()
    with ab.use_backend(backend):
        kernel = get_kernel("entmax", r=0.8)  # alpha 2.25: outside adasplash's (1, 2]
        assert "alpha" in ab.skip_reason(kernel, keys, values)
        kernel(keys, values, beta)
        kernel = get_kernel("biweight")
        kernel.use_adasplash = False
        assert "use_adasplash" in ab.skip_reason(kernel, keys, values)
        kernel(keys, values, beta)
        kernel.use_adasplash = True
        wide = torch.nn.functional.normalize(torch.randn(1, 3, 9, 300), dim=-1)
        assert "head size" in ab.skip_reason(kernel, wide, torch.randn(1, 3, 9, 300))
        monkeypatch.setenv(ab.ENV_SWITCH, "0")
        assert ab.ENV_SWITCH in ab.skip_reason(kernel, keys, values)
        kernel(keys, values, beta)
        monkeypatch.setenv(ab.ENV_SWITCH, "1")
        kernel(keys, values, beta)
    assert len(backend.calls) == 1  # only the last call


def test_without_backend_on_cpu_the_reason_is_given() -> None:
    keys, values, _, _ = _inputs(5)
    reason = ab.skip_reason(get_kernel("epanechnikov"), keys, values)
    assert reason is not None and "CUDA" in reason
    if ab._missing_package() is not None or not torch.cuda.is_available():
        assert not ab.available() and ab.disabled_reason()


def test_decoding_keeps_its_own_solvers() -> None:
    kernel = get_kernel("biweight")
    keys, values, beta, _ = _inputs(12, B=1)
    backend = Recorder()
    with ab.use_backend(backend):
        full = kernel(keys, values, beta)
        state = kernel.memory_of(keys[:, :, :10], values[:, :, :10], beta)
        y, state = kernel.step(state, keys[:, :, 10:11], keys[:, :, 10:10],
                                 values[:, :, 10:10], beta)
    assert len(backend.calls) == 1  # the whole-sequence forward only
    torch.testing.assert_close(y[:, :, 0], full[:, :, 10], rtol=1e-4, atol=1e-5)


def test_bf16_autocast_computes_in_fp32_and_returns_the_values_dtype() -> None:
    kernel = get_kernel("triweight")
    keys, values, beta, _ = _inputs(30)
    values = values.bfloat16()
    backend = Recorder()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = kernel(keys, values, beta)
        with ab.use_backend(backend):
            got = kernel(keys, values, beta)
    assert got.dtype == torch.bfloat16 and backend.calls[0][1] == torch.float32
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_padded_sizes() -> None:
    assert ab.padded_sizes(1, 8) == (64, 16)
    assert ab.padded_sizes(64, 16) == (64, 16)
    assert ab.padded_sizes(65, 17) == (128, 32)
    assert ab.padded_sizes(1023, 64) == (1024, 64)
    assert ab.padded_sizes(1024, 256) == (1024, 256)


def test_model_loss_and_gradients_match_through_the_backend() -> None:
    torch.manual_seed(0)
    model = MosaicsForCausalLM(MosaicsConfig(vocab_size=61, n_layer=2, n_head=2, n_embd=32,
                                             dropout=0.0, leaky_chunk_size=8, block_size=32,
                                             kernel="biweight"))
    ids = torch.randint(0, 61, (2, 32))
    losses, grads = [], []
    for backend in (None, Recorder()):
        model.zero_grad()
        with ab.use_backend(backend):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()
                                if p.grad is not None]))
    assert backend.calls
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-3, atol=1e-5)
