"""Out of memory during training: a memory snapshot, then one line naming the knobs.

Under :func:`oom_guard` (``TrainConfig.oom_snapshot``) a CUDA run records its allocation
history; ``torch.OutOfMemoryError`` writes ``<run_dir>/oom/snapshot_rank<r>.pickle`` (open it
in pytorch.org/memory_viz) and raises :class:`OutOfMemory`, whose message names micro-batch,
gradient checkpointing and block size. On CPU the snapshot is a JSON of the resident set's
peak."""

from __future__ import annotations

import contextlib
import json
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError


class OutOfMemory(ConfigError):
    """Training ran out of device memory; the message names the settings to change."""


def start_recording(device: torch.device) -> bool:
    """Record CUDA allocation history (for the snapshot); False on other devices."""
    if device.type != "cuda":
        return False
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    return True


def dump_snapshot(path: Path, device: torch.device) -> Path:
    """Write the memory snapshot of ``device`` to ``path`` (.pickle on CUDA, .json on CPU)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        torch.cuda.memory._dump_snapshot(str(path))
        return path
    path = path.with_suffix(".json")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    path.write_text(json.dumps({"device": str(device), "max_rss_bytes": peak}) + "\n")
    return path


def advice(cfg: Any) -> str:
    """The knobs that lower training memory, with this run's values."""
    return (f"lower batch_size (now {cfg.batch_size}; raise gradient_accumulation_steps, now "
            f"{cfg.gradient_accumulation_steps}, to keep the global batch), set "
            f"gradient_checkpointing=true (now {str(cfg.gradient_checkpointing).lower()}), or "
            f"lower block_size (now {cfg.block_size})")


@contextlib.contextmanager
def oom_guard(trainer: Any, enabled: bool = True) -> Iterator[None]:
    """Turn ``torch.OutOfMemoryError`` inside the block into :class:`OutOfMemory` after
    writing a snapshot into the run folder."""
    device = trainer.accelerator.device
    recording = enabled and start_recording(device)
    try:
        yield
    except torch.OutOfMemoryError as err:
        where = "no snapshot (no run_dir)"
        if enabled and trainer.run_dir is not None:
            rank = trainer.accelerator.process_index
            try:
                snap = dump_snapshot(trainer.run_dir / "oom" / f"snapshot_rank{rank}.pickle",
                                     device)
                where = f"memory snapshot in {snap}"
            except (OSError, RuntimeError) as dump_err:
                where = f"no snapshot ({dump_err})"
        first = str(err).splitlines()[0] if str(err) else "out of memory"
        raise OutOfMemory(f"out of memory at step {trainer.step + 1} on {device} ({first}); "
                          f"{where}; {advice(trainer.cfg)}.") from None
    finally:
        if recording:
            torch.cuda.memory._record_memory_history(enabled=None)
