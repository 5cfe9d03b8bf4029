"""Build the model a ``TrainConfig`` asks for: Memory Mosaics or a matched transformer baseline
(GPT-2 with learned positions, or the rotary Llama-style one)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from ..baselines import gpt2_config_like, llama_config_like
from ..configuration_mosaics import MosaicsConfig
from ..modeling_mosaics import MosaicsForCausalLM
from .config import TrainConfig


def as_hf_tokenizer(tokenizer: Any) -> PreTrainedTokenizerFast:
    """Wrap a raw ``tokenizers.Tokenizer`` so it saves as ``tokenizer.json`` + config."""
    if hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int | None]:
    """bos/eos/pad ids for the model config; pad falls back to eos (no padding in training)."""
    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}


def mosaics_config(cfg: TrainConfig, vocab_size: int, **token_ids: int | None) -> MosaicsConfig:
    """The ``MosaicsConfig`` of a run (also the size reference of the GPT-2 baseline)."""
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
        pmem_size=cfg.pmem_size, block_size=cfg.block_size, dropout=cfg.dropout,
        attn_dropout=cfg.attn_dropout, kernel=cfg.kernel, kernel_kwargs=dict(cfg.kernel_kwargs),
        initializer_seed=cfg.seed, **token_ids)
    kwargs.update(cfg.model_kwargs)
    return MosaicsConfig(**kwargs)


def causal_lm(config: PretrainedConfig) -> PreTrainedModel:
    """A fresh causal LM for a ``MosaicsConfig``, ``GPT2Config`` or ``LlamaConfig``."""
    if isinstance(config, MosaicsConfig):
        return MosaicsForCausalLM(config)
    if isinstance(config, GPT2Config):
        return GPT2LMHeadModel(config)
    if isinstance(config, LlamaConfig):
        return LlamaForCausalLM(config)
    raise TypeError(f"no causal LM for {type(config).__name__}")


def build_model(cfg: TrainConfig, vocab_size: int, **token_ids: int | None) -> PreTrainedModel:
    """A freshly initialised model, identical on every process (seeded by ``cfg.seed``)."""
    mcfg = mosaics_config(cfg, vocab_size, **token_ids)
    torch.manual_seed(cfg.seed)
    like = {"mosaics": lambda c: c, "gpt2": gpt2_config_like, "llama": llama_config_like}
    model = causal_lm(like[cfg.model_type](mcfg))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model

