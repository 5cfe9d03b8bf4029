"""One task experiment in this process: train (or load) one model, score it (RegBench or
length extrapolation) under a protocol of :mod:`mosaics.evaluation.protocols`. A sweep job's
process (:func:`mosaics.evaluation.runner.run_job`) runs each job through these.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError
from ..training.build import causal_lm
from ..training.checkpoint import checkpoint_root
from ..training.config import TrainConfig
from ..training.signals import RunPreempted
from ..training.trainer import (
    Hook,
    KeepBest,
    Trainer,
    TrainResult,
    count_parameters,
    make_accelerator,
)
from . import regbench, tasks
from .analysis import retrieval
from .models import is_mosaics, load_model, model_config, saved_label
from .protocols import ExtrapolationProtocol, RegBenchProtocol


class EpochBatches:
    """Endless batches over a fixed list of items, reshuffled every epoch by one seeded
    generator (the last batch of an epoch may be smaller); ``batch(i)`` is a pure function of i.
    """

    def __init__(self, items: Sequence, batch_size: int, collate: Callable[[list], dict],
                 seed: int = 0) -> None:
        self.items, self.batch_size, self.collate, self.seed = items, batch_size, collate, seed
        self.steps_per_epoch = math.ceil(len(items) / batch_size)
        self._rng = np.random.default_rng(seed)
        self._orders: list[np.ndarray] = []

    def batch(self, index: int) -> dict[str, Tensor]:
        epoch, j = divmod(index, self.steps_per_epoch)
        while len(self._orders) <= epoch:
            self._orders.append(self._rng.permutation(len(self.items)))
        rows = self._orders[epoch][j * self.batch_size: (j + 1) * self.batch_size]
        return self.collate([self.items[k] for k in rows])

    def state_dict(self) -> dict:
        return {"items": len(self.items), "batch_size": self.batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state != self.state_dict():
            raise DataError(f"the checkpoint's batches ({state}) differ from this run's "
                             f"({self.state_dict()}); resume with the same data settings")


def fit_task_model(model: torch.nn.Module, batches: Any, val_batches: list[dict[str, Tensor]],
                   total_steps: int, lr: float, weight_decay: float, warmup_frac: float,
                   eval_every: int, seed: int, device: str, time_budget_s: float | None = None,
                   run_dir: Path | None = None, progress: bool = True,
                   desc: str = "train", hooks: Sequence[Hook] = (),
                   warmup_steps: int | None = None, schedule_steps: int | None = None,
                   min_lr: float | None = None, keep: str = "best",
                   checkpoint_every: int = 0) -> TrainResult:
    """Train ``model`` in place with the shared :class:`Trainer` (AdamW, linear warm-up over
    ``warmup_frac`` of the steps or ``warmup_steps``, cosine to ``min_lr`` (lr / 10) at the
    last step or at ``schedule_steps``, clipping at 1); ``keep="best"`` restores the weights
    of the best validation loss, ``"last"`` keeps the last step's. Learning curves go to
    ``run_dir/metrics.jsonl`` when given; ``hooks`` run before the one that keeps the best
    weights. ``time_budget_s`` counts every attempt of a resumed run.

    ``checkpoint_every > 0`` (needs ``run_dir``): a checkpoint every that many steps (the
    newest kept, with the best weights so far) that the same call resumes exactly, and
    SIGTERM / SIGUSR1 end the run after the current step with a checkpoint, raising
    :class:`~mosaics.training.signals.RunPreempted` (exit status 75 if uncaught)."""
    if keep not in ("best", "last"):
        raise ValueError(f"keep must be 'best' or 'last', got {keep!r}")
    if checkpoint_every and run_dir is None:
        raise ValueError("checkpoint_every > 0 needs a run_dir to write the checkpoints to")
    cfg = TrainConfig(run_dir=str(run_dir) if run_dir is not None else "", seed=seed,
                      max_steps=total_steps, lr=lr, min_lr=0.1 * lr if min_lr is None else min_lr,
                      warmup_steps=(max(1, round(warmup_frac * total_steps))
                                    if warmup_steps is None else warmup_steps),
                      schedule_steps=schedule_steps,
                      weight_decay=weight_decay, grad_clip=1.0, eval_interval=eval_every,
                      log_interval=eval_every, checkpoint_interval=checkpoint_every,
                      keep_checkpoints=1, progress_bar=progress, tensorboard=False,
                      time_budget_s=time_budget_s, time_budget_scope="run")
    torch.manual_seed(seed)
    keepers = [KeepBest()] if keep == "best" else []
    trainer = Trainer(cfg, model.to(device), batches, val_batches, hooks=[*hooks, *keepers],
                      accelerator=make_accelerator(cfg, device), name=desc)
    result = trainer.fit()
    trainer.close()
    if result.stop_signal is not None:
        raise RunPreempted(f"{desc}: stopped by {result.stop_signal} at step {result.steps}, "
                           f"checkpoint {result.checkpoint}; run the same command again to "
                           "resume it")
    model.eval()
    return result


def drop_checkpoints(run_dir: Path | None) -> None:
    """Remove a finished task run's checkpoints (its result and saved model are written)."""
    if run_dir is not None:
        shutil.rmtree(checkpoint_root(run_dir), ignore_errors=True)


def train_summary(result: TrainResult) -> dict[str, Any]:
    """The JSON-ready part of a task run's :class:`TrainResult`."""
    return {"best_val_loss": result.best_val_loss, "best_step": result.best_step,
            "steps": result.steps, "seconds": result.wall_seconds,
            "stopped_early": result.stopped_early, "resumed_step": result.resumed_step,
            "resumed_seconds": result.resumed_seconds,
            "history": result.history}


def check_vocab(model: torch.nn.Module, expected: int, path: str | Path, task: str) -> None:
    """Refuse a saved model whose vocabulary is not the task's."""
    got = model.config.vocab_size
    if got != expected:
        raise ValueError(f"model {path} has vocab_size {got}, but {task} uses {expected} tokens; "
                         "pass a model trained on this task")


def _saved_run(model_dir: str | Path, changes: dict[str, Any] | None) -> dict[str, Any]:
    """The label and provenance of a scored saved model (and its config changes)."""
    return {"label": saved_label(model_dir, changes), "model_dir": str(model_dir),
            "config_changes": dict(changes or {})}


def _label(arch: str, kernel: str | None) -> str:
    return f"{arch}/{kernel}" if is_mosaics(arch) else arch


def _slug(label: str) -> str:
    return label.replace("/", "-")


def run_regbench(arch: str, kernel: str | None, size: int | None, proto: RegBenchProtocol,
                 seed: int = 0, kernel_kwargs: dict | None = None, device: str = "cpu",
                 out_dir: str | Path | None = None, save_model: bool = False,
                 model_dir: str | None = None, progress: bool = True,
                 resume: bool = False,
                 config_changes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train one model (``arch``, ``kernel``) on ``size`` training automata, or load the saved
    ``model_dir`` (with the ``config_changes`` to its config), and score it on the test
    automata; returns the JSON-ready results
    ``{protocol, seed, data_fingerprint, test_fingerprint, baselines, runs: [one run]}``.
    ``resume`` (with ``out_dir``): checkpoint at every evaluation and continue an interrupted
    run of the same call where its last checkpoint left it (:func:`fit_task_model`)."""
    data = regbench.make_splits(0 if model_dir else size, proto.n_val, proto.n_test, seed)
    results: dict[str, Any] = {"protocol": asdict(proto), "seed": seed,
                               "data_fingerprint": data.fingerprint(),
                               "test_fingerprint": heldout_fingerprint(data),
                               "baselines": regbench.baseline_scores(data.test), "runs": []}
    if model_dir:
        model = load_model(model_dir, device, config_changes)
        check_vocab(model, regbench.VOCAB_SIZE, model_dir, "RegBench")
        score = regbench.evaluate_model(model, data.test, proto.batch_size, device, progress)
        results["runs"].append({**_saved_run(model_dir, config_changes), "size": None,
                                "params": count_parameters(model), **score})
        return results
    if size is None:
        raise ValueError("RegBench training needs a size (number of training automata)")
    val_batches = [regbench.collate(data.val[i: i + proto.batch_size])
                   for i in range(0, len(data.val), proto.batch_size)]
    steps_per_epoch = math.ceil(size / proto.batch_size)
    total = proto.epochs * steps_per_epoch
    if proto.max_steps:
        total = min(total, proto.max_steps)
    eval_every = proto.eval_every or max(1, int(steps_per_epoch / proto.evals_per_epoch))
    label = _label(arch, kernel)
    cfg = model_config(arch, regbench.VOCAB_SIZE, proto.n_layer, proto.n_embd, proto.n_head,
                       proto.pmem_size, kernel or "gaussian", kernel_kwargs, proto.dropout,
                       proto.n_positions)
    torch.manual_seed(seed)
    model = causal_lm(cfg)
    batches = EpochBatches(data.train[:size], proto.batch_size, regbench.collate, seed)
    run_dir = None if out_dir is None else Path(out_dir) / "runs" / f"{_slug(label)}-n{size}"
    info = fit_task_model(model, batches, val_batches, total, proto.lr, proto.weight_decay,
                          proto.warmup_frac, eval_every, seed, device, proto.time_budget_s,
                          run_dir, progress, f"{label} n={size}",
                          checkpoint_every=eval_every if resume and run_dir else 0)
    t0 = time.time()
    score = regbench.evaluate_model(model, data.test, proto.batch_size, device, progress)
    run = {"label": label, "arch": arch, "kernel": kernel, "size": size,
           "params": count_parameters(model), **score, "eval_seconds": time.time() - t0,
           "train": train_summary(info)}
    if save_model and out_dir is not None:
        path = Path(out_dir) / "models" / f"{_slug(label)}-n{size}"
        model.save_pretrained(path)
        run["model_dir"] = str(path)
    results["runs"].append(run)
    drop_checkpoints(run_dir)
    return results


def heldout_fingerprint(data: regbench.RegBenchData) -> str:
    """Fingerprint of the test split alone (equal for every training size)."""
    return regbench.RegBenchData([], [], data.test).fingerprint()


class TaskExactMatch(Hook):
    """At every validation, the exact match and token accuracy of the validation samples and
    the wall time since training started, logged as extra rows of ``metrics.jsonl`` (and
    merged into the trainer's history). With ``paths`` (MQMTAR, a v1 Memory Mosaics model with
    a score kernel: every kernel but FSKA), also the recall's path masses at their best heads
    and the v1 / v2 token accuracy (keys ``val/direct_mass``, ..., ``val/v1_accuracy``:
    :func:`~mosaics.evaluation.analysis.retrieval.path_summary`) on the first
    ``PATH_SAMPLES`` validation samples."""

    PATH_SAMPLES = 32

    def __init__(self, task: str, samples: list[tasks.Sample], batch_size: int,
                 device: str, paths: bool = False) -> None:
        if paths and task != "mqmtar":
            raise ValueError(f"paths are MQMTAR's recall routes; task {task!r} has none")
        self.task, self.samples, self.batch_size, self.device = task, samples, batch_size, device
        self.paths = paths
        self.pending: dict[str, float] = {}

    def on_evaluate(self, trainer: Trainer, step: int, val_loss: float) -> None:
        model = trainer.unwrapped_model
        was_training = model.training
        score = tasks.evaluate_exact_match(model, self.task, self.samples, self.batch_size,
                                           self.device)
        self.pending = {"val/exact_match": score["exact_match"],
                        "val/token_accuracy": score["token_accuracy"]}
        if self.paths:
            profile = retrieval.retrieval_profile(model, self.task,
                                                  self.samples[:self.PATH_SAMPLES], self.device)
            self.pending.update({f"val/{k}": v
                                 for k, v in retrieval.path_summary(profile).items()})
        model.train(was_training)
        self.pending["elapsed_s"] = trainer.elapsed_seconds
        if trainer.is_main:  # beside the trainer's "val loss" line in the job's log
            paths = "" if not self.paths else ", paths " + " ".join(
                f"{k.removesuffix('_mass')} {self.pending[f'val/{k}']:.2f}"
                for k in retrieval.PATHS)
            print(f"{trainer.name} step {step}: val exact match {score['exact_match']:.3f}, "
                  f"token accuracy {score['token_accuracy']:.3f}{paths}", flush=True)

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        if not self.pending:
            return
        if trainer.history and trainer.history[-1]["step"] == step:
            trainer.history[-1].update(self.pending)
        if trainer.metrics is not None:
            trainer.metrics.log(step, self.pending)
        self.pending = {}


def extrapolation_model(task: str, arch: str, kernel: str | None,
                        proto: ExtrapolationProtocol, kernel_kwargs: dict | None,
                        longest: int) -> torch.nn.Module:
    """A fresh task model; ``longest`` is the longest test sequence. GPT-2 is refused: its
    learned position table cannot be evaluated past the training lengths."""
    if arch == "gpt2":
        raise ValueError("gpt2 has a learned position table and cannot be scored past its "
                         "training lengths; use the rotary-position baseline, llama")
    if proto.alibi and not is_mosaics(arch):
        raise ValueError(f"alibi is an option of Memory Mosaics' contextual memory; {arch} has "
                         "its own positions: drop alibi for this model")
    spec = tasks.TASKS[task]
    extra: dict[str, Any] = {"alibi": True} if proto.alibi else {}
    if proto.embedding_init_std is not None:
        if not is_mosaics(arch):
            raise ValueError(f"embedding_init_std is a Memory Mosaics option; {arch} keeps its "
                             "own init: drop embedding_init_std for this model")
        extra["embedding_init_std"] = float(proto.embedding_init_std)
    cfg = model_config(arch, spec.vocab_size, proto.n_layer or spec.n_layer, proto.n_embd,
                       proto.n_head, proto.pmem_size, kernel or "gaussian", kernel_kwargs,
                       proto.dropout,
                       2 * proto.max_len + 3 if is_mosaics(arch) else longest, **extra)
    return causal_lm(cfg)


def _run_name(task: str, arch: str, kernel: str | None) -> str:
    if arch == "mosaics-v2":
        return f"{task}-v2-{kernel}"
    return f"{task}-{kernel if arch == 'mosaics' else arch}"


def run_extrapolation(task: str, arch: str, kernel: str | None, proto: ExtrapolationProtocol,
                      seed: int = 0, kernel_kwargs: dict | None = None, device: str = "cpu",
                      out_dir: str | Path | None = None, save_model: bool = False,
                      model_dir: str | None = None, progress: bool = True,
                      resume: bool = False,
                      config_changes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train one model (``arch``, ``kernel``) on lengths U{min..max_len}, or load the saved
    ``model_dir`` (with the ``config_changes`` to its config); exact match and token
    accuracy per test length. Returns the JSON-ready results ``{task, protocol, seed,
    lengths, runs: [one run]}``. ``resume`` (with
    ``out_dir``): checkpoint at every evaluation and continue an interrupted run of the same
    call where its last checkpoint left it (:func:`fit_task_model`)."""
    from tqdm.auto import tqdm

    if task not in tasks.TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(tasks.TASKS)}")
    spec = tasks.TASKS[task]
    lengths = [proto.max_len * m for m in proto.multipliers]
    results: dict[str, Any] = {"task": task, "protocol": asdict(proto), "seed": seed,
                               "lengths": lengths, "runs": []}
    test_sets = {n: tasks.fixed_set(task, proto.n_samples, n, seed + 1000) for n in lengths}
    longest = max(len(s[0].tokens) for s in test_sets.values())

    def evaluate(model: torch.nn.Module, label: str) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {"exact_match": {}, "token_accuracy": {}}
        for n in tqdm(lengths, desc=f"{label} test", disable=not progress, leave=False):
            seq = len(test_sets[n][0].tokens)
            bs = max(1, proto.eval_tokens // seq)
            score = tasks.evaluate_exact_match(model, task, test_sets[n], bs, device)
            for key, value in score.items():
                out[key][n] = value
        return out

    if model_dir:
        model = load_model(model_dir, device, config_changes)
        check_vocab(model, spec.vocab_size, model_dir, task)
        run = _saved_run(model_dir, config_changes)
        results["runs"].append({**run, "params": count_parameters(model),
                                **evaluate(model, run["label"])})
        return results
    val = tasks.fixed_set(task, proto.n_val, (proto.min_len, proto.max_len), seed + 2000)
    val_batches = [tasks.collate(val[i: i + proto.batch_size], spec.pad)
                   for i in range(0, len(val), proto.batch_size)]
    for b in val_batches:
        b.pop("score_mask")
    label = _label(arch, kernel)
    torch.manual_seed(seed)
    model = extrapolation_model(task, arch, kernel, proto, kernel_kwargs, longest)
    batches = tasks.RandomTaskBatches(task, proto.batch_size, proto.min_len, proto.max_len,
                                      seed if proto.data_seed is None else proto.data_seed,
                                      proto.curriculum_steps)
    name = _run_name(task, arch, kernel)
    run_dir = None if out_dir is None else Path(out_dir) / "runs" / name
    watch = TaskExactMatch(task, val, proto.batch_size, device,
                           paths=task == "mqmtar" and retrieval.has_retrieval_weights(model))
    info = fit_task_model(model, batches, val_batches, proto.steps, proto.lr, proto.weight_decay,
                          proto.warmup_frac, proto.eval_every, seed, device, proto.time_budget_s,
                          run_dir, progress, f"{label} {task}", hooks=[watch],
                          warmup_steps=proto.warmup_steps, schedule_steps=proto.schedule_steps,
                          min_lr=proto.min_lr, keep=proto.keep,
                          checkpoint_every=proto.eval_every if resume and run_dir else 0)
    run = {"label": label, "arch": arch, "kernel": kernel, "params": count_parameters(model),
           **evaluate(model, label), "train": train_summary(info)}
    if save_model and out_dir is not None:
        path = Path(out_dir) / "models" / name
        model.save_pretrained(path)
        run["model_dir"] = str(path)
    results["runs"].append(run)
    drop_checkpoints(run_dir)
    return results
