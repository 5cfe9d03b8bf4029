"""Incremental decoding state of a Memory Mosaics model.

Per layer (:class:`LayerState`): for each contextual memory a :class:`MemoryState` (the running
un-normalised key sum, updated in place; the last token's unit key and raw value, whose value
v_{t-1} is finished when x_t arrives; the memory entries, held by the kernel; and the functions
of the parameters a step reuses), and for the persistent memory a :class:`BankState`. Every
tensor of a state has the batch as dimension 0, so beam search reorders it with one
``index_select``; the reused parameter functions have no batch dimension and sit in
``NamedTuple``s, which reordering leaves alone.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor


class ContextualWeights(NamedTuple):
    """A contextual memory's parameters in the form a step uses: the stacked projection
    [W_k; W_v] (2d, d), the log-decay a (H,) and decay lambda = e^{-a} (H, 1), the bandwidth
    beta (H,), the value mix c (H,) and c_proj with the value scale on its columns (d, d)."""

    kv: Tensor
    log_decay: Tensor
    decay: Tensor
    beta: Tensor
    mix: Tensor
    out: Tensor


class PersistentWeights(NamedTuple):
    """A persistent memory's parameters in the form a step uses: the log-decay a (H,), the
    decay e^{-a} (H, 1), the scaled banks beta' M_k and e^{10 q'} M_v (H, P, hs)."""

    log_decay: Tensor
    decay: Tensor
    keys: Tensor
    values: Tensor


@dataclass
class MemoryState:
    """One contextual memory while decoding.

    Attributes:
        kbar: (B, H, hs) running key sum.
        key: (B, H, 1, hs) unit key of the last token (its entry joins with the next token).
        v_raw: (B, H, 1, hs) raw value of the last token.
        memory: the kernel's state (``Kernel.init_state``); under visible intervals the
            entries base .. base + len - 1 as ``{"keys", "values"}``.
        base: absolute position of the first entry held in ``memory``.
        weights: the parameters in step form.
    """

    kbar: Tensor
    key: Tensor
    v_raw: Tensor
    memory: dict[str, Tensor]
    base: int
    weights: ContextualWeights


@dataclass
class BankState:
    """The persistent memory while decoding: the running key sum (B, H, hs) and weights."""

    kbar: Tensor
    weights: PersistentWeights


@dataclass
class LayerState:
    """One block while decoding: its contextual memories (one, or the short- and long-term
    pair) and its persistent memory (None for the stateless SwiGLU form)."""

    context: tuple[MemoryState, ...]
    persistent: BankState | None


@dataclass
class DocumentState:
    """The document in progress between decoding calls (``document_masking`` or padding),
    each (B,): its start and id, the last document id given, whether the last token was a
    separator, whether it was real (``attention_mask`` 1) and whether any token so far was."""

    start: Tensor
    id: Tensor
    last_id_given: Tensor | None = None
    last_is_separator: Tensor | None = None
    last_real: Tensor | None = None
    seen_real: Tensor | None = None


def _map_tensors(obj: Any, fn) -> Any:
    """Apply ``fn`` to every batch-first tensor of a state (NamedTuples of weights excepted)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map_tensors(v, fn) for v in obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn)
                               for f in fields(obj)})
    return obj


class MosaicsCache:
    """Decoding cache passed to and returned by ``MosaicsForCausalLM.forward`` as ``cache``
    (the name transformers' ``generate`` uses; ``past_key_values`` is accepted too).
    ``layers[i]`` is None until the first call (the prompt) fills it."""

    is_compileable = False

    def __init__(self, n_layer: int) -> None:
        self.layers: list[LayerState | None] = [None] * n_layer
        self.seen_tokens = 0
        self.documents: DocumentState | None = None

    def __len__(self) -> int:
        return len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of tokens already absorbed."""
        return self.seen_tokens

    def _map(self, fn) -> None:
        self.layers = [_map_tensors(layer, fn) for layer in self.layers]
        self.documents = _map_tensors(self.documents, fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows (beam search)."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row (expanding a prompt cache to several samples or beams)."""
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self.reorder_cache(indices)

    def __repr__(self) -> str:
        return f"MosaicsCache(n_layer={len(self.layers)}, seen_tokens={self.seen_tokens})"
