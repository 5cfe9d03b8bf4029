"""Model cards: the README.md of an exported model directory, in the Hugging Face format.

A card is a YAML header (``library_name``, ``tags``, ``pipeline_tag``, ``datasets``,
``license``) between ``---`` lines, then Markdown: architecture, kernel, size, training data and
steps, final losses, evaluation results, how to load and generate, and the papers to cite.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from .errors import InputError

CARD_NAME = "README.md"
LICENSE = "mit"
CITATIONS = """\
```bibtex
@inproceedings{zhang2025memorymosaics,
  title     = {Memory Mosaics},
  author    = {Jianyu Zhang and Niklas Nolte and Ranajoy Sadhukhan and Beidi Chen and
               L{\\'e}on Bottou},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2025},
  note      = {arXiv:2405.06394}
}
@article{zhang2025memorymosaicsatscale,
  title   = {Memory Mosaics at scale},
  author  = {Jianyu Zhang and L{\\'e}on Bottou},
  journal = {arXiv preprint arXiv:2507.03285},
  year    = {2025}
}
```"""


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise InputError(f"{model_dir} has no config.json; write the model (save_pretrained) "
                         "before its card.")
    return json.loads(path.read_text(encoding="utf-8"))


def _parameter_count(model_dir: Path) -> int | None:
    """Parameters stored in the directory's safetensors files (tied weights counted once)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name != "lm_head.weight":
                    total += _prod(f.get_slice(name).get_shape())
    return total


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def format_count(n: int) -> str:
    """123588336 -> '123.6M'; small counts in full (12,345)."""
    return f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n:,}"


def _looks_like_hub_id(name: str) -> bool:
    """A dataset named as on the hub (``owner/name`` or ``name``), not a local path."""
    return (not name.startswith((".", "/", "~")) and " " not in name and name.count("/") <= 1
            and not Path(name).exists())


def _architecture(cfg: Mapping[str, Any]) -> list[str]:
    if cfg.get("model_type") != "mosaics":
        return [f"- model type: `{cfg.get('model_type')}` (the baseline architecture), "
                f"{cfg.get('n_layer')} layers, {cfg.get('n_head')} heads, width "
                f"{cfg.get('n_embd')}"]
    v2 = [name for name in ("gated_keys", "adaptive_bandwidth", "three_level_memory",
                            "document_masking") if cfg.get(name)]
    lines = [
        f"- Memory Mosaics: {cfg['n_layer']} blocks, each a contextual memory (replaces "
        "self-attention) and a persistent memory (replaces the MLP); no positional encoding",
        f"- width d = {cfg['n_embd']}, {cfg['n_head']} heads of {cfg['n_embd'] // cfg['n_head']}",
        f"- persistent memory: `{cfg.get('persistent_memory', 'banks')}`"
        + (f", {cfg['pmem_size']} slots per head"
           if cfg.get("persistent_memory", "banks") == "banks" else ""),
        f"- contextual-memory kernel: `{cfg.get('kernel', 'gaussian')}`"
        + (f" with {json.dumps(cfg['kernel_kwargs'])}" if cfg.get("kernel_kwargs") else ""),
        f"- vocabulary {cfg['vocab_size']}, training context {cfg.get('block_size')} tokens",
    ]
    if v2:
        lines.append(f"- Memory Mosaics v2 options: {', '.join(v2)}")
    return lines


def render_model_card(config: Mapping[str, Any], *, n_params: int | None = None,
                      source: str | None = None, datasets: Sequence[str] | None = None,
                      steps: int | None = None, tokens_per_step: int | None = None,
                      losses: Mapping[str, float | None] | None = None,
                      results: Mapping[str, Any] | None = None,
                      tokenizer: str | None = None, model_id: str = "path/to/this/directory",
                      license: str = LICENSE) -> ModelCard:
    """Build the card of a model whose ``config.json`` holds ``config``."""
    kernel = config.get("kernel")
    tags = ["memory-mosaics", "associative-memory", "causal-lm", "mosaics"]
    if kernel:
        tags.append(f"kernel-{kernel}")
    hub_ids = [d for d in datasets or () if _looks_like_hub_id(d)]
    data = ModelCardData(library_name="transformers", license=license, tags=tags,
                         pipeline_tag="text-generation", datasets=hub_ids or None)
    size = f" ({format_count(n_params)} parameters)" if n_params else ""
    body = [f"# Memory Mosaics language model{size}", ""]
    if source:
        body += [f"Converted from a checkpoint of {source} with `mosaics convert-reference`; "
                 "the logits equal the source model's up to float rounding.", ""]
    body += ["## Architecture", "", *_architecture(config), ""]
    body += ["## Training", ""]
    body.append(f"- data: {', '.join(datasets)}" if datasets else "- data: not recorded")
    if steps is not None:
        extra = f" of {tokens_per_step:,} tokens" if tokens_per_step else ""
        body.append(f"- optimizer steps: {steps:,}{extra}")
    if tokenizer:
        body.append(f"- tokenizer: {tokenizer if ' ' in tokenizer else f'`{tokenizer}`'}")
    for name, value in (losses or {}).items():
        if value is not None:
            body.append(f"- final {name} loss: {value:.4f} nats/token")
    body.append("")
    if results:
        body += ["## Evaluation", "", "| metric | value |", "| --- | --- |"]
        body += [f"| {k} | {v} |" for k, v in results.items()]
        body.append("")
    body += [
        "## Use", "",
        "```python",
        "import mosaics  # registers the model with the Auto classes",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{model_id}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{model_id}")',
        'ids = tokenizer("Once upon a time", return_tensors="pt").input_ids',
        "out = model.generate(ids, max_new_tokens=40, do_sample=True, top_k=50)",
        "print(tokenizer.decode(out[0]))",
        "```", "",
        "Without the `mosaics` package, pass `trust_remote_code=True` (the model code is "
        "saved in this directory).", "",
        "## Citation", "", CITATIONS, "",
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


def write_model_card(model_dir: str | os.PathLike, config: Any = None, **kwargs: Any) -> Path:
    """Write ``model_dir/README.md`` (atomically) for the model saved there; ``kwargs`` go to
    :func:`render_model_card`. ``config`` defaults to the directory's config.json."""
    model_dir = Path(model_dir)
    if config is None:
        cfg = _read_config(model_dir)
    else:
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    kwargs.setdefault("n_params", _parameter_count(model_dir))
    card = render_model_card(cfg, **kwargs)
    path = model_dir / CARD_NAME
    tmp = path.with_name(f".{CARD_NAME}.tmp")
    tmp.write_text(str(card), encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_training_card(model_dir: str | os.PathLike, train_config: Any, result: Any) -> Path:
    """The card of a trainer's ``final/`` directory, from its ``TrainConfig`` and
    ``TrainResult``."""
    tcfg = train_config
    datasets = [tcfg.data_source] if tcfg.data_source else ["embedded story corpus (mosaics)"]
    tokens = tcfg.block_size * tcfg.global_batch_size if tcfg.global_batch_size else None
    return write_model_card(model_dir, None, datasets=datasets, steps=result.steps,
                            tokens_per_step=tokens, tokenizer=tcfg.tokenizer,
                            losses={"train": result.train_loss, "validation": result.val_loss})
