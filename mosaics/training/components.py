"""The hooks and wrappers a pretraining run gets from its config (evaluations, system
metrics, profiler, watchdog), kept out of the loop itself."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .config import TrainConfig
from .evals import (
    EvalSpec,
    Evaluation,
    PositionLoss,
    RecallProbe,
    SampleText,
    SourceLoss,
    parse_evals,
)
from .instrument import LoopProbe, SystemMetrics
from .profiling import ProfileSteps, parse_steps

VAL_STORY_SEED_OFFSET = 1_000_003  # the built-in corpus's validation stories (storygen)


def build_evaluations(cfg: TrainConfig, tokenizer: Any, main: bool = True,
                      per_source: dict[str, Any] | None = None) -> list[Evaluation]:
    """The evaluations of ``cfg.evals``; ``recall`` needs the built-in story corpus (its own
    question) and is left out with one line for other corpora. ``per_source`` (a mixture's
    validation windows by source) adds ``source_loss`` at every ``eval_interval``."""
    out: list[Evaluation] = []
    if per_source and cfg.eval_interval:
        spec = EvalSpec("source_loss", cfg.eval_interval, budget_s=float("inf"))
        out.append(SourceLoss(spec, per_source, cfg.eval_batch_size))
    for spec in parse_evals(cfg.evals):
        if spec.name == "position_loss":
            out.append(PositionLoss(spec))
        elif spec.name == "sample":
            out.append(SampleText(spec, tokenizer, cfg.sample_prompt, cfg.seed))
        elif spec.name == "recall":
            if cfg.data_source is not None:
                if main:
                    print("evals.recall: the recall probe asks the built-in story corpus's own "
                          "question; this corpus has none, so it is skipped", file=sys.stderr)
                continue
            from ..data.storygen import generate_story_records

            count = int(spec.options.get("prompts", 32))
            stories = generate_story_records(count, cfg.data_seed + VAL_STORY_SEED_OFFSET)
            out.append(RecallProbe(spec, tokenizer, stories))
        elif spec.name == "needle":
            from .eval_needle import NeedleProbe, needle_texts

            texts = needle_texts(cfg)
            if texts is None:
                if main:
                    print("evals.needle: the needle probe reads the corpus's validation split, "
                          "which this data_source lacks (or is a mixture); it is skipped",
                          file=sys.stderr)
                continue
            out.append(NeedleProbe(spec, tokenizer, texts, cfg.block_size, cfg.data_seed))
        elif spec.name == "lm_eval":
            from .eval_lm_harness import LmEvalTasks

            out.append(LmEvalTasks(spec, tokenizer))
    return out


def build_hooks(cfg: TrainConfig, tokenizer: Any, main: bool = True,
                probe: LoopProbe | None = None, rank: int = 0, world: int = 1,
                per_source: dict[str, Any] | None = None) -> list[Any]:
    """Every hook ``cfg`` asks for, in the order they run after each step; ``probe`` (the
    run's batches wrapped in a :class:`LoopProbe`) is needed by the system metrics and the
    profiler."""
    from .eval_hook import EvalHook

    hooks: list[Any] = []
    steps = parse_steps(cfg.profile_steps)
    if probe is not None and steps is not None and cfg.run_dir:
        hooks.append(ProfileSteps(steps, Path(cfg.run_dir) / "profile", rank, probe))
    evaluations = build_evaluations(cfg, tokenizer, main, per_source)
    if evaluations:
        hooks.append(EvalHook(evaluations))
    if probe is not None and cfg.system_metrics:
        hooks.append(SystemMetrics(probe))
    if cfg.watchdog_s is not None and cfg.run_dir:
        from .watchdog import Watchdog

        watchdog = Watchdog(cfg.watchdog_s, Path(cfg.run_dir), rank, world)
        if probe is not None:
            probe.listeners.append(watchdog.beat)
        hooks.append(watchdog)
    return hooks


@contextlib.contextmanager
def stopping(hooks: list[Any]) -> Iterator[None]:
    """Stop the hooks' threads (the watchdog) when the block ends, however it ends."""
    try:
        yield
    finally:
        for hook in hooks:
            if callable(getattr(hook, "stop", None)):
                hook.stop()
