"""Model FLOPs per token, device peaks and the MFU figures of the training log."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.baselines import gpt2_config_like
from mosaics.training.flops import (
    device_peak,
    flops_per_token,
    gpu_peak,
    measured_cpu_peak,
    mosaics_forward_flops,
)
from mosaics.training.trainer import speed_postfix


def test_mosaics_forward_flops_match_the_counted_matmuls() -> None:
    """Without retrieval (T = 1: no query sees an entry) the count is the matrix products
    torch's FLOP counter sees in a forward with the logits (the plain head)."""
    config = MosaicsConfig(vocab_size=97, n_layer=2, n_head=4, n_embd=32, block_size=8,
                           loss_chunk_size=0)
    model = MosaicsForCausalLM(config).eval()
    ids = torch.randint(0, 97, (3, 1))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert mosaics_forward_flops(config, 1) * ids.numel() == counter.get_total_flops()


def test_retrieval_flops_grow_with_the_entries_a_query_sees() -> None:
    v1 = MosaicsConfig(vocab_size=97, n_layer=1, n_head=4, n_embd=32)
    d = v1.n_embd
    # strict past: query t sees t entries, mean (T - 1) / 2; 4 d FLOPs per entry
    assert mosaics_forward_flops(v1, 9) - mosaics_forward_flops(v1, 1) == 4 * d * 4
    v2 = MosaicsConfig.v2(vocab_size=97, n_layer=1, n_head=4, n_embd=32, short_term_window=4,
                          long_term_gap=3, long_term_gap_range=None, eos_token_id=0)
    # T = 6: short-term sees min(t, 3) = 0 1 2 3 3 3, long-term max(0, t - 2) = 0 0 0 1 2 3
    assert mosaics_forward_flops(v2, 6) - mosaics_forward_flops(v2, 1) == 4 * d * (12 + 6) / 6


def test_124m_shapes_do_about_the_same_flops_as_gpt2() -> None:
    config = MosaicsConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    for T in (512, 2048):
        ours = flops_per_token(config, T)
        gpt2 = flops_per_token(gpt2_config_like(config, n_positions=T), T)
        assert 0.9 < ours / gpt2 < 1.1
        assert 6 * 124e6 < gpt2 < 6 * 124e6 + 12 * 12 * 768 * T  # nanoGPT's count bounds it


def test_peaks_by_device_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert gpu_peak("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert gpu_peak("NVIDIA H200", torch.float32) == 67e12
    assert gpu_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert gpu_peak("NVIDIA A10", torch.bfloat16) == 125e12
    assert gpu_peak("Some Future GPU", torch.bfloat16) is None
    peak, source = device_peak(torch.device("cpu"), "no")
    assert peak == measured_cpu_peak(torch.float32) and peak > 1e8 and "measured" in source
    monkeypatch.setenv("MOSAICS_PEAK_FLOPS", "1e15")
    assert device_peak(torch.device("cpu"), "no") == (1e15, "MOSAICS_PEAK_FLOPS")


def test_progress_line_shows_tokens_per_second_and_mfu() -> None:
    assert speed_postfix({"tokens_per_s": 12345.6, "mfu": 0.4217}) == {"tok/s": "12,346",
                                                                       "mfu": "42.2%"}
    assert speed_postfix({"lr": 1.0}) == {}


def test_measuring_the_cpu_peak_leaves_the_global_random_state_alone():
    """The run owns the global generator (dropout, data order, a resume's restored state)."""
    from mosaics.training.flops import measured_cpu_peak

    measured_cpu_peak.cache_clear()
    before = torch.random.get_rng_state()
    assert measured_cpu_peak(torch.float32, n=64, repeats=1) > 0
    assert torch.equal(torch.random.get_rng_state(), before)
