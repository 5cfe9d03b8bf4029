"""Blocked CPU causal attention against PyTorch's fused causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.kernels import get_kernel
from mosaics.ops import causal as ca


def _inputs(T: int, dtype=torch.float64, B: int = 2, H: int = 3, hs: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, hs, generator=g, dtype=dtype).requires_grad_()
               for _ in range(3))
    return q, k, v, torch.randn(B, H, T, hs, generator=g, dtype=dtype)


def _fwd_bwd(fn, q, k, v, grad):
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out.detach(), dq, dk, dv


@pytest.mark.parametrize("T,block", [(12, 4), (13, 4), (30, 7), (9, 3)])
def test_blocked_matches_fused_causal(T, block):
    q, k, v, grad = _inputs(T)
    ref = _fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True,
                                                                  scale=0.7), q, k, v, grad)
    got = _fwd_bwd(lambda a, b, c: ca._BlockedCausal.apply(a, b, c, 0.7, block), q, k, v, grad)
    for name, r, x in zip(("out", "dq", "dk", "dv"), ref, got):
        torch.testing.assert_close(x, r, rtol=1e-10, atol=1e-10, msg=name)


def test_blocked_gradcheck():
    q, k, v, _ = _inputs(10, B=1, H=2, hs=3, seed=1)
    assert torch.autograd.gradcheck(lambda a, b, c: ca._BlockedCausal.apply(a, b, c, 1.3, 3),
                                    (q, k, v))


def test_blocked_on_strided_views_like_the_gaussian_kernel():
    """Shifted slices of one tensor (queries 1..T-1, memory 0..T-2) and a transposed layout."""
    x = torch.randn(2, 20, 3, 8, dtype=torch.float64).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 3, 20, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 3, 19, 8, dtype=torch.float64)

    def run(fn):
        out = fn(x[:, :, 1:] * 2.0, x[:, :, :-1], v[:, :, :-1])
        return (out.detach(), *torch.autograd.grad(out, (x, v), grad))

    ref = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=1.0))
    got = run(lambda a, b, c: ca._BlockedCausal.apply(a, b, c, 1.0, 5))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_dispatch(monkeypatch):
    assert ca.blocked_attention_available()  # the private CPU ops pass their self-check here
    calls = []
    real = ca._BlockedCausal.apply
    monkeypatch.setattr(ca._BlockedCausal, "apply",
                        lambda *a: calls.append(a[-1]) or real(*a))
    q, k, v, _ = _inputs(30)
    ca.causal_attention(q, k, v, 1.0, block=8)  # 4 blocks of 8 (the last one 6)
    assert calls == [8]
    ca.causal_attention(q, k, v, 1.0, block=6)  # 5 even blocks of 6
    assert calls == [8, 6]
    ca.causal_attention(q, k, v, 1.0, block=14)  # at least 4 blocks: of 8 >= 14 / 2
    assert calls == [8, 6, 8]
    ca.causal_attention(q, k, v, 1.0, block=17)  # blocks of 8 < 17 / 2: one fused call
    ca.causal_attention(q, k, v, 1.0, block=0)
    ca.causal_attention(q, k, v, 1.0, block=8, max_len=30)
    ca.causal_attention(q, k, v, 1.0, block=8, dropout_p=0.1)
    assert calls == [8, 6, 8]
    # where they would not, one fused call
    monkeypatch.setattr(ca, "blocked_attention_available", lambda: False)
    ca.causal_attention(q, k, v, 1.0, block=8)
    assert calls == [8, 6, 8]


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_self_check_passes_when_first_called_without_grad(context):
    """Generation may be the first caller; the cached check must not record a failure."""
    ca.blocked_attention_available.cache_clear()
    try:
        with context():
            assert ca.blocked_attention_available()
            q, k, v, _ = _inputs(30)
            out = ca.causal_attention(q.detach(), k.detach(), v.detach(), 1.0, block=8)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        torch.testing.assert_close(out, ref.detach(), rtol=1e-10, atol=1e-10)
    finally:
        ca.blocked_attention_available.cache_clear()


def test_autocast_bf16_runs_in_bf16_like_sdpa():
    q, k, v, _ = _inputs(40, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ca.causal_attention(q, k, v, 0.5, block=8)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    assert out.dtype == ref.dtype == torch.bfloat16
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(out.float(), exact, rtol=0.0, atol=3e-2)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32 and q.grad.isfinite().all()


def test_gaussian_kernel_blocked_equals_single_call():
    g = torch.Generator().manual_seed(3)
    B, H, T, hs = 2, 2, 400, 16
    keys = F.normalize(torch.randn(B, H, T, hs, generator=g), dim=-1).requires_grad_()
    values = torch.randn(B, H, T, hs, generator=g, requires_grad=True)
    beta = torch.tensor([3.0, 9.0])
    grad = torch.randn(B, H, T, hs, generator=g)
    outs = []
    for block in (128, 0):
        y = get_kernel("gaussian", causal_block=block)(keys, values, beta)
        outs.append((y.detach(), *torch.autograd.grad(y, (keys, values), grad)))
    for blocked, single in zip(*outs):
        torch.testing.assert_close(blocked, single, rtol=1e-5, atol=1e-5)
    assert (outs[0][0][:, :, 0] == 0).all()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "128"])
def test_gaussian_rejects_bad_causal_block(bad):
    with pytest.raises(ValueError, match="causal_block must be an integer >= 0"):
        get_kernel("gaussian", causal_block=bad)


def test_model_training_step_blocked_matches_single_call_fp32_and_bf16():
    """Whole model, 5 query blocks: loss and gradients as with one fused call; bf16 autocast
    trains through the blocked path too."""
    torch.manual_seed(5)
    kw = dict(vocab_size=53, n_layer=2, n_head=2, n_embd=16, dropout=0.0, leaky_chunk_size=4)
    blocked = MosaicsForCausalLM(MosaicsConfig(**kw, kernel_kwargs={"causal_block": 4}))
    single = MosaicsForCausalLM(MosaicsConfig(**kw, kernel_kwargs={"causal_block": 0}))
    single.load_state_dict(blocked.state_dict())
    ids = torch.randint(0, 53, (3, 20))
    losses = []
    for model in (blocked, single):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(blocked.named_parameters(), single.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    blocked.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = blocked(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - losses[0].item()) < 0.05 * losses[0].item()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in blocked.parameters())


def _intervals(n: int, S: int, batch_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (batch_rows, n) bounds, some rows out of range or empty (hi < lo)."""
    g = torch.Generator().manual_seed(seed)
    lo = torch.randint(-3, S, (batch_rows, n), generator=g)
    return lo, lo + torch.randint(-3, 12, (batch_rows, n), generator=g)


@pytest.mark.parametrize("batch_rows,elements", [(1, 600), (2, 600), (2, 10**6)])
def test_interval_attention_matches_masked_sdpa(batch_rows, elements):
    from mosaics.ops.intervals import attend_plan, bounds_mask

    B, H, n, S, hs = 2, 3, 50, 40, 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, m, hs, generator=g, dtype=torch.float64).requires_grad_()
               for m in (n, S, S))
    lo, hi = _intervals(n, S, batch_rows, seed=batch_rows)
    plan = attend_plan(lo, hi, S, B * H, elements)
    got = _fwd_bwd(lambda a, b, c: ca.interval_attention(a, b, c, lo, hi, plan), q, k, v,
                   grad := torch.randn(B, H, n, hs, generator=g, dtype=torch.float64))

    def reference(a, b, c):  # one masked call over all columns; rows that see nothing -> 0
        mask = bounds_mask(lo, hi, S)
        sees = mask.any(-1, keepdim=True)
        y = F.scaled_dot_product_attention(a, b, c, attn_mask=mask | ~sees, scale=1.0)
        return torch.where(sees, y, 0.0)

    ref = _fwd_bwd(reference, q, k, v, grad)
    assert (ref[0].abs().sum(-1) == 0).any()  # the case has rows that see nothing
    for name, r, x in zip(("out", "dq", "dk", "dv"), ref, got):
        torch.testing.assert_close(x, r, rtol=1e-10, atol=1e-10, msg=name)


def test_interval_attention_gradcheck():
    from mosaics.ops.intervals import attend_plan

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, m, 3, generator=g, dtype=torch.float64).requires_grad_()
               for m in (9, 7, 7))
    lo, hi = _intervals(9, 7, 1, seed=5)
    plan = attend_plan(lo, hi, 7, 2, 20)
    assert len(plan) > 1
    assert torch.autograd.gradcheck(
        lambda a, b, c: ca.interval_attention(a, b, c, lo, hi, plan), (q, k, v))


def test_gaussian_attend_same_with_and_without_the_fused_interval_path(monkeypatch):
    """The v2 window path (per-chunk masked SDPA under autograd) and the one-Function path."""
    from mosaics.positions import visible_interval

    kernel = get_kernel("gaussian")
    g = torch.Generator().manual_seed(6)
    B, H, n, hs = 2, 2, 70, 4
    q, k, v = (torch.randn(B, H, n, hs, generator=g, dtype=torch.float64).requires_grad_()
               for _ in range(3))
    beta = torch.rand(B, H, n, generator=g, dtype=torch.float64) + 0.5
    lo, hi = visible_interval(n, None, 16, 1, q.device)  # a window of 16, the strict past
    grad = torch.randn(B, H, n, hs, generator=g, dtype=torch.float64)
    fused = _fwd_bwd(lambda a, b, c: kernel.attend(a, b, c, beta, lo, hi), q, k, v, grad)
    monkeypatch.setattr(ca, "blocked_attention_available", lambda: False)
    plain = _fwd_bwd(lambda a, b, c: kernel.attend(a, b, c, beta, lo, hi), q, k, v, grad)
    for r, x in zip(plain, fused):
        torch.testing.assert_close(x, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("bounds", [([[3]], [[9]]), ([[3], [0]], [[9], [4]]), ([[-2]], [[11]]),
                                    ([[5]], [[2]])])
def test_gaussian_attend_one_query_row_like_decoding(bounds):
    """One query row (decoding): one interval for the batch takes a slice, several the chunks;
    both equal the masked softmax, with a bandwidth per query."""
    from mosaics.kernels.gaussian import interval_softmax

    kernel = get_kernel("gaussian")
    g = torch.Generator().manual_seed(7)
    B, H, S, hs = 2, 3, 12, 4
    q = torch.randn(B, H, 1, hs, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, S, hs, generator=g, dtype=torch.float64) for _ in range(2))
    beta = torch.rand(B, H, 1, generator=g, dtype=torch.float64) + 0.5
    lo, hi = (torch.tensor(b) for b in bounds)
    with torch.no_grad():
        got = kernel.attend(q, k, v, beta, lo, hi)
    want = interval_softmax(q, k, v, beta.unsqueeze(-1), lo, hi)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
