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

from dataclasses import dataclass, field, fields, is_dataclass, replace
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


MIN_MEMORY_BUFFER = 64  # entries preallocated by the first append
MEMORY_HEADROOM = 4  # a full buffer grows by 1/4 of the needed length (at least the minimum)


@dataclass
class FeatureSums:
    """A linear-attention kernel's running sums over feature-mapped keys g(k_j) (FSKA).

    Attributes:
        S: (B, H, M', hv) sum_j g(k_j) v_j^T.
        z: (B, H, M') sum_j g(k_j).
        r: (B, H, M) exp map only: the per-feature running max of the keys' log g, relative
            to which S and z are kept; None for elu1.
        lo, hi: (B,) absolute positions of the first and last entry the sums hold, when they
            cover a query's visible interval (``Kernel.step`` with ``lo``, ``hi``); None when
            they hold every entry so far (the strict past, ``Kernel.step`` without them).
    """

    S: Tensor
    z: Tensor
    r: Tensor | None = None
    lo: Tensor | None = None
    hi: Tensor | None = None


@dataclass
class KernelMemory:
    """A contextual memory's entries while decoding, and a kernel's running sums over them.

    Attributes:
        keys, values: (B, H, S, hs) unit keys and values of the entries held (at absolute
            positions ``MemoryState.base`` ..), views of buffers that :meth:`append` fills in
            place.
        sums: a kernel's running sums (:class:`FeatureSums`), or None.
    """

    keys: Tensor
    values: Tensor
    sums: FeatureSums | None = None
    # (keys, values) buffers whose first S entries are the views above; None: not ours
    buffers: tuple[Tensor, Tensor] | None = field(default=None, init=False, repr=False,
                                                  compare=False)

    @classmethod
    def empty(cls, batch: int, heads: int, head_size: int, device: torch.device,
              dtype: torch.dtype) -> KernelMemory:
        shape = (batch, heads, 0, head_size)
        return cls(torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(shape, device=device, dtype=dtype))

    def __len__(self) -> int:
        return self.keys.shape[2]

    def append(self, keys: Tensor, values: Tensor) -> KernelMemory:
        """The entries held followed by (B, H, m, hs) new ones (sums kept as they are).

        The result's keys and values are views of the first S + m entries of preallocated
        (B, H, capacity, hs) buffers. When this memory's buffers have room, the new entries
        are copied behind the held ones (O(m)); otherwise buffers of 5/4 of the needed
        length are allocated, so appending one entry at a time copies amortised O(1) (at
        most 5) entries per step, while a long prompt's memory grows by a quarter, not
        double, at the first decoding step. This memory keeps its length, but the buffers'
        entries behind it now belong to the result: to continue one memory in two ways,
        ``copy.deepcopy`` it first. With gradients flowing into the entries it concatenates.
        """
        if torch.is_grad_enabled() and any(t.requires_grad for t in
                                           (self.keys, self.values, keys, values)):
            return replace(self, keys=torch.cat([self.keys, keys], 2),
                           values=torch.cat([self.values, values], 2))
        n, m = len(self), keys.shape[2]
        buffers = self.buffers  # set only by append: views of them start at their first entry
        if not (buffers is not None and buffers[0].shape[2] >= n + m
                and self.keys.data_ptr() == buffers[0].data_ptr()
                and self.values.data_ptr() == buffers[1].data_ptr()):
            headroom = max((n + m) // MEMORY_HEADROOM, MIN_MEMORY_BUFFER)
            buffers = tuple(_grown(t, n + m + headroom) for t in (self.keys, self.values))
        buffers[0].narrow(2, n, m).copy_(keys)
        buffers[1].narrow(2, n, m).copy_(values)
        out = KernelMemory(buffers[0].narrow(2, 0, n + m), buffers[1].narrow(2, 0, n + m),
                           self.sums)
        out.buffers = buffers
        return out

    def drop_last(self) -> KernelMemory:
        """Without the last entry (a prompt's v_{n-1} waits for x_n)."""
        return replace(self, keys=self.keys[:, :, :-1], values=self.values[:, :, :-1])

    def drop_first(self, count: int) -> KernelMemory:
        """Without the first ``count`` entries: views of the kept ones, which move to fresh
        buffers at the next :meth:`append`."""
        return replace(self, keys=self.keys[:, :, count:], values=self.values[:, :, count:])


def _grown(stored: Tensor, capacity: int) -> Tensor:
    """A (B, H, capacity, D) buffer starting with the (B, H, n, D) entries ``stored``."""
    B, H, n, D = stored.shape
    buffer = stored.new_empty(B, H, capacity, D)
    buffer.narrow(2, 0, n).copy_(stored)
    return buffer


@dataclass
class MemoryState:
    """One contextual memory while decoding.

    Attributes:
        kbar: (B, H, hs) running key sum.
        key: (B, H, 1, hs) unit key of the last token (its entry joins with the next token).
        v_raw: (B, H, 1, hs) raw value of the last token.
        memory: the entries base .. base + len - 1 and a kernel's running sums
            (``Kernel.memory_of``, ``Kernel.step``).
        base: absolute position of the first entry held in ``memory``.
        weights: the parameters in step form.
    """

    kbar: Tensor
    key: Tensor
    v_raw: Tensor
    memory: KernelMemory
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
    if is_dataclass(obj) and not isinstance(obj, type):  # fields outside __init__ (buffers) reset
        return replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn)
                               for f in fields(obj) if f.init})
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
