"""Weighted mixtures of several token streams.

``data_source`` given as a mapping ``{source: weight, ...}`` trains on all of them: every
window of a step draws its source with probability weight / sum(weights), then a uniformly
random offset in that source's stream. Both are drawn from ``PCG64([seed, step])``, so the
windows of a step are a pure function of (seed, step, global batch): exact resume, and resume
on another process count with the same global batch, hold as for one stream
(:class:`~mosaics.data.stream.RandomWindowBatches`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from ..errors import ConfigError, DataError


def parse_mixture(value: Any) -> dict[str, float] | None:
    """``{source: weight}`` from a mapping or its YAML text (``"{a.txt: 3, b.txt: 1}"``);
    ``None`` for one source (a plain string or None). Bad weights raise one-line
    ``ConfigError``."""
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"data_source {value!r} is not a readable mapping; write "
                              "data_source='{a.txt: 0.7, b.txt: 0.3}'.") from None
    if not isinstance(value, dict):
        return None
    if not value:
        raise ConfigError("data_source is an empty mapping; name at least one source with a "
                          "weight, e.g. {a.txt: 0.7, b.txt: 0.3}.")
    out: dict[str, float] = {}
    for source, weight in value.items():
        ok = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not ok or not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"data_source: the weight of {source!r} must be a number >= 0, "
                              f"got {weight!r}; e.g. {{{source}: 0.5, other: 0.5}}.")
        out[str(source)] = float(weight)
    if sum(out.values()) <= 0:
        raise ConfigError("data_source: the weights sum to 0; give at least one source a "
                          "positive weight.")
    return out


def source_names(sources: list[str]) -> list[str]:
    """Short metric names for sources (the file or folder name without extension; made
    unique with ``-2``, ``-3``...)."""
    names: list[str] = []
    for source in sources:
        base = Path(source.rstrip("/")).name or source
        base = re.sub(r"[^A-Za-z0-9_.-]+", "_", base.split(".")[0] or base)
        name, n = base, 2
        while name in names:
            name, n = f"{base}-{n}", n + 1
        names.append(name)
    return names


class MixtureBatches:
    """Windows of ``block_size`` tokens from several streams, each window's source drawn with
    probability ``weights / weights.sum()``; the same batch split and resume rules as
    :class:`~mosaics.data.stream.RandomWindowBatches`."""

    def __init__(self, streams: list[np.ndarray], weights: list[float], block_size: int,
                 batch_size: int = 1, seed: int = 0, rank: int = 0, world_size: int = 1,
                 accumulation: int = 1, names: list[str] | None = None) -> None:
        if len(streams) != len(weights) or not streams:
            raise ValueError("need one weight per stream")
        self.names = names or [str(i) for i in range(len(streams))]
        for name, stream in zip(self.names, streams):
            if len(stream) < block_size:
                raise DataError(f"data_source {name!r}: its token stream ({len(stream)} tokens) "
                                f"is shorter than block_size ({block_size}); give it more text "
                                "or drop it from the mixture.")
        self.streams, self.block_size = streams, block_size
        total = float(sum(weights))
        self.probs = np.asarray(weights, dtype=np.float64) / total
        self.batch_size, self.seed, self.rank = batch_size, seed, rank
        self.world_size, self.accumulation = world_size, accumulation
        self.num_offsets = np.asarray([len(s) - block_size + 1 for s in streams])

    @property
    def global_rows(self) -> int:
        return self.batch_size * self.world_size * self.accumulation

    def draws(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(sources, offsets) of the step's ``global_rows`` windows, a pure function of
        (seed, step, global batch)."""
        g = np.random.Generator(np.random.PCG64([self.seed, step]))
        sources = g.choice(len(self.streams), size=self.global_rows, p=self.probs)
        offsets = (g.random(self.global_rows) * self.num_offsets[sources]).astype(np.int64)
        return sources, offsets

    def sources(self, index: int) -> np.ndarray:
        """(batch_size,) source index of each window of this rank's micro-batch ``index``."""
        return self._rows(index)[0]

    def _rows(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        step, micro = divmod(index, self.accumulation)
        sources, offsets = self.draws(step)
        first = (micro * self.world_size + self.rank) * self.batch_size
        rows = slice(first, first + self.batch_size)
        return sources[rows], offsets[rows]

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """This rank's micro-batch ``index``: input_ids = labels, (batch_size, block_size)."""
        sources, offsets = self._rows(index)
        span = np.arange(self.block_size)
        rows = [np.asarray(self.streams[s][o + span], dtype=np.int64)
                for s, o in zip(sources.tolist(), offsets.tolist())]
        x = torch.from_numpy(np.stack(rows))
        return {"input_ids": x, "labels": x.clone()}

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "block_size": self.block_size, "global_rows": self.global_rows,
                "num_tokens": [len(s) for s in self.streams], "sources": list(self.names),
                "weights": self.probs.tolist(), "batch_size": self.batch_size,
                "world_size": self.world_size, "accumulation": self.accumulation}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint of other streams, weights, seed, window or global batch."""
        mine = self.state_dict()
        for key in ("seed", "block_size", "global_rows", "num_tokens", "sources", "weights"):
            theirs = state.get(key)
            if key in state and not (np.allclose(theirs, mine[key]) if key == "weights"
                                     and len(theirs) == len(mine[key]) else theirs == mine[key]):
                fix = ("keep batch_size x processes x accumulation (or global_batch_size) as "
                       "written" if key == "global_rows" else
                       "resume with the same data_source mixture")
                raise DataError(f"the checkpoint's batches had {key}={theirs}, this run has "
                                f"{key}={mine[key]}; {fix}")
