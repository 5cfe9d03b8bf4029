"""The pretraining loop on accelerate: DDP (gloo/NCCL), DeepSpeed ZeRO, mixed precision,
gradient accumulation, periodic validation, TensorBoard, atomic checkpoints, exact resume.

One optimizer step consumes ``batch_size x accumulation`` windows on each of the processes.
Metrics go to TensorBoard (``<run_dir>/tb``) and, one JSON object per line, to
``<run_dir>/metrics.jsonl``; the final Hugging Face model goes to ``<run_dir>/final``.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedDataParallelKwargs,
    DistributedType,
    InitProcessGroupKwargs,
)

from . import checkpoint as ckpt
from .build import as_hf_tokenizer, build_model, count_parameters, special_token_ids
from .config import TrainConfig, save_config
from .optim import build_optimizer, build_scheduler


@dataclass
class TrainResult:
    """What a finished run produced (main-process values; losses in nats per token)."""

    run_dir: Path
    final_dir: Path | None
    steps: int
    train_loss: float | None
    val_loss: float | None
    wall_seconds: float
    sample: str | None


def resolve_precision(setting: str) -> str:
    """``auto``: bf16 on a CUDA device that supports it, else fp32 (``no``). bf16 autocast is
    much slower than fp32 on CPUs without native bf16 matmuls."""
    if setting != "auto":
        return setting
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    handlers = []
    if world > 1 and not torch.cuda.is_available():
        # DeepSpeed through accelerate on CPU only sees the other ranks with an explicit gloo
        # process group (otherwise accelerate believes world size 1).
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    if cfg.ddp_find_unused_parameters:
        handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
    accelerator = Accelerator(mixed_precision=resolve_precision(cfg.mixed_precision),
                              gradient_accumulation_steps=cfg.accumulation_steps(world),
                              kwargs_handlers=handlers)
    if world > 1 and accelerator.distributed_type == DistributedType.NO:
        raise RuntimeError(f"WORLD_SIZE={world} but accelerate set up no process group, so each "
                           "process would train alone. On CPU set ACCELERATE_USE_CPU=1; see "
                           "docs/training.md for working launch commands.")
    if accelerator.num_processes != world:
        raise RuntimeError(f"WORLD_SIZE={world} but accelerate sees {accelerator.num_processes} "
                           "processes; see docs/training.md for working launch commands.")
    return accelerator


def _configure_deepspeed(accelerator: Accelerator, cfg: TrainConfig) -> None:
    """Fill the DeepSpeed config with this run's micro-batch, accumulation and clipping."""
    plugin = accelerator.state.deepspeed_plugin
    ds = plugin.deepspeed_config
    ds["train_micro_batch_size_per_gpu"] = cfg.batch_size
    ds["gradient_accumulation_steps"] = accelerator.gradient_accumulation_steps
    ds["train_batch_size"] = (cfg.batch_size * accelerator.gradient_accumulation_steps
                              * accelerator.num_processes)
    ds["gradient_clipping"] = cfg.grad_clip if cfg.grad_clip > 0 else 0.0
    if "optimizer" in ds or "scheduler" in ds:
        raise ValueError("The DeepSpeed config must not define 'optimizer' or 'scheduler': the "
                         "training config owns them (AdamW groups, cosine schedule).")


def load_data(cfg: TrainConfig, accelerator: Accelerator) -> Any:
    """Tokenized corpus (the main process prepares and caches it first, then the others)."""
    from ..data import prepare_corpus

    kwargs: dict[str, Any] = dict(source=cfg.data_source, vocab_size=cfg.vocab_size,
                                  val_fraction=cfg.val_fraction, seed=cfg.data_seed,
                                  num_proc=cfg.data_num_proc, text_column=cfg.text_column,
                                  num_train_stories=cfg.num_train_stories,
                                  num_val_stories=cfg.num_val_stories)
    if cfg.tokenizer is not None:
        kwargs["tokenizer"] = cfg.tokenizer
    if cfg.data_cache_dir is not None:
        kwargs["cache_dir"] = cfg.data_cache_dir
    with accelerator.main_process_first():
        return prepare_corpus(**kwargs)


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int,
             accelerator: Accelerator) -> float:
    """Mean next-token loss (nats) over ``windows`` (N, T), sharded over the processes.

    Every process runs the same number of batches (ZeRO-3 needs all ranks in each forward)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    usable = (windows.shape[0] // world) * world
    if usable == 0:
        raise ValueError(f"eval_windows ({windows.shape[0]}) must be at least the number of "
                         f"processes ({world}).")
    shard = windows[:usable][rank::world]
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for start in range(0, shard.shape[0], batch_size):
        ids = shard[start:start + batch_size].to(accelerator.device)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        loss = out.lm_loss if getattr(out, "lm_loss", None) is not None else out.loss
        n = ids.shape[0] * (ids.shape[1] - 1)
        total += torch.stack([loss.double() * n, torch.tensor(float(n), dtype=torch.float64,
                                                              device=total.device)])
    total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    return float(total[0] / total[1])


class MetricsLog:
    """TensorBoard scalars plus ``metrics.jsonl`` (main process only)."""

    def __init__(self, run_dir: Path, enabled: bool, start_step: int) -> None:
        self.enabled = enabled
        self.writer = None
        self.path = run_dir / "metrics.jsonl"
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"), purge_step=start_step or None)
        if self.path.exists():  # drop rows past the resume point
            rows = [r for r in self.path.read_text().splitlines()
                    if r.strip() and json.loads(r)["step"] <= start_step]
            self.path.write_text("".join(r + "\n" for r in rows))

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def save_checkpoint(accelerator: Accelerator, cfg: TrainConfig, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: Any, sampler: Any,
                    step: int, tokens_seen: int) -> None:
    """Collective: every process writes its RNG and sampler state; main writes the rest."""
    run_dir = Path(cfg.run_dir)
    if accelerator.is_main_process:
        ckpt.prepare_save(run_dir, step)
    accelerator.wait_for_everyone()
    tmp = ckpt.tmp_dir(run_dir, step)
    sampler.set_step(step * accelerator.gradient_accumulation_steps)
    ckpt.save_rank_state(tmp, accelerator.process_index, sampler.state_dict())
    is_ds = accelerator.distributed_type == DistributedType.DEEPSPEED
    if is_ds:  # weights and the ZeRO optimizer shards, one file per process
        ckpt.save_deepspeed_state(tmp, model)
    if accelerator.is_main_process:
        state = {"step": step, "tokens_seen": tokens_seen,
                 "world_size": accelerator.num_processes, "deepspeed": is_ds,
                 "config": cfg.to_dict()}
        ckpt.save_main_state(tmp, None if is_ds else accelerator.unwrap_model(model),
                             None if is_ds else optimizer, scheduler, state)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        ckpt.finalize_save(run_dir, step, keep=cfg.keep_checkpoints)
    accelerator.wait_for_everyone()


def save_final_model(model: torch.nn.Module, state_dict: dict, tokenizer: Any,
                     final_dir: Path) -> None:
    """Write the HF directory into a temporary folder, then rename it into place."""
    tmp = final_dir.with_name(f".tmp-{final_dir.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.replace(tmp, final_dir)


def _sample_text(final_dir: Path, prompt: str, max_new_tokens: int, seed: int) -> str:
    """Reload the saved model with the Auto classes and sample a continuation of ``prompt``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations import deepspeed as hf_ds

    tokenizer = AutoTokenizer.from_pretrained(final_dir)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    # under ZeRO-3, from_pretrained would partition the weights over all processes and
    # generate would sync with them (collectives); this single-process check must not
    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        model = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32).eval()
        torch.manual_seed(seed)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=40,
                             temperature=0.8, pad_token_id=tokenizer.pad_token_id,
                             synced_gpus=False)
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved
    return tokenizer.decode(out[0], skip_special_tokens=True)


def _shut_down(accelerator: Accelerator, model_ref: weakref.ref) -> None:
    """End training and tear down the process group without a hang.

    The DDP wrapper's C++ reducer holds the process group, and pybind frees it with the GIL
    held; if the reducer drops the group's last reference, the gloo destructor joins worker
    threads that may still be freeing a finished collective's tensors, which needs the GIL,
    and the rank deadlocks (seen with 2 gloo ranks on a loaded machine: 4 hangs in 16 runs).
    So the wrapped model is released first, while torch.distributed still registers the
    group; the group then goes with ``destroy_process_group``, whose destructor releases the
    GIL.
    """
    accelerator.free_memory()
    gc.collect()
    if model_ref() is not None:
        print("warning: the wrapped model outlived training; process-group teardown may hang",
              file=sys.stderr)
    accelerator.end_training()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def train(cfg: TrainConfig) -> TrainResult:
    """Run (or resume) the pretraining described by ``cfg``."""
    started = time.time()
    accelerator = make_accelerator(cfg)
    is_ds = accelerator.distributed_type == DistributedType.DEEPSPEED
    main = accelerator.is_main_process
    run_dir = Path(cfg.run_dir)
    resume_from = ckpt.latest_checkpoint(run_dir) if cfg.resume else None
    if cfg.resume and resume_from is None and main:
        print(f"resume: no complete checkpoint in {run_dir}/checkpoints, starting fresh",
              file=sys.stderr)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")

    corpus = load_data(cfg, accelerator)
    tokenizer = as_hf_tokenizer(corpus.tokenizer)
    from ..data import RandomWindowDataset, fixed_validation_windows

    # micro-batch m of a process is sampler.batch(m): a pure function of (seed, m, rank), and
    # the processes' rows together form the same global batch for any number of processes.
    sampler = RandomWindowDataset(corpus.train_tokens, cfg.block_size, batch_size=cfg.batch_size,
                                  seed=cfg.seed, rank=accelerator.process_index,
                                  world_size=accelerator.num_processes)
    val_windows = fixed_validation_windows(corpus.val_tokens, cfg.block_size, cfg.eval_windows,
                                           cfg.data_seed)

    model = build_model(cfg, len(tokenizer), **special_token_ids(tokenizer))
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2),
                                cfg.adam_eps)
    scheduler = build_scheduler(optimizer, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)
    start_step, tokens_seen = 0, 0

    def resumed(state: dict, data_state: dict) -> tuple[int, int]:
        sampler.load_state_dict(data_state)  # checks seed, sizes and stream length match
        step = state["step"]
        if sampler.step != step * cfg.accumulation_steps(accelerator.num_processes):
            raise ValueError(f"{resume_from}: the sampler position does not match step "
                             f"{step}; resume with the same gradient accumulation.")
        if main:
            print(f"resumed from {resume_from} at step {step}", file=sys.stderr)
        return step, state["tokens_seen"]

    if resume_from is not None and not is_ds:
        start_step, tokens_seen = resumed(*ckpt.load_checkpoint(
            resume_from, model, optimizer, scheduler, accelerator.process_index,
            accelerator.num_processes))
    if is_ds:
        _configure_deepspeed(accelerator, cfg)
    model, optimizer = accelerator.prepare(model, optimizer)
    if resume_from is not None and is_ds:  # the engine restores into its own partitions
        start_step, tokens_seen = resumed(*ckpt.load_deepspeed_checkpoint(
            resume_from, model, scheduler, accelerator.process_index, accelerator.num_processes))
    model.train()

    accum = accelerator.gradient_accumulation_steps
    tokens_per_step = cfg.batch_size * cfg.block_size * accum * accelerator.num_processes
    if main:
        n_params = count_parameters(accelerator.unwrap_model(model)) / 1e6
        print(f"{cfg.model_type}: {n_params:.2f}M parameters | {accelerator.num_processes} "
              f"process(es), {accelerator.distributed_type}, precision "
              f"{accelerator.mixed_precision} | {accum} micro-batch(es) of "
              f"{cfg.batch_size} x {cfg.block_size} per process per step", file=sys.stderr)
    metrics = MetricsLog(run_dir, main, start_step)
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=not (main and cfg.progress_bar),
               dynamic_ncols=True, desc="train")
    sums = torch.zeros(3, dtype=torch.float64)  # loss, lm_loss, aux_loss over logged micro-steps
    counted, window_start = 0, time.time()
    train_loss = val_loss = None
    step = start_step
    while step < cfg.max_steps:
        grad_norm = None
        for micro in range(step * accum, (step + 1) * accum):
            ids = sampler.batch(micro)["input_ids"].to(accelerator.device)
            with accelerator.accumulate(model):
                out = model(input_ids=ids, labels=ids, use_cache=False)
                loss = out.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    if cfg.grad_clip > 0 or is_ds:
                        grad_norm = accelerator.clip_grad_norm_(
                            model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            lm = getattr(out, "lm_loss", None)
            aux = getattr(out, "aux_loss", None)
            sums += torch.tensor([loss.item(), (lm if lm is not None else loss).item(),
                                  aux.item() if aux is not None else float("nan")],
                                 dtype=torch.float64)
            counted += 1
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        step += 1
        tokens_seen += tokens_per_step
        bar.update(1)

        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            means = accelerator.reduce(sums.to(accelerator.device) / counted, reduction="mean")
            elapsed = time.time() - window_start
            values = {"train/loss": float(means[0]), "train/lm_loss": float(means[1]),
                      "lr": lr,
                      "tokens_per_s": tokens_per_step * (counted / accum) / max(elapsed, 1e-9)}
            if not math.isnan(float(means[2])):
                values["train/aux_loss"] = float(means[2])
            if grad_norm is not None:
                values["grad_norm"] = float(grad_norm)
            metrics.log(step, values)
            train_loss = values["train/lm_loss"]
            bar.set_postfix(loss=f"{train_loss:.3f}", lr=f"{lr:.2e}")
            sums.zero_()
            counted, window_start = 0, time.time()
        if (cfg.eval_interval and step % cfg.eval_interval == 0) or step == cfg.max_steps:
            val_loss = evaluate(model, val_windows, cfg.eval_batch_size, accelerator)
            metrics.log(step, {"val/loss": val_loss})
            if main:
                bar.write(f"step {step}: val loss {val_loss:.4f}")
            window_start = time.time()
        if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0 \
                and step < cfg.max_steps:
            save_checkpoint(accelerator, cfg, model, optimizer, scheduler, sampler, step,
                            tokens_seen)
            window_start = time.time()
    bar.close()
    metrics.close()

    final_dir = sample = None
    if cfg.save_final:
        final_dir = run_dir / "final"
        state_dict = accelerator.get_state_dict(model)  # a collective under ZeRO-3
        if main:
            save_final_model(accelerator.unwrap_model(model), state_dict, tokenizer, final_dir)
        accelerator.wait_for_everyone()
        if main and cfg.sample_tokens > 0:
            sample = _sample_text(final_dir, cfg.sample_prompt, cfg.sample_tokens, cfg.seed)
            print(f"\n--- sample from {final_dir} ---\n{sample}\n", flush=True)
    wall = time.time() - started
    if main:
        print(f"done: {step} steps, train loss {train_loss}, val loss {val_loss}, "
              f"{wall:.1f} s", file=sys.stderr)
    model_ref = weakref.ref(model)
    model = optimizer = scheduler = None
    _shut_down(accelerator, model_ref)
    return TrainResult(run_dir=run_dir, final_dir=final_dir, steps=step, train_loss=train_loss,
                       val_loss=val_loss, wall_seconds=wall, sample=sample)
