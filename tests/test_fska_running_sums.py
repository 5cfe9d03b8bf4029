"""FSKA decoding through running sums in the model's interval memories (short-term window,
long-term gap): every step equals the full forward without the dense attend, the long-term
cache stops growing, and beam search reorders the sums."""

from __future__ import annotations

import pytest
import torch
from test_model_memory_options import SEP, SMALL_LEVELS, _config, _gate_randomly, _with_documents

from mosaics import MosaicsForCausalLM


def test_fska_decodes_intervals_with_running_sums(monkeypatch):
    """v2 FSKA at one bandwidth per head: after the prompt, every decoding step goes through
    FSKAKernel.step's running sums (never the dense attend) and equals the full forward,
    across window trims and document restarts; after the first step, which sums its
    interval, each step forms features of O(1) keys."""
    from mosaics.kernels import fska

    options = dict(kernel="fska", gated_keys=True, document_masking=True, **SMALL_LEVELS,
                   kernel_kwargs=dict(num_features=6, flow_hidden=8, flow_layers=1,
                                      chunk_size=4))
    torch.manual_seed(0)
    model = MosaicsForCausalLM(_config(**options)).eval()
    _gate_randomly(model)
    ids = _with_documents(2, 48, seed=3)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :10], use_cache=True)
    rows = []
    real = fska.elu1_features

    def counting(x, w1, w2):
        rows.append(x.shape[2])
        return real(x, w1, w2)

    def no_dense(*args, **kwargs):
        raise AssertionError("a decoding step took the dense attend")

    monkeypatch.setattr(fska.FSKAKernel, "attend", no_dense)
    monkeypatch.setattr(fska, "elu1_features", counting)
    cache, steps = out.cache, [out.logits]
    with torch.no_grad():
        for t in range(10, 48):
            rows.clear()
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
            # one feature call per memory; after the first step, documents included: on the
            # key that enters, the one that leaves, the query
            memories = sum(len(layer.context) for layer in cache.layers)
            assert len(rows) == memories and (t == 10 or max(rows) <= 3), rows
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    memory = cache.layers[0].context[0].memory  # the short-term memory keeps its sums
    assert memory.sums.S.dtype == torch.float64 and len(memory) <= 2 * 6


def test_fska_long_term_memory_keeps_only_the_entries_its_sums_do_not_hold():
    """With running sums the long-term memory drops the entries they hold, so the cache stops
    growing with the context; decoding still equals the full forward (documents, a prompt of
    several tokens continued by several tokens at once), and a cache so trimmed refuses the
    dense path instead of answering from missing entries."""
    options = dict(kernel="fska", document_masking=True, **SMALL_LEVELS, block_size=512,
                   kernel_kwargs=dict(num_features=6, flow_hidden=8, flow_layers=1,
                                      chunk_size=4))
    torch.manual_seed(0)
    model = MosaicsForCausalLM(_config(**options)).eval()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 61, (2, 260), generator=g)
    ids[0, [40, 170]] = SEP
    ids[1, 120] = SEP
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :20], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(20, 250):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.cache
        steps.append(model(ids[:, 250:], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    long = cache.layers[0].context[1]
    assert long.memory.keys.shape[2] <= 2 * 64 + 10 and long.base > 100
    with pytest.raises(RuntimeError, match="running sums"):
        model(ids[:, 250:252], cache=cache, use_cache=True)  # grad enabled: the dense path


def test_fska_running_sums_follow_beam_search():
    """Beam search reorders every tensor of the cache, the running sums and their bounds
    included: generation with the cache equals generation without it, past the first trims
    of the long-term memory."""
    options = dict(kernel="fska", document_masking=True, **SMALL_LEVELS, block_size=512,
                   kernel_kwargs=dict(num_features=6, flow_hidden=8, flow_layers=1,
                                      chunk_size=4))
    torch.manual_seed(0)
    model = MosaicsForCausalLM(_config(**options)).eval()
    ids = torch.randint(1, 61, (2, 90), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=40, num_beams=3, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))
