"""Training metrics: ``<run_dir>/metrics.jsonl`` (one JSON object per line) and TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """Writes on the main process only; a resumed run first drops rows past its start step."""

    def __init__(self, run_dir: Path, enabled: bool, start_step: int,
                 tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.writer = None
        self.path = run_dir / "metrics.jsonl"
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tb"), purge_step=start_step or None)
        if self.path.exists():
            rows = [r for r in self.path.read_text().splitlines()
                    if r.strip() and json.loads(r)["step"] <= start_step]
            self.path.write_text("".join(r + "\n" for r in rows))

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
