"""Gated leaky averages (v2): the chunked scan against the explicit recursion, gradients,
and continuing a prefix's state."""

from __future__ import annotations

import pytest
import torch

from mosaics.ops import leaky_average, leaky_average_reference


def gated_leaky_average(x, gain, a, chunk=16, initial=None, documents=None):
    return leaky_average(x, a, gain=gain, chunk=chunk, initial=initial, documents=documents)


def gated_leaky_reference(x, gain, a, initial=None, documents=None):
    return leaky_average_reference(x, a, gain=gain, initial=initial, documents=documents)


def gated_leaky_step(x, gain, a, state):
    """One decoding step through the op's step form: (B, H, D) x, (B, H) gain and a."""
    return leaky_average(x[:, :, None], a[:, :, None], gain=gain[:, :, None],
                         initial=state.clone())[1]


def _inputs(B=2, H=3, T=37, D=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    gain = torch.exp(0.5 * torch.randn(B, H, T, generator=g, dtype=dtype))
    log_decay = torch.rand(B, H, T, generator=g, dtype=dtype) * 2.0
    return x, gain, log_decay


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_chunked_scan_matches_the_loop(chunk):
    x, gain, a = _inputs()
    out, last = gated_leaky_average(x, gain, a, chunk=chunk)
    ref = gated_leaky_reference(x, gain, a)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, ref[:, :, -1], rtol=1e-10, atol=1e-10)


def test_strong_and_zero_decays_stay_finite_and_exact():
    x, gain, a = _inputs(T=40)
    a[:, :, ::3] = 60.0  # lambda ~ 1e-26: the past is forgotten
    a[:, :, 1::3] = 0.0  # lambda = 1: a plain running sum
    out, _ = gated_leaky_average(x, gain, a, chunk=8)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, gated_leaky_reference(x, gain, a), rtol=1e-10, atol=1e-10)


def test_gradients_match_the_loop():
    x, gain, a = _inputs(T=19)
    w = torch.randn_like(x)
    grads = []
    for fn in (lambda *t: gated_leaky_average(*t, chunk=4)[0], gated_leaky_reference):
        leaves = [t.clone().requires_grad_() for t in (x, gain, a)]
        (fn(*leaves) * w).sum().backward()
        grads.append([t.grad for t in leaves])
    for fast, slow in zip(*grads):
        torch.testing.assert_close(fast, slow, rtol=1e-9, atol=1e-9)
    leaves = [t[:1, :1, :7, :2].clone().requires_grad_() if t.dim() == 4
              else t[:1, :1, :7].clone().requires_grad_() for t in (x, gain, a)]
    assert torch.autograd.gradcheck(lambda *t: gated_leaky_average(*t, chunk=3)[0], leaves)


def test_a_prefix_state_continues_the_sequence():
    x, gain, a = _inputs(T=30)
    full, _ = gated_leaky_average(x, gain, a, chunk=8)
    head, state = gated_leaky_average(x[:, :, :13], gain[:, :, :13], a[:, :, :13], chunk=8)
    tail, _ = gated_leaky_average(x[:, :, 13:], gain[:, :, 13:], a[:, :, 13:], chunk=8,
                                  initial=state)
    torch.testing.assert_close(torch.cat([head, tail], dim=2), full, rtol=1e-10, atol=1e-10)
    step = gated_leaky_step(x[:, :, 13], gain[:, :, 13], a[:, :, 13], state)
    torch.testing.assert_close(step, full[:, :, 13], rtol=1e-10, atol=1e-10)


def test_float32_stays_close_to_float64():
    x, gain, a = _inputs(T=200)
    out32, _ = gated_leaky_average(x.float(), gain.float(), a.float(), chunk=16)
    ref = gated_leaky_reference(x, gain, a)
    torch.testing.assert_close(out32.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 5, 8, 64])
def test_documents_restart_the_average(chunk):
    x, gain, a = _inputs(T=41)
    starts = torch.zeros(2, 41, dtype=torch.long)
    starts[0, [7, 8, 16, 33]] = 1  # 16: a document starting exactly at a chunk start (C 8)
    starts[1, [24]] = 1
    docs = starts.cumsum(1)
    out, last = gated_leaky_average(x, gain, a, chunk=chunk, documents=docs)
    ref = gated_leaky_reference(x, gain, a, documents=docs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, ref[:, :, -1], rtol=1e-10, atol=1e-10)
    # the document from position 33 on sees only itself
    alone, _ = gated_leaky_average(x[:1, :, 33:], gain[:1, :, 33:], a[:1, :, 33:], chunk=chunk)
    torch.testing.assert_close(out[:1, :, 33:], alone, rtol=1e-10, atol=1e-10)
    # a prefix state is dropped when the continuation starts a new document
    init = torch.randn_like(x[:, :, 0])
    got, _ = gated_leaky_average(x, gain, a, chunk=chunk, initial=init, documents=docs)
    want = gated_leaky_reference(x, gain, a, initial=init, documents=docs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
