"""No silent hangs: the watchdog dumps the stacks, names the stalled rank and exits with the
status the launcher and the sbatch script requeue."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mosaics.training.config import TrainConfig
from mosaics.training.trainer import Hook
from mosaics.training.watchdog import EXIT_STALLED, Watchdog, stalled_rank

ROOT = Path(__file__).resolve().parents[1]


def test_stalled_rank_from_heartbeats():
    now = 1000.0
    beat = dict(pid=1, host="h", step=7, progress=990.0, written=999.0)
    beats = {0: dict(beat, progress=995.0), 1: dict(beat, pid=2, written=950.0, step=6)}
    rank, why = stalled_rank(beats, now, stale_s=3)
    assert rank == 1 and "rank 1 (pid 2 on h) stopped responding" in why and "step 6" in why
    beats = {0: dict(beat, progress=995.0), 1: dict(beat, progress=980.0), 2: beat}
    rank, why = stalled_rank(beats, now, stale_s=3)
    assert rank == 1 and "stalled at step 7: no progress for 20 s" in why
    assert stalled_rank({0: beat, 1: None}, now, 3)[0] == 1
    with pytest.raises(ValueError):
        TrainConfig(watchdog_s=0)


class Stall(Hook):
    """Stalls at step 2 until the watchdog fires (its exit sets ``released``)."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.since: float | None = None

    def on_step_end(self, trainer, step, metrics) -> None:
        if step == 2:
            self.since = time.monotonic()
            self.released.wait(60)


def test_stalled_step_ends_with_stacks_and_status(tmp_path):
    from mosaics import MosaicsConfig, MosaicsForCausalLM
    from mosaics.training.components import build_hooks, stopping
    from mosaics.training.instrument import LoopProbe
    from mosaics.training.trainer import Trainer, make_accelerator
    from tests.test_trackers import RandomTokens

    cfg = TrainConfig(run_dir=str(tmp_path), max_steps=3, checkpoint_interval=0, eval_interval=0,
                      progress_bar=False, log_with="none", watchdog_s=0.5)
    model = MosaicsForCausalLM(MosaicsConfig(vocab_size=32, n_layer=1, n_embd=16, n_head=2,
                                             block_size=16))
    stall = Stall()
    probe = LoopProbe(RandomTokens())
    hooks = build_hooks(cfg, None, True, probe)
    (watchdog,) = [h for h in hooks if isinstance(h, Watchdog)]
    exits: list[tuple[int, float]] = []
    watchdog.exit = lambda status: (exits.append((status, time.monotonic())),
                                    stall.released.set())
    trainer = Trainer(cfg, model, probe, [], hooks=[stall, *hooks],
                      accelerator=make_accelerator(cfg, "cpu"))
    probe.attach(trainer)
    with stopping(hooks):
        trainer.fit()
    trainer.close()
    assert [s for s, _ in exits] == [EXIT_STALLED]
    assert exits[0][1] - stall.since < 0.5 + 20  # the limit, polling and a loaded machine
    stacks = (tmp_path / "watchdog" / "stacks_rank0.txt").read_text()
    assert "on_step_end" in stacks and "test_train_watchdog.py" in stacks  # the stalled frame
    assert watchdog.message.startswith("watchdog: rank 0 made no progress for")
    assert "this process stalled at step 2" in watchdog.message
    assert f"exiting with status {EXIT_STALLED}" in watchdog.message
    assert not watchdog._thread.is_alive()  # stopped with the run


@pytest.mark.integration
def test_sigstopped_gloo_rank_is_named_and_the_run_requeues(tmp_path):
    run_dir = tmp_path / "run"
    settings = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2, max_steps=400,
                    num_train_stories=200, vocab_size=300, eval_interval=0, log_interval=1,
                    checkpoint_interval=2, progress_bar=False, sample_tokens=0,
                    watchdog_s=6, data_cache_dir=str(tmp_path / "cache"), run_dir=str(run_dir))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="0")
    cmd = [sys.executable, "-m", "mosaics", "train", "--nproc", "2",
           *(f"{k}={v}" for k, v in settings.items())]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    beat = run_dir / "watchdog" / "rank1.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if beat.exists() and json.loads(beat.read_text() or "{}").get("step", 0) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()
    pid = json.loads(beat.read_text())["pid"]
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == EXIT_STALLED, err[-3000:]
    assert time.monotonic() - stopped < 6 + 5 + 40  # limit, grace, a loaded machine
    lines = [x for x in err.splitlines() if x.startswith("watchdog: rank 0")]
    assert len(lines) == 1 and f"rank 1 (pid {pid}" in lines[0] and "stopped responding" \
        in lines[0], err[-3000:]
    stacks = (run_dir / "watchdog" / "stacks_rank0.txt").read_text()
    assert "Thread" in stacks and "trainer.py" in stacks  # rank 0 blocked inside the loop
    # the next run resumes from the last checkpoint
    again = subprocess.run([*cmd[:5], *cmd[5:], "max_steps=6"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "resumed from" in again.stderr, again.stderr[-3000:]
