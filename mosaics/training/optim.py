"""AdamW with weight decay on matrices only, and a cosine schedule with linear warm-up."""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: tensors with ``dim >= 2`` (weights, embeddings, memory banks) decay;
    vectors and per-head scalars (LayerNorm gains, bandwidths, leak rates) do not.

    Tied parameters appear once (``named_parameters`` de-duplicates them)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8
                    ) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps)


def cosine_with_warmup(step: int, lr: float, min_lr: float, warmup_steps: int,
                       max_steps: int) -> float:
    """Learning rate at optimizer step ``step`` (0-based).

    lr * (step + 1) / warmup for step < warmup; then
    min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2 with
    progress = (step - warmup) / (max_steps - warmup), clamped to [0, 1]."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, lr: float, min_lr: float,
                    warmup_steps: int, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` following :func:`cosine_with_warmup` (multiplier relative to ``lr``)."""
    def factor(step: int) -> float:
        return cosine_with_warmup(step, lr, min_lr, warmup_steps, max_steps) / lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
