"""Transformer baselines matched to a Memory Mosaics configuration.

A Memory Mosaics block has 12 d^2 weights (contextual memory 3 d^2 + persistent memory
9 d^2 with P = 3.5 d), exactly a GPT-2 block's 12 d^2 (attention 4 d^2 + MLP 8 d^2). So the
GPT-2 of the same width, depth and vocabulary matches it up to biases, LayerNorm biases and
the learned position table (n_positions x d): about 0.5% at the 124M size. The rotary-position
Llama of the same width and depth has no position table (so it runs at any length) and a SwiGLU
MLP of 3 d x (8 d / 3) weights, also 12 d^2 per block.
"""

from __future__ import annotations

from typing import Any

from transformers import GPT2Config, LlamaConfig

from .configuration_mosaics import MosaicsConfig


def gpt2_config_like(config: MosaicsConfig, n_positions: int | None = None,
                     **overrides: Any) -> GPT2Config:
    """A ``GPT2Config`` with the width, depth, heads, vocabulary and dropout of ``config``."""
    kwargs: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        n_positions=n_positions or config.block_size,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.attn_dropout,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def llama_config_like(config: MosaicsConfig, **overrides: Any) -> LlamaConfig:
    """A rotary-position ``LlamaConfig`` (no biases, RMSNorm, SwiGLU with 8 d / 3 hidden units,
    rounded up to a multiple of 8) with the width, depth, heads and vocabulary of ``config``."""
    hidden = -(-8 * config.n_embd // 3 // 8) * 8
    kwargs: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=hidden,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.n_head,
        max_position_embeddings=max(config.block_size, 8192),
        attention_dropout=config.attn_dropout,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)
