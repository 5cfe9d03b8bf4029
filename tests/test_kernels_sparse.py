"""Compact-support kernels against independent references.

Oracles: the ``entmax`` package for sparsemax / 1.5-entmax / alpha-entmax, plain per-row loops
for the kNN, fixed-bandwidth and ReLUmax kernels. The kernels' fast paths (query chunks,
candidate pruning, custom backward) are checked against these on random masked inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

entmax_pkg = pytest.importorskip("entmax")

from mosaics import MosaicsForCausalLM  # noqa: E402
from mosaics.kernels import available_kernels, get_kernel  # noqa: E402
from mosaics.kernels.score_kernel import retrieve  # noqa: E402
from mosaics.ops.entmax import entmax, entmax15, sparsemax  # noqa: E402

# (registered name, kernel_kwargs) pairs covering every kernel and its options
CASES = [
    ("gaussian_knn", {}),
    ("gaussian_knn", {"k": 3}),
    ("uniform_knn", {"k": 3}),
    ("epanechnikov", {}),
    ("biweight", {}),
    ("triweight", {}),
    ("entmax", {}),
    ("entmax", {"alpha": 1.25}),
    ("entmax", {"r": 0.5}),  # alpha = 3
    ("epanechnikov_fixed", {}),
    ("epanechnikov_fixed", {"r": 2.0}),
    ("relumax", {}),
    ("relumax", {"r": 2.0, "b": 0.5}),
]
NAMES = ["gaussian_knn", "uniform_knn", "epanechnikov", "biweight", "triweight", "entmax",
         "epanechnikov_fixed", "relumax"]
IDS = [f"{n}-{'-'.join(f'{k}{v}' for k, v in kw.items()) or 'default'}" for n, kw in CASES]


# ----------------------------------------------------------------------------- references
def entmax_alpha(name: str, kwargs: dict) -> float | None:
    if name == "epanechnikov":
        return 2.0
    if name == "biweight":
        return 1.5
    if name == "triweight":
        return 4.0 / 3.0
    if name == "entmax":
        return kwargs.get("alpha", 1.0 + 1.0 / kwargs["r"] if "r" in kwargs else 1.5)
    return None


def reference_row(name: str, kwargs: dict, cos: torch.Tensor, beta) -> torch.Tensor:
    """Weights over one row of valid cosines (1-D, at least one entry), float64."""
    z = beta * cos
    alpha = entmax_alpha(name, kwargs)
    if alpha is not None:
        if alpha == 2.0:
            return entmax_pkg.sparsemax(z, dim=-1)
        if alpha == 1.5:
            return entmax_pkg.entmax15(z, dim=-1)
        return entmax_pkg.entmax_bisect(z, alpha=alpha, dim=-1, n_iter=200)
    if name in ("gaussian_knn", "uniform_knn"):
        k = min(kwargs.get("k", 16), z.numel())
        top = torch.argsort(z, descending=True)[:k]
        w = torch.zeros_like(z)
        w[top] = torch.softmax(z[top], dim=0) if name == "gaussian_knn" else 1.0 / k
        return w
    r = kwargs.get("r", 1.0)
    if name == "epanechnikov_fixed":
        u = torch.relu(1.0 - beta * (1.0 - cos)) ** r
    else:  # relumax
        u = torch.relu(kwargs.get("b", 1.0) + z - z.max()) ** r
    total = u.sum()
    return u / total if total > 0 else u


def reference_forward(name, kwargs, keys, values, beta):
    """y_t = sum_{s<t} w_ts v_s with the row weights computed one by one (float64)."""
    B, H, T, _ = keys.shape
    out = torch.zeros(B, H, T, values.shape[-1], dtype=torch.float64)
    k64, v64, b64 = keys.double(), values.double(), beta.double()
    for bi in range(B):
        for h in range(H):
            for t in range(1, T):
                cos = k64[bi, h, :t] @ k64[bi, h, t]
                w = reference_row(name, kwargs, cos, b64[h])
                out[bi, h, t] = w @ v64[bi, h, :t]
    return out


def unit_keys(B, H, T, hs, dtype=torch.float32, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, H, 1, hs, generator=g, dtype=torch.float64)
    k = base + spread * torch.randn(B, H, T, hs, generator=g, dtype=torch.float64)
    return F.normalize(k, dim=-1).to(dtype)


def values_like(keys, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(keys.shape, generator=g, dtype=torch.float64).to(keys.dtype)


# ----------------------------------------------------------------------------- registry
def test_every_name_is_registered_and_builds_without_kwargs():
    for name in NAMES:
        assert name in available_kernels()
        kernel = get_kernel(name)
        assert kernel.name == name
    assert get_kernel("gaussian_knn").k == 16 and get_kernel("uniform_knn").k == 16
    assert get_kernel("entmax").alpha == 1.5
    assert get_kernel("entmax", r=2).alpha == 1.5
    relu = get_kernel("relumax")
    assert (relu.r, relu.b) == (1.0, 1.0)
    assert get_kernel("epanechnikov_fixed").r == 1.0


@pytest.mark.parametrize("name,kwargs,match", [
    ("entmax", {"alpha": 1.0}, "alpha > 1"),
    ("entmax", {"alpha": 0.5}, "alpha > 1"),
    ("entmax", {"r": 0}, "r must be"),
    ("entmax", {"alpha": 1.5, "r": 2}, "not both"),
    ("gaussian_knn", {"k": 0}, "k must be"),
    ("uniform_knn", {"k": 2.5}, "k must be"),
    ("relumax", {"r": -1}, "r must be"),
    ("relumax", {"b": 0}, "b must be"),
    ("epanechnikov_fixed", {"r": 0}, "r must be"),
    ("epanechnikov", {"alpha": 3}, "bad kernel_kwargs"),
])
def test_invalid_kwargs_fail_clearly(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_kernel(name, **kwargs)


def test_config_selects_kernel_and_kwargs(tiny_config):
    model = MosaicsForCausalLM(tiny_config(kernel="relumax", kernel_kwargs={"r": 2, "b": 0.5}))
    kernel = model.model.blocks[0].cmem.kernel
    assert kernel.name == "relumax" and (kernel.r, kernel.b) == (2.0, 0.5)
    with pytest.raises(ValueError, match="alpha > 1"):
        MosaicsForCausalLM(tiny_config(kernel="entmax", kernel_kwargs={"alpha": 1}))


# ----------------------------------------------------------------------------- normalizers
@pytest.mark.parametrize("alpha", [2.0, 1.5, 4.0 / 3.0, 1.1, 2.5])
@pytest.mark.parametrize("scale", [1.0, 30.0, 22026.0])
def test_normalizers_match_entmax_package(alpha, scale):
    g = torch.Generator().manual_seed(int(alpha * 100 + scale))
    z = torch.randn(7, 40, generator=g, dtype=torch.float64) * scale
    mask = torch.rand(7, 40, generator=g) > 0.3
    mask[:, 0] = True
    mask[3] = False  # a row with no valid entry
    ours = entmax(z.float(), alpha, mask).double()
    ref = torch.zeros_like(z)
    for i in range(z.shape[0]):
        if mask[i].any():
            zi = z[i, mask[i]]
            if alpha == 2.0:
                ref[i, mask[i]] = entmax_pkg.sparsemax(zi, dim=-1)
            elif alpha == 1.5:
                ref[i, mask[i]] = entmax_pkg.entmax15(zi, dim=-1)
            else:
                ref[i, mask[i]] = entmax_pkg.entmax_bisect(zi, alpha=alpha, dim=-1, n_iter=200)
    torch.testing.assert_close(ours, ref, atol=2e-6, rtol=1e-4)
    assert torch.all(ours[~mask] == 0)
    sums = ours.sum(-1)
    torch.testing.assert_close(sums[mask.any(-1)], torch.ones_like(sums[mask.any(-1)]),
                               atol=1e-6, rtol=0)
    assert torch.all(sums[3] == 0)


@pytest.mark.parametrize("fn", [sparsemax, entmax15, lambda z, m: entmax(z, 1.3, m),
                                lambda z, m: entmax(z, 2.5, m)],
                         ids=["sparsemax", "entmax15", "entmax1.3", "entmax2.5"])
def test_normalizer_gradients(fn):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(4, 9, generator=g) > 0.3
    mask[:, 0] = True
    mask[2] = False
    assert torch.autograd.gradcheck(lambda x: fn(x, mask), (z,))
    fn(z, mask).pow(2).sum().backward()
    assert torch.all(z.grad[~mask] == 0)


def test_custom_backward_matches_entmax_package_backward():
    g = torch.Generator().manual_seed(5)
    z = torch.randn(6, 30, generator=g, dtype=torch.float64) * 4
    dy = torch.randn(6, 30, generator=g, dtype=torch.float64)
    for ours, ref in [(sparsemax, lambda x: entmax_pkg.sparsemax(x, dim=-1)),
                      (entmax15, lambda x: entmax_pkg.entmax15(x, dim=-1)),
                      (lambda x, m: entmax(x, 1.7, m),
                       lambda x: entmax_pkg.entmax_bisect(x, alpha=1.7, dim=-1, n_iter=200))]:
        a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
        (ours(a, None) * dy).sum().backward()
        (ref(b) * dy).sum().backward()
        torch.testing.assert_close(a.grad, b.grad, atol=1e-8, rtol=1e-6)


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_forward_matches_reference(name, kwargs):
    keys = unit_keys(2, 3, 13, 5, seed=len(name))
    values = values_like(keys)
    beta = torch.tensor([1.5, 7.39, 60.0])
    kernel = get_kernel(name, **kwargs)
    ref = reference_forward(name, kwargs, keys, values, beta)
    out = kernel(keys, values, beta)
    assert out.dtype == values.dtype
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    assert torch.all(out[:, :, 0] == 0)
    kernel.chunk_elements = 1  # one query row per chunk: same result
    torch.testing.assert_close(kernel(keys, values, beta), out, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_gradcheck_float64(name, kwargs):
    keys = unit_keys(1, 2, 6, 3, dtype=torch.float64, seed=7).requires_grad_()
    values = values_like(keys).requires_grad_()
    beta = torch.tensor([0.9, 2.5], dtype=torch.float64, requires_grad=True)
    kernel = get_kernel(name, **kwargs)
    kernel.chunk_elements = 8  # several chunks, backward accumulates across them
    assert torch.autograd.gradcheck(kernel, (keys, values, beta))


@pytest.mark.parametrize("name", ["epanechnikov", "biweight", "triweight", "gaussian_knn",
                                  "relumax", "epanechnikov_fixed"])
def test_backward_matches_autograd_through_reference(name):
    """Custom backward == autograd through the dense per-row reference, at a moderate size."""
    keys = unit_keys(1, 2, 24, 4, dtype=torch.float64, seed=11)
    values = values_like(keys)
    beta = torch.tensor([3.0, 12.0], dtype=torch.float64)
    grads = []
    for fn in (lambda k, v, b: get_kernel(name)(k, v, b),
               lambda k, v, b: reference_forward(name, {}, k, v, b)):
        k, v, b = (x.clone().requires_grad_() for x in (keys, values, beta))
        (fn(k, v, b) * values_like(keys, seed=9)).sum().backward()
        grads.append((k.grad, v.grad, b.grad))
    for ours, ref in zip(*grads):
        torch.testing.assert_close(ours, ref, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_weights_sum_to_one_and_masked_entries_are_exact_zeros(name):
    kernel = get_kernel(name)
    g = torch.Generator().manual_seed(2)
    cos = F.normalize(torch.randn(2, 3, 10, 8, generator=g), dim=-1)
    cos = cos @ cos.transpose(-1, -2)
    beta = torch.tensor([1.0, 7.39, 22026.0]).view(1, 3, 1, 1)
    mask = torch.ones(10, 10, dtype=torch.bool).tril(-1)
    cos = cos.requires_grad_()
    p = kernel.weights(cos, beta, mask)
    assert torch.all(p[..., ~mask] == 0) and not torch.isnan(p).any()
    sums = p.sum(-1)
    assert torch.all(sums[..., 0] == 0)  # row 0 sees nothing
    nonempty = (p > 0).any(-1)
    torch.testing.assert_close(sums[nonempty], torch.ones_like(sums[nonempty]))
    if name != "epanechnikov_fixed":  # the fixed-bandwidth kernel may have empty support
        assert nonempty[..., 1:].all()
    dp = torch.randn(p.shape, generator=g)
    dcos, _ = kernel.weights_backward(p, dp, cos.detach(), beta, mask)
    assert torch.all(dcos[..., ~mask] == 0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_at_max_bandwidth(name, dtype):
    keys = unit_keys(1, 2, 40, 16, seed=4, spread=0.3)
    values = values_like(keys)
    beta = torch.tensor([math.exp(10.0), 7.39])
    kernel = get_kernel(name)
    k16, v16 = keys.to(dtype).requires_grad_(), values.to(dtype).requires_grad_()
    out = kernel(k16, v16, beta)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = kernel(k16.detach().float(), v16.detach().float(), beta)  # same inputs, fp32 path
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    out.float().sum().backward()
    assert torch.isfinite(k16.grad.float()).all() and torch.isfinite(v16.grad.float()).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: weights still in fp32
        auto = kernel(keys, values, beta)
    torch.testing.assert_close(auto.float(), kernel(keys, values, beta), atol=1e-6, rtol=1e-5)


def test_empty_support_rows_output_zero_without_nan():
    keys = unit_keys(1, 1, 30, 16, seed=6, spread=3.0)  # nearly orthogonal keys
    values = values_like(keys).requires_grad_()
    beta = torch.tensor([math.exp(10.0)], requires_grad=True)
    kernel = get_kernel("epanechnikov_fixed")
    out = kernel(keys.requires_grad_(), values, beta)
    ref = reference_forward("epanechnikov_fixed", {}, keys.detach(), values.detach(),
                            beta.detach())
    assert (ref.abs().sum(-1) == 0).sum() > 20  # most rows really have empty support
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)
    out.sum().backward()
    for grad in (keys.grad, values.grad, beta.grad):
        assert torch.isfinite(grad).all()


def test_backward_saves_no_quadratic_tensor():
    """Only O(T) tensors are kept for backward: the T x T weights are recomputed per chunk."""
    T = 256
    keys = unit_keys(1, 2, T, 8, seed=8).requires_grad_()
    values = values_like(keys).requires_grad_()
    beta = torch.tensor([7.39, 20.0], requires_grad=True)
    for name in NAMES:
        kernel = get_kernel(name)
        kernel.chunk_elements = 4096
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = kernel(keys, values, beta)
        assert max(saved) < T * T, name
        out.sum().backward()


@pytest.mark.parametrize("name", NAMES)
def test_retrieval_with_empty_memory_or_blind_rows(name):
    """retrieve() with no memory entry at all, and with a negative offset (the first query
    sees nothing): zeros there, finite gradients, the masked weights elsewhere."""
    kernel = get_kernel(name)
    beta = torch.tensor([1.5, 9.0], dtype=torch.float64, requires_grad=True)
    q = unit_keys(1, 2, 4, 3, dtype=torch.float64, seed=13).requires_grad_()
    empty = q.new_zeros(1, 2, 0, 3).requires_grad_()
    y = retrieve(kernel, q, empty, empty, beta, -4)
    assert torch.equal(y, torch.zeros_like(y))
    y.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    k = unit_keys(1, 2, 3, 3, dtype=torch.float64, seed=14).requires_grad_()
    v = values_like(k).requires_grad_()
    y = retrieve(kernel, q, k, v, beta, -1)  # query i sees j <= i - 1
    mask = torch.ones(4, 3, dtype=torch.bool).tril(-1)
    want = kernel.weights((q @ k.transpose(-1, -2)).detach(), beta.detach().view(1, 2, 1, 1),
                          mask) @ v.detach()
    torch.testing.assert_close(y.detach(), want)
    assert torch.equal(y[:, :, 0], torch.zeros_like(y[:, :, 0]))
    y.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, beta))


# ----------------------------------------------------------------------------- decoding
def assert_close_per_head(got, want, atol):
    """assert_close with one absolute tolerance per head (dim 1)."""
    for h, tol in enumerate(atol):
        torch.testing.assert_close(got[:, h], want[:, h], atol=tol, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_step_equals_forward(name, dtype):
    keys = unit_keys(2, 3, 11, 5, seed=12, dtype=dtype)
    values = values_like(keys)
    beta = torch.tensor([2.0, 7.39, 40.0], dtype=dtype)
    # float64: the same numbers whatever the tiles; float32: cosines from matrix products of
    # different shapes may differ by one rounding step, which the bandwidth magnifies (beta
    # times 2^-23, 4.8e-6 at beta = 40)
    eps = torch.finfo(dtype).eps
    atol = [1e-12 if dtype == torch.float64 else max(1e-6, float(b) * eps) for b in beta]
    kernel = get_kernel(name)
    full = kernel(keys, values, beta)
    kernel.chunk_elements = 2 * 3 * 4  # decoding also runs in several query chunks
    # prefill 4 positions (memory 0..2), then feed the rest in uneven steps, as the model does
    state = kernel.memory_of(keys[:, :, :3], values[:, :, :3], beta)
    torch.testing.assert_close(state.keys, keys[:, :, :3])
    outs, pos = [full[:, :, :4]], 4
    for n in (1, 3, 1, 2):
        y, state = kernel.step(state, keys[:, :, pos:pos + n], keys[:, :, pos - 1:pos + n - 1],
                                 values[:, :, pos - 1:pos + n - 1], beta)
        outs.append(y)
        pos += n
    assert_close_per_head(torch.cat(outs, dim=2), full, atol)
    # m = n - 1: the first query sees only the existing memory
    state = kernel.memory_of(keys[:, :, :0], values[:, :, :0], beta)
    y, state = kernel.step(state, keys, keys[:, :, :-1], values[:, :, :-1], beta)
    assert_close_per_head(y, full, atol)


@pytest.mark.parametrize("name", NAMES)
def test_cached_model_logits_equal_full_forward(tiny_config, name):
    torch.manual_seed(0)
    model = MosaicsForCausalLM(tiny_config(kernel=name)).eval()
    ids = torch.randint(0, 61, (2, 14))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache, parts, pos = None, [], 0
        for n in (5, 1, 1, 4, 3):
            out = model(ids[:, pos:pos + n], cache=cache, use_cache=True)
            cache, pos = out.cache, pos + n
            parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_trains_without_nan(tiny_config, name):
    torch.manual_seed(0)
    model = MosaicsForCausalLM(tiny_config(kernel=name, n_layer=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 61, (2, 24))
    losses = []
    for _ in range(4):
        loss = model(ids, labels=ids, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            assert p.grad is None or torch.isfinite(p.grad).all()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]


def test_custom_score_kernel_from_the_docs(tiny_config):
    """The docs/kernels.md recipe: a registered ScoreKernel works end to end from the config."""
    from mosaics.kernels import register_kernel
    from mosaics.kernels.score_kernel import ScoreKernel, check_positive

    @register_kernel("test_cubic_relu")
    class CubicReLUKernel(ScoreKernel):
        def __init__(self, b: float = 1.0) -> None:
            super().__init__()
            self.b = check_positive(self.name, "b", b)

        def score_weights(self, z, mask):
            z = z.masked_fill(~mask, float("-inf"))
            top = z.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
            u = (z - top + self.b).clamp_min(0.0) ** 3
            return u / u.sum(-1, keepdim=True).clamp_min(1e-30)

        def score_backward(self, p, dp, z, mask):
            with torch.enable_grad():
                z = z.detach().requires_grad_()
                (self.score_weights(z, mask) * dp).sum().backward()
            return z.grad

    keys = unit_keys(1, 2, 6, 3, dtype=torch.float64, seed=3).requires_grad_()
    values = values_like(keys).requires_grad_()
    beta = torch.tensor([0.9, 2.5], dtype=torch.float64, requires_grad=True)
    kernel = get_kernel("test_cubic_relu", b=0.5)
    assert torch.autograd.gradcheck(kernel, (keys, values, beta))
    ref = reference_forward("relumax", {"r": 3.0, "b": 0.5}, keys.detach(), values.detach(),
                            beta.detach())
    torch.testing.assert_close(kernel(keys, values, beta).detach(), ref)
    # attend over windows with a bandwidth per query: the generic chunked path (no fused
    # tiles) against relumax r 3 on its fused tiles
    T = 6
    i = torch.arange(T).view(1, T)
    lo, hi = i - 3, i - 1
    per_query = (beta.detach().view(1, 2, 1) * (1.0 + 0.1 * i).view(1, 1, T)).requires_grad_()
    ours = kernel.attend(keys, keys, values, per_query, lo, hi)
    tiled = get_kernel("relumax", r=3.0, b=0.5).attend(keys, keys, values, per_query, lo, hi)
    torch.testing.assert_close(ours, tiled)
    for a, b in zip(torch.autograd.grad(ours.sum(), (keys, values, per_query)),
                    torch.autograd.grad(tiled.sum(), (keys, values, per_query))):
        torch.testing.assert_close(a, b)
    model = MosaicsForCausalLM(tiny_config(kernel="test_cubic_relu", kernel_kwargs={"b": 0.5}))
    ids = torch.randint(0, 61, (1, 9))
    assert torch.isfinite(model(ids, labels=ids, use_cache=False).loss)


@pytest.mark.parametrize("name", ["gaussian_knn", "uniform_knn"])
@pytest.mark.parametrize("offset,k", [(0, 3), (4, 5), (0, 40)])
def test_dense_knn_retrieval_equals_the_tiled_one(name, offset, k):
    """Short memories take dense matrices (_DenseTopKRetrieval), long ones the tiles of k
    gathered rows: both give the same output and gradients (float64, ties impossible)."""
    from mosaics.kernels.score_kernel import retrieve
    from mosaics.ops.topk_retrieval import _DenseTopKRetrieval

    keys = unit_keys(2, 3, 30, 8, dtype=torch.float64, seed=5)
    queries = unit_keys(2, 3, 30 - offset, 8, dtype=torch.float64, seed=6)
    values = values_like(keys)
    beta = torch.tensor([1.0, 4.0, 20.0], dtype=torch.float64)
    weight = values_like(values[:, :, :queries.shape[2]], seed=7)
    results = []
    for dense in (True, False):
        kernel = get_kernel(name, k=k)
        kernel.dense_keys_per_k = float("inf") if dense else 0.0
        q, kk, v, b = (x.clone().requires_grad_() for x in (queries, keys, values, beta))
        calls = []
        original = _DenseTopKRetrieval.forward

        def spy(*args, original=original, calls=calls):
            calls.append(1)
            return original(*args)

        _DenseTopKRetrieval.forward = staticmethod(spy)
        try:
            y = retrieve(kernel, q, kk, v, b, offset)
        finally:
            _DenseTopKRetrieval.forward = staticmethod(original)
        assert bool(calls) == dense
        (y * weight).sum().backward()
        results.append((y, q.grad, kk.grad, v.grad, b.grad))
    for dense, tiled in zip(*results, strict=True):
        torch.testing.assert_close(dense, tiled, atol=1e-10, rtol=1e-10)
