"""FSKA kernel: flow, features, prior/KL, chunked linear attention, decoding, HF round-trip."""

import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from mosaics import MosaicsForCausalLM
from mosaics.kernels import get_kernel
from mosaics.kernels.fska import FSKAKernel
from mosaics.kernels.spectral_flow import (
    SpectralFlow,
    SpectralMixturePrior,
    cosine_features,
    elu1_features,
    exp_log_features,
    spectral_kl,
)
from mosaics.ops import feature_attention
from mosaics.ops.feature_attention import CosineFeatureAttention, chunked_causal_linear_attention
from mosaics.remote_code import flat_sources


def fska_config(tiny_config, **kernel_kwargs):
    kw = dict(num_features=16, flow_hidden=16, chunk_size=4)
    kw.update(kernel_kwargs)
    return tiny_config(kernel="fska", kernel_kwargs=kw)


def built_kernel(H=3, hs=5, **kw) -> FSKAKernel:
    kernel = get_kernel("fska", **kw)
    kernel.build(H, hs)
    return kernel


def perturb(flow: SpectralFlow, scale: float = 0.5, seed: int = 0) -> None:
    """Give the zero-initialised last layers random values (a non-trivial flow)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in flow.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def unit(x):
    return F.normalize(x, dim=-1)


# ---------------------------------------------------------------- flow


def test_flow_starts_as_identity():
    flow = SpectralFlow(n_head=2, head_size=3, layers=5, hidden=8)
    z = torch.randn(2, 7, 6)
    u, logdet = flow(z)
    assert torch.equal(u, z) and torch.equal(logdet, torch.zeros(2, 7))


def test_flow_inverse_and_logdet_match_autograd_jacobian():
    torch.manual_seed(0)
    H, hs = 2, 3
    flow = SpectralFlow(H, hs, layers=5, hidden=7).double()
    perturb(flow, 0.7)
    z = torch.randn(H, 4, 2 * hs, dtype=torch.float64)
    u, logdet = flow(z)
    assert not torch.allclose(u, z)
    z_back, logdet_inv = flow.inverse(u)
    torch.testing.assert_close(z_back, z, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(logdet_inv, -logdet, rtol=1e-8, atol=1e-8)
    for h in range(H):
        for n in range(z.shape[1]):
            def one(v, h=h, n=n):
                zz = z.clone()
                zz[h, n] = v
                return flow(zz)[0][h, n]
            jac = torch.autograd.functional.jacobian(one, z[h, n])
            sign, logabs = torch.linalg.slogdet(jac)
            assert sign > 0
            torch.testing.assert_close(logdet[h, n], logabs, rtol=1e-9, atol=1e-9)


def test_flow_heads_are_independent():
    """Each head has its own weights: changing head 1's parameters leaves head 0 alone."""
    flow = SpectralFlow(2, 3, layers=3, hidden=5)
    perturb(flow)
    z = torch.randn(2, 4, 6)
    before = flow(z)[0]
    with torch.no_grad():
        flow.w_out[:, 1].add_(1.0)
    after = flow(z)[0]
    assert torch.equal(after[0], before[0]) and not torch.allclose(after[1], before[1])


def test_log_scales_are_bounded():
    flow = SpectralFlow(1, 2, layers=1, hidden=3)
    with torch.no_grad():
        flow.w_out.fill_(1e3)
    _, logdet = flow(torch.randn(1, 5, 4))
    assert bool((logdet.abs() <= 2 * 2.0 + 1e-6).all())  # hs=2 dims, |s| < bound = 2


# ---------------------------------------------------------------- features


def test_cosine_features_match_bivariate_formula():
    torch.manual_seed(1)
    B, H, T, hs, M = 1, 2, 4, 5, 6
    x = torch.randn(B, H, T, hs, dtype=torch.float64)
    w1 = torch.randn(H, M, hs, dtype=torch.float64)
    w2 = torch.randn(H, M, hs, dtype=torch.float64)
    phi = cosine_features(x, w1, w2)
    got = phi @ phi.transpose(-1, -2)
    want = torch.zeros(B, H, T, T, dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            for j in range(T):
                xi, xj = x[0, h, i], x[0, h, j]
                total = 0.0
                for m in range(M):
                    a, b = w1[h, m], w2[h, m]
                    total += (torch.cos(a @ xi - a @ xj) + torch.cos(b @ xi - b @ xj)
                              + torch.cos(a @ xi - b @ xj) + torch.cos(b @ xi - a @ xj))
                want[0, h, i, j] = total / (4 * M)
    torch.testing.assert_close(got, want)
    assert bool((elu1_features(x, w1, w2) > 0).all())


def test_exp_features_match_formula():
    torch.manual_seed(2)
    H, hs, M = 2, 4, 5
    x = unit(torch.randn(1, H, 3, hs, dtype=torch.float64))
    w1 = torch.randn(H, M, hs, dtype=torch.float64)
    w2 = torch.randn(H, M, hs, dtype=torch.float64)
    g = torch.exp(exp_log_features(x, w1, w2))
    a1, a2 = x @ w1.transpose(-1, -2), x @ w2.transpose(-1, -2)  # (1, H, T, M)
    torch.testing.assert_close(g, (torch.exp(a1) + torch.exp(a2)) / math.sqrt(4 * M))
    # g(x).g(y) = (4M)^-1 sum_m e^{w1.x+w1.y} + e^{w1.x+w2.y} + e^{w2.x+w1.y} + e^{w2.x+w2.y}
    got = g @ g.transpose(-1, -2)
    want = sum(torch.exp(p.unsqueeze(-2) + r.unsqueeze(-3)).sum(-1)
               for p in (a1, a2) for r in (a1, a2)) / (4 * M)
    torch.testing.assert_close(got, want)


def test_initial_kernel_is_gaussian_plus_floor():
    """Identity flow and w = sqrt(beta) z: E[phi(x).phi(y)] = e^-beta / 2 (e^{beta cos} + 1)."""
    torch.manual_seed(3)
    H, hs = 2, 4
    kernel = built_kernel(H, hs, num_features=40000, flow_layers=2).eval()
    beta = torch.tensor([1.0, 3.0])
    w1, w2 = kernel.frequencies(beta)
    x = unit(torch.randn(1, H, 5, hs))
    phi = cosine_features(x, w1, w2)
    got = phi @ phi.transpose(-1, -2)
    cos = x @ x.transpose(-1, -2)
    b = beta.view(1, H, 1, 1)
    want = torch.exp(-b) / 2 * (torch.exp(b * cos) + 1)
    torch.testing.assert_close(got, want, rtol=0, atol=0.02)


# ---------------------------------------------------------------- prior and KL


def test_prior_density_against_torch_distributions():
    torch.manual_seed(4)
    hs, Q = 3, 4
    prior = SpectralMixturePrior(hs, Q).double()
    with torch.no_grad():
        prior.weight_logits.copy_(torch.randn(Q))
        prior.rho_raw.mul_(3.0)  # strong correlations, still in (-1, 1)
    u = torch.randn(6, 2 * hs, dtype=torch.float64)
    sd = prior.log_scale.exp()
    rho = torch.tanh(prior.rho_raw)
    comps = []
    for q in range(Q):
        total = 0.0
        for i in range(hs):
            cov = torch.tensor([[sd[q, 0, i] ** 2, rho[q, i] * sd[q, 0, i] * sd[q, 1, i]],
                                [rho[q, i] * sd[q, 0, i] * sd[q, 1, i], sd[q, 1, i] ** 2]],
                               dtype=torch.float64)
            mvn = torch.distributions.MultivariateNormal(prior.mean[q, :, i], cov)
            total = total + mvn.log_prob(torch.stack([u[:, i], u[:, hs + i]], -1))
        comps.append(total + torch.log_softmax(prior.weight_logits, 0)[q])
    want = torch.logsumexp(torch.stack(comps), 0)
    torch.testing.assert_close(prior.log_prob(u), want)
    assert bool((rho.abs() < 1).all())


def _gaussian_kl(mu0, var0, mu1, cov1):
    """KL(N(mu0, diag var0) || N(mu1, cov1)), closed form."""
    k = mu0.numel()
    inv = torch.linalg.inv(cov1)
    diff = mu1 - mu0
    return 0.5 * (torch.trace(inv @ torch.diag(var0)) + diff @ inv @ diff - k
                  + torch.logdet(cov1) - torch.log(var0).sum())


def test_kl_estimate_matches_closed_form_for_affine_flow_and_one_component():
    torch.manual_seed(5)
    H, hs, N = 2, 3, 60000
    flow = SpectralFlow(H, hs, layers=3, hidden=4).double()
    with torch.no_grad():  # w_in = 0: every coupling is a constant affine map
        flow.w_in.zero_()
        flow.b_in.normal_()
        flow.w_out.normal_(std=0.3)
        flow.b_out.normal_(std=0.3)
    prior = SpectralMixturePrior(hs, 1).double()
    z = torch.randn(H, N, 2 * hs, dtype=torch.float64)
    u, log_q = flow.sample(z)
    estimate = spectral_kl(log_q, u, prior).detach()
    sd, rho = prior.log_scale.exp()[0], torch.tanh(prior.rho_raw[0])
    cov = torch.zeros(2 * hs, 2 * hs, dtype=torch.float64)
    for i in range(hs):
        cov[i, i], cov[hs + i, hs + i] = sd[0, i] ** 2, sd[1, i] ** 2
        cov[i, hs + i] = cov[hs + i, i] = rho[i] * sd[0, i] * sd[1, i]
    mu1 = prior.mean[0].reshape(-1)
    zero = torch.zeros(H, 1, 2 * hs, dtype=torch.float64)
    with torch.no_grad():
        mu0, scale0 = flow(zero)[0][:, 0], flow(zero + 1)[0][:, 0] - flow(zero)[0][:, 0]
        torch.testing.assert_close(u, mu0.unsqueeze(1) + scale0.unsqueeze(1) * z)  # affine
    exact = torch.stack([_gaussian_kl(mu0[h], scale0[h] ** 2, mu1, cov) for h in range(H)]).mean()
    assert abs(float(estimate - exact)) < 0.05 * float(exact) + 0.05


# ---------------------------------------------------------------- linear attention


@pytest.mark.parametrize("T,chunk", [(1, 4), (13, 4), (16, 16), (9, 64), (11, 1)])
def test_chunked_linear_attention_matches_dense_masked_reference(T, chunk):
    torch.manual_seed(6)
    q = torch.rand(2, 3, T, 7, dtype=torch.float64)
    k = torch.rand(2, 3, T, 7, dtype=torch.float64)
    v = torch.randn(2, 3, T, 5, dtype=torch.float64)
    got = chunked_causal_linear_attention(q, k, v, chunk, eps=1e-12)
    scores = (q @ k.transpose(-1, -2)).tril(-1)  # keep s < t only
    want = scores @ v / (scores.sum(-1, keepdim=True) + 1e-12)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[:, :, 0], torch.zeros_like(got[:, :, 0]))


def elu1_inputs(T, seed=9):
    g = torch.Generator().manual_seed(seed)
    x = unit(torch.randn(2, 3, T, 5, generator=g, dtype=torch.float64)).requires_grad_()
    v = torch.randn(2, 3, T, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w1, w2 = (torch.randn(3, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
              for _ in range(2))
    return x, v, w1, w2


@pytest.mark.parametrize("T,chunk,segment", [(1, 4, 2**18), (13, 4, 2**18), (40, 8, 300),
                                             (37, 4, 150), (11, 1, 40), (9, 64, 2**18)])
def test_elu1_retrieval_matches_autograd_through_the_chunked_reference(monkeypatch, T, chunk,
                                                                       segment):
    """The segmented elu1 function (hand-written backward, several segments when the segment
    budget is small) == autograd through features + causal_linear_attention, in float64."""
    monkeypatch.setattr(feature_attention, "SEGMENT_ELEMENTS", segment)
    x, v, w1, w2 = elu1_inputs(T)
    dy = torch.randn(2, 3, T, 4, dtype=torch.float64)
    f = elu1_features(x, w1, w2)
    want = chunked_causal_linear_attention(f, f, v, chunk, 1e-20)
    got = CosineFeatureAttention.apply(x, v, w1, w2, chunk, 1e-20)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    for a, b in zip(torch.autograd.grad(got, (x, v, w1, w2), dy),
                    torch.autograd.grad(want, (x, v, w1, w2), dy)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
    if T <= 13:
        assert torch.autograd.gradcheck(
            lambda *a: CosineFeatureAttention.apply(*a, chunk, 1e-20), (x, v, w1, w2))


def test_elu1_retrieval_saves_no_features(monkeypatch):
    """Backward keeps the inputs, the output and O(T + segments x M' hs) numbers: nothing of
    size T x M'."""
    monkeypatch.setattr(feature_attention, "SEGMENT_ELEMENTS", 2**12)
    T = 256
    x, v, w1, w2 = elu1_inputs(T)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = CosineFeatureAttention.apply(x, v, w1, w2, 8, 1e-20)
    assert max(saved) < 2 * 3 * T * 2 * 6  # the features would be B H T M' numbers
    y.sum().backward()


def dense_reference(kernel: FSKAKernel, keys, values, beta):
    """float64 masked attention with weights g(k_t).g(k_s), s < t, normalised in log space."""
    w1, w2 = (w.detach().double() for w in kernel.frequencies(beta))
    keys, values = keys.double(), values.double()
    a1, a2 = keys @ w1.transpose(-1, -2), keys @ w2.transpose(-1, -2)
    M = w1.shape[-2]
    if kernel.positive == "elu1":
        phi = torch.cat([a1.cos() + a2.cos(), a1.sin() + a2.sin()], -1) / math.sqrt(4 * M)
        g = F.elu(phi) + 1
        log_k = torch.log(g @ g.transpose(-1, -2))
    else:
        log_g = torch.logaddexp(a1, a2)
        log_k = torch.logsumexp(log_g.unsqueeze(-2) + log_g.unsqueeze(-3), dim=-1)
    T = keys.shape[2]
    log_k = log_k.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(-1), float("-inf"))
    weights = torch.softmax(log_k, dim=-1).nan_to_num(0.0)  # row 0: no memory -> 0
    return weights @ values


@pytest.mark.parametrize("positive,log_beta", [("elu1", 1.0), ("elu1", 8.0), ("exp", 1.0),
                                               ("exp", 4.0), ("exp", 6.0)])
def test_kernel_forward_is_normalized_feature_attention(positive, log_beta):
    torch.manual_seed(7)
    kernel = built_kernel(2, 6, num_features=8, positive=positive, chunk_size=3,
                          flow_hidden=8).eval()
    perturb(kernel.flow, 0.1)
    keys, values = unit(torch.randn(2, 2, 10, 6)), torch.randn(2, 2, 10, 6)
    beta = torch.tensor([2.0, math.exp(log_beta)])
    y = kernel(keys, values, beta)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), dense_reference(kernel, keys, values, beta),
                               rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("positive,log_beta", [("elu1", 1.5), ("exp", 1.5), ("exp", 10.0)])
def test_kernel_step_matches_forward(positive, log_beta):
    """Memory entries lag the queries by one (m = n - 1 first, then m = n), any split."""
    torch.manual_seed(8)
    kernel = built_kernel(2, 4, num_features=8, positive=positive, flow_hidden=8,
                          chunk_size=5).eval()
    perturb(kernel.flow, 0.1)
    T = 12
    keys, values = unit(torch.randn(1, 2, T, 4)), torch.randn(1, 2, T, 4)
    beta = torch.tensor([3.0, math.exp(log_beta)])
    full = kernel(keys, values, beta)
    state = kernel.memory_of(keys[:, :, :0], values[:, :, :0], beta)  # no entry: zero sums
    outs, pos = [], 0
    for n in (1, 4, 1, 6):
        lo, hi = max(pos - 1, 0), pos + n - 1  # positions not yet in memory, all < pos + n - 1
        y, state = kernel.step(state, keys[:, :, pos:pos + n], keys[:, :, lo:hi],
                                 values[:, :, lo:hi], beta)
        outs.append(y)
        pos += n
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-5, atol=1e-6)
    assert state.sums.S.shape == (1, 2, kernel.feature_dim, 4) and len(state) == 0
    assert state.sums.z.shape == (1, 2, kernel.feature_dim)


@pytest.mark.parametrize("positive", ["elu1", "exp"])
def test_memory_of_takes_its_bandwidth_not_the_last_forwards(positive):
    torch.manual_seed(10)
    kernel = built_kernel(2, 4, num_features=8, positive=positive, flow_hidden=8).eval()
    perturb(kernel.flow, 0.1)
    keys, values = unit(torch.randn(1, 2, 9, 4)), torch.randn(1, 2, 9, 4)
    beta = torch.tensor([3.0, 5.0])
    full = kernel(keys, values, beta)
    kernel(keys, values, 2 * beta)  # a later forward at another bandwidth changes nothing
    state = kernel.memory_of(keys[:, :, :7], values[:, :, :7], beta)
    y, _ = kernel.step(state, keys[:, :, 8:9], keys[:, :, 7:8], values[:, :, 7:8], beta)
    torch.testing.assert_close(y, full[:, :, 8:9], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("positive", ["elu1", "exp"])
def test_cached_decoding_equals_full_forward(tiny_config, positive):
    torch.manual_seed(9)
    model = MosaicsForCausalLM(fska_config(tiny_config, positive=positive)).eval()
    for block in model.model.blocks:
        perturb(block.cmem.kernel.flow, 0.1)
    ids = torch.randint(0, 61, (2, 19))
    full = model(ids, use_cache=False).logits
    for splits in ([1] * 19, [7, 1, 5, 6]):
        cache, parts, pos = None, [], 0
        for n in splits:
            out = model(ids[:, pos:pos + n], cache=cache, use_cache=True)
            cache, pos = out.cache, pos + n
            parts.append(out.logits)
        torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)
    sums = cache.layers[0].context[0].memory.sums  # the sums alone: no entry is stored
    assert len(cache.layers[0].context[0].memory) == 0 and sums.lo is None
    assert (sums.r is None) == (positive == "elu1")
    assert sums.S.dtype == torch.float32
    assert sums.S.shape == (2, 4, model.model.blocks[0].cmem.kernel.feature_dim, 8)


# ---------------------------------------------------------------- training behaviour


def test_frequencies_redrawn_in_training_fixed_in_eval():
    kernel = built_kernel(2, 3, num_features=4)
    beta = torch.ones(2)
    kernel.train()
    assert not torch.equal(kernel.frequencies(beta)[0], kernel.frequencies(beta)[0])
    kernel.eval()
    a, b = kernel.frequencies(beta)[0], kernel.frequencies(beta)[0]
    assert torch.equal(a, b)
    torch.testing.assert_close(a, kernel.eval_noise[..., :3])  # identity flow, beta = 1
    assert torch.equal(built_kernel(2, 3, num_features=4).eval_noise, kernel.eval_noise)
    assert not torch.equal(built_kernel(2, 3, num_features=4, seed=1).eval_noise,
                           kernel.eval_noise)


def test_eval_frequencies_follow_beta_and_the_flow():
    """The decoding steps' frequencies are kept between calls; a new beta, new flow weights
    (as load_state_dict writes them) or a tracked beta must not reuse them."""
    kernel = built_kernel(2, 3, num_features=4).eval()
    beta = torch.tensor([1.0, 4.0])
    with torch.no_grad():
        first = kernel._eval_frequencies(beta)
        assert kernel._eval_frequencies(beta.clone()) is first
        torch.testing.assert_close(first[0][1], 2.0 * kernel.eval_noise[1, :, :3])
        other = kernel._eval_frequencies(torch.tensor([1.0, 9.0]))
        torch.testing.assert_close(other[0][1], 3.0 * kernel.eval_noise[1, :, :3])
        perturb(kernel.flow)
        moved = kernel._eval_frequencies(beta)
    assert not torch.equal(moved[0], first[0])
    torch.testing.assert_close(moved[0], kernel.flow(kernel.eval_noise)[0][..., :3]
                               * beta.sqrt().view(-1, 1, 1))
    tracked = beta.clone().requires_grad_()
    w1, _ = kernel._eval_frequencies(tracked)
    w1.sum().backward()
    assert tracked.grad is not None and bool((tracked.grad != 0).all())


def test_regularization_is_kl_and_enters_the_loss(tiny_config):
    torch.manual_seed(10)
    model = MosaicsForCausalLM(fska_config(tiny_config, lambda_spec=0.5)).train()
    ids = torch.randint(0, 61, (2, 12))
    out = model(ids, labels=ids)
    kernels = [b.cmem.kernel for b in model.model.blocks]
    regs = [k.regularization() for k in kernels]
    assert all(r.dim() == 0 and r.requires_grad and float(r.detach()) > 0 for r in regs)
    torch.testing.assert_close(out.aux_loss, torch.stack(regs).mean())
    torch.testing.assert_close(out.loss, out.lm_loss + 0.5 * out.aux_loss)
    # the KL is the MC estimate on the draw used in that forward
    k = kernels[0]
    u, log_q = k.flow.sample(k._noise)
    torch.testing.assert_close(regs[0], (log_q - k.prior.log_prob(u)).mean())
    out.loss.backward()
    assert float(kernels[0].flow.w_out.grad.abs().sum()) > 0
    model.eval()
    out = model(ids, labels=ids)
    assert out.aux_loss is None and torch.equal(out.loss, out.lm_loss)


def test_regularization_survives_gradient_checkpointing(tiny_config):
    torch.manual_seed(11)
    model = MosaicsForCausalLM(fska_config(tiny_config)).train()
    model.activation_checkpointing_enable()
    ids = torch.randint(0, 61, (2, 12))
    out = model(ids, labels=ids)
    assert out.aux_loss.requires_grad
    out.loss.backward()
    assert float(model.model.blocks[0].cmem.kernel.flow.w_out.grad.abs().sum()) > 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(positive="relu"), "positive must be one of"),
    (dict(num_features=0), "num_features must be an integer >= 1"),
    (dict(flow_layers=2.5), "flow_layers must be an integer"),
    (dict(lambda_spec=-1.0), "lambda_spec must be a number >= 0"),
    (dict(chunk_size=True), "chunk_size must be an integer"),
    (dict(bogus=1), "bad kernel_kwargs for kernel 'fska'"),
])
def test_bad_kwargs_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_kernel("fska", **kwargs)


def test_unbuilt_or_mismatched_kernel_fails_clearly():
    kernel = get_kernel("fska")
    x = torch.randn(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="not built"):
        kernel(x, x, torch.ones(2))
    kernel.build(2, 4)
    with pytest.raises(ValueError, match="built for n_head=2"):
        kernel(torch.randn(1, 3, 3, 4), torch.randn(1, 3, 3, 4), torch.ones(3))


# ---------------------------------------------------------------- save / load


def test_save_load_keeps_eval_frequencies(tiny_config, tmp_path):
    torch.manual_seed(12)
    model = MosaicsForCausalLM(fska_config(tiny_config, positive="exp")).eval()
    for block in model.model.blocks:
        perturb(block.cmem.kernel.flow, 0.2)
        with torch.no_grad():  # not the seeded draw: loading must restore the saved one
            block.cmem.kernel.eval_noise.normal_()
    ids = torch.randint(0, 61, (2, 10))
    model.save_pretrained(tmp_path)
    loaded = MosaicsForCausalLM.from_pretrained(tmp_path).eval()
    for a, b in zip(model.model.blocks, loaded.model.blocks):
        assert torch.equal(a.cmem.kernel.eval_noise, b.cmem.kernel.eval_noise)
        assert torch.equal(a.cmem.kernel.prior.mean, b.cmem.kernel.prior.mean)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert loaded.regularization_weight == 1e-3


def test_remote_code_bundle_has_fska_with_flat_imports():
    files = flat_sources()
    assert "kernels_fska.py" in files and "kernels_spectral_flow.py" in files
    fska = files["kernels_fska.py"]
    assert "from .kernels_spectral_flow import" in fska and "from .kernels_base import" in fska
    assert "from .fska import FSKAKernel" not in files["kernels.py"]


@pytest.mark.slow
@pytest.mark.integration
def test_remote_code_loads_fska_without_the_package(tiny_config, tmp_path):
    torch.manual_seed(13)
    model = MosaicsForCausalLM(fska_config(tiny_config)).eval()
    model.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 61, (1, 9))
    with torch.no_grad():  # the inference path: the compiled CPU kernel trains only
        torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "ref.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["mosaics"] = None
        import torch
        from transformers import AutoModelForCausalLM
        ref = torch.load({str(tmp_path / 'ref.pt')!r}, weights_only=True)
        m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r},
                                                 trust_remote_code=True).eval()
        with torch.no_grad():
            assert torch.equal(m(ref["ids"]).logits, ref["logits"])
        print("OK")
    """)
    env = {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "OK" in res.stdout


# ---------------------------------------------------------------- paper simplifications


@pytest.mark.parametrize("kernel", ["gaussian", "fska"])
def test_no_key_projection_and_fixed_values(tiny_config, kernel):
    torch.manual_seed(14)
    kw = dict(kernel_kwargs=dict(num_features=8, flow_hidden=8)) if kernel == "fska" else {}
    full_cfg = tiny_config(kernel=kernel, **kw)
    lean_cfg = tiny_config(kernel=kernel, key_projection=False, fixed_value_projection=True, **kw)
    full, lean = MosaicsForCausalLM(full_cfg), MosaicsForCausalLM(lean_cfg)

    def trainable(m):
        return sum(p.numel() for p in m.parameters() if p.requires_grad)

    d, L = full_cfg.n_embd, full_cfg.n_layer
    assert trainable(full) - trainable(lean) == L * 2 * d * d
    cmem = lean.model.blocks[0].cmem
    assert cmem.k_proj is None and cmem.v_proj is None
    assert "model.blocks.0.cmem.v_fixed" in lean.state_dict()
    v = cmem.v_fixed
    torch.testing.assert_close(v @ v.T, torch.eye(d), rtol=0, atol=1e-5)
    ids = torch.randint(0, 61, (2, 14))
    lean.train()
    lean(ids, labels=ids).loss.backward()
    lean.eval()
    full_logits = lean(ids, use_cache=False).logits
    cache, parts = None, []
    for pos in range(14):
        out = lean(ids[:, pos:pos + 1], cache=cache, use_cache=True)
        cache = out.cache
        parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, 1), full_logits, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- retrieval sharpness


def retrieval_sharpness(positive: str, beta: float, T: int = 64, hs: int = 16, M: int = 96,
                        seed: int = 0) -> float:
    """Mean weight the last query puts on its exact match among T - 1 past keys, times
    (T - 1): 1 means uniform attention."""
    torch.manual_seed(seed)
    kernel = built_kernel(1, hs, num_features=M, positive=positive, flow_layers=1,
                          chunk_size=16).eval()
    keys = unit(torch.randn(32, 1, T, hs))
    target = torch.randint(0, T - 1, (32,))
    keys[:, 0, -1] = keys[torch.arange(32), 0, target]
    values = F.one_hot(torch.arange(T), T).float().expand(32, 1, T, T)
    y = kernel(keys, values, torch.tensor([beta]))
    weight = y[torch.arange(32), 0, -1, target]
    return float(weight.detach().mean()) * (T - 1)


@pytest.mark.parametrize("log_beta", [2.0, 10.0])  # the bandwidth at init, and its cap
def test_exp_map_attends_more_sharply_than_elu1(log_beta):
    beta = math.exp(log_beta)
    elu1, exp = retrieval_sharpness("elu1", beta), retrieval_sharpness("exp", beta)
    assert elu1 < 2.0  # the ELU+1 map is nearly uniform (|phi_i| <= 2 / sqrt(4M))
    assert exp > 5.0 * elu1  # at e^10 this needs the per-feature rescaled state


@pytest.mark.parametrize("shared", [True, False])
def test_interval_linear_attention_equals_its_dense_reference(shared):
    """Prefix differences of chunk states plus dense ends = the dense masked form, value and
    gradient, in float64 (windows, gaps and empty rows; bounds shared or per batch row)."""
    torch.manual_seed(21)
    B, H, n, F, D = 2, 3, 37, 6, 5
    fq = torch.rand(B, H, n, F, dtype=torch.float64, requires_grad=True)
    fk = torch.rand(B, H, n, F, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, H, n, D, dtype=torch.float64, requires_grad=True)
    i = torch.arange(n)
    hi = (i - torch.tensor([[1], [3]])).clamp(min=-1)[: 1 if shared else B]
    lo = torch.maximum(hi - 11, torch.zeros_like(hi))
    lo[:, 5] = hi[:, 5] + 1  # a row that sees nothing
    args = (fq, fk, v, lo, hi)
    got = feature_attention.interval_linear_attention(*args, chunk=4, eps=1e-9, elements=64)
    want = feature_attention.interval_linear_attention_reference(*args, eps=1e-9)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, (fq, fk, v), g)
    for a, b in zip(grads, torch.autograd.grad(want, (fq, fk, v), g)):
        torch.testing.assert_close(a, b)
