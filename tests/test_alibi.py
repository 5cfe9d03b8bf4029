"""ALiBi on the contextual memory's kernel scores: slopes, the biased retrieval against
independent normalizers, the model against the position-by-position reference, decoding."""

import entmax
import pytest
import torch

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.kernels import get_kernel
from mosaics.kernels.position_bias import alibi_slopes, biased_retrieval, supports_score_bias
from mosaics.memory import ContextualMemory
from mosaics.reference import contextual_memory_reference, reference_logits

SCORE_KERNELS = ["gaussian", "epanechnikov", "biweight", "triweight", "relumax",
                 "epanechnikov_fixed", "gaussian_knn", "uniform_knn"]


def test_slopes_are_the_standard_alibi_ones():
    torch.testing.assert_close(alibi_slopes(8), 2.0 ** -torch.arange(1, 9, dtype=torch.float64))
    torch.testing.assert_close(alibi_slopes(4), torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8],
                                                             dtype=torch.float64))
    # not a power of two: the 4 slopes of H = 4, then every other one of H = 8
    torch.testing.assert_close(
        alibi_slopes(6), torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3],
                                      dtype=torch.float64))
    with pytest.raises(ValueError, match="positive integer"):
        alibi_slopes(0)


ORACLES = {
    "gaussian": lambda z: torch.softmax(z, -1),
    "epanechnikov": lambda z: entmax.sparsemax(z, dim=-1),
    "biweight": lambda z: entmax.entmax15(z, dim=-1),
    "triweight": lambda z: entmax.entmax_bisect(z, alpha=4 / 3, dim=-1, n_iter=200),
}


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_biased_retrieval_matches_an_independent_loop(name):
    """Row by row: weights = normalizer(beta cos - m (t - s)) over s < t, with the softmax or
    the ``entmax`` package as the normalizer."""
    torch.manual_seed(0)
    B, H, T, hs = 2, 3, 12, 5
    k = torch.nn.functional.normalize(torch.randn(B, H, T, hs, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, hs, dtype=torch.float64)
    beta = torch.tensor([2.0, 5.0, 9.0], dtype=torch.float64)
    slopes = torch.tensor([0.9, 0.3, 0.05], dtype=torch.float64)
    kernel = get_kernel(name)
    kernel.chunk_elements = 7 * B * H * (T - 1)  # several chunks of rows
    got = biased_retrieval(kernel, k[:, :, 1:], k[:, :, :-1], v[:, :, :-1], beta, slopes, 0)
    want = torch.zeros(B, H, T - 1, hs, dtype=torch.float64)
    for t in range(1, T):
        past = torch.arange(t, dtype=torch.float64)
        z = beta.view(1, H, 1) * (k[:, :, t:t + 1] @ k[:, :, :t].transpose(-1, -2)).squeeze(2)
        z = z - slopes.view(1, H, 1) * (t - past)
        want[:, :, t - 1] = (ORACLES[name](z).unsqueeze(-2) @ v[:, :, :t]).squeeze(-2)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("name", ["gaussian", "epanechnikov", "relumax", "epanechnikov_fixed",
                                  "gaussian_knn"])
def test_biased_retrieval_gradients(name, chunked):
    """One chunk (kept for backward) and several (recomputed), the bandwidth's gradient
    through the bias included."""
    torch.manual_seed(1)
    B, H, T, hs = 1, 2, 7, 3
    k = torch.nn.functional.normalize(torch.randn(B, H, T, hs, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, hs, dtype=torch.float64)
    q = k.clone().requires_grad_()
    k, v = k.requires_grad_(), v.requires_grad_()
    beta = torch.tensor([1.5, 3.0], dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.25, 0.0625], dtype=torch.float64)
    kernel = get_kernel(name, **({"k": 3} if name == "gaussian_knn" else {}))
    if chunked:
        kernel.chunk_elements = 2 * B * H * (T - 1)  # two rows per chunk

    def f(q, k, v, beta):
        return biased_retrieval(kernel, q[:, :, 1:], k[:, :, :-1], v[:, :, :-1], beta, slopes, 0)

    assert torch.autograd.gradcheck(f, (q, k, v, beta), eps=1e-6, atol=1e-5)


def test_zero_slopes_give_the_kernels_own_retrieval():
    """With m = 0 the biased path must equal each kernel's fused forward."""
    torch.manual_seed(2)
    B, H, T, hs = 2, 4, 19, 8
    k = torch.nn.functional.normalize(torch.randn(B, H, T, hs, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, hs, dtype=torch.float64)
    beta = torch.linspace(1.0, 8.0, H, dtype=torch.float64)
    for name in SCORE_KERNELS:
        kernel = get_kernel(name).double()
        assert supports_score_bias(kernel)
        want = kernel(k, v, beta)[:, :, 1:]
        got = biased_retrieval(kernel, k[:, :, 1:], k[:, :, :-1], v[:, :, :-1], beta,
                               torch.zeros(H, dtype=torch.float64), 0)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=name)


def test_the_bias_changes_the_retrieval(tiny_config):
    torch.manual_seed(3)
    x = torch.randn(1, 16, tiny_config().n_embd)
    plain, biased = (ContextualMemory(tiny_config(alibi=a)).eval() for a in (False, True))
    biased.load_state_dict(plain.state_dict())  # same weights; the slopes are not saved
    assert not torch.allclose(plain(x)[0], biased(x)[0], atol=1e-4)


@pytest.mark.parametrize("kernel", ["gaussian", "epanechnikov"])
def test_model_with_alibi_matches_the_reference(tiny_config, kernel):
    torch.manual_seed(4)
    cfg = tiny_config(kernel=kernel, alibi=True)
    mem = ContextualMemory(cfg).double().eval()
    for p in mem.parameters():
        p.data.add_(0.02 * torch.randn_like(p))
    x = torch.randn(2, 13, cfg.n_embd, dtype=torch.float64)
    torch.testing.assert_close(mem(x)[0], contextual_memory_reference(mem, x), rtol=1e-9,
                               atol=1e-9)
    model = MosaicsForCausalLM(cfg).double().eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    torch.testing.assert_close(model(ids).logits, reference_logits(model, ids), rtol=1e-7,
                               atol=1e-7)


@pytest.mark.parametrize("kernel", ["gaussian", "triweight", "gaussian_knn"])
def test_cached_decoding_with_alibi_equals_the_full_forward(tiny_config, kernel):
    torch.manual_seed(5)
    model = MosaicsForCausalLM(tiny_config(kernel=kernel, alibi=True)).double().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 21))
    full = model(ids).logits
    out = model(ids[:, :9], use_cache=True)
    logits, cache = [out.logits], out.past_key_values
    for t in range(9, 21, 4):  # decoding in pieces of several tokens and single ones
        step = 4 if t < 17 else 1
        for s in range(t, min(t + 4, 21), step):
            out = model(ids[:, s:s + step], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-9, atol=1e-9)
    greedy = model.generate(ids[:, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
    again = model.generate(ids[:, :5], max_new_tokens=6, do_sample=False, pad_token_id=0,
                           use_cache=False)
    assert torch.equal(greedy, again)


def test_alibi_trains(tiny_config):
    torch.manual_seed(6)
    model = MosaicsForCausalLM(tiny_config(kernel="epanechnikov", alibi=True)).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.model.blocks[0].cmem.k_proj.weight.grad.abs().sum() > 0


def test_bad_alibi_settings_are_refused():
    with pytest.raises(ValueError, match="score normalizer.*fska"):
        MosaicsForCausalLM(MosaicsConfig(vocab_size=32, n_layer=1, n_head=2, n_embd=16,
                                         kernel="fska", alibi=True))
    with pytest.raises(ValueError, match="v1 contextual memory only"):
        MosaicsConfig.v2(vocab_size=32, n_layer=1, n_head=2, n_embd=16, alibi=True)
    with pytest.raises(ValueError, match="True or False"):
        MosaicsConfig(alibi="yes")


def test_alibi_survives_save_and_load(tmp_path, tiny_config):
    model = MosaicsForCausalLM(tiny_config(alibi=True)).eval()
    model.save_pretrained(tmp_path)
    again = MosaicsForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.alibi
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    torch.testing.assert_close(again(ids).logits, model(ids).logits)


@pytest.mark.parametrize("name", ["gaussian", "epanechnikov", "gaussian_knn"])
def test_biased_retrieval_saves_no_quadratic_tensor(name):
    """The bias rides on the chunked retrieval: O(T) numbers saved for backward."""
    torch.manual_seed(3)
    B, H, T, hs = 1, 2, 1024, 8
    kernel = get_kernel(name)
    kernel.chunk_elements = 2**14
    k = torch.nn.functional.normalize(torch.randn(B, H, T, hs), dim=-1).requires_grad_()
    v = torch.randn(B, H, T, hs, requires_grad=True)
    beta = torch.tensor([3.0, 9.0], requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = biased_retrieval(kernel, k[:, :, 1:], k[:, :, :-1], v[:, :, :-1], beta,
                               alibi_slopes(H), 0)
    assert sum(saved.values()) < T * T, sum(saved.values())  # < T^2 / 4 fp32 numbers
    out.sum().backward()
    assert beta.grad is not None and torch.isfinite(beta.grad).all()
