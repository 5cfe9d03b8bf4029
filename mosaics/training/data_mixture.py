"""Pretraining data from a weighted mixture of sources (``data_source: {source: weight}``).

Each source is prepared as a single one would be (cached), all with one tokenizer: the
``tokenizer`` setting if given, else the BPE trained on the first source. Training windows come
from :class:`~mosaics.data.mixture.MixtureBatches`; the validation set holds windows of every
source in proportion to its weight (``val/loss``), and every source's own windows give
``eval/source_loss/<name>`` at each ``eval_interval``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

from ..data.mixture import MixtureBatches, source_names
from .config import TrainConfig


@dataclass
class MixtureData:
    """The mixture's batches, validation windows (N, T) and per-source windows."""

    batches: MixtureBatches
    val_windows: torch.Tensor
    per_source: dict[str, torch.Tensor]
    tokenizer: Any
    weights: dict[str, float]


def load_mixture(cfg: TrainConfig, accelerator: Accelerator) -> MixtureData:
    """Prepare every source of ``cfg.data_source`` with one tokenizer; the batches of this
    process."""
    from ..data import fixed_validation_windows
    from ..data.corpus import default_cache_dir
    from ..data.stream import tokenizer_fingerprint
    from .pretrain import load_data

    sources = list(cfg.data_source)
    names = source_names(sources)
    tokenizer, corpora = cfg.tokenizer, []
    for source in sources:
        corpus = load_data(dataclasses.replace(cfg, data_source=source, tokenizer=tokenizer),
                           accelerator)
        if tokenizer is None:  # the first source's BPE, by path, for the others
            root = default_cache_dir() if cfg.data_cache_dir is None else cfg.data_cache_dir
            folder = f"{root}/tokenizers/mixture-{tokenizer_fingerprint(corpus.tokenizer)}"
            with accelerator.main_process_first():
                if accelerator.is_main_process:
                    corpus.tokenizer.save_pretrained(folder)
            tokenizer = folder
        corpora.append(corpus)
    weights = [cfg.data_source[s] for s in sources]
    batches = MixtureBatches([c.train_tokens for c in corpora], weights, cfg.block_size,
                             batch_size=cfg.batch_size, seed=cfg.seed,
                             rank=accelerator.process_index,
                             world_size=accelerator.num_processes,
                             accumulation=accelerator.gradient_accumulation_steps, names=names)
    per_source = {name: fixed_validation_windows(c.val_tokens, cfg.block_size, cfg.eval_windows,
                                                 cfg.data_seed)
                  for name, c in zip(names, corpora)}
    total = sum(weights)
    shares = [max(1, round(cfg.eval_windows * w / total)) for w in weights]
    val = torch.cat([per_source[n][:k] for n, k in zip(names, shares)])
    return MixtureData(batches, val, per_source, corpora[0].tokenizer,
                       dict(zip(names, (w / total for w in weights))))
