"""Multi-process training on CPU: 2 gloo DDP ranks (torchrun) and DeepSpeed ZeRO-2 (through
accelerate) reach the same losses as one process with the same global batch."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mosaics.training.config import load_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, max_steps=12, warmup_steps=3,
            num_train_stories=200, vocab_size=300, eval_interval=6, eval_windows=8,
            eval_batch_size=4, log_interval=1, checkpoint_interval=0, dropout=0.0,
            progress_bar=False, sample_tokens=0, save_final=False)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("ACCELERATE_USE_CPU", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill_matching(marker: str) -> list[int]:
    """SIGKILL every process whose command line contains ``marker`` (launchers start their
    ranks in sessions of their own, so killing the launcher's group can miss them)."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except ProcessLookupError:
                pass
    return killed


def _run(cmd: list[str], env: dict[str, str], timeout: float, run_dir: Path) -> tuple[int, str]:
    """Run a launcher with its output in a file (a stray rank holding a pipe cannot block the
    test); on timeout, or if a rank outlives its launcher, kill every process of the run."""
    log_path = run_dir.parent / f"{run_dir.name}.launcher.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            _kill_matching(str(run_dir))
            pytest.fail(f"{cmd[2]} timed out after {timeout} s:\n{log_path.read_text()[-3000:]}")
    stray = _kill_matching(str(run_dir))
    err = log_path.read_text()
    assert not stray, f"ranks {stray} outlived their launcher:\n{err[-3000:]}"
    return proc.returncode, err


def _metrics(run_dir: Path) -> dict[tuple[int, str], float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], k): v for r in rows for k, v in r.items()
            if k in ("train/loss", "val/loss", "lr")}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """One process, 4 windows per step (in this process; also fills the data cache)."""
    from mosaics.training import train

    base = tmp_path_factory.mktemp("dist")
    settings = dict(TINY, data_cache_dir=str(base / "cache"))
    train(load_config(None, dict(settings, run_dir=str(base / "single"), batch_size=4,
                                 checkpoint_interval=6)))
    return base, settings, _metrics(base / "single")


def _check_same(reference: dict, other: dict) -> None:
    assert set(reference) == set(other)
    for key, value in reference.items():
        assert other[key] == pytest.approx(value, abs=1e-4, rel=0), key


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(single_process) -> None:
    base, settings, reference = single_process
    run_dir = base / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "train.py"), *(f"{k}={v}" for k, v in settings.items()),
           f"run_dir={run_dir}", "batch_size=2", "checkpoint_interval=6"]
    env = dict(_env(), ACCELERATE_USE_CPU="1")
    code, err = _run(cmd, env, timeout=300, run_dir=run_dir)
    assert code == 0, err[-3000:]
    assert "2 process(es), DistributedType.MULTI_CPU, backend gloo" in err
    assert "warning" not in err.lower()
    _check_same(reference, _metrics(run_dir))


def _resume_copy(source: Path, target: Path) -> None:
    import shutil

    from mosaics.training import checkpoint as ckpt

    saved = ckpt.checkpoint_root(source) / "step_0000006"
    assert ckpt.verify(saved) is None
    shutil.copytree(saved, ckpt.checkpoint_root(target) / saved.name)


def _steps_after_six(run_dir: Path, reference: dict) -> None:
    resumed = _metrics(run_dir)
    assert {s for s, _ in resumed} == set(range(7, 13))
    for key, value in resumed.items():
        assert value == pytest.approx(reference[key], abs=1e-4, rel=0), key


@pytest.mark.slow
@pytest.mark.parametrize("split", [dict(batch_size=4), dict(batch_size=2,
                                                            gradient_accumulation_steps=2)])
def test_two_rank_checkpoint_resumes_on_one_process(single_process, split, capsys) -> None:
    """Written by 2 gloo ranks (2 windows each), resumed by 1 process with the same global
    batch of 4 windows (as one batch, or 2 micro-batches of 2)."""
    from mosaics.training import train

    base, settings, reference = single_process
    written = base / "ddp"
    if not (written / "checkpoints").is_dir():
        pytest.skip("needs test_two_gloo_ranks_match_one_process")
    run_dir = base / f"ddp_to_1_{split['batch_size']}"
    _resume_copy(written, run_dir)
    capsys.readouterr()
    train(load_config(None, dict(settings, run_dir=str(run_dir), resume=True, **split)))
    assert "on 1 process(es), written by 2 (same global batch" in capsys.readouterr().err
    _steps_after_six(run_dir, reference)
    with pytest.raises(ValueError, match="global_rows=4, this run has global_rows=2"):
        train(load_config(None, dict(settings, run_dir=str(run_dir), resume=True,
                                     batch_size=2)))


@pytest.mark.slow
def test_one_process_checkpoint_resumes_on_two_ranks(single_process) -> None:
    base, settings, reference = single_process
    run_dir = base / "one_to_ddp"
    _resume_copy(base / "single", run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "train.py"), *(f"{k}={v}" for k, v in settings.items()),
           f"run_dir={run_dir}", "batch_size=2", "resume=true"]
    code, err = _run(cmd, dict(_env(), ACCELERATE_USE_CPU="1"), timeout=300, run_dir=run_dir)
    assert code == 0, err[-3000:]
    assert "on 2 process(es), written by 1" in err
    _steps_after_six(run_dir, reference)


@pytest.mark.slow
def test_two_nodes_on_one_host_match_one_process(single_process) -> None:
    """A 2-node x 1-process job: two torchrun invocations with node ranks 0 and 1 meeting at
    127.0.0.1, as on two machines, reach the one-process losses."""
    base, settings, reference = single_process
    run_dir = base / "two_nodes"
    port = _free_port()
    env = dict(_env(), ACCELERATE_USE_CPU="1")
    procs, logs = [], []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
               str(node), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
               "--master_port", str(port), str(ROOT / "train.py"),
               *(f"{k}={v}" for k, v in settings.items()), f"run_dir={run_dir}", "batch_size=2"]
        log = base / f"two_nodes.{node}.log"
        logs.append(log)
        with open(log, "w") as handle:
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=handle,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    try:
        codes = [p.wait(timeout=300) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        _kill_matching(str(run_dir))
        pytest.fail("the 2-node job timed out:\n" + logs[0].read_text()[-3000:])
    assert codes == [0, 0], logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
    assert "2 process(es), DistributedType.MULTI_CPU, backend gloo" in logs[0].read_text()
    _check_same(reference, _metrics(run_dir))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_zero2_matches_one_process(single_process) -> None:
    base, settings, reference = single_process
    run_dir = base / "zero2"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs/accelerate/deepspeed_zero2.yaml"), "--main_process_port",
           str(_free_port()), "--deepspeed_config_file",
           str(ROOT / "configs/deepspeed/zero2.json"), str(ROOT / "train.py"),
           *(f"{k}={v}" for k, v in settings.items()), f"run_dir={run_dir}", "batch_size=2",
           "save_final=true"]
    code, err = _run(cmd, _env(), timeout=500, run_dir=run_dir)
    assert code == 0, err[-3000:]
    assert "2 process(es), DistributedType.DEEPSPEED" in err
    _check_same(reference, _metrics(run_dir))

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert model.config.n_layer == settings["n_layer"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_checkpoint_resumes_exactly(single_process) -> None:
    """ZeRO-2 on 2 processes writes a checkpoint at step 6; a new run resumed from it alone
    reproduces steps 7-12 of the uninterrupted single-process run."""
    import shutil

    from mosaics.training import checkpoint as ckpt

    base, settings, reference = single_process
    first, second = base / "zero2_ckpt", base / "zero2_resumed"

    def launch(run_dir: Path, *extra: str, processes: int = 2) -> str:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs/accelerate/deepspeed_zero2.yaml"), "--main_process_port",
               str(_free_port()), "--num_processes", str(processes), "--deepspeed_config_file",
               str(ROOT / "configs/deepspeed/zero2.json"), str(ROOT / "train.py"),
               *(f"{k}={v}" for k, v in settings.items()), f"run_dir={run_dir}",
               f"batch_size={4 // processes}", *extra]
        code, err = _run(cmd, _env(), timeout=500, run_dir=run_dir)
        assert code == 0, err[-3000:]
        return err

    launch(first, "checkpoint_interval=6")
    assert [s for s, _ in ckpt.list_checkpoints(first)] == [6, 12]  # the last step too
    saved = ckpt.checkpoint_root(first) / "step_0000006"
    state = json.loads((saved / "trainer_state.json").read_text())
    assert state["deepspeed"] is True and state["world_size"] == 2
    assert not (saved / "model.safetensors").exists()  # the engine's own files instead
    assert len(list((saved / "deepspeed" / "state").glob("*optim_states.pt"))) == 2

    shutil.copytree(saved, ckpt.checkpoint_root(second) / saved.name)
    err = launch(second, "resume=true")
    assert "at step 6" in err
    resumed = _metrics(second)
    assert {s for s, _ in resumed} == set(range(7, 13))
    for key, value in resumed.items():
        assert value == pytest.approx(reference[key], abs=1e-4, rel=0), key

    # one DeepSpeed process continues it through DeepSpeed's universal checkpoint
    third = base / "zero2_to_one"
    shutil.copytree(saved, ckpt.checkpoint_root(third) / saved.name)
    err = launch(third, "resume=true", processes=1)
    assert "converting it to a universal checkpoint" in err and "written by 2" in err
    assert (ckpt.checkpoint_root(third) / saved.name / "deepspeed" / "universal").is_dir()
    resumed = _metrics(third)
    assert {s for s, _ in resumed} == set(range(7, 13))
    for key, value in resumed.items():
        assert value == pytest.approx(reference[key], abs=1e-4, rel=0), key

    # a DDP / single-process run refuses the DeepSpeed checkpoint with a clear message
    from mosaics.training import train

    with pytest.raises(ValueError, match="written by a DeepSpeed run"):
        train(load_config(None, dict(settings, run_dir=str(second), batch_size=4,
                                     resume=True)))
