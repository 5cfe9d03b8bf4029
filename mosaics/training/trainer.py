"""The training core shared by pretraining (``train.py``) and the task experiments (``eval/``).

    trainer = Trainer(cfg, model, batches, val_batches, hooks=[KeepBest()])
    result = trainer.fit()          # setup -> (train_step, evaluate, save_checkpoint)* -> hooks
    trainer.export(final_dir, tokenizer)
    trainer.close()

Parts, each a method: :meth:`Trainer.setup` (optimizer, schedule, resume, accelerate/DeepSpeed
wrapping), :meth:`Trainer.train_step` (one optimizer step of ``accumulation`` micro-batches),
:meth:`Trainer.evaluate` (token-weighted validation loss, sharded over processes),
:meth:`Trainer.save_checkpoint` (atomic, verified on resume), :meth:`Trainer.export` (a Hugging
Face model directory). One optimizer step consumes ``batch_size x accumulation`` rows on each
process.

``batches`` is a :class:`BatchSource`: ``batch(i)`` is this process's ``i``-th micro-batch, a
pure function of ``i``, so a resumed run sees exactly the batches the interrupted one would have.
Metrics go to ``<run_dir>/metrics.jsonl`` (one JSON object per line), the trackers of
``cfg.log_with`` (TensorBoard in ``<run_dir>/tb`` by default; W&B, MLflow; see
:mod:`mosaics.training.metrics`) and :attr:`Trainer.history`.

Faults (with checkpoints on, ``checkpoint_interval > 0``): a stop signal (``stop_signals``)
ends the run after the current step with a checkpoint, agreed by all processes; the last step
and a time-budget stop are checkpointed; a non-finite loss or gradient norm skips the step
(optimizer and schedule untouched) and ``max_bad_steps`` in a row stop the run, or roll it
back to the last checkpoint onto new batches (``bad_step_rollback``); a failed save raises
:class:`~mosaics.training.checkpoint.CheckpointWriteError` on every process.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import random
import shutil
import sys
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedDataParallelKwargs,
    DistributedType,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    broadcast_object_list,
)
from torch import Tensor

from ..errors import ConfigError, InputError
from . import checkpoint as ckpt
from .config import TrainConfig
from .metrics import MetricsLog, check_installed, tracker_names
from .optim import build_optimizer, build_scheduler
from .signals import StopSignals, parse_signals

Batch = dict[str, Tensor]


class BatchSource(Protocol):
    """This process's micro-batches: ``batch(i)`` -> {"input_ids": (B, T), "labels": (B, T)}
    (labels -100 are ignored), a pure function of ``i``. ``state_dict`` describes the source
    (seed, sizes) so that a resume can refuse a different one in ``load_state_dict``."""

    def batch(self, index: int) -> Batch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainResult:
    """What a finished run produced (main-process values; losses in nats per token)."""

    run_dir: Path | None
    steps: int
    train_loss: float | None
    val_loss: float | None
    wall_seconds: float
    stopped_early: bool = False
    best_val_loss: float | None = None
    best_step: int | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    final_dir: Path | None = None
    sample: str | None = None
    stop_signal: str | None = None  # the signal that stopped the run (checkpoint written)
    checkpoint: Path | None = None  # the run's last checkpoint, if it wrote one
    skipped_steps: int = 0  # steps skipped for a non-finite loss or gradient norm
    resumed_step: int | None = None  # the checkpoint's step this attempt resumed from
    resumed_seconds: float = 0.0  # wall time of the attempts before it (in wall_seconds)


class TrainingDiverged(ConfigError, FloatingPointError):
    """Too many non-finite steps in a row; the message names the settings to change."""


class Hook:
    """Callbacks; override what you need. ``trainer.stop = True`` ends training after the step.

    A hook with state that a resumed run needs writes it in :meth:`save_state` (main process,
    into the checkpoint's folder before its manifest, so it is verified with the rest) and
    reads it back in :meth:`load_state` (every process, the checkpoint being resumed)."""

    def on_evaluate(self, trainer: Trainer, step: int, val_loss: float) -> None: ...

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None: ...

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None: ...

    def save_state(self, folder: Path) -> None: ...

    def load_state(self, folder: Path) -> None: ...


class KeepBest(Hook):
    """Keep the weights of the lowest validation loss (in CPU memory) and restore them at the
    end; records ``best_val_loss`` / ``best_step`` in the result. Checkpoints carry them
    (``best_weights.safetensors``), so a resumed run restores the best of the whole run. Not
    under DeepSpeed ZeRO-3 (the weights are partitioned there)."""

    FILE = "best_weights.safetensors"

    def __init__(self) -> None:
        self.loss, self.step, self.state = math.inf, None, None

    def on_evaluate(self, trainer: Trainer, step: int, val_loss: float) -> None:
        if val_loss < self.loss:
            self.loss, self.step = val_loss, step
            model = trainer.unwrapped_model
            self.state = {k: v.detach().to("cpu", copy=True) for k, v in
                          model.state_dict().items()}

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None:
        if self.state is not None:
            trainer.unwrapped_model.load_state_dict(self.state)
            result.best_val_loss, result.best_step = self.loss, self.step

    def save_state(self, folder: Path) -> None:
        if self.state is not None:
            from safetensors.torch import save_file

            meta = {"val_loss": repr(self.loss), "step": str(self.step)}
            ckpt.write_file(folder / self.FILE,
                            lambda name: save_file(self.state, name, metadata=meta))

    def load_state(self, folder: Path) -> None:
        path = folder / self.FILE
        if not path.exists():
            self.loss, self.step, self.state = math.inf, None, None
            return
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata()
            self.state = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        self.loss, self.step = float(meta["val_loss"]), int(meta["step"])


def resolve_precision(setting: str) -> str:
    """``auto``: bf16 on a CUDA device that supports it, else fp32 (``no``). bf16 autocast is
    much slower than fp32 on CPUs without native bf16 matmuls."""
    if setting != "auto":
        return setting
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def denormals_are_flushed() -> bool:
    """Whether this thread flushes subnormal floats now (torch has no getter: a subnormal
    times one reads as zero when it does)."""
    return (torch.tensor([1e-39], dtype=torch.float32) * 1.0).item() == 0.0


@contextlib.contextmanager
def denormals_flushed(enabled: bool = True) -> Iterator[bool]:
    """Flush subnormal floats to zero (FTZ/DAZ) inside the block where the CPU supports it,
    as GPUs' fast paths do; yields whether flushing is on. Sharp softmax rows underflow to
    subnormals, and x86 arithmetic on them is one to two orders slower: one v2 layer's
    training step at T 4096 went from 12.4 s to 6.4 s (``bench/long_context.py``).

    The flag is per thread and torch's worker threads copy it when they start: the calling
    thread gets it here, the workers only if it was set before torch's first parallel op, which
    ``mosaics train`` and the sweep's job processes do (:func:`flush_denormals_early`).
    The calling thread's previous setting is restored afterwards."""
    before = denormals_are_flushed()
    on = before or (enabled and torch.set_flush_denormal(True))
    try:
        yield on
    finally:
        if on and not before:
            torch.set_flush_denormal(False)


def flush_denormals_early(enabled: bool = True) -> bool:
    """Flush subnormals for the rest of the process, before torch starts its worker threads
    (they inherit the flag; measured: set later, 2 threads flush half of an op's elements).
    Entry points call it first; returns whether it took effect."""
    return enabled and torch.set_flush_denormal(True)


def make_accelerator(cfg: TrainConfig, device: str | None = None) -> Accelerator:
    """The run's ``Accelerator`` (``device="cpu"`` forces the CPU on a GPU machine)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    handlers: list[Any] = []
    if world > 1 and not torch.cuda.is_available():
        # DeepSpeed through accelerate on CPU only sees the other ranks with an explicit gloo
        # process group (otherwise accelerate believes world size 1).
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    if cfg.ddp_find_unused_parameters:
        handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
    # trackers of cfg.log_with (started and finished by metrics.MetricsLog)
    trackers = tracker_names(cfg.log_with, cfg.tensorboard) if cfg.run_dir else []
    check_installed(trackers)
    project = ProjectConfiguration(project_dir=cfg.run_dir,
                                   logging_dir=str(Path(cfg.run_dir) / "tb")) if trackers else None
    accelerator = Accelerator(mixed_precision=resolve_precision(cfg.mixed_precision),
                              gradient_accumulation_steps=cfg.accumulation_steps(world),
                              kwargs_handlers=handlers, cpu=device == "cpu",
                              log_with=trackers or None, project_config=project)
    if world > 1 and accelerator.distributed_type == DistributedType.NO:
        raise ConfigError(f"WORLD_SIZE={world} but accelerate set up no process group, so each "
                          "process would train alone. On CPU set ACCELERATE_USE_CPU=1; see "
                          "docs/training.md for working launch commands.")
    if accelerator.num_processes != world:
        raise ConfigError(f"WORLD_SIZE={world} but accelerate sees {accelerator.num_processes} "
                          "processes; see docs/training.md for working launch commands.")
    return accelerator


def count_parameters(model: torch.nn.Module) -> int:
    """Trainable parameters, tied tensors counted once; ZeRO-3 partitions at full size."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed torch, numpy and python RNGs from (seed, step, rank)."""
    value = int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)


def speed_postfix(values: dict[str, float]) -> dict[str, str]:
    """The progress line's tokens/s and MFU (in %), where the log row has them."""
    out = {}
    if "tokens_per_s" in values:
        out["tok/s"] = f"{values['tokens_per_s']:,.0f}"
    if "mfu" in values:
        out["mfu"] = f"{100 * values['mfu']:.1f}%"
    return out


def shard_rows(batch: Batch, rank: int, world: int) -> Batch:
    """Rows ``rank, rank + world, ...`` of every tensor in ``batch``."""
    return {k: v[rank::world] for k, v in batch.items()}


class Trainer:
    """One training run of ``model`` on ``batches`` under ``cfg`` (see the module docstring).

    Args:
        cfg: the optimisation, schedule, precision, logging and checkpoint settings.
        model: a causal LM taking ``input_ids`` and ``labels`` (its ``loss`` is minimised).
        batches: this process's micro-batches (:class:`BatchSource`).
        val_batches: global validation batches; process r scores rows r, r + world, ...
        hooks: callbacks, e.g. :class:`KeepBest`.
        accelerator: an existing ``Accelerator`` (default: :func:`make_accelerator`).
        name: the progress bar's label.
    """

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, batches: BatchSource,
                 val_batches: Sequence[Batch] = (), hooks: Sequence[Hook] = (),
                 accelerator: Accelerator | None = None, name: str = "train") -> None:
        self.cfg = cfg
        self.accelerator = accelerator or make_accelerator(cfg)
        self.model: Any = model
        self.batches = batches
        self.val_batches = list(val_batches)
        self.hooks = list(hooks)
        self.name = name
        self.run_dir = Path(cfg.run_dir) if cfg.run_dir else None
        self.is_main = self.accelerator.is_main_process
        self.is_deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.step = 0
        self.tokens_seen = 0
        self.stop = False
        self.history: list[dict[str, float]] = []
        self.metrics: MetricsLog | None = None
        self.data_offset = 0  # added to the step to index batches (moved by a rollback)
        self.schedule_steps = cfg.max_steps
        self.bad_in_a_row = 0
        self.skipped_steps = 0
        self.stop_requested = False  # a stop signal reached some process (agreed every step)
        self.signals = StopSignals(parse_signals(cfg.stop_signals) if self.checkpointing
                                   else [])
        self._saved_step: int | None = None
        self._rollback_from: int | None = None
        self.seconds_before = 0.0  # wall time of the earlier attempts of a resumed run
        self.resumed_step: int | None = None
        self._fit_started: float | None = None
        self.train_forward: Any = None  # the model, or its torch.compile'd call (``compile``)
        self.flops_per_token: float | None = None  # model FLOPs per training token
        self.peak_flops: float | None = None  # one process's peak FLOP/s, for the MFU

    @property
    def checkpointing(self) -> bool:
        """Checkpoints on: a run_dir and ``checkpoint_interval > 0``."""
        return self.run_dir is not None and self.cfg.checkpoint_interval > 0

    # --- setup ---------------------------------------------------------------------------

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    @property
    def accumulation(self) -> int:
        return self.accelerator.gradient_accumulation_steps

    @property
    def elapsed_seconds(self) -> float:
        """Wall time of the run so far, the attempts before a resume included."""
        now = 0.0 if self._fit_started is None else time.time() - self._fit_started
        return self.seconds_before + now

    @property
    def out_of_time(self) -> bool:
        """Past ``time_budget_s``: this attempt's time, or the whole run's with scope "run"."""
        budget = self.cfg.time_budget_s
        if budget is None:
            return False
        spent = self.elapsed_seconds
        if self.cfg.time_budget_scope == "attempt":
            spent -= self.seconds_before
        return spent > budget

    def setup(self) -> None:
        """Optimizer and schedule, the checkpoint to resume from, accelerate/DeepSpeed wrapping."""
        cfg, acc = self.cfg, self.accelerator
        # DeepSpeed 0.19 calls collectives that torch deprecated (all_gather_into_tensor,
        # reduce_scatter_tensor), one warning per call; not the user's concern
        warnings.filterwarnings("ignore", category=FutureWarning,
                                module="torch.distributed.c10d_logger")
        self.optimizer = build_optimizer(self.model, cfg.lr, cfg.weight_decay,
                                         (cfg.beta1, cfg.beta2), cfg.adam_eps)
        resume_from = (self._choose_checkpoint() if self.run_dir is not None
                       and not cfg.fresh_start else None)
        self.schedule_steps = self._schedule_length(resume_from)
        self.scheduler = build_scheduler(self.optimizer, cfg.lr, cfg.min_lr, cfg.warmup_steps,
                                         self.schedule_steps)
        if resume_from is not None and not self.is_deepspeed:
            self._resumed(resume_from, ckpt.load_checkpoint(
                resume_from, self.model, self.optimizer, self.scheduler, acc.process_index,
                acc.num_processes))
        universal = False
        if self.is_deepspeed:
            universal = resume_from is not None and self._needs_universal(resume_from)
            self._configure_deepspeed(universal)
        self.model, self.optimizer = acc.prepare(self.model, self.optimizer)
        if resume_from is not None and self.is_deepspeed:  # restores into its own partitions
            self._resumed(resume_from, ckpt.load_deepspeed_checkpoint(
                resume_from, self.model, self.scheduler, acc.process_index, acc.num_processes,
                universal))
        self.model.train()
        self.train_forward = self._compiled_forward() if self.compiles else self.model
        self._hardware_figures()
        if self.run_dir is not None:
            self.metrics = MetricsLog(self.run_dir, self.is_main, self.step, acc, cfg)

    @property
    def compiles(self) -> bool:
        """``compile`` resolved: null is on with CUDA (not under DeepSpeed ZeRO-3)."""
        if self.cfg.compile is not None:
            return self.cfg.compile
        return self.accelerator.device.type == "cuda" and self._zero_stage() != 3

    def _zero_stage(self) -> int | None:
        plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed else None
        return None if plugin is None else int(plugin.zero_stage)

    def _compiled_forward(self) -> Any:
        """The training forward under ``torch.compile``; the module itself stays as it was, so
        evaluation, export and sampling run eagerly. Under DeepSpeed ZeRO-1/2 the engine's
        module is compiled (the engine's forward adds nothing to it there)."""
        from ..compilation import compile_backend

        if self._zero_stage() == 3:
            raise ConfigError("compile=true does not work with DeepSpeed ZeRO-3 (its parameter "
                              "gathering hooks run inside the forward); set compile=false or "
                              "use ZeRO-2.")
        if self.is_main:
            print(f"{self.name}: compiling the training step with torch.compile (backend "
                  f"{compile_backend()}); the first step takes longer", file=sys.stderr)
        target = self.model.module if self.is_deepspeed else self.model
        return torch.compile(target, backend=compile_backend())

    def _hardware_figures(self) -> None:
        """FLOPs per token of the model at this run's sequence length, and the peak FLOP/s
        of one process's device (:mod:`mosaics.training.flops`)."""
        from .flops import device_peak, flops_per_token

        config = getattr(self.unwrapped_model, "config", None)
        if config is None or not hasattr(config, "n_embd"):
            return
        length = int(self.batches.batch(0)["input_ids"].shape[1])
        try:
            self.flops_per_token = flops_per_token(config, length)
        except (AttributeError, TypeError):  # a model config without the fields counted
            return
        self.peak_flops = device_peak(self.accelerator.device, self.accelerator.mixed_precision)[0]

    def _choose_checkpoint(self) -> Path | None:
        """The newest intact checkpoint (main decides, every process gets the same answer)."""
        choice: list[str | None] = [None]
        if self.is_main and self.run_dir is not None:
            path, skipped = ckpt.find_resumable(self.run_dir)
            for warning in skipped:
                print(f"warning: {warning}", file=sys.stderr)
            if path is None:
                if self.cfg.resume or skipped:
                    print(f"resume: no intact checkpoint in "
                          f"{ckpt.checkpoint_root(self.run_dir)}, starting fresh",
                          file=sys.stderr)
            else:
                ckpt.check_model_config(path, self.unwrapped_model.config)
            choice = [None if path is None else str(path)]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(choice)
        return None if choice[0] is None else Path(choice[0])

    def _schedule_length(self, resume_from: Path | None) -> int:
        """Steps of the cosine: ``schedule_steps`` if set, else the length the run started
        with (a resumed run with a larger ``max_steps`` keeps it: lr stays at ``min_lr``
        after its end), else ``max_steps``."""
        cfg = self.cfg
        if cfg.schedule_steps is not None:
            return cfg.schedule_steps
        if resume_from is None:
            return cfg.max_steps
        state = ckpt.read_trainer_state(resume_from)
        length = int(state.get("schedule_steps") or state.get("config", {}).get("max_steps")
                     or cfg.max_steps)
        if cfg.max_steps > length and self.is_main:
            print(f"max_steps={cfg.max_steps} extends the run past its schedule of {length} "
                  f"steps: lr stays at min_lr={cfg.min_lr} after step {length} (set "
                  f"schedule_steps={cfg.max_steps} to stretch the cosine instead)",
                  file=sys.stderr)
        return length

    def _resumed(self, path: Path, states: tuple[dict, dict]) -> None:
        trainer_state, data_state = states
        try:  # refuses other data, seed or global batch
            self.batches.load_state_dict(data_state)
        except InputError as err:
            raise type(err)(f"{err} (resuming {path}); to start a new run there instead, "
                            "fresh_start=true moves the earlier one aside") from err
        self.step, self.tokens_seen = trainer_state["step"], trainer_state["tokens_seen"]
        self.data_offset = int(trainer_state.get("data_offset", 0))
        self._saved_step = self.step
        self.history = list(trainer_state.get("history", []))
        self.seconds_before = float(trainer_state.get("wall_seconds", 0.0))
        self.resumed_step = self.step
        for hook in self.hooks:
            hook.load_state(path)
        # the optimizer's lr came from the checkpoint; follow this run's schedule from here
        # (they differ when schedule_steps changed)
        sched = self.scheduler
        for group, base, factor in zip(sched.optimizer.param_groups, sched.base_lrs,
                                       sched.lr_lambdas):
            group["lr"] = base * factor(sched.last_epoch)
        sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]
        written = trainer_state.get("world_size")
        world = self.accelerator.num_processes
        if written != world:  # the RNG streams were per process: start new ones
            reseed(self.cfg.seed, self.step, self.accelerator.process_index)
        if self.is_main:
            moved = (f" on {world} process(es), written by {written} (same global batch; "
                     "dropout and sampling RNG re-seeded)" if written != world else "")
            print(f"resumed from {path} at step {self.step}{moved}", file=sys.stderr)

    def _needs_universal(self, path: Path) -> bool:
        """A DeepSpeed checkpoint of another process count: convert it (main, once) to
        DeepSpeed's universal form, which loads on any process count."""
        written = ckpt.read_trainer_state(path).get("world_size")
        if written == self.accelerator.num_processes:
            return False
        if self.is_main:
            print(f"resume: {path} was written by {written} DeepSpeed processes, this run has "
                  f"{self.accelerator.num_processes}: converting it to a universal checkpoint",
                  file=sys.stderr)
            ckpt.universal_checkpoint(path)
        self.accelerator.wait_for_everyone()
        return True

    def _configure_deepspeed(self, universal: bool = False) -> None:
        """Fill the DeepSpeed config with this run's micro-batch, accumulation and clipping
        (and, for a resume on another process count, universal-checkpoint loading)."""
        ds = self.accelerator.state.deepspeed_plugin.deepspeed_config
        if universal:
            ds.setdefault("checkpoint", {})["load_universal"] = True
        if "optimizer" in ds or "scheduler" in ds:
            raise ConfigError("The DeepSpeed config must not define 'optimizer' or 'scheduler': "
                              "the training config owns them (AdamW groups, cosine schedule).")
        rows = next(iter(self.batches.batch(0).values())).shape[0]
        ds["train_micro_batch_size_per_gpu"] = rows
        ds["gradient_accumulation_steps"] = self.accumulation
        ds["train_batch_size"] = rows * self.accumulation * self.accelerator.num_processes
        ds["gradient_clipping"] = self.cfg.grad_clip if self.cfg.grad_clip > 0 else 0.0

    # --- the loop ------------------------------------------------------------------------

    def _agree(self, *flags: bool) -> list[bool]:
        """Each flag true on any process (one all-reduce; none with a single process)."""
        if self.accelerator.num_processes == 1:
            return list(flags)
        local = torch.tensor([float(f) for f in flags], device=self.accelerator.device)
        total = self.accelerator.reduce(local, reduction="sum")
        return [bool(v > 0) for v in total.tolist()]

    def train_step(self) -> dict[str, float]:
        """One optimizer step; returns this process's mean losses and its token count.

        Before the optimizer steps, all processes agree (one all-reduce) whether any saw a
        non-finite loss or gradient norm, and whether any received a stop signal. A bad step
        leaves optimizer and schedule untouched (``"skipped": 1.0`` in the result)."""
        acc, cfg = self.accelerator, self.cfg
        sums = torch.zeros(3, dtype=torch.float64)  # loss, lm_loss, aux_loss
        tokens, grad_norm, bad, value = 0, None, False, math.nan
        first = (self.step + self.data_offset) * self.accumulation
        skipped_before = getattr(self.model, "skipped_steps", 0) if self.is_deepspeed else 0
        for index in range(first, first + self.accumulation):
            batch = self.batches.batch(index)
            ids = batch["input_ids"].to(acc.device)
            labels = batch["labels"].to(acc.device)
            with acc.accumulate(self.model):
                forward = self.model if self.train_forward is None else self.train_forward
                out = forward(input_ids=ids, labels=labels, use_cache=False)
                loss = out.loss
                acc.backward(loss)
                value = loss.item()
                bad = bad or not math.isfinite(value)
                if acc.sync_gradients:
                    if cfg.grad_clip > 0 or self.is_deepspeed:
                        grad_norm = acc.clip_grad_norm_(
                            self.model.parameters(),
                            cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
                        bad = bad or not math.isfinite(float(grad_norm))
                    bad, stop = self._agree(bad, self.signals.requested())
                    self.stop_requested = self.stop_requested or stop
                    if bad and self.is_deepspeed:  # its engine stepped inside backward
                        self._check_deepspeed_skipped(skipped_before)
                    if not bad:
                        self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
            lm = getattr(out, "lm_loss", None)
            aux = getattr(out, "aux_loss", None)
            sums += torch.tensor([value, value if lm is None else lm.item(),
                                  math.nan if aux is None else aux.item()], dtype=torch.float64)
            tokens += ids.numel()
        lr = self.scheduler.get_last_lr()[0]
        self.step += 1
        if bad:
            return {"skipped": 1.0, "train/loss": value, "lr": lr, "tokens": float(tokens),
                    "grad_norm": math.nan if grad_norm is None else float(grad_norm)}
        self.scheduler.step()
        means = sums / self.accumulation
        row = {"train/loss": float(means[0]), "train/lm_loss": float(means[1]), "lr": lr,
               "tokens": float(tokens)}
        if not math.isnan(float(means[2])):
            row["train/aux_loss"] = float(means[2])
        if grad_norm is not None:
            row["grad_norm"] = float(grad_norm)
        return row

    def _check_deepspeed_skipped(self, skipped_before: int) -> None:
        """A non-finite step under DeepSpeed: its engine stepped inside ``backward``, and
        skipped the update itself when it found the gradients non-finite (its overflow check:
        fp32, fp16, bf16 with ``check_grad_overflow``). Stop when it applied the step."""
        engine = self.model
        applied = getattr(engine, "_step_applied", None)
        if applied is None:  # an older DeepSpeed: its skipped-steps counter moved or not
            applied = getattr(engine, "skipped_steps", skipped_before) == skipped_before
        if applied:
            raise TrainingDiverged(
                f"non-finite training loss at step {self.step + 1} under DeepSpeed, whose "
                "engine applied the step (its gradients were finite, or its overflow check is "
                "off: bf16.check_grad_overflow=false); lower lr (now "
                f"{self.cfg.lr}), raise warmup_steps, or keep grad_clip > 0.")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss (nats per scored token) over ``val_batches``.

        Every process runs the same number of forwards (ZeRO-3 needs all ranks in each)."""
        acc = self.accelerator
        rank, world = acc.process_index, acc.num_processes
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=acc.device)
        for batch in self.val_batches:
            usable = (batch["input_ids"].shape[0] // world) * world
            if usable == 0:
                raise ConfigError(f"a validation batch has {batch['input_ids'].shape[0]} rows, "
                                  f"fewer than the {world} processes; use more eval_windows.")
            part = shard_rows({k: v[:usable] for k, v in batch.items()}, rank, world)
            ids, labels = part["input_ids"].to(acc.device), part["labels"].to(acc.device)
            out = self.model(input_ids=ids, labels=labels, use_cache=False)
            loss = out.lm_loss if getattr(out, "lm_loss", None) is not None else out.loss
            n = (labels[:, 1:] != -100).sum().double()
            total += torch.stack([loss.double() * n, n])
        total = acc.reduce(total, reduction="sum")
        self.model.train(was_training)
        return float(total[0] / total[1].clamp_min(1))

    def fit(self) -> TrainResult:
        """Train to ``max_steps`` (or the time budget, or a stop signal) and return the result.

        With checkpoints on, the last step is checkpointed, whichever of the three ends it."""
        from tqdm.auto import tqdm

        if self.optimizer is None:
            self.setup()
        cfg, acc = self.cfg, self.accelerator
        self._fit_started = time.time()
        if self.step >= cfg.max_steps and self.is_main:
            print(f"{self.name}: already at step {self.step} of max_steps={cfg.max_steps}; "
                  "raise max_steps to train further", file=sys.stderr)
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc=self.name, dynamic_ncols=True,
                   disable=not (self.is_main and cfg.progress_bar), mininterval=1.0)
        window: list[dict[str, float]] = []
        window_start = time.time()
        train_loss = val_loss = None
        stopped_early = False
        flush = cfg.flush_denormal and self.accelerator.device.type == "cpu"
        with self.signals, denormals_flushed(flush):
            while self.step < cfg.max_steps and not self.stop:
                row = self.train_step()
                bar.update(1)
                if row.get("skipped"):
                    self._skipped(row)
                else:
                    self.bad_in_a_row = 0
                    window.append(row)
                    self.tokens_seen += int(row["tokens"]) * acc.num_processes
                out_of_time = self.out_of_time
                last = self.step == cfg.max_steps or out_of_time
                values: dict[str, float] = {}  # a stop signal skips the evaluation, not the log
                if window and (self.step % cfg.log_interval == 0 or last or self.stop_requested):
                    values = self._window_metrics(window, time.time() - window_start)
                    train_loss = values["train/lm_loss"]
                    bar.set_postfix(loss=f"{train_loss:.3f}", lr=f"{values['lr']:.2e}",
                                    **speed_postfix(values))
                    window, window_start = [], time.time()
                if (cfg.eval_interval and self.step % cfg.eval_interval == 0) or last:
                    val_loss = self.evaluate() if self.val_batches else None
                    if val_loss is not None:
                        values["val/loss"] = val_loss
                        if self.is_main:
                            bar.write(f"{self.name} step {self.step}: val loss {val_loss:.4f}")
                        for hook in self.hooks:
                            hook.on_evaluate(self, self.step, val_loss)
                    window_start = time.time()
                if values:
                    self._log(values)
                for hook in self.hooks:
                    hook.on_step_end(self, self.step, values)
                last = last or self.stop or self.stop_requested
                if self.checkpointing and self._saved_step != self.step \
                        and (self.step % cfg.checkpoint_interval == 0 or last):
                    self.save_checkpoint()
                    window_start = time.time()
                if self.stop_requested:
                    break
                if out_of_time and self.step < cfg.max_steps:
                    stopped_early = True
                    break
        bar.close()
        if self.metrics is not None:
            self.metrics.close()
        result = TrainResult(run_dir=self.run_dir, steps=self.step, train_loss=train_loss,
                             val_loss=val_loss, wall_seconds=self.elapsed_seconds,
                             stopped_early=stopped_early or self.stop_requested,
                             history=self.history, skipped_steps=self.skipped_steps,
                             resumed_step=self.resumed_step,
                             resumed_seconds=self.seconds_before)
        if self.stop_requested:
            result.stop_signal = self.signals.received or "a stop signal on another process"
        if self._saved_step is not None and self.run_dir is not None:
            result.checkpoint = (ckpt.checkpoint_root(self.run_dir)
                                 / ckpt.step_dir_name(self._saved_step))
        for hook in self.hooks:
            hook.on_train_end(self, result)
        return result

    def _skipped(self, row: dict[str, float]) -> None:
        """Count a skipped step; after ``max_bad_steps`` in a row roll back or stop."""
        cfg = self.cfg
        self.bad_in_a_row += 1
        self.skipped_steps += 1
        if self.is_main:
            print(f"warning: step {self.step}: non-finite loss ({row['train/loss']}) or "
                  f"gradient norm ({row['grad_norm']}); step skipped, optimizer and lr schedule "
                  f"unchanged ({self.bad_in_a_row} in a row, {cfg.max_bad_steps} allowed)",
                  file=sys.stderr)
        if self.metrics is not None:
            self.metrics.log(self.step, {"skipped_steps": float(self.skipped_steps)})
        if self.bad_in_a_row <= cfg.max_bad_steps:
            return
        advice = (f"lower lr (now {cfg.lr}), raise warmup_steps, keep grad_clip > 0, or "
                  "check the data")
        if not cfg.bad_step_rollback:
            raise TrainingDiverged(
                f"{self.bad_in_a_row} non-finite steps in a row (max_bad_steps="
                f"{cfg.max_bad_steps}) at step {self.step}: {advice}; or set "
                "bad_step_rollback=true to go back to the last checkpoint and continue on "
                "other batches.")
        self.roll_back(advice)

    def roll_back(self, advice: str = "") -> None:
        """Collective: reload the newest intact checkpoint (weights, optimizer, schedule, RNG)
        and move the batch index past every batch used since, so training goes on with
        batches it has not seen (the windows are a pure function of the index)."""
        if self.is_deepspeed:
            raise TrainingDiverged(f"non-finite steps under DeepSpeed: {advice}.")
        path = self._choose_checkpoint() if self.checkpointing else None
        if path is None:
            raise TrainingDiverged(f"{self.bad_in_a_row} non-finite steps in a row at step "
                                   f"{self.step} and no checkpoint to roll back to: {advice}.")
        back_to = ckpt.read_trainer_state(path)["step"]
        if self._rollback_from == back_to:
            raise TrainingDiverged(f"{self.bad_in_a_row} non-finite steps in a row at step "
                                   f"{self.step}, again after rolling back to step {back_to} "
                                   f"onto other batches: {advice}.")
        used = self.step + self.data_offset  # batches used so far, as step indices
        acc = self.accelerator
        state, _ = ckpt.load_checkpoint(path, self.unwrapped_model, self.optimizer,
                                        self.scheduler, acc.process_index, acc.num_processes)
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.data_offset = used - self.step
        self.bad_in_a_row = 0
        self._rollback_from = self._saved_step = back_to
        if self.is_main:
            print(f"rolled back to {path} (step {back_to}); continuing on batches from index "
                  f"{used} on", file=sys.stderr)
    def _window_metrics(self, rows: list[dict[str, float]], seconds: float) -> dict[str, float]:
        """Means over the steps since the last log, averaged over processes; tokens/s."""
        keys = ["train/loss", "train/lm_loss"] + (["train/aux_loss"] if "train/aux_loss" in
                                                   rows[0] else [])
        local = torch.tensor([[r[k] for k in keys] + [r["tokens"]] for r in rows],
                             dtype=torch.float64)
        sums = local.sum(0).to(self.accelerator.device)
        sums = self.accelerator.reduce(sums, reduction="sum").cpu()
        world = self.accelerator.num_processes
        values = {k: float(sums[i]) / (len(rows) * world) for i, k in enumerate(keys)}
        values["lr"] = rows[-1]["lr"]
        values["tokens_per_s"] = float(sums[-1]) / max(seconds, 1e-9)
        if self.flops_per_token is not None:
            values["flops_per_token"] = self.flops_per_token
            if self.peak_flops:
                values["mfu"] = (values["tokens_per_s"] * self.flops_per_token
                                 / (self.peak_flops * world))
        if "grad_norm" in rows[-1]:
            values["grad_norm"] = rows[-1]["grad_norm"]
        return values

    def _log(self, values: dict[str, float]) -> None:
        self.history.append({"step": self.step, **values})
        if self.metrics is not None:
            self.metrics.log(self.step, values)

    # --- checkpoints and export ----------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Collective: every process writes its RNG and data-source state, main the rest.

        A failed write on any process (full disk, I/O error, permissions) is agreed on by all:
        main removes the temporary folder and every process raises
        :class:`~mosaics.training.checkpoint.CheckpointWriteError` (earlier checkpoints are
        left as they were)."""
        acc, run_dir, step = self.accelerator, self.run_dir, self.step
        if run_dir is None:
            raise ConfigError("checkpoint_interval > 0 needs a run_dir to write checkpoints to.")
        tmp = ckpt.tmp_dir(run_dir, step)
        failure: OSError | None = None

        def attempt(action: Any) -> None:
            nonlocal failure
            if failure is None:
                try:
                    action()
                except OSError as err:
                    failure = err
            if self._agree(failure is not None)[0]:
                if self.is_main:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise ckpt.CheckpointWriteError(self._save_failure(step, failure))

        attempt(lambda: ckpt.prepare_save(run_dir, step) if self.is_main else None)
        acc.wait_for_everyone()

        def write_states() -> None:
            ckpt.save_rank_state(tmp, acc.process_index, self.batches.state_dict())
            if self.is_deepspeed:  # weights and the ZeRO optimizer shards, one file each
                ckpt.save_deepspeed_state(tmp, self.model)
            if self.is_main:
                model = self.unwrapped_model
                state = {"step": step, "tokens_seen": self.tokens_seen,
                         "world_size": acc.num_processes, "accumulation": self.accumulation,
                         "deepspeed": self.is_deepspeed, "config": self.cfg.to_dict(),
                         "model_config": ckpt.model_config_dict(model.config),
                         "schedule_steps": self.schedule_steps, "data_offset": self.data_offset,
                         "history": self.history, "wall_seconds": self.elapsed_seconds}
                ckpt.save_main_state(tmp, None if self.is_deepspeed else model,
                                     None if self.is_deepspeed else self.optimizer,
                                     self.scheduler, state)
                for hook in self.hooks:
                    hook.save_state(tmp)

        attempt(write_states)
        attempt(lambda: ckpt.finalize_save(run_dir, step, keep=self.cfg.keep_checkpoints)
                if self.is_main else None)
        self._saved_step = step
        return ckpt.checkpoint_root(run_dir) / ckpt.step_dir_name(step)

    def _save_failure(self, step: int, err: OSError | None) -> str:
        """The one-line message of a failed save (``err``: this process's error, if any)."""
        assert self.run_dir is not None
        if err is None:
            return (f"another process could not write its part of checkpoint "
                    f"{ckpt.checkpoint_root(self.run_dir) / ckpt.step_dir_name(step)} (see its "
                    "error); earlier checkpoints are intact.")
        done = ckpt.list_checkpoints(self.run_dir)
        if done:
            estimate = ckpt.checkpoint_bytes(done[-1][1])
        else:  # weights and two AdamW moments
            estimate = 3 * sum(p.numel() * p.element_size()
                               for p in self.unwrapped_model.parameters())
        return ckpt.save_failure_message(self.run_dir, step, err, estimate)

    def export(self, final_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
        """Collective: write a Hugging Face model directory (config, safetensors, tokenizer)
        into a temporary folder, then rename it into place."""
        final_dir = Path(final_dir)
        state_dict = self.accelerator.get_state_dict(self.model)  # a collective under ZeRO-3
        if self.is_main:
            tmp = final_dir.with_name(f".tmp-{final_dir.name}")
            if tmp.exists():
                shutil.rmtree(tmp)
            self.unwrapped_model.save_pretrained(tmp, state_dict=state_dict)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if final_dir.exists():
                shutil.rmtree(final_dir)
            os.replace(tmp, final_dir)
        self.accelerator.wait_for_everyone()
        return final_dir

    def close(self) -> None:
        """Release the model and tear down the process group without a hang.

        The DDP wrapper's C++ reducer holds the process group, and pybind frees it with the GIL
        held; if the reducer drops the group's last reference, the gloo destructor joins worker
        threads that may still be freeing a finished collective's tensors, which needs the GIL,
        and the rank deadlocks (seen with 2 gloo ranks on a loaded machine: 4 hangs in 16
        runs). So the wrapped model is released first, while torch.distributed still registers
        the group; the group then goes with ``destroy_process_group``, whose destructor
        releases the GIL. (A DeepSpeed engine holds no reducer; ZeRO-3's parameter hooks keep
        it alive until exit, which is harmless.)"""
        wrapped = weakref.ref(self.model) if self.model is not None else None
        self.model = self.optimizer = self.scheduler = self.train_forward = None
        self.accelerator.free_memory()
        gc.collect()
        survivor = wrapped() if wrapped is not None else None
        if isinstance(survivor, torch.nn.parallel.DistributedDataParallel):  # holds the group
            print("warning: the DDP-wrapped model outlived training; process-group teardown "
                  "may hang", file=sys.stderr)
        self.accelerator.end_training()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
