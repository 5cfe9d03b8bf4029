"""Incremental decoding: every kernel's decoding step against the full forward, the growing
memory buffers, in-place running sums, beam-search reordering and batched generation."""

from __future__ import annotations

import pytest
import torch

from mosaics import MosaicsForCausalLM, available_kernels
from mosaics.cache import MIN_MEMORY_BUFFER, KernelMemory, MosaicsCache
from mosaics.kernels import get_kernel
from mosaics.kernels.base import gather_rows

KERNELS = [k for k in available_kernels() if not k.startswith("test_")]


def decode_one_by_one(model: MosaicsForCausalLM, ids: torch.Tensor, prompt: int):
    """Logits of a prompt forward then one token per call, and the final cache."""
    out = model(ids[:, :prompt], use_cache=True)
    parts = [out.logits]
    for t in range(prompt, ids.shape[1]):
        out = model(ids[:, t:t + 1], cache=out.cache)
        parts.append(out.logits)
    return torch.cat(parts, 1), out.cache


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("grad", [False, True])  # True: the paths that keep gradients
def test_decoding_step_equals_full_forward_batch_8(tiny_config, kernel, grad):
    torch.manual_seed(0)
    model = MosaicsForCausalLM(tiny_config(kernel=kernel)).eval()
    ids = torch.randint(0, 61, (8, 15))
    with torch.set_grad_enabled(grad):
        full = model(ids, use_cache=False).logits
        steps, cache = decode_one_by_one(model, ids, 6)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == 15


@pytest.mark.parametrize("kernel", ["gaussian", "epanechnikov", "biweight"])
def test_decoding_uses_the_single_row_path(tiny_config, kernel, monkeypatch):
    """Without gradients a decoding step asks the kernel for one row of weights."""
    model = MosaicsForCausalLM(tiny_config(kernel=kernel)).eval()
    ids = torch.randint(0, 61, (2, 9))
    calls = []
    if kernel == "gaussian":
        import mosaics.kernels.gaussian as module

        original = module.decode_softmax
        monkeypatch.setattr(module, "decode_softmax",
                            lambda *a: calls.append(1) or original(*a))
    else:  # the PyTorch row (epanechnikov's compiled row: tests/test_sparse_rows.py)
        import mosaics.kernels.entmax_kernel as entmax_module

        monkeypatch.setattr(entmax_module, "sparsemax_row", lambda *a: None)
        cls = type(model.model.blocks[0].cmem.kernel)
        original = cls.row_weights
        monkeypatch.setattr(cls, "row_weights",
                            lambda self, *a: calls.append(1) or original(self, *a))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        steps, _ = decode_one_by_one(model, ids, 5)
    assert len(calls) == 4 * model.config.n_layer
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["epanechnikov", "biweight"])
def test_sorted_row_solvers_equal_the_training_normalizer(name):
    kernel = get_kernel(name)
    torch.manual_seed(1)
    for S, scale in [(1, 7.0), (5, 1.0), (300, 7.4), (300, 500.0), (64, 22026.0)]:
        cos = torch.rand(3, 4, 1, S, dtype=torch.float64) * 2 - 1
        cos[0, 0, 0, : min(S, 3)] = 0.99  # ties at the top
        beta = torch.full((1, 4, 1, 1), scale, dtype=torch.float64)
        expected = kernel.weights(cos, beta, torch.ones(1, S, dtype=torch.bool))
        weights, index = kernel.row_weights(cos, beta)  # the top candidates only
        got = torch.zeros_like(cos).scatter(-1, index, weights)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 1, dtype=torch.float64))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_memory_append_writes_in_place_and_grows(mode):
    memory = KernelMemory(torch.zeros(2, 3, 0, 4), torch.zeros(2, 3, 0, 4))
    parts = []
    ptrs = set()
    with getattr(torch, mode)():  # inference-mode views have no _base: still in place
        for step in range(3 * MIN_MEMORY_BUFFER):
            new = torch.randn(2, 3, 1 if step else 5, 4)
            parts.append(new)
            memory = memory.append(new, -new)
            ptrs.add(memory.keys.data_ptr())
            torch.testing.assert_close(memory.keys, torch.cat(parts, 2))
            torch.testing.assert_close(memory.values, -torch.cat(parts, 2))
    # 5 + 64 entries, then 70 + 64, then 135 + 64: below 4 * 64 the headroom is the minimum
    assert len(ptrs) == 3
    assert memory.buffers[0].shape[2] == 135 + MIN_MEMORY_BUFFER
    big = KernelMemory(torch.zeros(1, 1, 1000, 2), torch.zeros(1, 1, 1000, 2))
    big = big.append(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    assert big.buffers[1].shape[2] == 1001 + 1001 // 4  # a quarter on top, not double
    # dropped entries: views of the kept ones, which move to a fresh buffer at the next append
    kept = memory.drop_first(10)
    assert kept.buffers is None and torch.equal(kept.keys, memory.keys[:, :, 10:])
    grown = kept.append(torch.ones(2, 3, 1, 4), torch.ones(2, 3, 1, 4))
    assert grown.keys.data_ptr() != memory.keys.data_ptr() and len(grown) == len(memory) - 9


def test_memory_append_never_writes_into_a_callers_tensor():
    mine = torch.randn(2, 3, 10, 4)
    snapshot = mine.clone()
    memory = KernelMemory(mine[:, :, :6], mine[:, :, :6])  # views with room behind
    out = memory.append(torch.ones(2, 3, 2, 4), torch.ones(2, 3, 2, 4))
    assert torch.equal(mine, snapshot) and out.keys.data_ptr() != mine.data_ptr()
    torch.testing.assert_close(out.keys, torch.cat([snapshot[:, :, :6],
                                                    torch.ones(2, 3, 2, 4)], 2))


def test_memory_append_keeps_gradients():
    memory = KernelMemory(torch.zeros(1, 2, 0, 3), torch.zeros(1, 2, 0, 3))
    memory = memory.append(torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3))
    new = torch.randn(1, 2, 1, 3, requires_grad=True)
    out = memory.append(new, new)
    (out.keys.sum() + out.values.sum()).backward()
    torch.testing.assert_close(new.grad, 2 * torch.ones_like(new))


def test_reordering_a_cache_drops_its_buffers():
    """Beam search's reorder makes fresh tensors: the memory must not append behind them as
    if they were still its buffers."""
    memory = KernelMemory(torch.zeros(2, 1, 0, 2), torch.zeros(2, 1, 0, 2))
    memory = memory.append(torch.randn(2, 1, 3, 2), torch.randn(2, 1, 3, 2))
    cache = MosaicsCache(1)
    cache.layers[0] = memory
    cache.reorder_cache(torch.tensor([1, 0]))
    swapped = cache.layers[0]
    assert swapped.buffers is None and torch.equal(swapped.keys, memory.keys.flip(0))


def test_decoding_updates_buffers_and_sums_in_place(tiny_config):
    model = MosaicsForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        out = model(ids[:, :4], use_cache=True)
        layer = out.cache.layers[0]
        ptrs = (layer.context[0].memory.keys.data_ptr(),
                layer.context[0].memory.values.data_ptr(),
                layer.context[0].kbar.data_ptr(), layer.persistent.kbar.data_ptr())
        for t in range(4, 12):
            out = model(ids[:, t:t + 1], cache=out.cache)
    layer = out.cache.layers[0]
    assert ptrs == (layer.context[0].memory.keys.data_ptr(),
                    layer.context[0].memory.values.data_ptr(),
                    layer.context[0].kbar.data_ptr(), layer.persistent.kbar.data_ptr())
    assert layer.context[0].memory.keys.shape[2] == 11  # memory holds s <= t - 1


@pytest.mark.parametrize("kernel", ["gaussian", "epanechnikov", "fska"])
def test_reorder_and_repeat_the_decoding_buffers(tiny_config, kernel):
    """Beam search selects and repeats batch rows of a cache with buffers in mid-growth."""
    torch.manual_seed(2)
    model = MosaicsForCausalLM(tiny_config(kernel=kernel)).eval()
    ids = torch.randint(0, 61, (3, 14))
    rows = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        out = model(ids[:, :5], use_cache=True)
        for t in range(5, 8):
            out = model(ids[:, t:t + 1], cache=out.cache)
        out.cache.reorder_cache(rows)
        out.cache.batch_repeat_interleave(2)
        chosen = ids[rows].repeat_interleave(2, dim=0)
        parts = []
        for t in range(8, 14):
            out = model(chosen[:, t:t + 1], cache=out.cache)
            parts.append(out.logits)
        full = model(chosen, use_cache=False).logits
    torch.testing.assert_close(torch.cat(parts, 1), full[:, 8:], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["gaussian", "epanechnikov"])
def test_batched_generate_cached_equals_recomputed(tiny_config, kernel):
    torch.manual_seed(3)
    model = MosaicsForCausalLM(tiny_config(kernel=kernel, eos_token_id=None)).eval()
    prompt = torch.randint(1, 61, (8, 7))
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, **kw)
    assert cached.shape == (8, 17)
    assert torch.equal(cached, model.generate(prompt, use_cache=False, **kw))


@pytest.mark.parametrize("kernel", ["gaussian", "epanechnikov"])
def test_bf16_decoding_tracks_the_full_forward(tiny_config, kernel):
    """bf16 autocast and a bf16 model decode through the same paths (loose tolerance)."""
    torch.manual_seed(4)
    model = MosaicsForCausalLM(tiny_config(kernel=kernel)).eval()
    ids = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            full = model(ids, use_cache=False).logits
            steps, _ = decode_one_by_one(model, ids, 5)
        torch.testing.assert_close(steps.float(), full.float(), atol=0.05, rtol=0.05)
        model.to(torch.bfloat16)
        full = model(ids, use_cache=False).logits
        steps, _ = decode_one_by_one(model, ids, 5)
    assert steps.dtype == torch.bfloat16
    torch.testing.assert_close(steps.float(), full.float(), atol=0.05, rtol=0.05)


def test_gather_rows_equals_gather_on_buffers_and_other_layouts():
    torch.manual_seed(5)
    buffer = torch.randn(3, 2, 10, 4)
    for x in (buffer[:, :, :7], buffer[1:, :, 2:9], buffer[:, :, :7].contiguous(),
              buffer.transpose(0, 1)[:, :, :7]):
        B, H, S, D = x.shape
        index = torch.randint(0, S, (B, H, 5))
        expected = x.gather(2, index.unsqueeze(-1).expand(B, H, -1, D))
        assert torch.equal(gather_rows(x, index), expected)


@pytest.mark.parametrize("scale", [7.4, 22026.0])  # many candidates (a dense row), few
def test_decode_row_equals_the_dense_weights(scale):
    from mosaics.kernels.base import decode_row

    kernel = get_kernel("epanechnikov")
    torch.manual_seed(2)
    keys = torch.randn(2, 4, 300, 8, dtype=torch.float64)
    keys[:, :, 100:] = keys[:, :, -1:] + 0.05 * keys[:, :, 100:]  # near the query: candidates
    keys = torch.nn.functional.normalize(keys, dim=-1)
    values = torch.randn(2, 4, 300, 8, dtype=torch.float64)
    query = keys[:, :, -1:]
    beta = torch.full((4,), scale, dtype=torch.float64)
    cos = query @ keys.transpose(-1, -2)
    count = kernel.row_weights(cos, beta.view(1, 4, 1, 1))[1].shape[-1]
    assert (count * 8 >= 300) == (scale < 100)  # both paths of decode_row are taken
    weights = kernel.weights(cos, beta.view(1, 4, 1, 1), torch.ones(1, 300, dtype=torch.bool))
    torch.testing.assert_close(decode_row(kernel, query, keys, values, beta), weights @ values)
