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
            per head (W_g = W_lambda = 0 at init: the v1 average). See ``mosaics/memory.py``.
        persistent_memory: ``"banks"`` (v1: attention over P learned slots) or ``"swiglu"``
            (v2: W2 (SiLU(W1 x) * W3 x)).
        swiglu_hidden: hidden width of the SwiGLU persistent memory; ``None`` gives 3 d, the
            9 d^2 weights of the v1 persistent memory with its c_proj.
        adaptive_bandwidth: v2 bandwidth per query, beta = beta1 n^alpha + beta0 per head, n
            the number of memory entries the query sees (replaces the fixed beta_h).
        three_level_memory: v2 contextual memory split into a short-term memory over the last
            ``short_term_window`` - 1 keys and a long-term memory over the keys at least
            ``long_term_gap`` positions back, each with its own parameters, outputs summed
            (= concatenated and projected).
        short_term_window: h; the short-term memory at t holds keys t - h + 1 .. t - 1.
        long_term_gap: m at inference; the long-term memory at t holds keys 0 .. t - m.
        long_term_gap_range: ``[low, high]``: during training m is drawn uniformly from it
            for each batch (v2: [64, 256]); ``None`` trains with ``long_term_gap``.
        document_masking: restart the leaky averages and hide the memories of earlier
            documents at document boundaries: a new document starts after each
            ``document_separator_id`` token (or where the ``document_ids`` passed to forward
            change), so packed windows do not mix stories.
        document_separator_id: token that ends a document; ``None``: ``eos_token_id``.
        alibi: add the ALiBi position bias -m_h (t - s) to the contextual memory's kernel
            scores beta cos(k_t, k_s) before the kernel (standard per-head slopes m_h; any
            kernel with a score normalizer, i.e. all built-in ones but FSKA; the v1 memory,
            without per-query intervals). See :mod:`mosaics.kernels.position_bias`.
        embedding_init_std: standard deviation of the token embedding's N(0, s^2) init (tied
            to the output head). 1.0 is the Memory Mosaics reference; n_embd ** -0.5 is what a
            tied head's Linear init gives (the sparse-kernel paper's synthetic-task code).
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
        adaptive_bandwidth: bool = False,
        three_level_memory: bool = False,
        short_term_window: int = 256,
        long_term_gap: int = 64,
        long_term_gap_range: list[int] | tuple[int, int] | None = (64, 256),
        document_masking: bool = False,
        document_separator_id: int | None = None,
        initializer_seed: int = 0,
        alibi: bool = False,
        embedding_init_std: float = 1.0,
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
        self.adaptive_bandwidth = bool(adaptive_bandwidth)
        self.three_level_memory = bool(three_level_memory)
        self.short_term_window = short_term_window
        self.long_term_gap = long_term_gap
        self.long_term_gap_range = (None if long_term_gap_range is None
                                    else [int(m) for m in long_term_gap_range])
        self.document_masking = bool(document_masking)
        self.document_separator_id = document_separator_id
        self.initializer_seed = initializer_seed
        self.alibi = alibi
        self.embedding_init_std = embedding_init_std
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
        self.validate_memory_levels()
        std = self.embedding_init_std
        if isinstance(std, bool) or not isinstance(std, (int, float)) or not std > 0:
            raise ValueError("MosaicsConfig.embedding_init_std must be a number > 0 (1.0: the "
                             f"reference init; n_embd ** -0.5: a tied head's), got {std!r}.")
        if not isinstance(self.alibi, bool):
            raise ValueError(f"MosaicsConfig.alibi must be True or False, got {self.alibi!r}.")
        if self.alibi and self.uses_visibility:
            raise ValueError("MosaicsConfig.alibi works with the v1 contextual memory only: "
                             "turn off adaptive_bandwidth, three_level_memory and "
                             "document_masking, or alibi.")
        if not isinstance(self.kernel, str):
            raise ValueError(f"MosaicsConfig.kernel must be a kernel name, got {self.kernel!r}.")


    def validate_memory_levels(self) -> None:
        for name, low in (("short_term_window", 2), ("long_term_gap", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"MosaicsConfig.{name} must be an integer >= {low}, got "
                                 f"{value!r}.")
        rng = self.long_term_gap_range
        if rng is not None and (len(rng) != 2 or not 1 <= rng[0] <= rng[1]):
            raise ValueError("MosaicsConfig.long_term_gap_range must be [low, high] with "
                             f"1 <= low <= high, or None; got {rng!r}.")

    @property
    def separator_id(self) -> int | None:
        """The token that ends a document under ``document_masking``."""
        sep = self.document_separator_id
        return self.eos_token_id if sep is None else sep

    @property
    def uses_visibility(self) -> bool:
        """Whether a contextual memory needs per-query visible intervals (any v2 memory
        option other than gated keys), served by ``Kernel.attend``."""
        return self.adaptive_bandwidth or self.three_level_memory or self.document_masking

    @classmethod
    def v2(cls, **kwargs: Any) -> MosaicsConfig:
        """The Memory Mosaics v2 block ("Memory Mosaics at scale"): gated keys, adaptive
        bandwidth, three-level memory (h = 256, m ~ U[64, 256] in training, 64 at
        inference), a SwiGLU persistent memory and document-aware training. ``kwargs``
        override any field (sizes, kernel, ...)."""
        preset: dict[str, Any] = dict(gated_keys=True, adaptive_bandwidth=True,
                                      three_level_memory=True, short_term_window=256,
                                      long_term_gap=64, long_term_gap_range=(64, 256),
                                      persistent_memory="swiglu", document_masking=True)
        return cls(**{**preset, **kwargs})


def _nearest_divisor(n: int, k: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: abs(d - k))
