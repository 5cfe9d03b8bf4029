"""Training configuration: a dataclass loaded from YAML, every field overridable from the CLI.

Precedence (lowest to highest): dataclass defaults < YAML file (and the files it names with
``base:``) < command-line overrides. Values are coerced to each field's declared type, so
``lr: 5e-3`` in YAML (a string for PyYAML) and ``lr=5e-3`` on the command line both give a float.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from .metrics import tracker_names

MODEL_TYPES = ("mosaics", "gpt2", "llama")
PRECISIONS = ("auto", "no", "fp16", "bf16")


@dataclass
class TrainConfig:
    """Everything a pretraining run needs. Defaults: a small model that trains on 2 CPU cores
    in a few minutes on the embedded story corpus (``configs/default.yaml`` restates them)."""

    # run
    run_dir: str = "runs/default"
    seed: int = 0
    resume: bool = False  # intact checkpoints in run_dir are resumed even without it

    # data (see mosaics.data.prepare_corpus); a mapping {source: weight, ...} trains on a
    # weighted mixture (mosaics.data.mixture; one tokenizer for all)
    data_source: str | dict[str, float] | None = None
    data_cache_dir: str | None = None
    tokenizer: str | None = None
    vocab_size: int = 4096
    num_train_stories: int = 20000
    num_val_stories: int | None = None
    val_fraction: float = 0.005
    data_seed: int = 0
    data_num_proc: int = 1
    text_column: str = "text"
    skip_malformed: bool = False  # skip (and count) unreadable JSON lines instead of stopping

    # model
    model_type: str = "mosaics"
    n_layer: int = 4
    n_head: int = 8
    n_embd: int = 256
    block_size: int = 256
    pmem_size: int | None = None
    dropout: float = 0.0
    attn_dropout: float = 0.0
    kernel: str = "gaussian"
    kernel_kwargs: dict[str, Any] = field(default_factory=dict)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    gradient_checkpointing: bool = False
    # torch.compile the training forward and backward (as nanoGPT's compile=true); null: on
    # with CUDA, off on CPU (where the first step's compile costs more than it saves)
    compile: bool | None = None

    # optimisation
    max_steps: int = 150
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    global_batch_size: int | None = None
    lr: float = 5e-3
    min_lr: float = 1e-4
    warmup_steps: int = 15
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    mixed_precision: str = "auto"
    # CPU: flush subnormal floats to zero while training (sharp kernels underflow into them,
    # and the CPU attention backward slows 2.5x on them; docs/performance.md)
    flush_denormal: bool = True
    ddp_find_unused_parameters: bool = False

    # evaluation, logging, checkpoints
    eval_interval: int = 50
    eval_windows: int = 32
    eval_batch_size: int = 16
    log_interval: int = 10
    checkpoint_interval: int = 50
    keep_checkpoints: int = 2
    progress_bar: bool = True
    tensorboard: bool = True
    # trackers through accelerate: tensorboard, wandb, mlflow, ... (a list or "a,b"; "none");
    # metrics.jsonl is always written. tensorboard: false drops TensorBoard from this list.
    log_with: list[str] | str | None = "tensorboard"
    time_budget_s: float | None = None  # stop early after this many seconds (final eval kept)
    # what the budget counts: "attempt" (this process; a resumed run gets it again, one SLURM
    # allocation each) or "run" (every attempt together, a compute budget for a protocol)
    time_budget_scope: str = "attempt"

    # evaluations on the live model: {name: interval} or {name: {interval, budget_s, ...}};
    # position_loss, sample, recall, lm_eval (mosaics.training.evals)
    evals: dict[str, Any] = field(default_factory=dict)

    # profiles, memory and hangs (docs/training.md): a torch profiler trace of steps "a:b";
    # data-wait time and peak memory in the metrics; a memory snapshot on out-of-memory; a
    # watchdog that ends a stalled step or collective after watchdog_s seconds (null: off)
    profile_steps: str | None = None
    system_metrics: bool = True
    oom_snapshot: bool = True
    watchdog_s: float | None = None

    # final model and sample
    save_final: bool = True
    sample_prompt: str = "Once upon a time"
    sample_tokens: int = 48

    # cluster runs: requeue, preemption, loss spikes, extension (docs/training.md)
    fresh_start: bool = False  # move an earlier run in run_dir aside instead of resuming it
    stop_signals: str = "SIGTERM,SIGUSR1"  # checkpoint and exit (status 75) on these; "" = off
    max_bad_steps: int = 5  # non-finite steps skipped in a row before the run stops
    bad_step_rollback: bool = False  # then roll back to the last checkpoint, new batches
    schedule_steps: int | None = None  # cosine length; null: max_steps of the run's start

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the bad field and the fix."""
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}.")
        if self.mixed_precision not in PRECISIONS:
            raise ConfigError(
                f"mixed_precision must be one of {PRECISIONS}, got {self.mixed_precision!r}.")
        for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "block_size",
                     "eval_windows", "eval_batch_size", "log_interval", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}.")
        for name in ("warmup_steps", "eval_interval", "checkpoint_interval", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 disables), got {getattr(self, name)}.")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}.")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ConfigError(f"time_budget_s must be positive or null, got {self.time_budget_s}.")
        if self.time_budget_scope not in ("attempt", "run"):
            raise ConfigError(f"time_budget_scope must be 'attempt' or 'run', got "
                              f"{self.time_budget_scope!r}.")
        if self.fresh_start and self.resume:
            raise ConfigError("fresh_start=true and resume=true contradict each other; a run_dir "
                              "with checkpoints is resumed anyway, so drop one of them.")
        from .signals import parse_signals

        parse_signals(self.stop_signals)
        if self.max_bad_steps < 0:
            raise ConfigError(f"max_bad_steps must be >= 0 (0: stop at the first non-finite "
                              f"step), got {self.max_bad_steps}.")
        if self.schedule_steps is not None and self.schedule_steps <= 0:
            raise ConfigError(f"schedule_steps must be positive or null, got "
                              f"{self.schedule_steps}.")
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise ConfigError(f"global_batch_size must be positive or null, got "
                             f"{self.global_batch_size}.")
        tracker_names(self.log_with, self.tensorboard)  # raises on an unknown tracker
        from ..data.mixture import parse_mixture

        mixture = parse_mixture(self.data_source)
        if mixture is not None:
            self.data_source = mixture
        from .evals import parse_evals

        parse_evals(self.evals)
        from .profiling import parse_steps

        parse_steps(self.profile_steps)
        if self.watchdog_s is not None and self.watchdog_s <= 0:
            raise ConfigError(f"watchdog_s must be positive seconds or null (off), got "
                              f"{self.watchdog_s}.")

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each process.

        ``global_batch_size`` (windows per optimizer step, all processes together) wins when set:
        it must equal batch_size x world_size x accumulation."""
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        per_step = self.batch_size * world_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not a multiple of batch_size x "
                f"processes = {self.batch_size} x {world_size}; change batch_size or "
                f"global_batch_size.")
        return self.global_batch_size // per_step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def _unknown_key_error(key: str, where: str) -> ConfigError:
    names = field_names()
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"Unknown config field {key!r} ({where}).{hint} "
                      f"Valid fields: {', '.join(names)}.")


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Convert ``value`` (YAML scalar or CLI string) to the field type ``hint``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        if isinstance(value, dict) and any(typing.get_origin(a) is dict for a in args):
            return dict(value)
        return _coerce(name, value, args[0])
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in _TRUE | _FALSE:
                return text in _TRUE
            raise ValueError
        if hint is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() \
                else int(value)
        if hint is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if hint is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
        if origin is dict or hint is dict:
            if isinstance(value, str):
                value = yaml.safe_load(value) if value.strip() else {}
            if value is None:
                return {}
            if not isinstance(value, dict):
                raise ValueError
            return dict(value)
    except (TypeError, ValueError):
        pretty = getattr(hint, "__name__", str(hint))
        raise ConfigError(f"Config field {name!r} expects {pretty}, got {value!r}.") from None
    return value


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML config; a ``base: other.yaml`` key (relative to this file) is merged first."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"Config files include each other in a loop: {path}")
    if not path.is_file():
        raise ConfigError(f"Config file not found: {path}; pass an existing YAML file to "
                          "--config (see configs/).")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem}); fix the file (each line "
                          "`field: value`, see configs/default.yaml).") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file; pass a YAML config.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config fields (`field: value` lines), "
                          f"got {type(data).__name__}.")
    base = data.pop("base", None)
    merged: dict[str, Any] = {}
    if base is not None:
        merged.update(_read_yaml(path.parent / str(base), (*seen, path)))
    for key in data:
        if key not in _hints():
            raise _unknown_key_error(key, f"in {path}")
    merged.update(data)
    return merged


def parse_overrides(args: list[str]) -> tuple[str | None, dict[str, str]]:
    """Split CLI arguments into (config path, {field: raw value}).

    Accepted forms: ``key=value``, ``--key value``, ``--key=value``, bare ``--flag`` for a
    boolean (``--resume``), and ``--config PATH``. Dashes in keys are read as underscores."""
    config_path: str | None = None
    overrides: dict[str, str] = {}
    hints = _hints()
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            body = arg[2:]
            if "=" in body:
                key, value = body.split("=", 1)
            else:
                key = body
                nxt = args[i + 1] if i + 1 < len(args) else None
                is_bool = hints.get(key.replace("-", "_")) is bool
                if is_bool and (nxt is None or nxt.startswith("--") or "=" in nxt
                                or nxt.lower() not in _TRUE | _FALSE):
                    value = "true"
                elif nxt is None:
                    raise ConfigError(f"Option --{key} needs a value: --{key} VALUE.")
                else:
                    value = nxt
                    i += 1
        elif "=" in arg:
            key, value = arg.split("=", 1)
        else:
            raise ConfigError(f"Cannot read argument {arg!r}: write key=value or --key value.")
        key = key.replace("-", "_")
        if key == "config":
            config_path = value
        else:
            if key not in hints:
                raise _unknown_key_error(key, "on the command line")
            overrides[key] = value
        i += 1
    return config_path, overrides


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None
                ) -> TrainConfig:
    """Build a ``TrainConfig`` from defaults, an optional YAML file and overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        values.update(_read_yaml(Path(path)))
    for key, value in (overrides or {}).items():
        if key not in _hints():
            raise _unknown_key_error(key, "in overrides")
        values[key] = value
    hints = _hints()
    coerced = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    return TrainConfig(**coerced)


def config_from_argv(argv: list[str]) -> TrainConfig:
    """``train.py`` argument handling: ``[--config PATH] [key=value | --key value]...``."""
    path, overrides = parse_overrides(argv)
    return load_config(path, overrides)


def save_config(config: TrainConfig, path: str | Path) -> None:
    """Write the config as YAML, atomically (a temporary file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    os.replace(tmp, path)
