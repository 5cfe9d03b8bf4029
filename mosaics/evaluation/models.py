"""The models of the task experiments: Memory Mosaics and size-matched transformer baselines,
built fresh or loaded from a saved directory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: job definitions read this module without torch
    import torch
    from transformers import PretrainedConfig

ARCHS = ("mosaics", "mosaics-v2", "gpt2", "llama")
MOSAICS_ARCHS = ("mosaics", "mosaics-v2")  # built with a kernel


def is_mosaics(arch: str) -> bool:
    """Whether ``arch`` is a Memory Mosaics model (v1 or v2), which takes a kernel."""
    return arch in MOSAICS_ARCHS


def model_config(arch: str, vocab_size: int, n_layer: int, n_embd: int, n_head: int,
                 pmem_size: int | None = None, kernel: str = "gaussian",
                 kernel_kwargs: dict | None = None, dropout: float = 0.0,
                 n_positions: int = 1024, **extra: Any) -> PretrainedConfig:
    """``MosaicsConfig`` (``mosaics``; ``mosaics-v2``: :meth:`MosaicsConfig.v2` without
    document masking, a task example being one document), or the same-size ``GPT2Config``
    (learned positions, ``n_positions``) or rotary ``LlamaConfig`` (``gpt2`` / ``llama``)."""
    from mosaics import MosaicsConfig, available_kernels
    from mosaics.baselines import gpt2_config_like, llama_config_like

    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    if is_mosaics(arch) and kernel not in available_kernels():
        raise ValueError(f"unknown kernel {kernel!r}; registered kernels: "
                         f"{', '.join(available_kernels())}")
    if arch == "mosaics-v2":
        extra = {"document_masking": False, **extra}
    build = MosaicsConfig.v2 if arch == "mosaics-v2" else MosaicsConfig
    cfg = build(vocab_size=vocab_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                        pmem_size=pmem_size, kernel=kernel, kernel_kwargs=kernel_kwargs or {},
                        dropout=dropout, block_size=n_positions, **extra)
    if arch == "gpt2":
        return gpt2_config_like(cfg, n_positions=n_positions)
    if arch == "llama":
        return llama_config_like(cfg)
    return cfg


def load_model(path: str | Path, device: str | torch.device = "cpu",
               config_changes: dict[str, Any] | None = None) -> torch.nn.Module:
    """Load a saved model directory (Memory Mosaics or a baseline) offline, in eval mode;
    ``config_changes`` replace fields of its saved config first (a test-time ablation such as
    ``{"alibi": False}``: the same weights, another model)."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM

    import mosaics  # noqa: F401  (registers the Auto classes)
    from mosaics.errors import InputError

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json); pass the "
                                "folder written by save_pretrained")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as err:
        raise InputError(f"{path / 'config.json'} is not the config of a model this install "
                         f"knows ({_first_line(err)}); pass a directory written by "
                         "save_pretrained for a Memory Mosaics, GPT-2 or Llama model.") from None
    check_config_changes(path, config_changes or {})
    for key, value in (config_changes or {}).items():
        setattr(config, key, value)
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise InputError(f"{path} holds a config but no weights (none of "
                         f"{', '.join(WEIGHT_FILES)}); copy the whole directory that "
                         "save_pretrained wrote.")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True,
                                                     trust_remote_code=False)
    except (SafetensorError, OSError, ValueError, RuntimeError, KeyError) as err:
        # a truncated or damaged weights file, or weights of another shape
        raise InputError(f"cannot load the weights of {path} ({type(err).__name__}: "
                         f"{_first_line(err)}); the file is truncated or damaged, or was "
                         "written for another model: copy or export it again.") from None
    return model.to(device).eval()


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_config_changes(path: str | Path, changes: dict[str, Any]) -> None:
    """Refuse config changes that name no field of the saved model's config.json."""
    import json

    from mosaics.errors import InputError

    if not changes:
        return
    saved = json.loads((Path(path) / "config.json").read_text())
    for key in changes:
        if key not in saved:
            raise InputError(f"{path}: its config has no field {key!r}, so it cannot be changed "
                             f"at load time; its fields: {', '.join(sorted(saved))}")


def saved_label(model_dir: str | Path, changes: dict[str, Any] | None) -> str:
    """The table row of a scored saved model: its folder, with its config changes if any."""
    if not changes:
        return str(model_dir)
    return f"{model_dir} (" + ", ".join(f"{k}={v}" for k, v in sorted(changes.items())) + ")"
