"""The Memory Mosaics model: math against slow references, HF integration, decoding."""

import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from mosaics import MosaicsConfig, MosaicsForCausalLM, MosaicsModel, available_kernels
from mosaics.cache import MosaicsCache
from mosaics.memory import ContextualMemory
from mosaics.ops import bank_attention, leaky_average_reference
from mosaics.ops import banks as bank_ops
from mosaics.ops.banks import BANK_BLOCK
from mosaics.persistent_memory import PersistentMemory
from mosaics.reference import contextual_memory_reference, reference_logits


def test_contextual_memory_matches_slow_reference(tiny_config):
    torch.manual_seed(0)
    cfg = tiny_config()
    mem = ContextualMemory(cfg).double().eval()
    for p in mem.parameters():  # move scalars away from their symmetric init
        p.data.add_(0.02 * torch.randn_like(p))
    x = torch.randn(2, 13, cfg.n_embd, dtype=torch.float64)
    fast, _ = mem(x)
    torch.testing.assert_close(fast, contextual_memory_reference(mem, x), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kernel", ["gaussian", "epanechnikov"])
def test_model_logits_match_reference_model(tiny_config, kernel):
    """The whole stack against :func:`mosaics.reference.reference_logits` (float64)."""
    torch.manual_seed(11)
    model = MosaicsForCausalLM(tiny_config(kernel=kernel)).double().eval()
    for p in model.parameters():
        p.data.add_(0.02 * torch.randn_like(p))
    ids = torch.randint(0, 61, (2, 11))
    torch.testing.assert_close(model(ids).logits, reference_logits(model, ids),
                               rtol=1e-7, atol=1e-7)


def test_position_zero_has_no_memory(tiny_config):
    cfg = tiny_config()
    mem = ContextualMemory(cfg).eval()
    y, _ = mem(torch.randn(3, 9, cfg.n_embd))
    assert torch.equal(y[:, 0], torch.zeros_like(y[:, 0]))
    assert y[:, 1:].abs().sum() > 0


def test_persistent_memory_matches_formula(tiny_config):
    torch.manual_seed(1)
    cfg = tiny_config(pmem_size=12)
    mem = PersistentMemory(cfg).double().eval()
    x = torch.randn(2, 7, cfg.n_embd, dtype=torch.float64)
    H, hs = cfg.n_head, cfg.head_size
    k = (x @ mem.k_proj.weight.T).view(2, 7, H, hs).transpose(1, 2)
    kbar = leaky_average_reference(k, 10 * mem.leaky_p.abs())
    q = kbar / kbar.norm(dim=-1, keepdim=True)
    beta = torch.exp(2 * torch.clamp(10 * mem.bandwidth_b, max=5)).view(1, H, 1, 1)
    w = torch.softmax(beta * q @ mem.mem_keys.transpose(-1, -2), dim=-1)
    y = (w @ mem.mem_values) * torch.exp(10 * mem.value_q).view(1, H, 1, 1)
    expected = y.transpose(1, 2).reshape(2, 7, -1) @ mem.c_proj.weight.T
    torch.testing.assert_close(mem(x)[0], expected)


@pytest.mark.parametrize("P", [BANK_BLOCK + 1, 1000])
def test_bank_attention_blocked_backward_matches_softmax_formula(P, monkeypatch):
    """Without the compiled kernel, above BANK_BLOCK slots the CPU backward runs in even
    blocks of slots (2 and 3 here); output and gradients equal autograd through
    softmax(q k^T) v."""
    monkeypatch.setattr(bank_ops, "bank_extension", lambda: None)
    torch.manual_seed(0)
    q = F.normalize(torch.randn(3, 40, 8), dim=-1).requires_grad_()
    k, v = (torch.randn(3, P, 8).requires_grad_() for _ in range(2))
    g = torch.randn(3, 40, 8)
    out = bank_attention(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out, ref)
    for mine, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_value_lookahead_uses_next_token(tiny_config):
    """The memory entry of position s holds norm((1 - c) W_v x_{s+1} + c W_v x_s); its scale
    e^{10q} is applied after retrieval (``test_contextual_memory_matches_slow_reference``)."""
    torch.manual_seed(3)
    cfg = tiny_config()
    mem = ContextualMemory(cfg).eval()
    x = torch.randn(2, 10, cfg.n_embd)
    _, state = mem(x, use_cache=True)
    values = state.memory.values  # (B, H, 9, hs): v_0 .. v_8, v_9 is still pending
    assert values.shape[2] == 9
    H, hs = cfg.n_head, cfg.head_size
    vraw = (x @ mem.v_proj.weight.T).view(2, 10, H, hs).transpose(1, 2)
    c = mem.lookahead_c.view(1, H, 1, 1)
    vbar = (1 - c) * vraw[:, :, 1:] + c * vraw[:, :, :-1]
    torch.testing.assert_close(values, F.normalize(vbar, dim=-1))
    # changing x_6 changes v_5 and v_6 only
    x2 = x.clone()
    x2[:, 6] += 1.0
    v2 = mem(x2, use_cache=True)[1].memory.values
    changed = (v2 - values).abs().amax(dim=(0, 1, 3)) > 0
    assert changed.tolist() == [s in (5, 6) for s in range(9)]


def test_strict_causality(tiny_config):
    torch.manual_seed(4)
    model = MosaicsForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 61, (2, 24))
    base = model(ids).logits
    for j in (0, 5, 23):
        changed = ids.clone()
        changed[:, j] = (changed[:, j] + 7) % 61
        out = model(changed).logits
        assert torch.equal(out[:, :j], base[:, :j])
        assert not torch.allclose(out[:, j], base[:, j])


def test_reference_parameter_count():
    with torch.device("meta"):
        model = MosaicsForCausalLM(MosaicsConfig(vocab_size=50304, n_layer=12, n_head=12,
                                                 n_embd=768, pmem_size=2688))
    assert sum(p.numel() for p in model.parameters()) == 123_588_336
    assert model.config.pmem_size == MosaicsConfig(n_embd=768).pmem_size == 2688


def test_initialisation_matches_reference(tiny_config):
    torch.manual_seed(5)
    cfg = tiny_config(n_embd=128, n_head=8, n_layer=3, vocab_size=500)
    model = MosaicsForCausalLM(cfg)
    d = cfg.n_embd
    assert model.lm_head.weight is model.model.wte.weight
    assert abs(model.model.wte.weight.std().item() - 1.0) < 0.05
    blk = model.model.blocks[0]
    assert abs(blk.cmem.k_proj.weight.std().item() - d**-0.5) < 0.01
    assert abs(blk.cmem.c_proj.weight.std().item() - (d * cfg.n_layer) ** -0.5) < 0.01
    assert abs(blk.pmem.mem_keys.std().item() - cfg.head_size**-0.5) < 0.02
    torch.testing.assert_close(blk.cmem.leaky_p.data, torch.linspace(0.5, 5, 8) / 10)
    beta = torch.exp(2 * torch.clamp(10 * blk.cmem.bandwidth_b, max=5))
    torch.testing.assert_close(beta, torch.full((8,), math.e**2))
    assert blk.cmem.lookahead_c.min() >= 0 and blk.cmem.lookahead_c.max() <= 1
    assert math.isclose(model.logit_scale, d**-0.5)


def test_weight_decay_groups_are_matrices_only(tiny_config):
    model = MosaicsForCausalLM(tiny_config())
    scalars = [n for n, p in model.named_parameters() if p.dim() < 2]
    assert any("leaky_p" in n for n in scalars) and any("ln_1" in n for n in scalars)
    assert all(p.dim() >= 2 for n, p in model.named_parameters() if "mem_keys" in n)


def test_save_load_roundtrip_and_auto_classes(tiny_config, tmp_path):
    torch.manual_seed(6)
    model = MosaicsForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 61, (2, 17))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    for cls in (MosaicsForCausalLM, AutoModelForCausalLM):
        loaded = cls.from_pretrained(tmp_path).eval()
        assert isinstance(loaded, MosaicsForCausalLM)
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    backbone = AutoModel.from_pretrained(tmp_path)
    assert isinstance(backbone, MosaicsModel)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(cfg, MosaicsConfig) and cfg.kernel == "gaussian" and cfg.n_layer == 2


def test_config_roundtrip(tmp_path):
    cfg = MosaicsConfig(vocab_size=100, n_layer=3, n_head=2, n_embd=16, kernel="gaussian",
                        kernel_kwargs={"a": 1}, dropout=0.1, eos_token_id=3)
    cfg.save_pretrained(tmp_path)
    again = MosaicsConfig.from_pretrained(tmp_path)
    for key in ("vocab_size", "n_layer", "n_head", "n_embd", "pmem_size", "kernel",
                "kernel_kwargs", "dropout", "eos_token_id", "tie_word_embeddings"):
        assert getattr(again, key) == getattr(cfg, key), key
    assert again.num_hidden_layers == 3 and again.hidden_size == 16
    assert MosaicsConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n_embd=30, n_head=4), "divisible by n_head"),
        (dict(n_layer=0), "n_layer must be a positive integer"),
        (dict(vocab_size=-5), "vocab_size must be a positive integer"),
        (dict(pmem_size=0), "pmem_size must be a positive integer"),
        (dict(dropout=1.5), "dropout must be in"),
    ],
)
def test_bad_configs_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MosaicsConfig(**kwargs)


def test_unknown_kernel_lists_registered(tiny_config):
    with pytest.raises(ValueError, match="unknown kernel 'nope'.*gaussian") as err:
        MosaicsForCausalLM(tiny_config(kernel="nope"))
    assert all(name in str(err.value) for name in available_kernels())


@pytest.mark.parametrize("splits", [[1] * 20, [7, 1, 1, 5, 6], [3, 17]])
@pytest.mark.parametrize("block", [128, 4])  # 4: the full forward runs blocked attention
def test_cached_logits_equal_full_forward(tiny_config, splits, block):
    torch.manual_seed(7)
    model = MosaicsForCausalLM(tiny_config(kernel_kwargs={"causal_block": block})).eval()
    ids = torch.randint(0, 61, (3, 20))
    full = model(ids, use_cache=False).logits
    cache, parts, pos = None, [], 0
    for n in splits:
        out = model(ids[:, pos:pos + n], cache=cache, use_cache=True)
        cache, pos = out.cache, pos + n
        parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 20


def test_decoding_state_does_not_grow_for_leaky_parts(tiny_config):
    model = MosaicsForCausalLM(tiny_config()).eval()
    out = model(torch.randint(0, 61, (1, 5)), use_cache=True)
    layer = out.cache.layers[0]
    sizes = (layer.context[0].kbar.shape, layer.persistent.kbar.shape)
    for _ in range(6):
        out = model(torch.randint(0, 61, (1, 1)), cache=out.cache)
    layer = out.cache.layers[0]
    assert (layer.context[0].kbar.shape, layer.persistent.kbar.shape) == sizes
    assert layer.context[0].memory.keys.shape[2] == 10  # memory holds s <= t - 1


def test_generate_cached_equals_uncached(tiny_config):
    torch.manual_seed(8)
    model = MosaicsForCausalLM(tiny_config(eos_token_id=None)).eval()
    prompt = torch.randint(0, 61, (2, 6))
    greedy = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert greedy.shape == (2, 18)
    assert torch.equal(greedy, model.generate(prompt, max_new_tokens=12, do_sample=False,
                                              use_cache=False))
    beam = model.generate(prompt[:1], max_new_tokens=8, num_beams=3, do_sample=False)
    assert torch.equal(beam, model.generate(prompt[:1], max_new_tokens=8, num_beams=3,
                                            do_sample=False, use_cache=False))
    torch.manual_seed(9)
    s1 = model.generate(prompt, max_new_tokens=8, do_sample=True, num_return_sequences=2)
    torch.manual_seed(9)
    s2 = model.generate(prompt, max_new_tokens=8, do_sample=True, num_return_sequences=2,
                        use_cache=False)
    assert s1.shape == (4, 14) and torch.equal(s1, s2)


def test_generate_feeds_one_token_per_step_through_the_cache(tiny_config):
    """transformers' generate hands the model's own cache back (as ``cache``): after the
    prompt, every forward sees one new token and the same MosaicsCache."""
    model = MosaicsForCausalLM(tiny_config(eos_token_id=None)).eval()
    calls = []

    def record(module, args, kwargs, output):
        calls.append((kwargs["input_ids"].shape[1], kwargs.get("cache"), output.cache))

    handle = model.register_forward_hook(record, with_kwargs=True)
    try:
        model.generate(torch.randint(0, 61, (2, 5)), max_new_tokens=4, do_sample=False)
    finally:
        handle.remove()
    assert [n for n, _, _ in calls] == [5, 1, 1, 1]
    assert calls[0][1] is None and all(c is calls[0][2] for _, c, _ in calls[1:])
    assert isinstance(calls[0][2], MosaicsCache) and calls[-1][2].get_seq_length() == 8


def test_past_key_values_is_an_alias_of_cache(tiny_config):
    torch.manual_seed(15)
    model = MosaicsForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 61, (2, 9))
    full = model(ids).logits
    out = model(ids[:, :5], use_cache=True)
    assert out.past_key_values is out.cache and out["past_key_values"] is out.cache
    step = model(ids[:, 5:], past_key_values=out.past_key_values)
    torch.testing.assert_close(torch.cat([out.logits, step.logits], 1), full)
    assert step.cache is out.cache and step.cache.get_seq_length() == 9
    for m in (model, model.model):
        with pytest.raises(ValueError, match="two different decoding caches"):
            m(ids[:, :1], cache=step.cache, past_key_values=MosaicsCache(2))
    inputs = model.prepare_inputs_for_generation(ids, past_key_values=step.cache, use_cache=True)
    assert inputs["cache"] is step.cache and inputs["input_ids"].shape[1] == 0


def test_greedy_generation_is_argmax_of_full_forward(tiny_config):
    torch.manual_seed(10)
    model = MosaicsForCausalLM(tiny_config(eos_token_id=None)).eval()
    prompt = torch.randint(0, 61, (1, 4))
    out = model.generate(prompt, max_new_tokens=6, do_sample=False)
    logits = model(out, use_cache=False).logits
    assert torch.equal(out[0, 4:], logits[0, 3:-1].argmax(-1))


def test_gradient_checkpointing_same_gradients(tiny_config):
    torch.manual_seed(11)
    model = MosaicsForCausalLM(tiny_config()).train()
    ids = torch.randint(0, 61, (2, 16))
    model(ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing
    model(ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)


def test_loss_is_shifted_cross_entropy(tiny_config):
    torch.manual_seed(12)
    model = MosaicsForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 61, (2, 9))
    labels = ids.clone()
    labels[0, 4] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 61)
    expected = F.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    assert out.aux_loss is None and torch.equal(out.lm_loss, out.loss)


@pytest.mark.integration
def test_remote_code_loads_without_the_package(tiny_config, tmp_path):
    torch.manual_seed(13)
    model = MosaicsForCausalLM(tiny_config()).eval()
    model.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 61, (1, 11))
    with torch.no_grad():  # the inference path: the compiled CPU kernel trains only
        torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "ref.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["mosaics"] = None  # the package is not importable here
        import torch
        from transformers import AutoModelForCausalLM
        ref = torch.load({str(tmp_path / 'ref.pt')!r}, weights_only=True)
        m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r},
                                                 trust_remote_code=True).eval()
        assert type(m).__module__.startswith("transformers_modules"), type(m).__module__
        with torch.no_grad():
            assert torch.equal(m(ref["ids"]).logits, ref["logits"])
        g = m.generate(ref["ids"], max_new_tokens=3, do_sample=False)
        print("OK", tuple(g.shape))
    """)
    env = {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "OK (1, 14)" in res.stdout


def test_kernel_with_forward_only_decodes_through_default_step(tiny_config):
    """A user kernel that implements only forward still gives exact cached generation."""
    from mosaics.kernels import Kernel, register_kernel, strict_causal_mask

    @register_kernel("test_cauchy")
    class CauchyKernel(Kernel):
        def forward(self, keys, values, beta):
            cos = keys @ keys.transpose(-1, -2)
            w = 1.0 / (1.0 + beta.view(1, -1, 1, 1) * (1.0 - cos))
            w = w * strict_causal_mask(keys.shape[2], keys.device)
            return (w / w.sum(-1, keepdim=True).clamp_min(1e-20)) @ values

    torch.manual_seed(14)
    model = MosaicsForCausalLM(tiny_config(kernel="test_cauchy")).eval()
    ids = torch.randint(0, 61, (2, 12))
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :1], use_cache=True)
    parts = [out.logits]
    for t in range(1, 12):
        out = model(ids[:, t:t + 1], cache=out.cache)
        parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
