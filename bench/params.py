"""Trainable parameters of Memory Mosaics configurations, with and without FSKA's
simplifications (no key projection, fixed orthogonal value projection).

    python bench/params.py
"""

from __future__ import annotations

import torch

from mosaics import MosaicsConfig, MosaicsForCausalLM

SIZES = {
    "small (4 layers, d 256, 8 heads)": dict(n_layer=4, n_embd=256, n_head=8),
    "124M (12 layers, d 768, 12 heads)": dict(n_layer=12, n_embd=768, n_head=12),
}


def trainable(**kwargs) -> int:
    with torch.device("meta"):
        model = MosaicsForCausalLM(MosaicsConfig(vocab_size=50304, **kwargs))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def main() -> None:
    print(f"{'config':<36} {'kernel':<9} {'full':>12} {'simplified':>12} {'removed':>11} {'%':>6}")
    for label, size in SIZES.items():
        for kernel in ("gaussian", "fska"):
            full = trainable(kernel=kernel, **size)
            simple = trainable(kernel=kernel, key_projection=False, fixed_value_projection=True,
                               **size)
            print(f"{label:<36} {kernel:<9} {full:>12,} {simple:>12,} {full - simple:>11,} "
                  f"{100 * (full - simple) / full:>5.1f}%")


if __name__ == "__main__":
    main()
