"""The v2 options inside the model (gated keys, SwiGLU persistent memory): v1 at init,
cached decoding equal to the full forward, training gradients, save / load round trip."""

from __future__ import annotations

import pytest
import torch

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.memory_v2 import GatedKeys, SwiGLUMemory

V2_OPTIONS = [dict(gated_keys=True), dict(persistent_memory="swiglu"),
              dict(gated_keys=True, persistent_memory="swiglu")]


def _config(**kw) -> MosaicsConfig:
    base = dict(vocab_size=61, n_layer=2, n_head=4, n_embd=32, dropout=0.0,
                leaky_chunk_size=8, block_size=64)
    return MosaicsConfig(**{**base, **kw})


def _gate_randomly(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GatedKeys):
                module.gate.weight.normal_(0, 0.2)
                module.decay.weight.normal_(0, 0.2)


def test_gated_keys_start_as_v1():
    torch.manual_seed(0)
    v1 = MosaicsForCausalLM(_config()).eval()
    v2 = MosaicsForCausalLM(_config(gated_keys=True)).eval()
    missing, unexpected = v2.load_state_dict(v1.state_dict(), strict=False)
    assert all("gated" in k for k in missing) and all("leaky_p" in k for k in unexpected)
    assert sum(isinstance(m, GatedKeys) for m in v2.modules()) == 2
    assert all((m.gate.weight == 0).all() for m in v2.modules() if isinstance(m, GatedKeys))
    ids = torch.randint(0, 61, (2, 40))
    torch.testing.assert_close(v2(ids).logits, v1(ids).logits, rtol=1e-5, atol=1e-5)
    _gate_randomly(v2)
    assert not torch.allclose(v2(ids).logits, v1(ids).logits, atol=1e-3)


@pytest.mark.parametrize("options", V2_OPTIONS)
def test_cached_decoding_equals_the_full_forward(options):
    torch.manual_seed(0)
    model = MosaicsForCausalLM(_config(**options)).eval()
    _gate_randomly(model)
    ids = torch.randint(1, 61, (2, 30))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :12], use_cache=True)
        cache, steps = out.cache, [out.logits]
        for t in range(12, 30):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
        out2 = model(ids[:, :12], use_cache=True)  # several tokens at once (extend)
        chunk = model(ids[:, 12:20], cache=out2.cache, use_cache=True).logits
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunk, full[:, 12:20], rtol=1e-4, atol=1e-4)
    greedy = model.generate(ids[:, :10], max_new_tokens=8, do_sample=False, pad_token_id=0)
    again = model.generate(ids[:, :10], max_new_tokens=8, do_sample=False, use_cache=False,
                           pad_token_id=0)
    assert torch.equal(greedy, again)


@pytest.mark.parametrize("options", V2_OPTIONS)
def test_training_step_and_causality(options):
    torch.manual_seed(0)
    model = MosaicsForCausalLM(_config(**options))
    _gate_randomly(model)
    ids = torch.randint(0, 61, (2, 24))
    model(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [n for n, g in grads.items() if g is None]
    model.eval()
    changed = ids.clone()
    changed[:, 15] = (changed[:, 15] + 1) % 61
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :15], b[:, :15])
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def test_swiglu_sizes_and_round_trip(tmp_path):
    torch.manual_seed(0)
    model = MosaicsForCausalLM(_config(persistent_memory="swiglu", gated_keys=True)).eval()
    swiglu = [m for m in model.modules() if isinstance(m, SwiGLUMemory)]
    assert len(swiglu) == 2 and swiglu[0].w1.weight.shape == (96, 32)  # 3 d hidden
    _gate_randomly(model)
    model.save_pretrained(tmp_path)
    again = MosaicsForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.persistent_memory == "swiglu" and again.config.gated_keys
    ids = torch.randint(0, 61, (1, 20))
    torch.testing.assert_close(again(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="persistent_memory must be one of"):
        _config(persistent_memory="mlp")
