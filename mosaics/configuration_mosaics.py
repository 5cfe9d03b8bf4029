"""Configuration of a Memory Mosaics language model."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

PERSISTENT_MEMORIES = ("banks", "swiglu")


class MosaicsConfig(PretrainedConfig):
    """Hyper-parameters of a Memory Mosaics model (Zhang, Bottou et al., 2025).

    Args:
        vocab_size: number of token ids.
        n_layer: number of blocks (one contextual + one persistent memory each).
        n_head: heads per memory; ``n_embd`` must be divisible by it.
        n_embd: model width d.
        pmem_size: persistent-memory slots P per head; ``None`` gives the reference 3.5 d,
            which makes W_k + M_k + M_v the size of a GPT MLP (8 d^2).
        block_size: training context length (informational: there is no positional table,
            so any length can be evaluated).
        dropout: residual dropout after each memory block.
        attn_dropout: dropout on the contextual-memory retrieval weights (softmax kernels only)
            and on the persistent-memory weights.
        kernel: name of the contextual-memory kernel in :mod:`mosaics.kernels`.
        kernel_kwargs: options passed to that kernel.
        leaky_chunk_size: chunk length C of the exact chunked leaky average, cost
            O(T (C + T / C) d); 16 measured fastest for training at T = 512 on CPU.
        key_projection: ``False`` drops W_k of the contextual memory (keys = block input).
        fixed_value_projection: ``True`` replaces W_v by a fixed random orthogonal matrix
            (a saved buffer, not trained).
        loss_chunk_size: a training forward with labels computes the loss and its gradient
            in chunks of this many tokens without materialising the (B, T, V) logits
            (``logits`` is then ``None``); 0 always materialises them.
        gated_keys: Memory Mosaics v2 keys in the contextual memory: kbar_t = g_t k~_t +
            lambda_t kbar_{t-1} with g_t = exp(W_g x_t), lambda_t = exp(-|W_lambda x_t + b|)
            per head (W_g = W_lambda = 0 at init: the v1 average). See ``memory_v2.py``.
        persistent_memory: ``"banks"`` (v1: attention over P learned slots) or ``"swiglu"``
            (v2: W2 (SiLU(W1 x) * W3 x)).
        swiglu_hidden: hidden width of the SwiGLU persistent memory; ``None`` gives 3 d, the
            9 d^2 weights of the v1 persistent memory with its c_proj.
    """

    model_type = "mosaics"
    attribute_map = {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "max_position_embeddings": "block_size",
    }

    def __init__(
        self,
        vocab_size: int = 50304,
        n_layer: int = 12,
        n_head: int = 12,
        n_embd: int = 768,
        pmem_size: int | None = None,
        block_size: int = 512,
        dropout: float = 0.05,
        attn_dropout: float = 0.0,
        kernel: str = "gaussian",
        kernel_kwargs: dict[str, Any] | None = None,
        leaky_chunk_size: int = 16,
        key_projection: bool = True,
        fixed_value_projection: bool = False,
        loss_chunk_size: int = 1024,
        gated_keys: bool = False,
        persistent_memory: str = "banks",
        swiglu_hidden: int | None = None,
        initializer_seed: int = 0,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.n_layer = n_layer
        self.n_head = n_head
        self.n_embd = n_embd
        self.pmem_size = pmem_size if pmem_size is not None else (7 * n_embd) // 2
        self.block_size = block_size
        self.dropout = dropout
        self.attn_dropout = attn_dropout
        self.kernel = kernel
        self.kernel_kwargs = dict(kernel_kwargs or {})
        self.leaky_chunk_size = leaky_chunk_size
        self.key_projection = key_projection
        self.fixed_value_projection = fixed_value_projection
        self.loss_chunk_size = loss_chunk_size
        self.gated_keys = bool(gated_keys)
        self.persistent_memory = persistent_memory
        self.swiglu_hidden = swiglu_hidden if swiglu_hidden is not None else 3 * n_embd
        self.initializer_seed = initializer_seed
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate_sizes()

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def validate_sizes(self) -> None:
        """Raise ``ValueError`` naming the bad field and how to fix it."""
        if self.persistent_memory not in PERSISTENT_MEMORIES:
            raise ValueError(f"MosaicsConfig.persistent_memory must be one of "
                             f"{PERSISTENT_MEMORIES}, got {self.persistent_memory!r}.")
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "pmem_size", "block_size",
                     "leaky_chunk_size", "swiglu_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MosaicsConfig.{name} must be a positive integer, got {value!r}.")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"MosaicsConfig.n_embd ({self.n_embd}) must be divisible by n_head "
                f"({self.n_head}); choose e.g. n_head={_nearest_divisor(self.n_embd, self.n_head)}."
            )
        if not isinstance(self.loss_chunk_size, int) or self.loss_chunk_size < 0:
            raise ValueError("MosaicsConfig.loss_chunk_size must be a non-negative integer "
                             f"(0 disables the chunked loss), got {self.loss_chunk_size!r}.")
        for name in ("dropout", "attn_dropout"):
            value = getattr(self, name)
            if not 0.0 <= float(value) < 1.0:
                raise ValueError(f"MosaicsConfig.{name} must be in [0, 1), got {value!r}.")
        if not isinstance(self.kernel, str):
            raise ValueError(f"MosaicsConfig.kernel must be a kernel name, got {self.kernel!r}.")


def _nearest_divisor(n: int, k: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: abs(d - k))
