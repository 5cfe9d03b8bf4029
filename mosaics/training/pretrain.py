"""Pretraining a language model on a text corpus: the :class:`Trainer` fed random windows.

    run_dir lock (main) -> earlier run resumed, or moved aside -> corpus (prepared once, main
    process first) -> RandomWindowBatches -> Trainer.fit -> <run_dir>/final (Hugging Face model
    + tokenizer) -> a sample from the reloaded model

The same command is safe to repeat: it resumes from the newest intact checkpoint of
``run_dir`` (the scheduler-requeue case). A stop signal ends it with a checkpoint and
:class:`~mosaics.training.signals.RunPreempted` (exit status 75).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from ..errors import ConfigError
from .build import as_hf_tokenizer, build_model, special_token_ids
from .components import build_hooks, stopping
from .config import TrainConfig, save_config
from .data_mixture import load_mixture
from .instrument import LoopProbe
from .oom import oom_guard
from .rundir import RunLock, prepare_run_dir
from .signals import EXIT_PREEMPTED, RunPreempted
from .trainer import Trainer, TrainResult, count_parameters, make_accelerator


def load_data(cfg: TrainConfig, accelerator: Accelerator) -> Any:
    """Tokenized corpus (the main process prepares and caches it first, then the others)."""
    from ..data import prepare_corpus

    kwargs: dict[str, Any] = dict(source=cfg.data_source, vocab_size=cfg.vocab_size,
                                  val_fraction=cfg.val_fraction, seed=cfg.data_seed,
                                  num_proc=cfg.data_num_proc, text_column=cfg.text_column,
                                  skip_malformed=cfg.skip_malformed,
                                  num_train_stories=cfg.num_train_stories,
                                  num_val_stories=cfg.num_val_stories)
    if cfg.tokenizer is not None:
        kwargs["tokenizer"] = cfg.tokenizer
    if cfg.data_cache_dir is not None:
        kwargs["cache_dir"] = cfg.data_cache_dir
    with accelerator.main_process_first():
        return prepare_corpus(**kwargs)


def validation_batches(windows: torch.Tensor, rows: int) -> list[dict[str, torch.Tensor]]:
    """(N, T) windows as global batches of ``rows`` rows (labels = inputs)."""
    return [{"input_ids": w, "labels": w} for w in windows.split(rows)]


def sample_text(final_dir: Path, prompt: str, max_new_tokens: int, seed: int) -> str:
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


def claim_run_dir(cfg: TrainConfig, accelerator: Accelerator) -> RunLock | None:
    """Main process: lock ``run_dir`` and move an earlier run without an intact checkpoint
    (or any, under ``fresh_start``) aside; every process raises the same ``ConfigError`` when
    the folder is in use. Returns the held lock (main) or ``None``."""
    lock, error = None, None
    if accelerator.is_main_process:
        run_dir = Path(cfg.run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(run_dir)
            note = lock.acquire()
            if note is not None:
                print(note, file=sys.stderr)
            prepare_run_dir(run_dir, cfg.fresh_start)
            save_config(cfg, run_dir / "config.yaml")
        except (ConfigError, OSError) as err:
            if lock is not None:
                lock.release()
            error = (str(err) if isinstance(err, ConfigError)
                     else f"cannot prepare run_dir {run_dir}: {err}")
    if accelerator.num_processes > 1:
        box = [error]
        broadcast_object_list(box)
        error = box[0]
    if error is not None:
        raise ConfigError(error)
    return lock


def train(cfg: TrainConfig) -> TrainResult:
    """Run (or resume) the pretraining described by ``cfg``; raises
    :class:`~mosaics.training.signals.RunPreempted` when a stop signal ended it."""
    accelerator = make_accelerator(cfg)
    lock = claim_run_dir(cfg, accelerator)
    try:
        return _train_locked(cfg, accelerator)
    finally:
        if lock is not None:
            lock.release()


def _train_locked(cfg: TrainConfig, accelerator: Accelerator) -> TrainResult:
    from ..data import RandomWindowBatches, fixed_validation_windows

    main, world = accelerator.is_main_process, accelerator.num_processes
    run_dir = Path(cfg.run_dir)
    # the windows of step s are a pure function of (seed, s, global batch), however they are
    # split over processes and micro-batches (so a resume may change the process count)
    batches: Any
    per_source: dict[str, torch.Tensor] = {}
    if isinstance(cfg.data_source, dict):  # a weighted mixture of sources
        mixture = load_mixture(cfg, accelerator)
        raw_tokenizer, batches, windows = mixture.tokenizer, mixture.batches, mixture.val_windows
        per_source = mixture.per_source
        if main:
            print("data: " + ", ".join(f"{n} {100 * w:.1f}%" for n, w in
                                       mixture.weights.items()), file=sys.stderr)
    else:
        corpus = load_data(cfg, accelerator)
        raw_tokenizer = corpus.tokenizer
        batches = RandomWindowBatches(corpus.train_tokens, cfg.block_size,
                                      batch_size=cfg.batch_size, seed=cfg.seed,
                                      rank=accelerator.process_index, world_size=world,
                                      accumulation=accelerator.gradient_accumulation_steps)
        windows = fixed_validation_windows(corpus.val_tokens, cfg.block_size, cfg.eval_windows,
                                           cfg.data_seed)
    tokenizer = as_hf_tokenizer(raw_tokenizer)
    model = build_model(cfg, len(tokenizer), **special_token_ids(tokenizer))
    probe = LoopProbe(batches, accelerator.gradient_accumulation_steps)
    hooks = build_hooks(cfg, tokenizer, main, probe, accelerator.process_index, world,
                        per_source)
    trainer = Trainer(cfg, model, probe, validation_batches(windows, cfg.eval_batch_size * world),
                      hooks=hooks, accelerator=accelerator)
    probe.attach(trainer)
    trainer.setup()
    accum = trainer.accumulation
    if main:
        n_params = count_parameters(trainer.unwrapped_model) / 1e6
        backend = (torch.distributed.get_backend() if torch.distributed.is_available()
                   and torch.distributed.is_initialized() else "none")
        print(f"{cfg.model_type}: {n_params:.2f}M parameters | {world} process(es), "
              f"{accelerator.distributed_type}, backend {backend}, precision "
              f"{accelerator.mixed_precision} | "
              f"global batch {cfg.batch_size * accum * world} x {cfg.block_size} = "
              f"{cfg.batch_size * accum * world * cfg.block_size} tokens per step "
              f"({accum} micro-batch(es) of {cfg.batch_size} per process)", file=sys.stderr)
    with stopping(hooks), oom_guard(trainer, cfg.oom_snapshot):
        result = trainer.fit()
    if result.stop_signal is not None:  # preempted: no final model, the checkpoint resumes
        trainer.close()
        where = f"checkpoint {result.checkpoint} written" if result.checkpoint else \
            "no checkpoint (checkpoint_interval=0)"
        stopped = RunPreempted(f"stopped by {result.stop_signal} at step {result.steps}: "
                               f"{where}; run the same command again to continue (exit status "
                               f"{EXIT_PREEMPTED})")
        if main:
            print(stopped, file=sys.stderr, flush=True)
        raise stopped
    if cfg.save_final:
        result.final_dir = trainer.export(run_dir / "final", tokenizer)
        if main:  # the model card (README.md) of the exported directory
            from ..model_card import write_training_card
            card_cfg = cfg if not isinstance(cfg.data_source, dict) else dataclasses.replace(
                cfg, data_source=", ".join(cfg.data_source))
            write_training_card(result.final_dir, card_cfg, result)
        if main and cfg.sample_tokens > 0:
            result.sample = sample_text(result.final_dir, cfg.sample_prompt, cfg.sample_tokens,
                                        cfg.seed)
            print(f"\n--- sample from {result.final_dir} ---\n{result.sample}\n", flush=True)
    if main:
        print(f"done: {result.steps} steps, train loss {result.train_loss}, val loss "
              f"{result.val_loss}, {result.wall_seconds:.1f} s", file=sys.stderr)
    trainer.close()
    return result
