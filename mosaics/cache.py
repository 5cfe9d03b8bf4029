"""Incremental decoding state of a Memory Mosaics model.

Per layer: the running un-normalised leaky key sums (contextual and persistent, updated in
place), the last token's unit key and raw value (its value v_{t-1} is finished when x_t
arrives), the kernel's memory (quadratic kernels: keys and values in preallocated buffers that
double when full, so a step writes one entry instead of copying the memory; FSKA: fixed-size
prefix sums) and the functions of the parameters a step reuses (computed once, at the prompt).
Every tensor of a layer's state has the batch as dimension 0, so beam search reorders it with
one ``index_select``; the reused parameter functions have no batch dimension and sit in
``NamedTuple``s, which reordering leaves alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


class MosaicsCache:
    """Decoding cache passed to and returned by ``MosaicsForCausalLM.forward`` as ``cache``
    (the name transformers' ``generate`` uses; ``past_key_values`` is accepted too)."""

    is_compileable = False

    def __init__(self, n_layer: int) -> None:
        self.layers: list[dict[str, Any]] = [{"context": {}, "persistent": {}}
                                             for _ in range(n_layer)]
        self.seen_tokens = 0
        # document in progress (``document_masking``): (B,) tensors, see MosaicsModel.positions
        self.documents: dict[str, Tensor] = {}

    def __len__(self) -> int:
        return len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of tokens already absorbed."""
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows (beam search)."""
        def select(t: Tensor) -> Tensor:
            return t.index_select(0, beam_idx.to(t.device))

        self.layers = [_map_tensors(layer, select) for layer in self.layers]
        self.documents = _map_tensors(self.documents, select)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row (expanding a prompt cache to several samples or beams)."""
        def repeat(t: Tensor) -> Tensor:
            return t.repeat_interleave(repeats, dim=0)

        self.layers = [_map_tensors(layer, repeat) for layer in self.layers]
        self.documents = _map_tensors(self.documents, repeat)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.reorder_cache(indices)

    def __repr__(self) -> str:
        return f"MosaicsCache(n_layer={len(self.layers)}, seen_tokens={self.seen_tokens})"
