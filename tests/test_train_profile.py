"""Profiles and memory: a profiler trace of a step range, data-wait time and per-step peak
memory in the metrics, and an out-of-memory that writes a snapshot and names the knobs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mosaics.errors import ConfigError
from mosaics.training.config import TrainConfig
from mosaics.training.trainer import Hook

BIG = 256 * 1024 ** 2  # bytes touched by the batch source at step 3


class SlowTokens:
    """Micro-batch i after ``delay`` seconds; the batches of step 3 also touch BIG bytes."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.delay)
        if index == 2:
            scratch = np.ones(BIG // 8)
            scratch.sum()
            del scratch
        ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _fit(run_dir: Path, source, extra=(), model=None, **settings):
    from mosaics import MosaicsConfig, MosaicsForCausalLM
    from mosaics.training.components import build_hooks
    from mosaics.training.instrument import LoopProbe
    from mosaics.training.oom import oom_guard
    from mosaics.training.trainer import Trainer, make_accelerator

    values = dict(run_dir=str(run_dir), max_steps=4, lr=2e-3, min_lr=2e-4, warmup_steps=1,
                  eval_interval=0, log_interval=1, checkpoint_interval=0, progress_bar=False,
                  log_with="none")
    values.update(settings)
    cfg = TrainConfig(**values)
    torch.manual_seed(0)
    model = model or MosaicsForCausalLM(MosaicsConfig(vocab_size=32, n_layer=1, n_embd=16,
                                                      n_head=2, block_size=16))
    probe = LoopProbe(source)
    hooks = build_hooks(cfg, None, True, probe) + list(extra)
    trainer = Trainer(cfg, model, probe, [], hooks=hooks, accelerator=make_accelerator(cfg, "cpu"))
    probe.attach(trainer)
    try:
        with oom_guard(trainer, cfg.oom_snapshot):
            trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return trainer, hooks, rows


def test_profile_steps_parse():
    from mosaics.training.profiling import parse_steps

    assert parse_steps("2:5") == (2, 5) and parse_steps(None) is None and parse_steps("") is None
    for bad in ("5:2", "0:1", "3", "a:b"):
        with pytest.raises(ConfigError, match="profile_steps must be 'a:b'.*profile_steps=10:12"):
            TrainConfig(profile_steps=bad)


class TraceSeen(Hook):
    def __init__(self) -> None:
        self.seen: dict[int, bool] = {}

    def on_step_end(self, trainer, step, metrics) -> None:
        self.seen[step] = any((Path(trainer.run_dir) / "profile").glob("*.pt.trace.json"))


def test_profiler_trace_of_the_step_range(tmp_path):
    seen = TraceSeen()
    _, hooks, _ = _fit(tmp_path / "run", SlowTokens(), [seen], profile_steps="2:3")
    assert seen.seen == {1: False, 2: False, 3: True, 4: True}  # written when step 3 ends
    (trace,) = (tmp_path / "run" / "profile").glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names)  # the training step's operators
    assert any(e.get("name") == "[memory]" for e in events)  # memory events (profile_memory)
    assert not any(isinstance(h, type(hooks[0])) and h.profiler is not None for h in hooks)


def test_data_wait_and_per_step_peak_memory_in_metrics(tmp_path):
    _, _, rows = _fit(tmp_path / "run", SlowTokens(delay=0.05))
    system = {r["step"]: r for r in rows if "sys/peak_mem_gib" in r}
    assert sorted(system) == [1, 2, 3, 4]
    for row in system.values():
        assert 0.05 <= row["sys/data_wait_s"] < 1.0
        assert 0.0 < row["sys/data_wait_frac"] <= 1.0
    peaks = {s: r["sys/peak_mem_gib"] for s, r in system.items()}
    assert all(p > 0.01 for p in peaks.values())
    # the step that touched BIG bytes peaks that much above the next one (reset every step)
    assert peaks[3] - peaks[4] > 0.8 * BIG / 1024 ** 3
    assert peaks[3] - peaks[2] > 0.8 * BIG / 1024 ** 3


class OomAtStep2(torch.nn.Module):
    """A model whose second training forward raises the CUDA out-of-memory error."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0
        self.config = inner.config

    def forward(self, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return self.inner(**kwargs)


def test_simulated_out_of_memory_writes_snapshot_and_names_knobs(tmp_path):
    from mosaics import MosaicsConfig, MosaicsForCausalLM
    from mosaics.training.oom import OutOfMemory

    model = OomAtStep2(MosaicsForCausalLM(MosaicsConfig(vocab_size=32, n_layer=1, n_embd=16,
                                                        n_head=2, block_size=16)))
    with pytest.raises(OutOfMemory) as info:
        _fit(tmp_path / "run", SlowTokens(), model=model, batch_size=2, block_size=16)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("out of memory at step 2 on cpu (CUDA out of memory. Tried to "
                              "allocate 2.00 GiB)")
    for knob in ("batch_size (now 2", "gradient_accumulation_steps", "gradient_checkpointing="
                 "true (now false)", "block_size (now 16)"):
        assert knob in message
    (snapshot,) = (tmp_path / "run" / "oom").iterdir()
    assert str(snapshot) in message
    assert json.loads(snapshot.read_text())["max_rss_bytes"] > 0
