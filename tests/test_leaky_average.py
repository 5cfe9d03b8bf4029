"""The leaky average, kbar_t = g_t x_t + e^{-a_t} kbar_{t-1}, against the step-by-step
recursion (:func:`mosaics.ops.leaky_average_reference`), float64: per-head decays (both
forms of the chunked scan, the closed-form backward), per-step gains and decays, prefix
states, decoding steps, document restarts, extreme decays and float32."""

from __future__ import annotations

import pytest
import torch

from mosaics.ops import leaky_average, leaky_average_reference
from mosaics.ops.leaky import _chunked_scan

# --- per-head decays ------------------------------------------------------------------------


@pytest.mark.parametrize("sequential", [True, False])
@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (16, 4), (33, 8)])
@pytest.mark.parametrize("reverse", [False, True])
def test_chunked_scan_forms_match_the_recursion(sequential, T, chunk, reverse):
    """Both forms of the chunked scan (sequential inside chunks on CPU, decay-matrix products
    elsewhere), forwards and reversed."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(2, T, 3, 5, generator=g, dtype=torch.float64).transpose(1, 2)  # split heads
    a = torch.tensor([0.05, 0.7, 3.0], dtype=torch.float64)
    got = _chunked_scan(x, a, chunk, reverse=reverse, sequential=sequential)
    want = (leaky_average_reference(x.flip(2), a).flip(2) if reverse
            else leaky_average_reference(x, a))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("chunk", [1, 5, 16, 100])
def test_per_head_decays_equal_the_recursion(chunk):
    torch.manual_seed(2)
    x = torch.randn(2, 3, 37, 4, dtype=torch.float64)
    a = torch.tensor([0.01, 0.7, 4.0], dtype=torch.float64)
    init = torch.randn(2, 3, 4, dtype=torch.float64)
    for initial in (None, init):
        out, last = leaky_average(x, a, initial=initial, chunk=chunk)
        ref = leaky_average_reference(x, a, initial=initial)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(last, ref[:, :, -1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk,T", [(1, 9), (4, 12), (5, 13), (16, 9), (16, 23)])
def test_per_head_gradients_equal_the_recursion(chunk, T):
    """The closed-form backward (reverse scan, dL/dlambda) against autograd of the loop: for
    x, the decays and the prefix state; gradcheck; a strided input."""
    torch.manual_seed(4)
    x = torch.randn(2, 3, T, 4, dtype=torch.float64, requires_grad=True)
    a = torch.tensor([0.05, 0.7, 3.0], dtype=torch.float64, requires_grad=True)
    init = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, T, 4, dtype=torch.float64)
    for leaves, initial in (((x, a), None), ((x, a, init), init)):
        fast = torch.autograd.grad(leaky_average(x, a, initial=initial, chunk=chunk)[0], leaves, g)
        slow = torch.autograd.grad(leaky_average_reference(x, a, initial=initial), leaves, g)
        for f, s in zip(fast, slow, strict=True):
            torch.testing.assert_close(f, s, rtol=1e-8, atol=1e-8)
    assert torch.autograd.gradcheck(lambda x, a: leaky_average(x, a, chunk=chunk)[0], (x, a))
    # a strided view (a head split of a wider projection), as the memories pass it
    wide = torch.randn(2, T, 3, 8, dtype=torch.float64, requires_grad=True)
    view = wide[..., :4].transpose(1, 2)
    fast = torch.autograd.grad(leaky_average(view, a, chunk=chunk)[0], (wide, a), g)
    slow = torch.autograd.grad(leaky_average_reference(view, a), (wide, a), g)
    for f, s in zip(fast, slow, strict=True):
        torch.testing.assert_close(f, s, rtol=1e-8, atol=1e-8)


def test_decoding_step_writes_the_state_in_place():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 1, 5, generator=g, dtype=torch.float64)
    init = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    a = torch.rand(3, generator=g, dtype=torch.float64)
    want = leaky_average_reference(x, a, initial=init)
    state = init.clone()
    with torch.no_grad():
        out, last = leaky_average(x, a, initial=state)
    assert last.data_ptr() == state.data_ptr()
    torch.testing.assert_close(out, want)


# --- per-step gains and decays (gated) --------------------------------------------------------


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
def test_gated_chunked_scan_matches_the_loop(chunk):
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


def test_gated_gradients_match_the_loop():
    x, gain, a = _inputs(T=19)
    w = torch.randn_like(x)
    grads = []
    for fn in (lambda *t: gated_leaky_average(*t, chunk=4)[0], gated_leaky_reference):
        leaves = [t.clone().requires_grad_() for t in (x, gain, a)]
        (fn(*leaves) * w).sum().backward()
        grads.append([t.grad for t in leaves])
    for fast, slow in zip(*grads, strict=True):
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


# --- documents ------------------------------------------------------------------------------


def _documents(T=41):
    starts = torch.zeros(2, T, dtype=torch.long)
    starts[0, [7, 8, 16, 33]] = 1  # 16: a document starting exactly at a chunk start (C 8)
    starts[1, 24] = 2  # ids need only change, not count up by one
    return starts.cumsum(1)


@pytest.mark.parametrize("chunk", [1, 5, 8, 64])
def test_documents_restart_the_average(chunk):
    x, gain, a = _inputs(T=41)
    docs = _documents()
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


@pytest.mark.parametrize("chunk", [1, 5, 8, 64])
def test_gradients_across_documents_match_the_loop(chunk):
    """Gradients for x, gains, decays and the prefix state where documents restart the sum."""
    x, gain, a = _inputs(T=41, seed=1)
    init = torch.randn_like(x[:, :, 0])
    docs = _documents()
    w = torch.randn_like(x)
    grads = []
    for fn in (lambda *t, **kw: gated_leaky_average(*t, chunk=chunk, **kw)[0],
               gated_leaky_reference):
        leaves = [t.clone().requires_grad_() for t in (x, gain, a, init)]
        (fn(*leaves[:3], initial=leaves[3], documents=docs) * w).sum().backward()
        grads.append([t.grad for t in leaves])
    for fast, slow in zip(*grads, strict=True):
        torch.testing.assert_close(fast, slow, rtol=1e-9, atol=1e-9)
