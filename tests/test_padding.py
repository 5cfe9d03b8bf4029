"""Padding by ``attention_mask``: each row of a padded batch gives what its unpadded tokens
give alone (the independent reference: the same model run on the row without padding), in
training forward, prompt and decoding, for every kernel and the v2 options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mosaics import MosaicsConfig, MosaicsForCausalLM, available_kernels

SEP = 5
KERNELS = [k for k in available_kernels() if not k.startswith("test_")]
V2 = dict(gated_keys=True, adaptive_bandwidth=True, document_masking=True,
          persistent_memory="swiglu", three_level_memory=True, short_term_window=6,
          long_term_gap=4)
CONFIGS = ([dict(kernel=k) for k in KERNELS]
           + [dict(alibi=True), dict(alibi=True, kernel="epanechnikov"), V2,
              dict(V2, kernel="fska", kernel_kwargs=dict(num_features=6, flow_hidden=8,
                                                         flow_layers=1, chunk_size=4)),
              dict(adaptive_bandwidth=True), dict(gated_keys=True)])
LENGTHS = [9, 4, 13, 1]


def _model(seed: int = 0, **kw) -> MosaicsForCausalLM:
    base = dict(vocab_size=61, n_layer=2, n_head=4, n_embd=32, dropout=0.0,
                leaky_chunk_size=4, block_size=64, eos_token_id=SEP)
    torch.manual_seed(seed)
    return MosaicsForCausalLM(MosaicsConfig(**{**base, **kw})).double().eval()


def _prompts(lengths: list[int], seed: int = 1, separators: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(SEP + 1, 61, (n,), generator=g) for n in lengths]
    if separators:  # a document boundary inside the longer prompts
        for p in out:
            if len(p) > 6:
                p[len(p) // 2] = SEP
    return out


def _left_pad(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = p, 1
    return ids, mask


@torch.no_grad()
def _greedy(model: MosaicsForCausalLM, ids: torch.Tensor, mask: torch.Tensor,
            steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding by hand with the cache, the mask growing as generate grows it:
    (new tokens (B, steps), logits of the prompt's last token and each step (B, steps, V))."""
    out = model(ids, attention_mask=mask, use_cache=True)
    logits, tokens = [out.logits[:, -1]], []
    for _ in range(steps - 1):
        nxt = logits[-1].argmax(-1, keepdim=True)
        tokens.append(nxt)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        out = model(nxt, attention_mask=mask, cache=out.cache, use_cache=True)
        logits.append(out.logits[:, -1])
    tokens.append(logits[-1].argmax(-1, keepdim=True))
    return torch.cat(tokens, 1), torch.stack(logits, 1)


@pytest.mark.parametrize("options", CONFIGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in
                                                                     o.items()
                                                                     if k != "kernel_kwargs"))
def test_left_padded_rows_equal_their_unpadded_prompts(options):
    """float64: the prompt logits (with and without the cache) and greedy decoding with the
    cache, row by row, equal the unpadded prompt's to 1e-6, tokens identical."""
    model = _model(**options)
    prompts = _prompts(LENGTHS, separators=bool(options.get("document_masking")))
    ids, mask = _left_pad(prompts)
    T = ids.shape[1]
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    tokens, logits = _greedy(model, ids, mask, 6)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            alone = model(p[None], use_cache=False).logits[0]
        torch.testing.assert_close(full[b, T - len(p):], alone, atol=1e-6, rtol=0)
        ref_tokens, ref_logits = _greedy(model, p[None], torch.ones(1, len(p), dtype=torch.long),
                                         6)
        assert torch.equal(tokens[b], ref_tokens[0])
        torch.testing.assert_close(logits[b], ref_logits[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("options", [dict(), dict(alibi=True), V2], ids=["v1", "alibi", "v2"])
def test_padded_training_gradients_equal_the_unpadded_rows(options):
    """The summed loss of a left-padded batch (pads labelled -100) has the gradient of the
    sum of the rows' own losses: nothing flows through or from the pads."""
    model = _model(**options).train()
    prompts = _prompts([7, 3, 11], seed=2, separators=bool(options.get("document_masking")))
    ids, mask = _left_pad(prompts)
    targets = ids[:, 1:].masked_fill(mask[:, :-1] == 0, -100)  # no prediction from a pad
    logits = model(ids, attention_mask=mask, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(),
                           ignore_index=-100, reduction="sum")
    padded = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    ref = 0
    for p in prompts:
        out = model(p[None], use_cache=False).logits[0]
        ref = ref + F.cross_entropy(out[:-1], p[1:], reduction="sum")
    alone = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(loss, ref, atol=1e-9, rtol=1e-9)
    for g, r in zip(padded, alone):
        if r is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, r, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("options", [dict(), V2], ids=["v1", "v2"])
def test_right_padding_and_holes(options):
    """Right padding leaves the real tokens as they are; a hole in the mask separates two
    documents, each of which gives what it gives alone."""
    model = _model(**options)
    a, b, c = _prompts([6, 5, 8], seed=3)
    ids = torch.zeros(2, 14, dtype=torch.long)
    mask = torch.zeros(2, 14, dtype=torch.long)
    ids[0, :6], mask[0, :6] = a, 1  # right padding
    ids[1, :5], mask[1, :5] = b, 1  # hole at 5..5, then c
    ids[1, 6:], mask[1, 6:] = c, 1
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
        alone = [model(p[None]).logits[0] for p in (a, b, c)]
    torch.testing.assert_close(out[0, :6], alone[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[1, :5], alone[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[1, 6:], alone[2], atol=1e-6, rtol=0)


@pytest.mark.parametrize("options", [dict(), dict(kernel="fska"), V2], ids=["v1", "fska", "v2"])
def test_generate_left_padded_batch_equals_one_at_a_time(options):
    """transformers' generate on a left-padded batch (greedy, and beam search, which reorders
    the cache) returns each prompt's own generation."""
    model = _model(**options)
    prompts = _prompts([7, 2, 10, 5], seed=4)
    ids, mask = _left_pad(prompts)
    for extra in (dict(), dict(num_beams=2)):
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None, **extra)
        batch = model.generate(ids, attention_mask=mask, **kw)[:, ids.shape[1]:]
        for b, p in enumerate(prompts):
            one = model.generate(p[None], attention_mask=torch.ones_like(p[None]), **kw)
            assert torch.equal(batch[b], one[0, len(p):]), (extra, b)


def test_decoding_with_this_calls_mask_only():
    """A decoding call may pass the mask of its own tokens only: the cache remembers the
    padding; and an unpadded batch gives the same logits with and without a mask."""
    model = _model()
    prompts = _prompts([8, 3], seed=5)
    ids, mask = _left_pad(prompts)
    nxt = torch.tensor([[7], [9]])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        full_mask = model(nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1),
                          cache=out.cache, use_cache=True).logits
        out = model(ids, attention_mask=mask, use_cache=True)
        own_mask = model(nxt, attention_mask=torch.ones_like(nxt), cache=out.cache,
                         use_cache=True).logits
        no_mask = model(nxt, cache=model(ids, attention_mask=mask, use_cache=True).cache).logits
        torch.testing.assert_close(own_mask, full_mask, atol=0, rtol=0)
        torch.testing.assert_close(no_mask, full_mask, atol=0, rtol=0)
        plain = torch.randint(6, 61, (2, 9))
        torch.testing.assert_close(model(plain, attention_mask=torch.ones_like(plain)).logits,
                                   model(plain).logits, atol=0, rtol=0)


@pytest.mark.parametrize("options", [dict(), V2], ids=["v1", "v2"])
def test_padding_inside_a_continued_cache_is_refused(options):
    """A right-padded prompt continued by decoding would put padding between real tokens:
    refused with the fix (left padding)."""
    model = _model(**options)
    ids = torch.randint(6, 61, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).cache
        with pytest.raises(ValueError, match="padding_side = 'left'"):
            model(torch.tensor([[7], [8]]), attention_mask=torch.cat(
                [mask, torch.ones(2, 1, dtype=torch.long)], 1), cache=cache)


def test_bad_mask_shape_is_refused():
    model = _model()
    ids = torch.randint(6, 61, (2, 6))
    with pytest.raises(ValueError, match="attention_mask must be"):
        model(ids, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask must be"):
        model(ids, attention_mask=torch.ones(2, 1, 6, 6))


def test_text_generation_pipeline_batches_prompts_of_different_lengths():
    """pipeline("text-generation") with batch_size 4 over prompts of different lengths
    (left-padded by the pipeline's tokenizer) returns the one-at-a-time generations."""
    from transformers import pipeline

    from mosaics.data.tokenizer import train_bpe_tokenizer

    texts = ["the cat sat on the mat", "a dog ran in the park", "the sun is warm today",
             "birds sing in the morning", "we read a book at night"] * 4
    tok = train_bpe_tokenizer(texts, vocab_size=300)
    tok.padding_side = "left"
    torch.manual_seed(0)
    model = MosaicsForCausalLM(MosaicsConfig(vocab_size=len(tok), n_layer=2, n_head=4,
                                             n_embd=32, dropout=0.0, block_size=64,
                                             eos_token_id=tok.eos_token_id)).eval()
    gen = pipeline("text-generation", model=model, tokenizer=tok)
    prompts = ["the cat", "a dog ran in the", "birds", "we read a book at night and"]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    one = [gen(p, **kw)[0]["generated_text"] for p in prompts]
    masks = []
    model.model.register_forward_pre_hook(
        lambda _, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True)
    batched = [r[0]["generated_text"] for r in gen(prompts, batch_size=4, **kw)]
    assert batched == one
    first = masks[0]  # the prompt call: four rows, left-padded
    assert first.shape[0] == 4 and not first[:, 0].all() and first[:, -1].all()


def test_gaussian_decoding_step_with_an_interval_per_row():
    """The Gaussian kernel's one-query retrieval with a different interval per batch row (a
    left-padded batch decoding) against the base class's row-by-row forward."""
    from mosaics.kernels import get_kernel
    from mosaics.kernels.base import Kernel

    kernel = get_kernel("gaussian")
    g = torch.Generator().manual_seed(6)
    q, k, v = (F.normalize(torch.randn(4, 3, n, 8, generator=g, dtype=torch.float64), dim=-1)
               for n in (1, 12, 12))
    beta = torch.tensor([1.0, 5.0, 20.0], dtype=torch.float64)
    lo = torch.tensor([[0], [3], [11], [7]])
    hi = torch.tensor([[11], [11], [10], [11]])  # row 2 sees nothing
    got = kernel.attend(q, k, v, beta, lo, hi)
    torch.testing.assert_close(got, Kernel.attend(kernel, q, k, v, beta, lo, hi),
                               atol=1e-12, rtol=1e-10)
    assert not got[2].any()
