"""lm-evaluation-harness tasks on the live model (optional dependency ``lm-eval``).

The harness's Hugging Face wrapper (``HFLM``) takes the model object itself, so nothing is
saved or reloaded; ``eval/lm_eval/<task>/<metric>`` for every numeric score. Options: ``tasks``
(names), ``include_path`` (a folder of local task YAML files), ``limit`` (documents per
task), ``batch_size``, ``num_fewshot``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from torch import nn

from ..errors import ConfigError
from .evals import EvalSpec, Evaluation


class LmEvalTasks(Evaluation):
    """``lm_eval.simple_evaluate`` over ``tasks`` with the live model (main process)."""

    def __init__(self, spec: EvalSpec, tokenizer: Any) -> None:
        super().__init__(spec)
        tasks = spec.options.get("tasks")
        if isinstance(tasks, str):
            tasks = [t.strip() for t in tasks.split(",") if t.strip()]
        if not tasks:
            raise ConfigError("evals.lm_eval needs tasks: [name, ...] (lm-eval task names, or "
                              "those of include_path).")
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise ConfigError("evals.lm_eval needs lm-evaluation-harness: pip install lm-eval, "
                              "or drop lm_eval from evals.") from None
        self.tasks, self.tokenizer = list(tasks), tokenizer

    def run(self, model: nn.Module, deadline: float, trainer: Any) -> dict[str, Any]:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        opts = self.spec.options
        include = opts.get("include_path")
        manager = TaskManager(include_path=str(include), include_defaults=False) if include \
            else TaskManager()
        wrapped = HFLM(pretrained=model, tokenizer=self.tokenizer,
                       batch_size=int(opts.get("batch_size", 1)),
                       max_length=getattr(model.config, "block_size", None))
        here = os.getcwd()
        try:  # local task files name their data relative to their folder
            if include:
                os.chdir(str(include))
            results = lm_eval.simple_evaluate(model=wrapped, tasks=self.tasks,
                                              task_manager=manager, limit=opts.get("limit"),
                                              num_fewshot=opts.get("num_fewshot"),
                                              log_samples=False, verbosity="ERROR")
        finally:
            os.chdir(here)
        out: dict[str, Any] = {}
        for task, scores in results["results"].items():
            for metric, value in scores.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and "stderr" not in metric:
                    out[f"{task}/{metric.replace(',none', '')}"] = float(value)
        if time.monotonic() > deadline:
            out["over_budget"] = 1.0
        return out
