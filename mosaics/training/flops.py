"""How well a run uses its hardware: model FLOPs per token, the device's peak, MFU.

Model FLOPs per training token = 3 x the forward's matrix-product FLOPs (the backward costs
two forwards), counted for the block that trains, 2 FLOPs per multiply-add:

- Memory Mosaics contextual memory, per layer: the key and value projections (4 d^2; 2 d^2
  without ``key_projection``), the output projection (2 d^2), the gated keys' gain and decay
  (4 d H), and the retrieval, 4 d m_t for a query that sees m_t entries (scores and weighted
  sum), averaged over the T positions: m_t = t for the strict past of v1, min(t, h - 1) for the
  v2 short-term memory and max(0, t - m + 1) for its long-term one (m the mean of the
  training gaps; document boundaries not subtracted), each with its own projections;
- persistent memory: key projection 2 d^2, the P-slot banks 4 d P, output projection 2 d^2;
  or the SwiGLU 6 d F;
- the tied head 2 d V (the chunked loss computes it too).

The element-wise work (leaky averages, unit norms, kernel maps) is not counted, as attention's
softmax is not in the usual formulas. GPT-2 (the baseline) counts 24 d^2 per layer, its causal
attention 4 d (T + 1) / 2 and the head; nanoGPT's 6 N + 12 L d T counts the attention over all
T keys instead of the causal half, so its MFU reads higher for the same run.

MFU = FLOPs per token x tokens/s / (peak FLOP/s x processes). The peak is the dense bf16 (or
fp32) tensor-core figure of the device's data sheet (:data:`GPU_PEAKS`; ``MOSAICS_PEAK_FLOPS``
overrides it), and on a CPU a matmul measured once in the run's precision.
"""

from __future__ import annotations

import functools
import os
import re
import time
from typing import Any

import torch

# dense (no sparsity) peak FLOP/s per device from the vendors' data sheets: (bf16, fp32).
# Patterns are tried in order, so the more specific ones come first.
GPU_PEAKS: list[tuple[str, float, float]] = [
    (r"H100.*(PCIe)", 756e12, 51e12),
    (r"H100.*NVL", 835e12, 60e12),
    (r"H100|H800|GH200", 989e12, 67e12),
    (r"H200", 989e12, 67e12),
    (r"A100|A800", 312e12, 19.5e12),
    (r"L40S", 362e12, 91.6e12),
    (r"\bL4\b", 121e12, 30.3e12),
    (r"\bA10\b", 125e12, 31.2e12),
    (r"RTX 4090", 165e12, 82.6e12),
    (r"RTX 3090", 71e12, 35.6e12),
]
PEAK_ENV = "MOSAICS_PEAK_FLOPS"


def _mean_visible(T: int, lo_lag: int, window: int | None) -> float:
    """Mean over t in [0, T) of the entries s with s <= t - lo_lag (and t - s < window)."""
    total = 0
    for t in range(T):
        seen = max(0, t - lo_lag + 1)
        if window is not None:
            seen = min(seen, window - 1)
        total += seen
    return total / T


def mosaics_forward_flops(config: Any, T: int) -> float:
    """Forward matrix-product FLOPs per token of a ``MosaicsConfig`` at sequence length T."""
    d, H, L, V = config.n_embd, config.n_head, config.n_layer, config.vocab_size
    projections = (4 if config.key_projection else 2) * d * d + 2 * d * d
    if config.gated_keys:
        projections += 4 * d * H
    if config.three_level_memory:
        gap = config.long_term_gap
        if config.long_term_gap_range is not None:
            low, high = config.long_term_gap_range
            gap = (low + high) / 2
        seen = (_mean_visible(T, 1, config.short_term_window)
                + _mean_visible(T, int(round(gap)), None))
        context = 2 * projections + 4 * d * seen
    else:
        context = projections + 4 * d * _mean_visible(T, 1, None)
    if config.persistent_memory == "swiglu":
        persistent = 6 * d * config.swiglu_hidden
    else:
        persistent = 4 * d * d + 4 * d * config.pmem_size
    return L * (context + persistent) + 2 * d * V


def gpt2_forward_flops(config: Any, T: int) -> float:
    """Forward matrix-product FLOPs per token of a ``GPT2Config`` at sequence length T."""
    d, L, V = config.n_embd, config.n_layer, config.vocab_size
    inner = config.n_inner or 4 * d
    return L * (8 * d * d + 4 * d * inner + 4 * d * (T + 1) / 2) + 2 * d * V


def llama_forward_flops(config: Any, T: int) -> float:
    """Forward matrix-product FLOPs per token of a ``LlamaConfig`` (SwiGLU: three d x hidden
    products) at sequence length T."""
    d, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    return L * (8 * d * d + 6 * d * config.intermediate_size + 4 * d * (T + 1) / 2) + 2 * d * V


def flops_per_token(config: Any, T: int) -> float:
    """Model FLOPs per training token (forward + backward) at sequence length T."""
    model_type = getattr(config, "model_type", None)
    if model_type == "gpt2":
        forward = gpt2_forward_flops(config, T)
    elif model_type == "llama":
        forward = llama_forward_flops(config, T)
    else:
        forward = mosaics_forward_flops(config, T)
    return 3.0 * forward


def gpu_peak(name: str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of the GPU called ``name`` in ``dtype`` (bf16/fp16 or fp32), or None
    for a device not in :data:`GPU_PEAKS`."""
    for pattern, half, single in GPU_PEAKS:
        if re.search(pattern, name):
            return single if dtype == torch.float32 else half
    return None


@functools.cache
def measured_cpu_peak(dtype: torch.dtype = torch.float32, n: int = 1024,
                      repeats: int = 5) -> float:
    """Best-of matmul FLOP/s of this CPU in ``dtype`` with the current thread count. Its own
    random generator: the global one belongs to the run (a resumed run must draw the same)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def device_peak(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s, where it comes from) for one process on ``device`` training in
    ``precision`` ("bf16", "fp16" or "no")."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if os.environ.get(PEAK_ENV):
        return float(os.environ[PEAK_ENV]), PEAK_ENV
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return gpu_peak(name, dtype), f"data sheet of {name}"
    if device.type == "cpu":
        return measured_cpu_peak(dtype), f"measured {str(dtype).replace('torch.', '')} matmul"
    return None, f"no peak known for {device.type}"
