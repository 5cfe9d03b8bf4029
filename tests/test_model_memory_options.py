"""The memory options inside the whole model (gated keys, SwiGLU persistent memory, adaptive
bandwidth, three-level memory, document masking, and the preset with all of them): v1 at init,
each option against an explicit loop, cached decoding equal to the full forward, documents
isolated, training gradients, save / load round trip. The options as modules against their
formulas: test_memory_options.py."""

from __future__ import annotations

import pytest
import torch

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.memory import ContextualMemory, GatedKeys
from mosaics.persistent_memory import SwiGLUMemory
from mosaics.positions import Positions, document_positions
from mosaics.reference import contextual_memory_reference, reference_logits

SMALL_LEVELS = dict(three_level_memory=True, short_term_window=6, long_term_gap=4,
                    long_term_gap_range=[3, 7])
OPTIONS = [dict(gated_keys=True), dict(persistent_memory="swiglu"),
              dict(gated_keys=True, persistent_memory="swiglu"),
              dict(adaptive_bandwidth=True), SMALL_LEVELS, dict(document_masking=True),
              dict(adaptive_bandwidth=True, document_masking=True, kernel="epanechnikov"),
              dict(gated_keys=True, adaptive_bandwidth=True, document_masking=True,
                   persistent_memory="swiglu", **SMALL_LEVELS),
              dict(kernel="fska", gated_keys=True, document_masking=True, **SMALL_LEVELS,
                   kernel_kwargs=dict(num_features=6, flow_hidden=8, flow_layers=1,
                                      chunk_size=4, linear_intervals=True))]
SEP = 0  # the document separator (eos) of these tests


def _config(**kw) -> MosaicsConfig:
    base = dict(vocab_size=61, n_layer=2, n_head=4, n_embd=32, dropout=0.0,
                leaky_chunk_size=8, block_size=64, eos_token_id=SEP)
    return MosaicsConfig(**{**base, **kw})


def _with_documents(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Random ids with a few separators (documents of different lengths per row)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 61, (batch, length), generator=g)
    ids[0, [7, 19]] = SEP
    ids[-1, [12, 13, 25]] = SEP  # an empty document too
    return ids


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


@pytest.mark.parametrize("options", OPTIONS)
def test_cached_decoding_equals_the_full_forward(options):
    torch.manual_seed(0)
    model = MosaicsForCausalLM(_config(**options)).eval()
    _gate_randomly(model)
    ids = _with_documents(2, 30)
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


@pytest.mark.parametrize("options", OPTIONS)
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


# --- adaptive bandwidth, three-level memory, documents ----------------------------------------

def test_all_options_logits_match_reference_model():
    """Every option at once, the whole stack against the position-by-position reference."""
    torch.manual_seed(3)
    cfg = _config(gated_keys=True, adaptive_bandwidth=True, persistent_memory="swiglu",
                  **{**SMALL_LEVELS, "long_term_gap_range": None})
    model = MosaicsForCausalLM(cfg).double().eval()
    _gate_randomly(model)
    ids = torch.randint(1, 61, (2, 17))
    torch.testing.assert_close(model(ids).logits, reference_logits(model, ids),
                               rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("level,options", [
    ("all", dict(adaptive_bandwidth=True)),
    ("all", dict(document_masking=True)),
    ("short", dict(three_level_memory=True, short_term_window=5)),
    ("long", dict(three_level_memory=True, long_term_gap=3)),
    ("short", dict(three_level_memory=True, short_term_window=4, adaptive_bandwidth=True,
                   document_masking=True)),
    ("long", dict(three_level_memory=True, long_term_gap=2, adaptive_bandwidth=True,
                  document_masking=True)),
])
def test_contextual_memory_against_explicit_loops(level, options):
    torch.manual_seed(0)
    mem = ContextualMemory(_config(**options), level=level).double()
    with torch.no_grad():
        mem.bandwidth_b.mul_(3.0) if mem.bandwidth_b is not None else None
        if mem.adaptive is not None:
            mem.adaptive.theta2.fill_(0.6)
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    starts = torch.zeros(2, 21, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, [5, 6, 14]] = True
    starts[1, 9] = True
    docs, doc_starts = document_positions(starts)
    masking = options.get("document_masking", False)
    pos = Positions(gap=options.get("long_term_gap", 64) if level == "long" else 1,
                    documents=docs if masking else None,
                    doc_starts=doc_starts if masking else None)
    y, _ = mem(x, pos)
    ref = contextual_memory_reference(mem, x, pos.gap, docs if masking else None)
    torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-9)


def test_document_positions():
    starts = torch.tensor([[True, False, True, True, False], [False, False, False, True, False]])
    ids, first = document_positions(starts, offset=10, last_start=torch.tensor([0, 7]),
                                    last_id=torch.tensor([0, 4]))
    assert ids.tolist() == [[1, 1, 2, 3, 3], [4, 4, 4, 5, 5]]
    assert first.tolist() == [[10, 10, 12, 13, 13], [7, 7, 7, 13, 13]]


@pytest.mark.parametrize("options", [dict(), dict(adaptive_bandwidth=True, kernel="triweight"),
                                     dict(gated_keys=True, persistent_memory="swiglu",
                                          adaptive_bandwidth=True, **SMALL_LEVELS)])
def test_documents_do_not_see_each_other(options):
    """With document masking the logits of a document are those of the document alone,
    whatever precedes it; given by separators or by document_ids."""
    torch.manual_seed(0)
    model = MosaicsForCausalLM(_config(document_masking=True, **options)).eval()
    _gate_randomly(model)
    ids = torch.randint(1, 61, (2, 36))
    ids[:, 14] = SEP
    with torch.no_grad():
        packed = model(ids).logits
        alone = model(ids[:, 15:]).logits
        first = model(ids[:, :15]).logits
        by_ids = model(ids, document_ids=(torch.arange(36) >= 15).long().expand(2, 36)).logits
        unmasked = MosaicsForCausalLM(_config(**options)).eval()
        unmasked.load_state_dict(model.state_dict())
        leaky = unmasked(ids).logits
    torch.testing.assert_close(packed[:, 15:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, :15], first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_ids, packed, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky[:, 15:], alone, atol=1e-3)  # without the option: mixed
    with pytest.raises(ValueError, match="document_masking needs the documents"):
        model(inputs_embeds=model.model.wte(ids))


def test_long_term_gap_drawn_per_training_batch():
    model = MosaicsForCausalLM(_config(**SMALL_LEVELS))
    ids = torch.randint(1, 61, (1, 8))
    gaps = {model.model.positions(ids, None, ids.shape, None, ids.device).gap
            for _ in range(60)}
    assert gaps <= set(range(3, 8)) and len(gaps) > 2
    model.eval()
    assert model.model.positions(ids, None, ids.shape, None, ids.device).gap == 4


def test_short_term_decoding_memory_stays_bounded():
    torch.manual_seed(0)
    model = MosaicsForCausalLM(_config(**SMALL_LEVELS)).eval()
    ids = torch.randint(1, 61, (1, 60))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :3], use_cache=True)
        steps = [out.logits]
        for t in range(3, 60):
            out = model(ids[:, t:t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
            short = out.cache.layers[0].context[0]
            assert short.memory.keys.shape[2] <= 2 * (6 - 1) + 1
    long = out.cache.layers[0].context[1]
    assert long.memory.keys.shape[2] == 59  # every entry: the long-term memory sees them all
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


def test_v2_preset_round_trip(tmp_path):
    config = MosaicsConfig.v2(vocab_size=61, n_layer=2, n_head=4, n_embd=32, eos_token_id=SEP,
                              kernel="epanechnikov", short_term_window=8)
    assert (config.gated_keys and config.adaptive_bandwidth and config.three_level_memory
            and config.document_masking and config.persistent_memory == "swiglu")
    assert (config.short_term_window, config.long_term_gap, config.long_term_gap_range) == \
        (8, 64, [64, 256])
    torch.manual_seed(0)
    model = MosaicsForCausalLM(config).eval()
    _gate_randomly(model)
    model.save_pretrained(tmp_path)
    again = MosaicsForCausalLM.from_pretrained(tmp_path).eval()
    fields = ("gated_keys", "adaptive_bandwidth", "three_level_memory", "short_term_window",
              "long_term_gap", "long_term_gap_range", "document_masking", "persistent_memory",
              "kernel")
    assert all(getattr(again.config, f) == getattr(config, f) for f in fields)
    ids = _with_documents(2, 80)
    torch.testing.assert_close(again(ids).logits, model(ids).logits)


@pytest.mark.parametrize("field,value,message", [
    ("short_term_window", 1, "short_term_window must be an integer >= 2"),
    ("long_term_gap", 0, "long_term_gap must be an integer >= 1"),
    ("long_term_gap_range", [9, 3], "long_term_gap_range must be"),
])
def test_memory_level_options_are_checked(field, value, message):
    with pytest.raises(ValueError, match=message):
        _config(**{field: value})
