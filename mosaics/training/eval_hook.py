"""The hook that runs :mod:`~mosaics.training.evals` on the live model every K steps.

Training is untouched: the RNG states (python, numpy, torch, CUDA) and the model's
train/eval mode are saved before and restored after, evaluations run under
``torch.no_grad`` on the unwrapped module (no DDP collectives). A failing evaluation logs one
line (``warning: evaluation <name> at step <s> failed: ...``) and training goes on. Under
DeepSpeed ZeRO-3 (weights partitioned, every forward a collective) none run.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .evals import Evaluation
from .metrics import log_row
from .trainer import Hook


@contextlib.contextmanager
def isolated(model: torch.nn.Module) -> Iterator[None]:
    """Run the block in eval mode under no_grad, then restore every RNG and the mode."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


class EvalHook(Hook):
    """Runs ``evaluations`` at their intervals; results go to metrics.jsonl, the trackers and
    ``trainer.history`` as ``eval/<name>/<metric>`` (plus ``eval/<name>/seconds``)."""

    def __init__(self, evaluations: list[Evaluation]) -> None:
        self.evaluations = list(evaluations)
        self.failures: list[str] = []  # the one-line messages of failed evaluations
        self.skipped = False  # under ZeRO-3

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        due = [e for e in self.evaluations if step % e.spec.interval == 0]
        if not due:
            return
        if trainer.is_deepspeed and trainer._zero_stage() == 3:
            if not self.skipped and trainer.is_main:  # said once
                print("warning: evaluations during training are skipped under DeepSpeed ZeRO-3 "
                      "(its weights are partitioned over the processes)", file=sys.stderr)
            self.skipped = True
            return
        model = trainer.unwrapped_model
        row: dict[str, Any] = {}
        for evaluation in due:
            if not trainer.is_main and not evaluation.every_rank:
                continue
            row.update(self._run(evaluation, model, trainer, step))
        if row:
            log_row(trainer, step, row)

    def _run(self, evaluation: Evaluation, model: Any, trainer: Any, step: int
             ) -> dict[str, Any]:
        name, start = evaluation.spec.name, time.monotonic()
        error: BaseException | None = None
        out: dict[str, Any] = {}
        with isolated(model):
            try:
                out = evaluation.run(model, start + evaluation.spec.budget_s, trainer)
            except Exception as err:  # noqa: BLE001 - an evaluation never stops training
                error = err
            if evaluation.every_rank:  # collective: every rank, always, one reduction
                failed = trainer._agree(error is not None)[0]
                if not failed:
                    sums = torch.cat([out["_sums"], out["_count"].reshape(1)])
                    sums = trainer.accelerator.reduce(sums.to(trainer.accelerator.device),
                                                      reduction="sum").cpu()
                    out = evaluation.finish(sums[:-1], float(sums[-1]))
                elif error is None:
                    error = RuntimeError("failed on another process")
        if error is not None:
            line = (f"warning: evaluation {name} at step {step} failed: "
                    f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                    "; training goes on")
            self.failures.append(line)
            if trainer.is_main:
                print(line, file=sys.stderr, flush=True)
            return {}
        values = {f"eval/{name}/{k}": v for k, v in out.items()}
        values[f"eval/{name}/seconds"] = time.monotonic() - start
        return values
