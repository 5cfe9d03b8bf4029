"""The kernel interface and registry of the contextual memory.

A kernel turns unit keys k_t (the query at t is k_t itself), values v_t and a per-head
bandwidth beta into the strict-past retrieval

    y_t = sum_{s < t} w_ts v_s,   w_t. = normalizer(beta * cos(k_t, k_s) for s < t),

with y_0 = 0 (position 0 has no memory). It also supports incremental decoding through
``memory_of`` / ``step`` over a typed :class:`~mosaics.cache.KernelMemory`, and
retrieval where each query sees its own interval of memory entries with its own bandwidth
(``attend``: windows, gaps and documents of Memory Mosaics v2; see docs/v2.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..cache import KernelMemory
from ..ops.intervals import check_attend_args

_REGISTRY: dict[str, type[Kernel]] = {}


class Kernel(nn.Module):
    """Base class of contextual-memory kernels.

    A kernel needs :meth:`forward` (the strict past of a whole sequence); the defaults of
    :meth:`attend` (per-query intervals) and :meth:`step` (decoding) are exact through it,
    and a kernel overrides them for speed. Score kernels also give their normalizer as
    :meth:`weights` / :meth:`weights_backward` (ALiBi, attention maps). ``dropout`` is set by
    the memory block from the config.
    """

    name: str = ""
    dropout: float = 0.0
    compile_traceable: bool = False  # forward traces under torch.compile without a graph break
    chunk_elements: int = 2**21  # target size of one (B, H, rows, columns) block of attend()
    regularization_weight: float = 0.0  # weight of regularization() in the training loss

    def build(self, n_head: int, head_size: int) -> None:
        """Create per-head weights once the sizes are known (called by the memory block right
        after construction, so weights exist before a checkpoint is loaded). Default: none."""

    def forward(self, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
        """Strict-past retrieval.

        Args:
            keys: (B, H, T, hs) unit keys (also the queries).
            values: (B, H, T, hs) values.
            beta: (H,) bandwidths.
        Returns:
            (B, H, T, hs); row t uses memory s < t only; row 0 is exactly 0.
        """
        raise NotImplementedError

    def memory_of(self, keys: Tensor, values: Tensor, beta: Tensor) -> KernelMemory:
        """The decoding memory holding (B, H, m, hs) entries, answering no query (the prompt's
        entries, for :meth:`step` to continue); beta (H,): the bandwidths of the prompt's
        forward (a kernel that keeps running sums of features needs them)."""
        return KernelMemory(keys[:, :, :0], values[:, :, :0]).append(keys, values)

    def step(self, memory: KernelMemory, queries: Tensor, keys: Tensor, values: Tensor,
             beta: Tensor, lo: Tensor | None = None, hi: Tensor | None = None,
             base: int = 0) -> tuple[Tensor, KernelMemory]:
        """Decoding: add memory entries and answer the queries that follow them.

        Args:
            memory: the memory so far (:meth:`memory_of`, or a previous step's), its first
                entry at absolute position ``base``.
            queries: (B, H, n, hs) unit query keys of the n new positions.
            keys, values: (B, H, m, hs) new memory entries, m in {n - 1, n}.
            beta: (H,) bandwidths, or (B or 1, H, n) one per query with intervals.
            lo, hi: None for the strict past: query i sees every entry already held and new
                entries j <= i + m - n. Else (B or 1, n) absolute positions: query i sees the
                entries lo[i] <= s <= hi[i] (an interval, as in :meth:`attend`).
        Returns:
            (B, H, n, hs) retrievals and the memory to keep.

        The default appends the entries and answers through :meth:`attend` (intervals) or
        :meth:`forward` over the whole memory plus the last query, whose own value is never
        read (the strict past: exact for any kernel, O(T^2) per step). Built-in kernels
        override the strict past for speed; a kernel that answers from running sums keeps
        them in ``memory.sums`` with their bounds (:class:`~mosaics.cache.FeatureSums`).
        """
        memory = memory.append(keys, values)
        if lo is not None:
            return self.attend(queries, memory.keys, memory.values, beta,
                               (lo - base).clamp(min=0), hi - base), memory
        all_keys = torch.cat([memory.keys, queries[:, :, -1:]], dim=2)
        B, H, _, hv = memory.values.shape
        all_values = torch.cat([memory.values, memory.values.new_zeros(B, H, 1, hv)], dim=2)
        n = queries.shape[2]
        return self.forward(all_keys, all_values, beta)[:, :, -n:], memory

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
               lo: Tensor, hi: Tensor) -> Tensor:
        """Retrieval where every query sees its own interval of memory entries.

        Args:
            queries: (B, H, n, hs) unit queries.
            keys: (B, H, S, hs) unit keys; values: (B, H, S, hv).
            beta: (H,) bandwidths, or (B or 1, H, n) one per query.
            lo, hi: (B or 1, n) integer bounds: query i sees the entries j with
                lo[i] <= j <= hi[i] (bounds outside 0..S-1 are clipped; none when hi < lo).
        Returns:
            (B, H, n, hv) in the values' dtype: y_i = sum_j w_ij v_j with w_i. the kernel's
            normalizer of beta_i cos(q_i, k_j) over the visible j; 0 for a row that sees
            nothing. Differentiable w.r.t. queries, keys, values and beta.

        The default is exact for any kernel that implements :meth:`forward`, but slow: one
        forward per query row (and per batch row when the bounds or bandwidths differ across
        the batch) over its visible entries followed by the query, whose own value is never
        read. Built-in kernels override it with chunked retrievals (see docs/v2.md).
        """
        beta4 = check_attend_args(queries, keys, values, beta, lo, hi)
        B, H, n, _ = queries.shape
        S, hv = keys.shape[2], values.shape[-1]
        zero = values.new_zeros(1, H, 1, hv)
        lo_rows, hi_rows = lo.tolist(), hi.tolist()
        shared = lo.shape[0] == hi.shape[0] == beta4.shape[0] == 1
        out = []
        for g in [0] if shared else range(B):
            batch = slice(None) if shared else slice(g, g + 1)
            lg, hg = lo_rows[g if lo.shape[0] > 1 else 0], hi_rows[g if hi.shape[0] > 1 else 0]
            bg = beta4[g if beta4.shape[0] > 1 else 0, :, :, 0]  # (H, n or 1)
            rows = []
            for i in range(n):
                first, last = max(lg[i], 0), min(hg[i], S - 1)
                q = queries[batch, :, i:i + 1]
                none = zero.expand(q.shape[0], H, 1, hv)
                if last < first:
                    rows.append(none)
                    continue
                k = torch.cat([keys[batch, :, first:last + 1], q], dim=2)
                v = torch.cat([values[batch, :, first:last + 1], none], dim=2)
                y = self.forward(k, v, bg[:, i if bg.shape[1] > 1 else 0])
                rows.append(y[:, :, -1:].to(values.dtype))
            out.append(torch.cat(rows, dim=2) if rows else values.new_zeros(B, H, 0, hv))
        return torch.cat(out, dim=0)

    def bandwidth(self, beta: Tensor) -> Tensor:
        """The bandwidth the scores use, given the memory's beta_h = exp(2 min(10 b_h, 5)) ((H,),
        or one per query with an adaptive bandwidth). The identity unless a kernel option maps
        beta to another parametrization (e.g. a published code's)."""
        return beta

    def weights(self, cos: Tensor, beta: Tensor, mask: Tensor) -> Tensor:
        """The normalizer as a function of a block of cosines: (B, H, n, S) cosines, (1, H, 1,
        1) bandwidth, bool mask broadcastable to the cosines -> (B, H, n, S) weights of the
        scores beta * cos, 0 where masked. Optional: a kernel that has it (with
        :meth:`weights_backward`) supports position biases on its scores
        (:mod:`.position_bias`)."""
        raise NotImplementedError(f"kernel {self.name!r} has no score normalizer")

    def weights_backward(self, p: Tensor, dp: Tensor, cos: Tensor, beta: Tensor,
                         mask: Tensor) -> tuple[Tensor, Tensor]:
        """(d cos, d beta summed to beta's shape) given the weights p and their gradient dp."""
        raise NotImplementedError(f"kernel {self.name!r} has no score normalizer")

    @classmethod
    def has_weights(cls) -> bool:
        """Whether the kernel gives its normalizer as :meth:`weights` with
        :meth:`weights_backward` (then it has :meth:`row_weights`, and position biases apply
        to its scores): every built-in kernel but FSKA, whose weights are feature maps."""
        return (cls.weights is not Kernel.weights
                and cls.weights_backward is not Kernel.weights_backward)

    def row_weights(self, cos: Tensor, beta: Tensor) -> tuple[Tensor, Tensor | None]:
        """The weights of one decoding row (no gradients; the reference model's rows too).

        (B, H, 1, S) cosines of one query that sees all S >= 1 entries, (1, H, 1, 1)
        bandwidth -> (weights, None) over all S entries, or (weights, index) over the c
        entries ``index`` (B, H, 1, c) when all others have weight 0. Default: :meth:`weights`
        with an all-true mask (NotImplementedError without a score normalizer).
        """
        mask = torch.ones(1, cos.shape[-1], dtype=torch.bool, device=cos.device)
        return self.weights(cos, beta, mask), None

    def decode_row(self, query: Tensor, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
        """One decoding query (B, H, 1, hs) over all S entries (B, H, S, hs), beta (H,),
        without gradients. Default: :func:`decode_row` (:meth:`row_weights` times V)."""
        return decode_row(self, query, keys, values, beta)

    def regularization(self) -> Tensor | None:
        """An extra training loss term of this kernel (e.g. FSKA's KL), or None."""
        return None

    def extra_repr(self) -> str:
        return f"name={self.name!r}"


def extend_mask(n: int, old: int, m: int, device: torch.device) -> Tensor:
    """(n, old + m) boolean mask of the memory entries each new query may see."""
    qi = torch.arange(n, device=device).view(n, 1)
    kj = torch.arange(m, device=device).view(1, m)
    new = kj <= qi + (m - n)
    return torch.cat([torch.ones(n, old, dtype=torch.bool, device=device), new], dim=1)


def strict_causal_mask(t: int, device: torch.device) -> Tensor:
    """(T, T) boolean mask, True where s < t."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril(-1)


def work_precision(x: Tensor) -> Tensor:
    """x in fp32, or x itself when it is fp32 or fp64 (no op dispatched: decoding steps are
    short enough for that to show)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def batched_rows(x: Tensor) -> Tensor:
    """(B, H, n, D) -> (B H, n, D) for ``torch.bmm`` (a view for the memory buffers)."""
    B, H, n, D = x.shape
    return x.reshape(B * H, n, D)


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """x[b, h, index[b, h, i]]: (B, H, S, D) and (B, H, c) -> (B, H, c, D).

    Memory buffers and contiguous tensors have whole rows of D contiguous elements at a
    stride of D: those are picked with one ``index_select`` over all B H S rows of the
    storage (several times faster than ``gather`` with an index expanded over D); other
    layouts use ``gather``.
    """
    B, H, S, D = x.shape
    sb, sh, ss, sd = x.stride()
    if sd == 1 and ss == D and sh % D == 0 and sb == H * sh:
        step = sh // D  # rows from x[b, h, 0] to x[b, h + 1, 0], and on to x[b + 1, 0, 0]
        rows = x.as_strided(((B * H - 1) * step + S, D), (D, 1))
        first = torch.arange(0, B * H * step, step, device=x.device).view(B, H, 1)
        return rows.index_select(0, (index + first).view(-1)).view(B, H, -1, D)
    return x.gather(2, index.unsqueeze(-1).expand(B, H, -1, D))


def decode_row(kernel: Kernel, query: Tensor, keys: Tensor, values: Tensor,
               beta: Tensor) -> Tensor:
    """One decoding query that sees the whole memory, without gradients: the weights
    ``kernel.row_weights`` of the row cos(q, k_j), j < S, times V. For score kernels this
    skips the chunking and autograd machinery that whole sequences need; a sparse kernel that
    names its few candidate entries has only their values read.

    Args:
        query: (B, H, 1, hs); keys, values: (B, H, S, hs); beta: (H,).
    Returns:
        (B, H, 1, hs) in the values' dtype; 0 for an empty memory. Computed in fp32 (fp64
        stays fp64) whatever the autocast state.
    """
    B, H, _, hv = values.shape
    if keys.shape[2] == 0:
        return values.new_zeros(B, H, 1, hv)
    device = query.device.type
    if torch.is_autocast_enabled(device):  # the context costs ~3 us a call: only when needed
        with torch.autocast(device, enabled=False):
            return decode_row(kernel, query, keys, values, beta)
    q = work_precision(query)
    cos = torch.bmm(batched_rows(q), batched_rows(work_precision(keys)).transpose(1, 2))
    weights, index = kernel.row_weights(cos.view(B, H, 1, -1),
                                        work_precision(beta).view(1, H, 1, 1))
    rows = values
    if index is not None:  # (B, H, 1, c): only these c values can have weight
        if index.shape[-1] * 8 < keys.shape[2]:  # few: read just their values
            rows = gather_rows(values, index.view(B, H, -1))
        else:  # many: one dense row, faster than gathering them (B 1, H 4, S 511, hs 64:
            # 19 against 27 us at c = 212, equal at c = 64)
            weights = weights.new_zeros(B, H, 1, keys.shape[2]).scatter_(-1, index, weights)
    y = torch.bmm(batched_rows(weights), batched_rows(work_precision(rows))).view(B, H, 1, hv)
    return y if y.dtype == values.dtype else y.to(values.dtype)


def register_kernel(name: str) -> Callable[[type[Kernel]], type[Kernel]]:
    """Class decorator: make a :class:`Kernel` subclass selectable as ``kernel: name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"kernel name must be a non-empty string, got {name!r}")

    def wrap(cls: type[Kernel]) -> type[Kernel]:
        if not (isinstance(cls, type) and issubclass(cls, Kernel)):
            raise TypeError(f"@register_kernel({name!r}) needs a subclass of "
                            "mosaics.kernels.Kernel")
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"kernel {name!r} is already registered by {existing.__module__}."
                             f"{existing.__qualname__}; pick another name")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_kernels() -> list[str]:
    """Sorted names of all registered kernels."""
    return sorted(_REGISTRY)


def get_kernel(name: str, **kwargs: Any) -> Kernel:
    """Instantiate the kernel registered as ``name`` with its options."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown kernel {name!r}; registered kernels: "
                         f"{', '.join(available_kernels())}. Register your own with "
                         "@mosaics.kernels.register_kernel('name').") from None
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"bad kernel_kwargs for kernel {name!r}: {err}") from None
