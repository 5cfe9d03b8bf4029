"""Preemption of a running job: a stop signal checkpoints and exits with status 75 (one process,
2 gloo DDP ranks, DeepSpeed ZeRO-2 on CPU, the ``--nproc`` launcher), and the same command run
again (the requeued job) continues with the losses of an uninterrupted run; the ranks of a
torchrun killed by a signal it does not handle checkpoint and free the lock; SIGKILLs at random
moments, each followed by the same command, end with the uninterrupted losses."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mosaics.training import EXIT_PREEMPTED, load_config, train
from mosaics.training import checkpoint as ckpt

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
# checkpoints only at the last step and on a signal; enough steps for a signal to land mid-run
SETTINGS = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2, max_steps=300,
                warmup_steps=2, num_train_stories=120, vocab_size=280, eval_interval=100,
                eval_windows=4, eval_batch_size=4, log_interval=1, checkpoint_interval=10000,
                keep_checkpoints=3, progress_bar=False, sample_tokens=0, save_final=False,
                tensorboard=False, dropout=0.0)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("ACCELERATE_USE_CPU", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metrics(run_dir: Path) -> dict[tuple[int, str], float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], k): v for r in rows for k, v in r.items()
            if k in ("train/loss", "val/loss", "lr")}


def _logged_steps(run_dir: Path) -> int:
    """Training steps logged so far (a step's system metrics come on lines of their own)."""
    try:
        return (run_dir / "metrics.jsonl").read_text().count('"train/loss"')
    except FileNotFoundError:
        return 0


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry.name))
    return sorted(found)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process (it also fills the data cache)."""
    base = tmp_path_factory.mktemp("preempt")
    settings = dict(SETTINGS, data_cache_dir=str(base / "cache"))
    train(load_config(None, dict(settings, run_dir=str(base / "reference"))))
    return base, settings, _metrics(base / "reference")


def _signal_mid_run(cmd: list[str], env: dict[str, str], run_dir: Path, sig: int,
                    target: str = "launcher", second: int | None = None) -> tuple[int, str]:
    """Start ``cmd``; once 20 steps are logged send ``sig`` to the launcher, or to one worker
    (its child, ``target="worker"``), and ``second`` right after it; return its exit code and
    output."""
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.time() + 400
        while _logged_steps(run_dir) < 20:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "the run did not start:\n" + log.read_text()[-3000:]
            time.sleep(0.02)
        victim = proc.pid
        if target == "worker":
            workers = _children(proc.pid)
            while len(workers) < 2 and target == "worker":  # accelerate: launcher -> torchrun
                workers = _children(workers[0])
            victim = workers[-1]  # not rank 0's process, as far as the order tells
        os.kill(victim, sig)
        if second is not None:
            os.kill(victim, second)
        code = proc.wait(timeout=300)
    except BaseException:
        _kill_group(proc)
        raise
    return code, log.read_text()


def _check_stopped(run_dir: Path, world: int) -> int:
    """The signal's checkpoint: complete, every process's state in it, before the last step."""
    (step, path), = ckpt.list_checkpoints(run_dir)
    assert ckpt.verify(path) is None
    assert {f"rank_{r}.json" for r in range(world)} <= {p.name for p in path.iterdir()}
    assert 20 <= step < SETTINGS["max_steps"]
    return step


def _check_requeued(run_dir: Path, out: str, step: int, reference: dict, tol: float) -> None:
    assert f"at step {step}" in out, out[-3000:]
    resumed = _metrics(run_dir)
    assert set(resumed) == set(reference)
    for key, value in reference.items():
        assert resumed[key] == pytest.approx(value, abs=tol, rel=0), key


def test_one_process_checkpoints_on_the_signal_and_the_same_command_resumes(reference) -> None:
    base, settings, expected = reference
    run_dir = base / "one"
    cmd = [sys.executable, str(ROOT / "train.py"), *(f"{k}={v}" for k, v in settings.items()),
           f"run_dir={run_dir}"]
    code, out = _signal_mid_run(cmd, _env(), run_dir, signal.SIGUSR1)
    assert code == EXIT_PREEMPTED, out[-3000:]
    step = _check_stopped(run_dir, 1)
    assert f"stopped by SIGUSR1 at step {step}: checkpoint" in out and "Traceback" not in out
    assert not (run_dir / ".lock").exists()
    again = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    _check_requeued(run_dir, again.stderr, step, expected, 1e-5)


def test_a_second_signal_exits_at_once_without_a_checkpoint(reference) -> None:
    base, settings, _ = reference
    run_dir = base / "twice"
    cmd = [sys.executable, str(ROOT / "train.py"), *(f"{k}={v}" for k, v in settings.items()),
           f"run_dir={run_dir}"]
    code, out = _signal_mid_run(cmd, _env(), run_dir, signal.SIGTERM, second=signal.SIGUSR1)
    assert code in (128 + signal.SIGTERM, 128 + signal.SIGUSR1), out[-3000:]
    assert "exiting now, without a checkpoint" in out
    assert ckpt.list_checkpoints(run_dir) == []


def test_two_gloo_ranks_agree_on_the_stop_step(reference) -> None:
    """SIGUSR1 reaches one of two torchrun ranks only; both stop after the same step and write
    one checkpoint; the same command continues it like the uninterrupted one-process run."""
    base, settings, expected = reference
    run_dir = base / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "train.py"), *(f"{k}={v}" for k, v in settings.items()),
           f"run_dir={run_dir}", "batch_size=1"]
    env = _env(ACCELERATE_USE_CPU="1")
    code, out = _signal_mid_run(cmd, env, run_dir, signal.SIGUSR1, target="worker")
    assert code != 0 and f"exitcode  : {EXIT_PREEMPTED}" in out, out[-3000:]
    step = _check_stopped(run_dir, 2)
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    _check_requeued(run_dir, again.stderr, step, expected, 1e-4)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_ranks_checkpoint_on_the_signal(reference) -> None:
    base, settings, expected = reference
    run_dir = base / "zero2"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs/accelerate/deepspeed_zero2.yaml"), "--main_process_port",
           str(_free_port()),
           "--deepspeed_config_file", str(ROOT / "configs/deepspeed/zero2.json"),
           str(ROOT / "train.py"), *(f"{k}={v}" for k, v in settings.items()),
           f"run_dir={run_dir}", "batch_size=1"]
    code, out = _signal_mid_run(cmd, _env(), run_dir, signal.SIGTERM, target="worker")
    assert code != 0 and f"exitcode  : {EXIT_PREEMPTED}" in out, out[-3000:]
    step = _check_stopped(run_dir, 2)
    again = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True,
                           timeout=500)
    assert again.returncode == 0, again.stderr[-3000:]
    _check_requeued(run_dir, again.stderr, step, expected, 1e-4)


# --- the project's launcher (mosaics train --nproc), torchrun's orphans, SIGKILL soak ----------

def _alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()
            and " Z " not in Path(f"/proc/{pid}/stat").read_text()]


# the runs below stop at step SHORT with the reference's 300-step schedule: their losses are the
# reference's first SHORT steps
SHORT = 60
SHORTER = dict(max_steps=SHORT, schedule_steps=SETTINGS["max_steps"])


def _launch_cmd(settings: dict, run_dir: Path) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--nproc", "2",
            *(f"{k}={v}" for k, v in dict(settings, **SHORTER).items()), f"run_dir={run_dir}",
            "batch_size=1"]


def _check_first_steps(run_dir: Path, reference: dict, tol: float, context: object = ""
                       ) -> float:
    """Every value the reference logged up to step SHORT, equal within ``tol``; returns the
    largest difference."""
    resumed, worst = _metrics(run_dir), 0.0
    for key, value in reference.items():
        if key[0] <= SHORT:
            assert key in resumed, (context, key)
            assert resumed[key] == pytest.approx(value, abs=tol, rel=0), (context, key)
            worst = max(worst, abs(resumed[key] - value))
    return worst


def _stop_launcher(cmd: list[str], run_dir: Path, sig: int, group: bool, after: int
                   ) -> tuple[int, str, list[int]]:
    """Start ``cmd`` (``--nproc 2``); once ``after`` steps are logged send ``sig`` to the
    launcher or to its process group; return its status, its output and its ranks' PIDs."""
    log = run_dir.parent / f"{run_dir.name}-{signal.Signals(sig).name}.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 400
        while _logged_steps(run_dir) < after:
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        code = proc.wait(timeout=300)
    except BaseException:
        _kill_group(proc)
        raise
    return code, log.read_text(), ranks


def _check_launcher_stop(run_dir: Path, code: int, out: str, ranks: list[int], name: str
                         ) -> int:
    """Status 75 after both ranks exited, one stop message, the newest checkpoint complete
    with both ranks' states, the lock free; returns the checkpoint's step."""
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert _alive(ranks) == []  # it returned after its ranks, not before
    step, path = ckpt.list_checkpoints(run_dir)[-1]
    assert ckpt.verify(path) is None
    assert {"rank_0.json", "rank_1.json"} <= {p.name for p in path.iterdir()}
    assert out.count(f"stopped by {name} at step {step}") == 1, out[-3000:]
    assert "Traceback" not in out and "exiting now" not in out  # one signal, delivered once
    assert not (run_dir / ".lock").exists()
    return step


def test_launcher_returns_75_after_the_ranks_checkpoint_and_resumes(reference) -> None:
    """SIGTERM to ``train.py --nproc 2`` (a pod's PID 1, a wrapper script), then SIGUSR1 to the
    process group of the same command run again (``kill -- -PGID``, like Ctrl-C's SIGINT): each
    time the launcher passes the signal to both ranks once, waits for their checkpoint and
    exits 75 itself; the same command then resumes at once, and the third run ends with the
    uninterrupted run's losses."""
    base, settings, expected = reference
    run_dir = base / "launcher"
    cmd = _launch_cmd(settings, run_dir)
    code, out, ranks = _stop_launcher(cmd, run_dir, signal.SIGTERM, group=False, after=15)
    first = _check_launcher_stop(run_dir, code, out, ranks, "SIGTERM")
    assert 15 <= first < SHORT - 10
    code, out, ranks = _stop_launcher(cmd, run_dir, signal.SIGUSR1, group=True, after=first + 5)
    assert f"resumed from {ckpt.checkpoint_root(run_dir) / ckpt.step_dir_name(first)}" in out
    second = _check_launcher_stop(run_dir, code, out, ranks, "SIGUSR1")
    assert first < second < SHORT
    again = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True,
                           timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at step {second}" in again.stderr, again.stderr[-3000:]
    _check_first_steps(run_dir, expected, 1e-4)


def test_ranks_of_a_torchrun_killed_by_sigusr1_checkpoint_and_free_the_lock(reference) -> None:
    """torchrun dies at once on SIGUSR1 (it does not handle it); its ranks notice that their
    launcher is gone, stop after the same step with one checkpoint and release the lock."""
    base, settings, _ = reference
    run_dir = base / "torchrun_orphans"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "train.py"),
           *(f"{k}={v}" for k, v in dict(settings, **SHORTER).items()), f"run_dir={run_dir}",
           "batch_size=1"]
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, env=_env(ACCELERATE_USE_CPU="1"), cwd=ROOT, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.time() + 400
        while _logged_steps(run_dir) < 20:
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        ranks = _children(proc.pid)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=60) == -signal.SIGUSR1
        deadline = time.time() + 120
        while _alive(ranks) and time.time() < deadline:
            time.sleep(0.05)
        assert _alive(ranks) == [], log.read_text()[-3000:]
    finally:
        for pid in _alive(ranks):
            os.kill(pid, signal.SIGKILL)
    _check_stopped(run_dir, 2)
    assert "launcher PID" in log.read_text() and not (run_dir / ".lock").exists()


@pytest.mark.slow
def test_sigkills_at_random_steps_end_with_the_uninterrupted_losses(reference) -> None:
    """Soak: SIGKILL the same command at 4 random steps (mid-step, mid-save, mid-resume), run it
    again each time, and once more to the end: the losses are the uninterrupted run's."""
    import random

    base, settings, expected = reference
    run_dir = base / "soak"
    cmd = [sys.executable, str(ROOT / "train.py"),
           *(f"{k}={v}" for k, v in dict(settings, **SHORTER).items()), f"run_dir={run_dir}",
           "checkpoint_interval=7"]
    seed = int(time.time())
    kills = sorted(random.Random(seed).sample(range(3, SHORT - 3), 4))
    logs = []
    for target in kills:
        logs.append(base / f"soak-{target}.log")
        with open(logs[-1], "w") as handle:
            proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=handle, start_new_session=True)
        try:
            deadline = time.time() + 300
            while _logged_steps(run_dir) < target and proc.poll() is None:
                assert time.time() < deadline, f"seed {seed}: no progress to step {target}"
                time.sleep(random.Random(seed + target).uniform(0.001, 0.02))
            assert proc.poll() is None, f"seed {seed}: ended before step {target}"
        finally:
            _kill_group(proc)
    final = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert final.returncode == 0, f"seed {seed}: " + final.stderr[-3000:]
    worst = _check_first_steps(run_dir, expected, 1e-5, f"seed {seed}, kills at steps {kills}")
    starts = [re.findall(r"resumed from \S+ at step (\d+)", text) or ["fresh"]
              for text in [log.read_text() for log in logs] + [final.stderr]]
    print(f"soak: seed {seed}; SIGKILLs once steps {kills} were logged; the runs started at "
          f"{[s[0] for s in starts]}; largest difference to the reference {worst:.2e}")
