"""The contextual memory's options against their formulas: adaptive bandwidth, visible
intervals, gated keys (explicit loop, v1 at init, decoding steps), SwiGLU."""

from __future__ import annotations

import math

import torch

from mosaics.memory import AdaptiveBandwidth, GatedKeys
from mosaics.ops import leaky_average, leaky_average_reference, unit_vectors
from mosaics.persistent_memory import SwiGLUMemory
from mosaics.positions import Positions, visible_interval


def visible_entries(T, offset=0, window=None, gap=1):
    """Entries each query sees, from :func:`visible_interval`."""
    lo, hi = visible_interval(T, Positions(start=offset), window, gap, torch.device("cpu"))
    return (hi - lo + 1).clamp(min=0)[0]


def gated_keys(keys, x, feats, state=None, chunk=4):
    """Unit keys and the last sum of the key features ``feats`` gated by ``keys``' rates."""
    gain, a = keys(x)
    kbar, last = leaky_average(feats, a, gain=gain, initial=state, chunk=chunk)
    return unit_vectors(kbar), last


def test_adaptive_bandwidth_formula_and_caps():
    bw = AdaptiveBandwidth(3)
    n = torch.tensor([0, 1, 8, 1000])
    beta = bw(n)
    assert beta.shape == (3, 4)
    expect = math.exp(1.5) * n.double() ** (1 / 3) + math.exp(1.5)
    torch.testing.assert_close(beta[0].double(), expect, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        bw.theta0.fill_(50.0)  # capped at e^10
        bw.theta1.fill_(-2.0)
        bw.theta2.copy_(torch.tensor([-0.5, 3.0, 0.0]))  # alpha = min(|theta2|, 1)
    beta = bw(n)
    b0, b1 = math.exp(10.0), math.exp(-2.0)
    for h, alpha in enumerate([0.5, 1.0, 0.0]):
        torch.testing.assert_close(beta[h].double(), b1 * n.double() ** alpha + b0, rtol=1e-6,
                                   atol=1e-3)
    assert bw(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 3, 5)


def test_visible_entries_counts_what_each_memory_sees():
    t = torch.arange(10)
    assert torch.equal(visible_entries(10), t)  # strict past
    assert torch.equal(visible_entries(10, window=4), t.clamp(max=3))  # last h-1 keys
    assert torch.equal(visible_entries(10, gap=3), (t - 2).clamp(min=0))  # keys up to p - m
    assert torch.equal(visible_entries(3, offset=7, window=4), torch.tensor([3, 3, 3]))
    for p in range(10):  # brute force over [p - window + 1, p - gap]
        allowed = [s for s in range(p) if p - 4 + 1 <= s <= p - 2]
        assert visible_entries(10, window=4, gap=2)[p] == len(allowed)


def _keys_inputs(B=2, T=21, d=12, H=3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, T, d, generator=g), torch.randn(B, H, T, d // H, generator=g)


def test_gated_keys_start_as_the_v1_average_and_follow_the_recursion():
    x, feats = _keys_inputs()
    keys = GatedKeys(12, 3)
    out, last = gated_keys(keys, x, feats)
    lam = torch.exp(-torch.linspace(0.5, 5.0, 3)).view(1, 3, 1, 1)
    kbar, ref = torch.zeros_like(feats[:, :, 0]), []
    for t in range(feats.shape[2]):
        kbar = feats[:, :, t] + lam[..., 0] * kbar
        ref.append(kbar)
    ref = torch.stack(ref, 2)
    torch.testing.assert_close(out, ref / ref.norm(dim=-1, keepdim=True), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(last, ref[:, :, -1], rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # input-dependent gates
        keys.gate.weight.normal_(0, 0.3)
        keys.decay.weight.normal_(0, 0.3)
    out, _ = gated_keys(keys, x, feats)
    gain, a = keys(x)
    loop = leaky_average_reference(feats.double(), a.double(), gain=gain.double())
    torch.testing.assert_close(out.double(), loop / loop.norm(dim=-1, keepdim=True),
                               rtol=1e-5, atol=1e-6)


def test_gated_keys_decode_step_by_step():
    x, feats = _keys_inputs()
    keys = GatedKeys(12, 3)
    with torch.no_grad():
        keys.gate.weight.normal_(0, 0.3)
        keys.decay.weight.normal_(0, 0.3)
    full, _ = gated_keys(keys, x, feats, chunk=8)
    out, state = gated_keys(keys, x[:, :9], feats[:, :, :9], chunk=8)
    steps = [out]
    for t in range(9, 21):
        y, state = gated_keys(keys, x[:, t:t + 1], feats[:, :, t:t + 1], state, chunk=8)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 2), full, rtol=1e-5, atol=1e-6)


def test_swiglu_formula():
    torch.manual_seed(0)
    mem = SwiGLUMemory(8, 24)
    x = torch.randn(2, 5, 8)
    w1, w2, w3 = mem.w1.weight, mem.w2.weight, mem.w3.weight
    h = x @ w1.T
    expect = ((h * torch.sigmoid(h)) * (x @ w3.T)) @ w2.T
    y, state = mem(x)
    torch.testing.assert_close(y, expect)
    assert state is None and mem(x, use_cache=True)[1] is None
    assert sum(p.numel() for p in mem.parameters()) == 3 * 8 * 24
