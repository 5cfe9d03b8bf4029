"""Kernel.attend: retrieval where every query sees its own interval lo[i] <= j <= hi[i] of
memory entries, with a bandwidth per head or per query.

Reference: a slow loop over (batch, head, query) that takes the visible slice and computes the
kernel's weights on that slice alone (the ``entmax`` package for the entmax family, plain
formulas for the others), differentiated by autograd.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mosaics.kernels import available_kernels, get_kernel
from mosaics.kernels.base import Kernel
from mosaics.kernels.spectral_flow import angle_features, projections
from mosaics.ops.intervals import attend_plan, causal_offset

entmax_pkg = pytest.importorskip("entmax")

FSKA_KW = dict(num_features=6, flow_hidden=8, flow_layers=2)
VARIANTS = [("gaussian_knn", {"k": 3}), ("uniform_knn", {"k": 3}), ("entmax", {"alpha": 1.25}),
            ("entmax", {"r": 0.5}), ("epanechnikov_fixed", {"r": 2.0}),
            ("relumax", {"r": 2.0, "b": 0.5}), ("fska", {"positive": "exp"})]
KERNELS = [(name, {}) for name in available_kernels()] + VARIANTS
IDS = [f"{n}-{'-'.join(f'{k}{v}' for k, v in kw.items()) or 'default'}" for n, kw in KERNELS]
B, H, HS = 2, 2, 4


def make_kernel(name: str, kwargs: dict | None = None, heads: int = H, hs: int = HS) -> Kernel:
    kwargs = dict(kwargs or {})
    if name == "fska":
        kwargs = {**FSKA_KW, **kwargs}
    kernel = get_kernel(name, **kwargs)
    kernel.build(heads, hs)
    if name == "fska":  # a flow away from the identity
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in kernel.flow.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return kernel.eval()


def unit(*shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    return F.normalize(x + 0.8 * x[..., :1, :], dim=-1).to(dtype)  # correlated keys


def randn(*shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------------------- reference
def reference_weights(kernel: Kernel, cos: torch.Tensor, beta: torch.Tensor, q: torch.Tensor,
                      k: torch.Tensor, head: int) -> torch.Tensor:
    """Weights of one query over its visible entries (1-D cosines, at least one entry)."""
    name, z = kernel.name, beta * cos
    if name == "gaussian":
        return torch.softmax(z, dim=0)
    if name in ("epanechnikov", "biweight", "triweight", "entmax"):
        if kernel.alpha == 2.0:
            return entmax_pkg.sparsemax(z, dim=0)
        if kernel.alpha == 1.5:
            return entmax_pkg.entmax15(z, dim=0)
        return entmax_pkg.entmax_bisect(z, alpha=kernel.alpha, dim=0, n_iter=200)
    if name in ("gaussian_knn", "uniform_knn"):
        top = torch.argsort(z.detach(), descending=True)[:kernel.k]
        w = torch.zeros_like(z)
        if name == "gaussian_knn":
            return w.index_put((top,), torch.softmax(z[top], dim=0))
        return w.index_put((top,), torch.full_like(z[top], 1.0 / len(top)))
    if name == "epanechnikov_fixed":
        u = torch.relu(1.0 - beta * (1.0 - cos)) ** kernel.r
    elif name == "relumax":
        u = torch.relu(kernel.b + z - z.max()) ** kernel.r
    elif name == "fska":  # g(q) . g(k_j) with frequencies sqrt(beta) u
        u = kernel.unit_frequencies().double()[head] * beta.sqrt()
        w1, w2 = u[None, :, :HS], u[None, :, HS:]  # (1 head, M, hs)
        fq = angle_features(*projections(q.view(1, 1, 1, -1), w1, w2), kernel.positive)
        fk = angle_features(*projections(k.view(1, 1, -1, HS), w1, w2), kernel.positive)
        if kernel.positive == "exp":
            return torch.softmax(torch.logsumexp(fq[0, 0] + fk[0, 0], dim=-1), dim=0)
        u = (fk[0, 0] @ fq[0, 0, 0])
        return u / (u.sum() + kernel.eps)
    else:
        raise KeyError(name)
    total = u.sum()
    return u / total if total > 0 else u


def reference_attend(kernel, queries, keys, values, beta, lo, hi):
    """y[b, h, i] = sum over lo <= j <= hi of w_ij v_j, one (b, h, i) at a time (float64)."""
    n, S = queries.shape[2], keys.shape[2]
    bq = beta.view(1, H, 1).expand(1, H, n) if beta.dim() == 1 else beta
    rows = []
    for b in range(queries.shape[0]):
        for h in range(H):
            for i in range(n):
                first = max(int(lo[b if lo.shape[0] > 1 else 0, i]), 0)
                last = min(int(hi[b if hi.shape[0] > 1 else 0, i]), S - 1)
                if last < first:
                    rows.append(values.new_zeros(values.shape[-1]))
                    continue
                k, v, q = keys[b, h, first:last + 1], values[b, h, first:last + 1], queries[b, h, i]
                w = reference_weights(kernel, k @ q, bq[b if bq.shape[0] > 1 else 0, h, i], q, k,
                                      h)
                rows.append(w @ v)
    return torch.stack(rows).view(queries.shape[0], H, n, values.shape[-1])


# ----------------------------------------------------------------------------- cases
def positions(n: int) -> torch.Tensor:
    return torch.arange(n).view(1, n)


def documents(n: int, starts_per_row: list[list[int]]) -> torch.Tensor:
    """lo[b, i] = the first position of the document of i in batch row b."""
    lo = torch.zeros(len(starts_per_row), n, dtype=torch.long)
    for b, starts in enumerate(starts_per_row):
        for s in starts:
            lo[b, s:] = s
    return lo


def make_case(case: str, dtype=torch.float64, seed: int = 0):
    """(queries, keys, values, beta, lo, hi) of a named interval pattern."""
    T = 13
    keys = unit(B, H, T, HS, seed=seed, dtype=dtype)
    values = randn(B, H, T, HS, seed=seed + 1, dtype=dtype)
    beta = torch.tensor([3.0, 12.0], dtype=dtype)
    queries, i = keys, positions(T)
    if case == "strict_past":
        lo, hi = torch.zeros_like(i), i - 1
    elif case == "window":
        lo, hi = i - 4 + 1, i - 1
    elif case == "gap":
        lo, hi = torch.zeros_like(i), i - 3
    elif case == "documents":  # per batch row; per-query bandwidth
        lo, hi = documents(T, [[0, 4, 9], [0, 6, 7]]), (i - 1).expand(B, T)
        beta = 2.0 + 10.0 * torch.rand(B, H, T, generator=torch.Generator().manual_seed(3),
                                       dtype=torch.float64).to(dtype)
    elif case == "per_query_beta":  # one bandwidth per query shared by the batch, window
        lo, hi = i - 6, i - 1
        beta = (1.0 + i.to(dtype).view(1, 1, T)) ** 0.7 * beta.view(1, H, 1)
    elif case == "empty_rows":  # out-of-order intervals, some empty, bounds outside 0..T-1
        g = torch.Generator().manual_seed(5)
        lo = torch.randint(-3, T, (B, T), generator=g)
        hi = lo + torch.randint(-3, 6, (B, T), generator=g)
        hi[:, -1] = T + 4
    elif case == "decode":  # n = 5 new queries against S = 13 stored entries
        queries = unit(B, H, 5, HS, seed=seed + 7, dtype=dtype)
        lo = torch.tensor([[0, 3, 9, 12, 8]])
        hi = torch.tensor([[12, 7, 8, 12, 12]])
        beta = 1.0 + 10.0 * torch.rand(1, H, 5, generator=torch.Generator().manual_seed(4),
                                       dtype=torch.float64).to(dtype)
    elif case == "memory_and_new":  # decoding: query i sees the 9 stored entries and i new ones
        queries = unit(B, H, 5, HS, seed=seed + 8, dtype=dtype)
        lo, hi = torch.full((1, 5), -2), 8 + positions(5)
    elif case == "more_queries_than_entries":  # n = 13 > S = 5, a gap of 2: last rows see all
        keys, values = keys[:, :, :5], values[:, :, :5]
        queries = unit(B, H, T, HS, seed=seed + 9, dtype=dtype)
        lo, hi = torch.full((1, T), -1), i - 2
    else:
        raise KeyError(case)
    return queries, keys, values, beta, lo, hi


CASES = ["strict_past", "window", "gap", "documents", "per_query_beta", "empty_rows", "decode",
         "memory_and_new", "more_queries_than_entries"]


def tolerance(name: str) -> dict:
    return dict(atol=2e-5, rtol=1e-4) if name == "fska" else dict(atol=1e-9, rtol=1e-7)


def grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 9) -> list[torch.Tensor]:
    weight = randn(*out.shape, seed=seed, dtype=out.dtype)
    found = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(found, inputs)]


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name,kwargs", KERNELS, ids=IDS)
def test_attend_matches_the_per_row_reference(name, kwargs, case):
    kernel = make_kernel(name, kwargs)
    q, k, v, beta, lo, hi = make_case(case)
    self_queries = q is k
    k, v, beta = (x.clone().requires_grad_() for x in (k, v, beta))
    q = k if self_queries else q.clone().requires_grad_()
    inputs = [k, v, beta] if self_queries else [q, k, v, beta]
    got = kernel.attend(q, k, v, beta, lo, hi)
    want = reference_attend(kernel, q, k, v, beta, lo, hi)
    assert got.shape == want.shape and got.dtype == v.dtype
    torch.testing.assert_close(got, want, **tolerance(name))
    for ours, ref in zip(grads(got, inputs), grads(want, inputs)):
        torch.testing.assert_close(ours, ref, **tolerance(name))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name,kwargs", KERNELS, ids=IDS)
def test_strict_past_equals_forward(name, kwargs, dtype):
    kernel = make_kernel(name, kwargs)
    keys = unit(B, H, 37, HS, seed=11, dtype=dtype)
    values = randn(B, H, 37, HS, seed=12, dtype=dtype)
    beta = torch.tensor([2.0, 20.0], dtype=dtype)
    i = positions(37)
    if name != "fska":
        kernel.chunk_elements = 4 * 8 * 37  # several chunks
    got = kernel.attend(keys, keys, values, beta, torch.zeros_like(i), i - 1)
    want = kernel(keys, values, beta)
    assert got.dtype == dtype
    atol = 1e-12 if dtype == torch.float64 and name != "fska" else 2e-6
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
    per_query = beta.view(1, H, 1).expand(B, H, 37)  # the interval path, not the causal one
    got = kernel.attend(keys, keys, values, per_query, torch.zeros_like(i), i - 1)
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
    if name != "fska":  # whole rows, gradients included
        ks, vs, bs = (x.clone().requires_grad_() for x in (keys, values, beta))
        ours = grads(kernel.attend(ks, ks, vs, bs, torch.zeros_like(i), i - 1), [ks, vs, bs])
        ref = grads(kernel(ks, vs, bs), [ks, vs, bs])
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, atol=100 * atol, rtol=1e-4)


@pytest.mark.parametrize("name,kwargs", KERNELS, ids=IDS)
def test_bandwidth_per_query_equal_to_per_head_gives_the_same(name, kwargs):
    kernel = make_kernel(name, kwargs)
    q, k, v, beta, lo, hi = make_case("window")
    per_head = beta.clone().requires_grad_()
    per_query = beta.view(1, H, 1).expand(B, H, q.shape[2]).clone().requires_grad_()
    y1 = kernel.attend(q, k, v, per_head, lo, hi)
    y2 = kernel.attend(q, k, v, per_query, lo, hi)
    torch.testing.assert_close(y1, y2, **tolerance(name))
    (g1,), (g2,) = grads(y1, [per_head]), grads(y2, [per_query])
    torch.testing.assert_close(g1, g2.sum(dim=(0, 2)), **tolerance(name))


@pytest.mark.parametrize("name,kwargs", KERNELS, ids=IDS)
def test_default_attend_agrees(name, kwargs):
    """The generic fallback (one forward per query row) and the kernel's own attend."""
    kernel = make_kernel(name, kwargs)
    q, k, v, beta, lo, hi = make_case("documents")
    torch.testing.assert_close(kernel.attend(q, k, v, beta, lo, hi),
                               Kernel.attend(kernel, q, k, v, beta, lo, hi), **tolerance(name))


@pytest.mark.parametrize("name", ["gaussian_knn", "uniform_knn"])
def test_knn_with_fewer_visible_entries_than_k(name):
    kernel = make_kernel(name, {"k": 5})
    q, k, v, beta, _, _ = make_case("window")
    i = positions(q.shape[2])
    lo, hi = i - 2, i - 1  # at most 2 visible entries, k = 5
    got = kernel.attend(q, k, v, beta, lo, hi)
    torch.testing.assert_close(got, reference_attend(kernel, q, k, v, beta, lo, hi))
    if name == "uniform_knn":  # 1 / min(k, visible count): the mean of the visible values
        torch.testing.assert_close(got[:, :, 3], v[:, :, 1:3].mean(dim=2))
    assert torch.equal(got[:, :, 0], torch.zeros_like(got[:, :, 0]))


@pytest.mark.parametrize("name", ["gaussian", "epanechnikov", "biweight", "relumax",
                                  "epanechnikov_fixed", "gaussian_knn"])
def test_gradcheck(name):
    kernel = make_kernel(name, {"k": 3} if name == "gaussian_knn" else {})
    T = 6
    q = unit(2, H, T, 3, seed=21).requires_grad_()
    k = unit(2, H, T, 3, seed=22).requires_grad_()
    v = randn(2, H, T, 2, seed=23).requires_grad_()
    g = torch.Generator().manual_seed(24)
    beta = (2.0 + 6.0 * torch.rand(2, H, T, generator=g, dtype=torch.float64)).requires_grad_()
    i = positions(T)
    lo, hi = documents(T, [[0, 3], [0, 2]]), (i - 1).expand(2, T)
    if name == "epanechnikov_fixed":
        beta = (0.5 + torch.rand(2, H, T, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda *x: kernel.attend(*x, lo, hi), (q, k, v, beta),
                                    atol=1e-6)
    window = torch.autograd.gradcheck(
        lambda *x: kernel.attend(*x, (i - 2), i), (q, k, v, beta[:1].detach().requires_grad_()),
        atol=1e-6)
    assert window


def test_empty_memory_and_rows_that_see_nothing_output_zero():
    q = unit(1, H, 4, HS, seed=30).requires_grad_()
    empty = q.new_zeros(1, H, 0, HS).requires_grad_()
    none = torch.full((1, 4), -1)
    for name in available_kernels():
        kernel = make_kernel(name)
        y = kernel.attend(q, empty, empty, torch.tensor([1.0, 2.0], dtype=q.dtype),
                          torch.zeros_like(none), none)
        assert torch.equal(y, torch.zeros_like(y)), name
        k, v = unit(1, H, 5, HS, seed=31), randn(1, H, 5, HS, seed=32)
        y = kernel.attend(q, k, v, torch.tensor([1.0, 2.0], dtype=q.dtype),
                          torch.tensor([[3, 0, 0, 0]]), torch.tensor([[1, 4, -1, 2]]))
        assert torch.equal(y[:, :, [0, 2]], torch.zeros_like(y[:, :, [0, 2]])), name
        (dq,) = torch.autograd.grad(y.sum(), q)
        assert torch.isfinite(dq).all() and torch.equal(dq[:, :, 0], torch.zeros_like(dq[:, :, 0]))


@pytest.mark.parametrize("name", [n for n in available_kernels() if n != "fska"])
def test_low_precision_and_autocast(name):
    """Weights in fp32 under autocast (sparse kernels) and output in the values' dtype."""
    kernel = make_kernel(name)
    q, k, v, beta, lo, hi = make_case("documents", dtype=torch.float32)
    want = kernel.attend(q, k, v, beta, lo, hi)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = kernel.attend(q, k, v, beta, lo, hi)
    assert got.dtype == torch.float32
    tol = 2e-2 if name == "gaussian" else 1e-6  # gaussian: the fused attention in bf16
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    k16, v16 = k.bfloat16().requires_grad_(), v.bfloat16().requires_grad_()
    y = kernel.attend(k16, k16, v16, torch.tensor([math.exp(10.0), 7.39]), lo, hi)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    y.float().sum().backward()
    assert torch.isfinite(k16.grad.float()).all() and torch.isfinite(v16.grad.float()).all()


TILED_KERNELS = [("epanechnikov", {}), ("biweight", {}), ("entmax", {"r": 0.5}),
                 ("relumax", {"r": 2.0, "b": 0.5}), ("relumax", {}), ("epanechnikov_fixed", {}),
                 ("gaussian_knn", {"k": 3}), ("uniform_knn", {"k": 5})]


@pytest.mark.parametrize("pattern", ["window_documents", "gap_per_query"])
@pytest.mark.parametrize("name,kwargs", TILED_KERNELS,
                         ids=[f"{n}-{len(kw)}" for n, kw in TILED_KERNELS])
def test_fused_tiles_over_many_chunks_match_the_reference(name, kwargs, pattern):
    """The fused tiles of the power and kNN kernels over many row tiles whose columns start off the
    16-column blocks (intervals), and over the strict past with a gap (a bandwidth per
    query): outputs and all gradients equal the per-row reference."""
    kernel = make_kernel(name, kwargs)
    kernel.chunk_elements = 4 * 40  # a few rows per tile
    T = 75
    keys = unit(B, H, T, HS, seed=50)
    values = randn(B, H, T, HS, seed=51)
    g = torch.Generator().manual_seed(52)
    beta = 2.0 + 8.0 * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    if name == "epanechnikov_fixed":
        beta = 0.5 + torch.rand(B, H, T, generator=g, dtype=torch.float64)
    i = positions(T)
    if pattern == "window_documents":
        lo = torch.maximum(documents(T, [[0, 23, 50], [0, 9]]), i - 21)
        hi = (i - 1).expand(B, T)
    else:
        lo, hi = torch.zeros_like(i), i - 5
    plan = attend_plan(lo, hi, T, B * H, kernel.chunk_elements, max_rows=96)
    assert len(plan) > 4
    assert pattern != "window_documents" or any(c0 % 16 for _, _, c0, _ in plan)
    k, v, bq = (x.clone().requires_grad_() for x in (keys, values, beta))
    got = kernel.attend(k, k, v, bq, lo, hi)
    want = reference_attend(kernel, k, k, v, bq, lo, hi)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-7)
    for ours, ref in zip(grads(got, [k, v, bq]), grads(want, [k, v, bq])):
        torch.testing.assert_close(ours, ref, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("name,kwargs", [k for k in KERNELS if k[0] != "fska"],
                         ids=[i for k, i in zip(KERNELS, IDS) if k[0] != "fska"])
def test_one_decoding_query_over_a_shared_interval(name, kwargs):
    """Decoding (one query, no gradients, the same interval in every batch row): the slice
    path equals the per-row reference, with a bandwidth per head and per query, and outputs
    0 for an interval that sees nothing."""
    kernel = make_kernel(name, kwargs)
    keys, values = unit(B, H, 40, HS, seed=60), randn(B, H, 40, HS, seed=61)
    query = unit(B, H, 1, HS, seed=62)
    for beta in (torch.tensor([3.0, 12.0], dtype=torch.float64),
                 torch.tensor([[[2.5], [7.0]]], dtype=torch.float64)):
        for lo, hi in ((-3, 39), (10, 25), (30, 45), (20, 19)):
            bounds = torch.tensor([[lo]]), torch.tensor([[hi]])
            with torch.no_grad():
                got = kernel.attend(query, keys, values, beta, *bounds)
            want = reference_attend(kernel, query, keys, values, beta, *bounds)
            torch.testing.assert_close(got, want, **tolerance(name))


def test_causal_offset_recognizes_the_strict_past_and_gaps():
    i = positions(6)
    assert causal_offset(torch.zeros_like(i), i - 1) == -1
    assert causal_offset(torch.full((2, 6), -4), (i + 3).expand(2, 6)) == 3
    assert causal_offset(i - 3, i - 1) is None  # a window
    hi = (i - 1).repeat(2, 1)
    hi[1, 4] = 2
    assert causal_offset(torch.zeros_like(i), hi) is None


def test_window_chunks_see_only_their_columns():
    """A window of h entries: every chunk spans at most h + rows - 1 memory columns."""
    T, h = 4096, 256
    i = positions(T)
    plan = attend_plan(i - h + 1, i - 1, T, 8, 2**18)
    rows = plan[1][1] - plan[1][0]
    assert plan[0][:3] == (0, rows, 0)
    assert all(c1 - c0 <= h + (b - a) - 1 for a, b, c0, c1 in plan)
    assert sum(b - a for a, b, _, _ in plan) == T - 1 or sum(b - a for a, b, *_ in plan) == T
    assert 8 * rows * (h + rows) <= 2**18


@pytest.mark.parametrize("pattern", ["window", "gap", "documents"])
@pytest.mark.parametrize("name", ["gaussian", "epanechnikov", "gaussian_knn",
                                  "epanechnikov_fixed", "fska"])
def test_backward_saves_no_quadratic_tensor(name, pattern):
    """Saved for backward: O(T) numbers, for a short window and for a gap (most of the past)."""
    T, h = 1024, 32
    kernel = make_kernel(name)
    kernel.chunk_elements = 2**14
    keys = unit(1, H, T, HS, seed=40, dtype=torch.float32).requires_grad_()
    values = randn(1, H, T, HS, seed=41, dtype=torch.float32).requires_grad_()
    beta = torch.tensor([3.0, 9.0], requires_grad=True)
    i = positions(T)
    saved: dict[int, int] = {}  # storage -> bytes (chunks save views of the same tensors)

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lo, hi = {"window": (i - h + 1, i - 1), "gap": (torch.zeros_like(i), i - h),
                  "documents": (documents(T, [[0, 300, 700]]), i - 1)}[pattern]
        out = kernel.attend(keys, keys, values, beta, lo, hi)
    assert sum(saved.values()) < T * T, (name, sum(saved.values()))  # < T^2 / 4 fp32 numbers
    out.sum().backward()


@pytest.mark.parametrize("case", CASES)
def test_fska_linear_intervals_match_the_per_row_reference(case):
    """FSKA's linear-time interval path (chunk prefix states plus the partial chunks at both
    ends), chunks of 3 entries, one bandwidth per head, every interval pattern."""
    kernel = make_kernel("fska", {"chunk_size": 3})
    kernel.linear_intervals = True
    q, k, v, beta, lo, hi = make_case(case)
    beta = torch.tensor([3.0, 12.0], dtype=v.dtype)  # per head: the linear path's case
    self_queries = q is k
    k, v, beta = (x.clone().requires_grad_() for x in (k, v, beta))
    q = k if self_queries else q.clone().requires_grad_()
    inputs = [k, v, beta] if self_queries else [q, k, v, beta]
    got = kernel.attend(q, k, v, beta, lo, hi)
    want = reference_attend(kernel, q, k, v, beta, lo, hi)
    torch.testing.assert_close(got, want, **tolerance("fska"))
    if got.requires_grad:
        for ours, ref in zip(grads(got, inputs), grads(want, inputs)):
            torch.testing.assert_close(ours, ref, **tolerance("fska"))


@pytest.mark.parametrize("pattern", ["window_documents", "shared_gap", "mixed_rows", "random"])
def test_fska_linear_intervals_equal_the_dense_chunks(pattern):
    """Many chunks (C 8, S 157 not a multiple of it), fp32: the linear path against the dense
    per-chunk one, outputs and the gradients of queries, keys, values, beta and the flow."""
    kernel = make_kernel("fska", {"chunk_size": 8})
    T, n = 157, 150
    keys = unit(B, H, T, HS, seed=21, dtype=torch.float32)
    values = randn(B, H, T, HS, seed=22, dtype=torch.float32)
    queries = unit(B, H, n, HS, seed=23, dtype=torch.float32)
    i = positions(n) + 7
    g = torch.Generator().manual_seed(6)
    if pattern == "window_documents":
        lo = torch.maximum(documents(n, [[0, 40, 41, 97], [0, 64, 130]]), i - 37)
        hi = (i - 1).expand(B, n)
    elif pattern == "shared_gap":
        lo, hi = torch.zeros_like(i), i - 9
    elif pattern == "mixed_rows":  # lo shared by the batch, hi per batch row
        lo, hi = torch.zeros_like(i), torch.cat([i - 9, i - 30])
    else:
        a, b = torch.randint(-4, T + 4, (B, n), generator=g), torch.randint(-4, T + 4, (B, n),
                                                                             generator=g)
        lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    beta = torch.tensor([2.5, 9.0])
    results = []
    for linear in (True, False):
        kernel.linear_intervals = linear
        kernel.zero_grad()
        q, k, v, bt = (x.clone().requires_grad_() for x in (queries, keys, values, beta))
        y = kernel.attend(q, k, v, bt, lo, hi)
        flow = [p for p in kernel.flow.parameters()]
        results.append([y, *grads(y, [q, k, v, bt, *flow])])
    for ours, ref in zip(*results):
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


def test_fska_takes_the_linear_path_where_it_computes_less():
    kernel = make_kernel("fska", {"num_features": 96}, hs=64)
    T = 1024
    i = positions(T)
    for lo, hi, S, linear in [(torch.zeros_like(i), i - 64, T, True),  # the long-term memory
                              (torch.tensor([[0]]), torch.tensor([[T - 1]]), T, False)]:  # decode
        plan = attend_plan(lo, hi, S, B * H, kernel.chunk_elements)
        with torch.enable_grad():
            assert kernel._linear_pays(plan, lo.shape[1], S, 64) is linear


def test_fska_trains_with_fresh_frequencies_and_per_query_bandwidth():
    kernel = make_kernel("fska").train()
    q, k, v, beta, lo, hi = make_case("documents", dtype=torch.float32)
    y = kernel.attend(q, k, v, beta, lo, hi)
    assert kernel.regularization() is not None
    y.sum().backward()
    assert all(p.grad is not None for p in kernel.flow.parameters())


def test_bad_arguments_fail_clearly():
    kernel = make_kernel("epanechnikov")
    q, k, v, beta, lo, hi = make_case("window")
    with pytest.raises(ValueError, match="beta must have shape"):
        kernel.attend(q, k, v, beta.view(1, H), lo, hi)
    with pytest.raises(ValueError, match="lo must be an integer tensor"):
        kernel.attend(q, k, v, beta, lo.double(), hi)
    with pytest.raises(ValueError, match="hi must be an integer tensor"):
        kernel.attend(q, k, v, beta, lo, hi[:, :-1])
    with pytest.raises(ValueError, match="keys"):
        kernel.attend(q, k[:, :1], v, beta, lo, hi)
