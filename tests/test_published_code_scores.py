"""The ``parametrization`` option of epanechnikov_fixed and relumax: the published code's scores.

Oracle: the scores as the published code of "Sparse Attention as Compact Kernel Regression"
forms them (``norm_relu`` and ``relumax``), written out here from its steps, with beta_p =
e^{min(10 b, 5)} (so the memory's beta = beta_p^2) and h = 1 / beta_p:

- regbench-code (``memory_mosaics.py``): keys scaled by beta_p, raw = k_t . k_s, then the ReLU
  of raw / (h^2 / 2) + 1 - 2 beta_p^2 (norm_relu) or of (raw - max raw) / h^2 + 1 (relumax);
- synthetic-code (``memory_mosaics_eft.py``): unit keys, c = k_t . k_s, then the ReLU of c
  (norm_relu: its b and gamma are computed but unused) or of (c - max c) / h^2 + 1 (relumax),

normalized over the strict past. Only the valid (strict-past) entries enter the oracle: the
regbench code masks future entries to a raw score of 0 before the ReLU, which gives them
weight 1 - 2 beta_p^2 > 0 when beta_p < 1/sqrt(2), a slip not reproduced.
"""

from __future__ import annotations

import math

import pytest
import torch

from mosaics import MosaicsForCausalLM
from mosaics.kernels import get_kernel
from mosaics.memory import EXP_SCALE, ContextualMemory
from mosaics.reference import reference_logits

KERNELS = ["epanechnikov_fixed", "relumax"]
VARIANTS = ["regbench-code", "synthetic-code"]
CASES = [(k, v) for k in KERNELS for v in VARIANTS]


def code_weights(kernel: str, variant: str, keys: torch.Tensor,
                 beta_p: torch.Tensor) -> torch.Tensor:
    """Published-code weights, float64: unit keys (H, T, hs), beta_p (H,) -> (H, T, T), row t
    over s < t; a row with no positive score stays 0."""
    H, T, _ = keys.shape
    out = torch.zeros(H, T, T, dtype=torch.float64)
    for h in range(H):
        inv_h2 = beta_p[h].double() ** 2  # h = 1 / beta_p
        k = keys[h].double() * (beta_p[h].double() if variant == "regbench-code" else 1.0)
        for t in range(1, T):
            raw = torch.stack([k[t] @ k[s] for s in range(t)])
            if kernel == "relumax":
                u = torch.relu((raw - raw.max()) / (1 / inv_h2) + 1)
            elif variant == "regbench-code":
                u = torch.relu(raw / (0.5 / inv_h2) + 1 - 2 * inv_h2)
            else:
                u = torch.relu(raw)
            if u.sum() > 0:
                out[h, t, :t] = u / u.sum()
    return out


def memory_with_bandwidths(tiny_config, kernel: str, variant: str,
                           b: list[float]) -> ContextualMemory:
    torch.manual_seed(3)
    cfg = tiny_config(kernel=kernel, kernel_kwargs={"parametrization": variant})
    mem = ContextualMemory(cfg).double().eval()
    with torch.no_grad():
        mem.bandwidth_b.copy_(torch.tensor(b, dtype=torch.float64))
    return mem


@pytest.mark.parametrize(("kernel", "variant"), CASES)
def test_weights_equal_the_published_code(tiny_config, kernel, variant):
    # beta_p = e^{10 b}: 0.61 (below 1/sqrt 2), 1, e^1 (the initial value), e^2.5
    b = [-0.05, 0.0, 0.1, 0.25]
    mem = memory_with_bandwidths(tiny_config, kernel, variant, b)
    x = torch.randn(1, 17, mem.c_proj.weight.shape[1], dtype=torch.float64)
    w = mem.retrieval_weights(x)[0]  # (H, T, T)
    keys = mem.unit_keys(x, torch.nn.functional.linear(x, mem.weights().kv[:x.shape[-1]])
                         .view(1, 17, mem.n_head, -1).transpose(1, 2), mem.weights())[0][0]
    expected = code_weights(kernel, variant, keys, torch.exp(EXP_SCALE * torch.tensor(b)))
    torch.testing.assert_close(w.double(), expected, rtol=1e-4, atol=1e-5)  # fp32 weights
    assert (w[:, 1:].sum(-1) > 0).any()


def test_fixed_bandwidth_support_starts_wide():
    """At the initial beta = e^2 the formula keeps c > 1 - e^-2 (0.86); the published code's
    scores keep c > (2 e^2 - 1) / (2 e^4) (0.13, regbench) or c > 0 (synthetic)."""
    beta = torch.tensor([math.e ** 2])

    def fixed(variant: str):
        return get_kernel("epanechnikov_fixed", parametrization=variant)

    for kernel, edge in ((fixed("formula"), 1 - math.exp(-2)),
                         (fixed("regbench-code"), (2 * math.e ** 2 - 1) / (2 * math.e ** 4)),
                         (fixed("synthetic-code"), 0.0)):
        a = kernel.bandwidth(beta)
        cos = torch.tensor([edge - 0.01, edge + 0.01]).view(1, 1, 1, 2)
        w = kernel.weights(cos, a.view(1, 1, 1, 1), torch.ones(1, 1, 1, 2, dtype=torch.bool))
        assert w[0, 0, 0, 0] == 0 and w[0, 0, 0, 1] == 1
    relumax = get_kernel("relumax", parametrization="regbench-code")
    assert relumax.bandwidth(beta).item() == pytest.approx(math.e ** 4)
    for variant in ("formula", "synthetic-code"):
        assert torch.equal(get_kernel("relumax", parametrization=variant).bandwidth(beta), beta)


@pytest.mark.parametrize(("kernel", "variant"), CASES)
def test_model_logits_match_reference_and_cache(tiny_config, kernel, variant):
    torch.manual_seed(5)
    cfg = tiny_config(kernel=kernel, kernel_kwargs={"parametrization": variant})
    model = MosaicsForCausalLM(cfg).double().eval()
    for p in model.parameters():
        p.data.add_(0.02 * torch.randn_like(p))
    ids = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        torch.testing.assert_close(full, reference_logits(model, ids), rtol=1e-7, atol=1e-7)
        cache, parts, pos = None, [], 0
        for n in (5, 1, 4, 2):
            out = model(ids[:, pos:pos + n], cache=cache, use_cache=True)
            cache, pos = out.cache, pos + n
            parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-7, atol=1e-7)
    formula = MosaicsForCausalLM(tiny_config(kernel=kernel)).double().eval()
    formula.load_state_dict(model.state_dict())
    same = kernel == "relumax" and variant == "synthetic-code"  # the formula's scores
    assert torch.allclose(formula(ids).logits, full) == same


@pytest.mark.parametrize(("kernel", "variant"), CASES)
def test_bandwidth_gradient_through_the_map(tiny_config, kernel, variant):
    """d f / d b through beta' = map(beta) equals a central difference, f a fixed random
    projection of the float64 logits; zero where the code ignores the bandwidth."""
    torch.manual_seed(7)
    cfg = tiny_config(kernel=kernel, kernel_kwargs={"parametrization": variant}, n_layer=1)
    model = MosaicsForCausalLM(cfg)
    model = model.double()
    b = model.model.blocks[0].cmem.bandwidth_b
    ids = torch.randint(0, 61, (2, 10))
    proj = torch.randn(2, 10, 61, dtype=torch.float64)
    with torch.no_grad():  # bandwidths wide enough that rows hold several entries
        b.copy_(torch.tensor([0.0, 0.02, 0.05, -0.02]))

    def f() -> torch.Tensor:
        return (model(ids).logits * proj).sum()

    f().backward()
    eps = 1e-6
    with torch.no_grad():
        b[1] += eps
        up = f().item()
        b[1] -= 2 * eps
        down = f().item()
    slope = (up - down) / (2 * eps)
    if kernel == "epanechnikov_fixed" and variant == "synthetic-code":
        assert slope == 0 and torch.all(b.grad == 0)
        return
    assert abs(slope) > 1e-6
    assert b.grad[1].item() == pytest.approx(slope, rel=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_unknown_parametrization_names_the_choices(kernel):
    with pytest.raises(ValueError, match="parametrization must be one of formula, regbench-code, "
                                         "synthetic-code"):
        get_kernel(kernel, parametrization="paper")
