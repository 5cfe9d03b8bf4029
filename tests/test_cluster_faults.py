"""Faults a run meets on a shared cluster, in-process: non-finite steps (skip, stop, roll back),
a checkpoint save failing at each of its files, the run_dir lock, a repeated command (resume,
move aside), and checkpoints at the last step and at a time-budget stop."""

from __future__ import annotations

import errno
import json
import math
import os
import resource
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PretrainedConfig

from mosaics.errors import ConfigError, DataError
from mosaics.training import TrainingDiverged, load_config, train
from mosaics.training import checkpoint as ckpt
from mosaics.training.config import TrainConfig
from mosaics.training.optim import cosine_with_warmup
from mosaics.training.rundir import LOCK_NAME, PREVIOUS_RUNS, RunLock
from mosaics.training.signals import parse_signals
from mosaics.training.trainer import Hook, Trainer

VOCAB, POISON = 11, 10  # a batch holding token POISON gives a NaN loss


class ToyLM(torch.nn.Module):
    """Embedding -> linear next-token model; a NaN loss on any batch containing POISON."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = PretrainedConfig(vocab_size=VOCAB)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, use_cache: bool = False
                ) -> Any:
        logits = self.head(self.embed(input_ids))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                 labels[:, 1:].reshape(-1))
        if (input_ids == POISON).any():
            loss = loss * math.nan
        return type("Out", (), {"loss": loss})()


class ToyBatches:
    """batch(i): 2 x 6 tokens drawn from (seed, i); index ``remap(i)`` and POISON-ed rows at
    the indices in ``poison``."""

    def __init__(self, poison: set[int] = frozenset(), remap: Any = None) -> None:
        self.poison, self.remap = set(poison), remap or (lambda i: i)

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        i = self.remap(index)
        ids = torch.randint(0, POISON, (2, 6), generator=torch.Generator().manual_seed(i))
        if i in self.poison:
            ids[0, 0] = POISON
        return {"input_ids": ids, "labels": ids}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "toy"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state == {"kind": "toy"}


def _cfg(run_dir: Path | None = None, **kw: Any) -> TrainConfig:
    base = dict(run_dir=str(run_dir) if run_dir else "", max_steps=10, lr=1e-2, min_lr=1e-3,
                warmup_steps=2, eval_interval=0, log_interval=1, checkpoint_interval=0,
                progress_bar=False, tensorboard=False, mixed_precision="no")
    return TrainConfig(**{**base, **kw})


def _trainer(cfg: TrainConfig, batches: ToyBatches) -> Trainer:
    trainer = Trainer(cfg, ToyLM(), batches)
    trainer.setup()
    return trainer


# --- non-finite steps -----------------------------------------------------------------------

def test_a_non_finite_step_leaves_optimizer_and_schedule_untouched() -> None:
    trainer = _trainer(_cfg(), ToyBatches(poison={3}))
    for _ in range(3):
        assert "skipped" not in trainer.train_step()
    weights = {k: v.clone() for k, v in trainer.unwrapped_model.state_dict().items()}
    moments = {k: v["exp_avg"].clone() for k, v in trainer.optimizer.state_dict()["state"].items()}
    epoch, lr = trainer.scheduler.last_epoch, trainer.scheduler.get_last_lr()
    row = trainer.train_step()  # batch 3 is poisoned
    assert row["skipped"] == 1.0 and math.isnan(row["train/loss"]) and trainer.step == 4
    for key, value in trainer.unwrapped_model.state_dict().items():
        assert torch.equal(value, weights[key]), key
    for key, value in trainer.optimizer.state_dict()["state"].items():
        assert torch.equal(value["exp_avg"], moments[key])
    assert trainer.scheduler.last_epoch == epoch and trainer.scheduler.get_last_lr() == lr
    assert "skipped" not in trainer.train_step()  # the next batch trains again
    assert not torch.equal(trainer.unwrapped_model.head.weight, weights["head.weight"])
    assert trainer.scheduler.last_epoch == epoch + 1


def test_skipped_steps_are_counted_and_too_many_in_a_row_stop(capsys) -> None:
    trainer = _trainer(_cfg(max_bad_steps=2), ToyBatches(poison={1, 4, 5, 6, 7}))
    with pytest.raises(TrainingDiverged, match=r"3 non-finite steps in a row \(max_bad_steps=2\) "
                                               r"at step 7: lower lr .*bad_step_rollback=true"):
        trainer.fit()
    assert trainer.skipped_steps == 4  # batch 1, then batches 4, 5, 6
    warnings = [x for x in capsys.readouterr().err.splitlines() if "step skipped" in x]
    assert len(warnings) == 4 and "(1 in a row, 2 allowed)" in warnings[0]
    result = _trainer(_cfg(max_bad_steps=2), ToyBatches(poison={1, 4})).fit()
    assert result.steps == 10 and result.skipped_steps == 2 and math.isfinite(result.train_loss)


def test_rollback_continues_on_new_batches_like_a_run_that_skipped_them(tmp_path) -> None:
    """Batches 4 and 5 are poisoned: steps 5 and 6 are skipped, the run rolls back to its
    step-4 checkpoint and goes on with batches 6, 7, ...: the same weights as a clean run fed
    batches 0-3 then 6-11."""
    cfg = _cfg(tmp_path / "rolled", checkpoint_interval=2, max_bad_steps=1,
               bad_step_rollback=True)
    trainer = _trainer(cfg, ToyBatches(poison={4, 5}))
    result = trainer.fit()
    assert result.steps == 10 and result.skipped_steps == 2 and trainer.data_offset == 2
    reference = _trainer(_cfg(), ToyBatches(remap=lambda i: i if i < 4 else i + 2))
    reference.fit()
    for key, value in reference.unwrapped_model.state_dict().items():
        assert torch.allclose(trainer.unwrapped_model.state_dict()[key], value, atol=1e-6), key
    # the offset is part of the checkpoint: a resume continues on the same batches
    assert ckpt.read_trainer_state(ckpt.latest_checkpoint(tmp_path / "rolled"))[
        "data_offset"] == 2


def test_rollback_that_meets_bad_batches_again_stops(tmp_path) -> None:
    cfg = _cfg(tmp_path / "again", checkpoint_interval=2, max_bad_steps=1,
               bad_step_rollback=True)
    with pytest.raises(TrainingDiverged, match="again after rolling back to step 4"):
        _trainer(cfg, ToyBatches(poison={4, 5, 6, 7})).fit()
    with pytest.raises(TrainingDiverged, match="no checkpoint to roll back to"):
        _trainer(_cfg(max_bad_steps=0, bad_step_rollback=True), ToyBatches(poison={0})).fit()


# --- a failing save ----------------------------------------------------------------------------

SAVE_FILES = ["rank_0.pt", "rank_0.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
              "trainer_state.json", "manifest.json"]
ERRNOS = [errno.ENOSPC, errno.EIO, errno.EACCES]


def _fail_at(monkeypatch, name: str, code: int) -> None:
    """The save of step 4 writes half of ``name`` and then fails with ``code``."""
    real_write, real_rename, real_fsync = ckpt.write_file, ckpt.rename, ckpt._fsync_file

    def error(path: Path) -> OSError:
        return OSError(code, os.strerror(code), str(path))

    def write_file(path: Path, write: Any) -> None:
        real_write(path, write)
        if path.name == name and "step_0000004" in str(path):
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
            raise error(path)

    def rename(src: Path, dst: Path) -> None:
        if name == "rename" and dst.name == "step_0000004":
            raise error(dst)
        real_rename(src, dst)

    def fsync(path: Path) -> None:
        if name == "fsync" and "step_0000004" in str(path):
            raise error(path)
        real_fsync(path)

    monkeypatch.setattr(ckpt, "write_file", write_file)
    monkeypatch.setattr(ckpt, "rename", rename)
    monkeypatch.setattr(ckpt, "_fsync_file", fsync)


@pytest.mark.parametrize("name", [*SAVE_FILES, "fsync", "rename"])
def test_a_failed_save_keeps_earlier_checkpoints_and_says_what_is_needed(tmp_path, monkeypatch,
                                                                          name) -> None:
    code = ERRNOS[([*SAVE_FILES, "fsync", "rename"]).index(name) % len(ERRNOS)]
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, checkpoint_interval=2, max_steps=6, keep_checkpoints=1)
    _fail_at(monkeypatch, name, code)
    before = None
    trainer = _trainer(cfg, ToyBatches())
    with pytest.raises(ckpt.CheckpointWriteError) as caught:
        trainer.fit()
    message = str(caught.value)
    assert "\n" not in message and trainer.step == 4
    assert f"cannot write checkpoint {run_dir / 'checkpoints' / 'step_0000004'}" in message
    assert os.strerror(code) in message and "iB free there" in message
    before = ckpt.checkpoint_bytes(run_dir / "checkpoints" / "step_0000002")
    assert f"needs about {before / 2**10:.1f} KiB" in message and "from step_0000002" in message
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [2]  # keep=1 did not prune it
    assert ckpt.verify(run_dir / "checkpoints" / "step_0000002") is None
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_0000002"]
    # space freed: the same settings resume from step 2 and finish
    monkeypatch.undo()
    again = _trainer(cfg, ToyBatches())
    assert again.step == 2
    assert again.fit().steps == 6 and ckpt.latest_checkpoint(run_dir).name == "step_0000006"


# --- the run_dir lock ---------------------------------------------------------------------------

def _write_lock(run_dir: Path, **holder: Any) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps(holder))


def test_lock_refuses_a_live_holder_and_replaces_a_dead_one(tmp_path, monkeypatch) -> None:
    host = socket.gethostname()
    alive = os.getppid()  # a live process other than this one
    _write_lock(tmp_path, host=host, pid=alive, since="then")
    with pytest.raises(ConfigError, match=f"in use by PID {alive} on host {host} since then: "
                                          "wait for it"):
        RunLock(tmp_path).acquire()
    dead = 2**22 + 12345  # above the default pid_max: no such process
    _write_lock(tmp_path, host=host, pid=dead)
    lock = RunLock(tmp_path)
    note = lock.acquire()
    assert note is not None and f"process {dead} no longer exists" in note
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()

    _write_lock(tmp_path, host="node-17", pid=4242, slurm_job="991", slurm_restart="0")
    with pytest.raises(ConfigError) as caught:
        RunLock(tmp_path).acquire()
    text = str(caught.value)
    assert "PID 4242 on host node-17 (SLURM job 991)" in text
    assert f"delete {tmp_path / LOCK_NAME}" in text
    # the same SLURM job, requeued: its earlier incarnation is gone
    monkeypatch.setenv("SLURM_JOB_ID", "991")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    note = RunLock(tmp_path).acquire()
    assert note is not None and "SLURM job 991 was requeued" in note


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_lock_of_a_reused_pid_or_an_earlier_boot_is_stale(tmp_path) -> None:
    """A live PID is not its holder when it started at another time, or the host rebooted."""
    from mosaics.training.rundir import _boot_id, _pid_start

    host, alive = socket.gethostname(), os.getppid()
    started, boot = _pid_start(alive), _boot_id()
    assert isinstance(started, int) and started > 0 and boot
    assert _pid_start(os.getpid()) >= started  # a child starts after its parent
    _write_lock(tmp_path, host=host, pid=alive, boot_id=boot, pid_start=started)
    with pytest.raises(ConfigError, match=f"in use by PID {alive}"):
        RunLock(tmp_path).acquire()  # the same process: still held
    _write_lock(tmp_path, host=host, pid=alive, boot_id=boot, pid_start=started - 1)
    note = RunLock(tmp_path).acquire()
    assert note is not None and f"PID {alive} now belongs to another process" in note
    written = json.loads((tmp_path / LOCK_NAME).read_text())
    assert written["pid_start"] == _pid_start(os.getpid()) and written["boot_id"] == boot
    _write_lock(tmp_path, host=host, pid=alive, boot_id="an-earlier-boot", pid_start=started)
    note = RunLock(tmp_path).acquire()
    assert note is not None and "the host restarted since" in note


def test_train_refuses_a_run_dir_in_use(tmp_path) -> None:
    _write_lock(tmp_path / "busy", host=socket.gethostname(), pid=os.getppid())
    with pytest.raises(ConfigError, match="busy is in use by PID"):
        train(load_config(None, dict(run_dir=str(tmp_path / "busy"), max_steps=1)))
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == [LOCK_NAME]


def test_stop_signal_names() -> None:
    assert [s.name for s in parse_signals("SIGTERM, usr1")] == ["SIGTERM", "SIGUSR1"]
    assert parse_signals("") == []
    with pytest.raises(ConfigError, match="unknown signal 'SIGFOO'"):
        TrainConfig(stop_signals="SIGFOO")
    with pytest.raises(ConfigError, match="cannot be caught"):
        TrainConfig(stop_signals="KILL")
    with pytest.raises(ConfigError, match="contradict"):
        TrainConfig(fresh_start=True, resume=True)


# --- a repeated command, extension, time budget (the real pretraining pipeline) ----------------

TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2, max_steps=4,
            warmup_steps=2, num_train_stories=120, vocab_size=280, eval_interval=0,
            eval_windows=4, eval_batch_size=4, log_interval=1, checkpoint_interval=2,
            keep_checkpoints=5, progress_bar=False, sample_tokens=0, save_final=False,
            tensorboard=False, lr=5e-3, min_lr=1e-3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("cluster")
    return base, dict(TINY, data_cache_dir=str(base / "cache"))


def _rows(run_dir: Path) -> dict[int, dict[str, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "train/loss" in r}


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.integration
def test_the_same_command_resumes_and_another_run_is_refused_or_moved_aside(tiny, capsys):
    base, settings = tiny
    run_dir = base / "repeat"
    first = dict(settings, run_dir=str(run_dir))
    train(load_config(None, first))
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [2, 4]  # the last step too
    weights = _sha(run_dir / "checkpoints/step_0000004/model.safetensors")
    capsys.readouterr()
    train(load_config(None, first))  # requeued: nothing left to do, nothing overwritten
    err = capsys.readouterr().err
    assert "at step 4" in err and "already at step 4" in err
    assert _sha(run_dir / "checkpoints/step_0000004/model.safetensors") == weights

    with pytest.raises(DataError, match="seed=0, this run has seed=1.*fresh_start=true"):
        train(load_config(None, dict(first, seed=1)))
    assert _sha(run_dir / "checkpoints/step_0000004/model.safetensors") == weights

    train(load_config(None, dict(first, seed=1, fresh_start=True)))
    moved = list((run_dir / PREVIOUS_RUNS).iterdir())
    assert len(moved) == 1 and "moved the earlier run's files to" in capsys.readouterr().err
    assert _sha(moved[0] / "checkpoints/step_0000004/model.safetensors") == weights
    assert {p.name for p in moved[0].iterdir()} >= {"config.yaml", "metrics.jsonl",
                                                    "checkpoints"}
    assert _sha(run_dir / "checkpoints/step_0000004/model.safetensors") != weights
    assert not (run_dir / LOCK_NAME).exists()


@pytest.mark.integration
def test_an_earlier_run_without_a_checkpoint_is_moved_aside(tiny, capsys) -> None:
    base, settings = tiny
    run_dir = base / "no_checkpoint"
    train(load_config(None, dict(settings, run_dir=str(run_dir), checkpoint_interval=0)))
    old_metrics = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    train(load_config(None, dict(settings, run_dir=str(run_dir), checkpoint_interval=0)))
    assert "holds no intact checkpoint to resume; moved" in capsys.readouterr().err
    (moved,) = (run_dir / PREVIOUS_RUNS).iterdir()
    assert (moved / "metrics.jsonl").read_text() == old_metrics


@pytest.mark.integration
@pytest.mark.parametrize("stretch", [False, True])
def test_max_steps_raised_on_resume(tiny, capsys, stretch) -> None:
    """4 steps, then the same command with max_steps=7: resumed at 4. The schedule keeps its
    4 steps (lr at min_lr after them), or, with schedule_steps=7, follows the 7-step cosine."""
    base, settings = tiny
    run_dir = base / f"extend_{stretch}"
    train(load_config(None, dict(settings, run_dir=str(run_dir))))
    capsys.readouterr()
    extra = dict(schedule_steps=7) if stretch else {}
    train(load_config(None, dict(settings, run_dir=str(run_dir), max_steps=7, **extra)))
    err = capsys.readouterr().err
    assert "at step 4" in err and ("extends the run past its schedule" in err) != stretch
    rows = _rows(run_dir)
    assert sorted(rows) == list(range(1, 8))
    length = 7 if stretch else 4
    for step, row in rows.items():  # the lr used by optimizer step `step` (0-based step - 1)
        expected = cosine_with_warmup(step - 1, 5e-3, 1e-3, 2, length if step > 4 else 4)
        assert row["lr"] == pytest.approx(expected, rel=1e-9), step
    assert ckpt.read_trainer_state(ckpt.latest_checkpoint(run_dir))["schedule_steps"] == length


@pytest.mark.integration
def test_a_time_budget_stop_writes_a_checkpoint(tiny) -> None:
    base, settings = tiny
    run_dir = base / "budget"
    result = train(load_config(None, dict(settings, run_dir=str(run_dir), max_steps=50,
                                          checkpoint_interval=20, time_budget_s=1e-6)))
    assert result.stopped_early and result.steps == 1
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [1]
    assert ckpt.verify(ckpt.latest_checkpoint(run_dir)) is None


class _FileSizeLimit(Hook):
    """From the end of step 3 on, no file of this process may grow past ``limit`` bytes (a
    real write failure, EFBIG, like a full disk's ENOSPC inside torch's writer)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.saved = limit, None

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict) -> None:
        if step == 3:
            self.saved = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.saved[1]))

    def restore(self) -> None:
        if self.saved is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.saved)


def test_a_real_write_failure_inside_torch_save_is_reported_the_same_way(tmp_path) -> None:
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, checkpoint_interval=2, max_steps=6)
    limit = _FileSizeLimit(1500)
    trainer = Trainer(cfg, ToyLM(), ToyBatches(), hooks=[limit])
    try:
        with pytest.raises(ckpt.CheckpointWriteError, match=r"step_0000004: write failed \("):
            trainer.fit()
    finally:
        limit.restore()
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [2]
    assert ckpt.verify(run_dir / "checkpoints" / "step_0000002") is None
    assert not (run_dir / "checkpoints" / ".tmp-step_0000004").exists()


def _age_lock(run_dir: Path, seconds: float) -> None:
    then = __import__("time").time() - seconds
    os.utime(run_dir / LOCK_NAME, (then, then))


def test_lock_of_another_host_is_a_lease(tmp_path) -> None:
    """A live holder on another host renews its lock; one not renewed for its lease is gone."""
    _write_lock(tmp_path, host="node-17", pid=4242, lease_s=60.0, since="then")
    _age_lock(tmp_path, 20)
    with pytest.raises(ConfigError, match=r"in use by PID 4242 on host node-17 since then: its "
                                          r"holder renewed the lock 20 s ago; .* expires 40 s"):
        RunLock(tmp_path).acquire()
    _age_lock(tmp_path, 61)
    lock = RunLock(tmp_path)
    note = lock.acquire()
    assert note is not None and "replaced the lock of PID 4242 on node-17 (its lease expired: " \
        "not renewed for 61 s" in note and "\n" not in note
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    # a lock written without a lease (an older version) is still refused
    _write_lock(tmp_path, host="node-17", pid=4242)
    _age_lock(tmp_path, 10**6)
    with pytest.raises(ConfigError, match="delete"):
        RunLock(tmp_path).acquire()


def test_a_held_lock_is_renewed_until_released(tmp_path) -> None:
    import time

    lock = RunLock(tmp_path, lease_s=0.3)
    assert lock.acquire() is None
    assert json.loads((tmp_path / LOCK_NAME).read_text())["lease_s"] == 0.3
    _age_lock(tmp_path, 100)
    time.sleep(0.25)  # renewed every lease / 6 = 0.05 s
    assert time.time() - (tmp_path / LOCK_NAME).stat().st_mtime < 1
    renewer = lock._renewer
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists() and renewer is not None \
        and not renewer.is_alive()


def test_lease_setting_is_checked(monkeypatch) -> None:
    from mosaics.training.rundir import LEASE_S, lease_seconds

    assert lease_seconds() == LEASE_S
    monkeypatch.setenv("MOSAICS_LOCK_LEASE_S", "30")
    assert lease_seconds() == 30.0
    monkeypatch.setenv("MOSAICS_LOCK_LEASE_S", "soon")
    with pytest.raises(ConfigError, match="MOSAICS_LOCK_LEASE_S must be a positive number"):
        lease_seconds()


def test_a_signal_delivered_twice_at_once_counts_once(monkeypatch) -> None:
    """A process-group signal and a launcher passing it on reach a rank together: one stop."""
    import signal

    from mosaics.training.signals import StopSignals

    stop = StopSignals([signal.SIGUSR1])
    with stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second, distinct signal would _exit here
        assert stop.received == "SIGUSR1" and stop.requested()
    monkeypatch.setenv("MOSAICS_LAUNCHER_PID", str(os.getppid()))
    watch = StopSignals([signal.SIGTERM])
    assert watch.launcher == os.getppid() and not watch.requested()  # our parent, alive
    monkeypatch.setattr(os, "getppid", lambda: 1)  # the launcher died: re-parented
    assert watch.requested() and watch.received == f"the exit of launcher PID {watch.launcher}"
    monkeypatch.undo()
    monkeypatch.setenv("MOSAICS_LAUNCHER_PID", str(2**22 + 1))  # inherited from a rank
    assert StopSignals([signal.SIGTERM]).launcher is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.delenv("MOSAICS_LAUNCHER_PID")
    assert StopSignals([signal.SIGTERM]).launcher == os.getppid()  # torch's agent
    assert StopSignals([]).launcher is None  # stop signals off: no launcher watch either


def test_nproc_option_forms_and_errors() -> None:
    from mosaics.training.launch import pop_nproc

    assert pop_nproc(["--nproc", "2", "lr=1e-3"]) == (2, ["lr=1e-3"])
    assert pop_nproc(["max_steps=5", "--nproc=4"]) == (4, ["max_steps=5"])
    assert pop_nproc(["--nproc_per_node", "3"]) == (3, [])
    assert pop_nproc(["lr=1"]) == (None, ["lr=1"])
    for bad in (["--nproc"], ["--nproc", "0"], ["--nproc=two"]):
        with pytest.raises(ConfigError, match="--nproc"):
            pop_nproc(bad)


DEEPSPEED_SKIP = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_cluster_faults import Hook, ToyBatches, ToyLM, _cfg
from mosaics.training.trainer import Trainer

class Weights(Hook):
    seen = []
    def on_step_end(self, trainer, step, metrics):
        self.seen.append(sum(float(v.double().sum()) for v in
                             trainer.unwrapped_model.state_dict().values()))

cfg = _cfg(run_dir=sys.argv[2], max_steps=6, max_bad_steps=2)
trainer = Trainer(cfg, ToyLM(), ToyBatches(poison={2, 3}), hooks=[Weights()])
result = trainer.fit()
print(json.dumps({"deepspeed": trainer.is_deepspeed, "skipped": result.skipped_steps,
                  "steps": result.steps, "weights": Weights.seen,
                  "lr": [r["lr"] for r in result.history]}))
trainer.close()
"""


@pytest.mark.integration
@pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None,
                    reason="needs deepspeed")
def test_deepspeed_skips_a_non_finite_step_like_the_other_engines(tmp_path) -> None:
    """Under DeepSpeed ZeRO-2 the poisoned steps 3 and 4 are skipped (weights and lr as
    before), counted in the result and in metrics.jsonl, and training goes on."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_MIXED_PRECISION="no",
               ACCELERATE_DEEPSPEED_CONFIG_FILE=str(root / "configs/deepspeed/zero2.json"))
    env.pop("ACCELERATE_USE_CPU", None)
    done = subprocess.run([sys.executable, "-c", DEEPSPEED_SKIP, str(root / "tests"),
                           str(tmp_path / "run")], env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["deepspeed"] and out["steps"] == 6 and out["skipped"] == 2
    weights = out["weights"]
    assert weights[1] == weights[2] == weights[3] != weights[4]  # steps 3, 4 left them alone
    assert len(out["lr"]) == 4  # the four trained steps are logged
    assert "step skipped" in done.stderr
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows if "skipped_steps" in r] == [1.0, 2.0]
