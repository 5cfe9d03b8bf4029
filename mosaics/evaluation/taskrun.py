"""A small train/evaluate driver for the synthetic tasks (RegBench, Sort, MQMTAR).

AdamW (weight decay on matrices only), linear warm-up then cosine decay to
``min_lr_ratio * lr``, gradient clipping, periodic validation, and the best-validation
weights kept in memory (restored at the end; optionally saved with ``save_pretrained``,
i.e. safetensors).
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

ARCHS = ("mosaics", "gpt2")


@dataclass
class TrainConfig:
    """Optimisation settings. ``max_steps`` caps ``total_steps``; ``time_budget_s`` stops early
    (the schedule is still planned over ``total_steps``)."""

    total_steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_frac: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    time_budget_s: float | None = None
    seed: int = 0


@dataclass
class TrainResult:
    best_val_loss: float
    best_step: int
    steps: int
    seconds: float
    stopped_early: bool
    history: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_config(arch: str, vocab_size: int, n_layer: int, n_embd: int, n_head: int,
                 pmem_size: int | None = None, kernel: str = "gaussian",
                 kernel_kwargs: dict | None = None, dropout: float = 0.0,
                 n_positions: int = 1024, **extra: Any):
    """``MosaicsConfig`` or a parameter-matched ``GPT2Config`` (with ``n_positions``)."""
    from mosaics import MosaicsConfig, available_kernels
    from mosaics.baselines import gpt2_config_like

    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    if arch == "mosaics" and kernel not in available_kernels():
        raise ValueError(f"unknown kernel {kernel!r}; registered kernels: "
                         f"{', '.join(available_kernels())}")
    cfg = MosaicsConfig(vocab_size=vocab_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                        pmem_size=pmem_size, kernel=kernel, kernel_kwargs=kernel_kwargs or {},
                        dropout=dropout, block_size=n_positions, **extra)
    return cfg if arch == "mosaics" else gpt2_config_like(cfg, n_positions=n_positions)


def build_model(config) -> nn.Module:  # noqa: ANN001
    """A fresh causal LM from a ``MosaicsConfig`` or a ``GPT2Config``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from mosaics import MosaicsForCausalLM

    if isinstance(config, GPT2Config):
        return GPT2LMHeadModel(config)
    return MosaicsForCausalLM(config)


def load_model(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """Load a saved model directory (Memory Mosaics or GPT-2) offline."""
    from transformers import AutoModelForCausalLM

    import mosaics  # noqa: F401  (registers the Auto classes)

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json); pass the "
                                "folder written by save_pretrained")
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device).eval()


def n_params(model: nn.Module) -> int:
    """Number of distinct trainable parameters (tied weights counted once)."""
    seen = {id(p): p.numel() for p in model.parameters() if p.requires_grad}
    return sum(seen.values())


def lr_lambda(total_steps: int, warmup_frac: float, min_lr_ratio: float) -> Callable[[int], float]:
    """Multiplier of the base lr at step s: linear warm-up, then cosine to ``min_lr_ratio``."""
    warmup = max(1, int(round(warmup_frac * total_steps)))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def epoch_batches(items: Sequence, batch_size: int, collate: Callable[[list], dict],
                  seed: int = 0) -> Iterator[dict[str, Tensor]]:
    """Endless batches: reshuffle every epoch, drop nothing (the last batch may be smaller)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(items))
        for i in range(0, len(order), batch_size):
            yield collate([items[j] for j in order[i: i + batch_size]])


def lm_loss_sum(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
    """Summed next-token cross-entropy over labels != -100, and the count."""
    logits = model(input_ids=batch["input_ids"]).logits
    shift = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    target = batch["labels"][:, 1:].reshape(-1)
    loss = nn.functional.cross_entropy(shift, target, ignore_index=-100, reduction="sum")
    return loss, int((target != -100).sum())


@torch.no_grad()
def validation_loss(model: nn.Module, batches: Sequence[dict[str, Tensor]],
                    device: str | torch.device = "cpu") -> float:
    """Token-weighted mean loss over fixed validation batches."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        loss, n = lm_loss_sum(model, {k: v.to(device) for k, v in batch.items()})
        total += float(loss)
        count += n
    return total / max(count, 1)


def _weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def train(model: nn.Module, batches: Iterator[dict[str, Tensor]],
          val_batches: Sequence[dict[str, Tensor]], cfg: TrainConfig,
          device: str | torch.device = "cpu", progress: bool = True,
          desc: str = "train") -> TrainResult:
    """Train ``model`` in place and restore its best-validation weights.

    The loss is the model's own (``model(input_ids, labels=labels).loss``: labels -100 are
    ignored; Memory Mosaics adds its kernel regulariser if any).
    """
    from tqdm.auto import tqdm

    torch.manual_seed(cfg.seed)
    model.to(device)
    opt = torch.optim.AdamW(_weight_decay_groups(model, cfg.weight_decay), lr=cfg.lr,
                            betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(cfg.total_steps, cfg.warmup_frac, cfg.min_lr_ratio))
    best = math.inf
    best_state: dict[str, Tensor] | None = None
    best_step = 0
    history: list[dict[str, float]] = []
    start = time.time()
    stopped_early = False
    step = 0
    bar = tqdm(total=cfg.total_steps, desc=desc, disable=not progress, mininterval=2.0)
    running = None
    while step < cfg.total_steps:
        model.train()
        batch = {k: v.to(device) for k, v in next(batches).items()}
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite training loss at step {step}; lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        step += 1
        value = loss.item()
        running = value if running is None else 0.95 * running + 0.05 * value
        bar.update(1)
        out_of_time = cfg.time_budget_s is not None and time.time() - start > cfg.time_budget_s
        if step % cfg.eval_every == 0 or step == cfg.total_steps or out_of_time:
            val = validation_loss(model, val_batches, device)
            history.append({"step": step, "train_loss": running, "val_loss": val,
                            "seconds": time.time() - start})
            bar.set_postfix(loss=f"{running:.3f}", val=f"{val:.3f}")
            if val < best:
                best, best_step = val, step
                best_state = copy.deepcopy({k: v.detach().cpu() for k, v in
                                            model.state_dict().items()})
        if out_of_time:
            stopped_early = step < cfg.total_steps
            break
    bar.close()
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    return TrainResult(best, best_step, step, time.time() - start, stopped_early, history)


def write_json(path: str | Path, obj: Any) -> None:
    """Write JSON atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=float))
    tmp.replace(path)
