"""configs/slurm/pretrain.sbatch run on this host: fake ``srun`` (starts the tasks locally with
the SLURM variables a task gets) and ``scontrol``; two gloo ranks train a tiny model, and the
script requeues only after the trainer's preemption status."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "configs" / "slurm" / "pretrain.sbatch"

FAKE_SRUN = f"""#!{sys.executable}
# srun on one host: drop the options, start SLURM_NTASKS copies of the command
import os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write("srun " + " ".join(args) + "\\n")
if os.environ.get("FAKE_SRUN_STATUS"):
    sys.exit(int(os.environ["FAKE_SRUN_STATUS"]))
while args and args[0].startswith("--"):
    args.pop(0)
n = int(os.environ["SLURM_NTASKS"])
procs = [subprocess.Popen(args, env={{**os.environ, "SLURM_PROCID": str(i),
                                      "SLURM_LOCALID": str(i)}}) for i in range(n)]
sys.exit(max(p.wait() for p in procs))
"""

FAKE_SCONTROL = f"""#!{sys.executable}
import os, sys
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write("scontrol " + " ".join(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["show", "hostnames"]:
    print("127.0.0.1")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, *overrides: str, srun_status: str = "") -> tuple:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               FAKE_LOG=str(log), FAKE_SRUN_STATUS=srun_status, SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="node[1]", SLURM_NTASKS="2", SLURM_CPUS_PER_TASK="1",
               SLURM_SUBMIT_DIR=str(ROOT), MASTER_PORT=str(_free_port()),
               CONFIG=str(ROOT / "configs" / "default.yaml"), RUN_DIR=str(tmp_path / "run"),
               ACCELERATE_USE_CPU="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(["bash", str(SCRIPT), *overrides], env=env, capture_output=True,
                          text=True, timeout=600)
    return proc, log.read_text() if log.exists() else ""


@pytest.mark.integration
def test_the_batch_script_trains_two_ranks_and_resumes(tmp_path):
    tiny = ["n_layer=1", "n_head=2", "n_embd=16", "block_size=16", "batch_size=2",
            "max_steps=4", "warmup_steps=1", "num_train_stories=60", "vocab_size=300",
            "eval_interval=2", "eval_windows=4", "eval_batch_size=4", "log_interval=1",
            "checkpoint_interval=2", "progress_bar=false", "sample_tokens=0",
            f"data_cache_dir={tmp_path / 'cache'}"]
    proc, calls = _run(tmp_path, *tiny)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "2 process(es)" in proc.stderr  # one world of two ranks
    assert "rendezvous 127.0.0.1:" in proc.stdout
    assert "scontrol show hostnames node[1]" in calls and "requeue" not in calls
    run = tmp_path / "run"
    assert (run / "final" / "config.json").is_file()
    # requeued: the same command continues from the newest checkpoint (step 4, the last step
    # of the first run, which is checkpointed as well as exported)
    again, _ = _run(tmp_path, *tiny[:-1], "max_steps=6", tiny[-1])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step_0000004 at step 4" in again.stderr and "done: 6 steps" in again.stderr


@pytest.mark.integration
@pytest.mark.parametrize("status,requeued,exit_status",
                         [("75", True, 0), ("76", True, 0), ("1", False, 1)])
def test_requeue_only_after_the_preemption_status(tmp_path, status, requeued, exit_status):
    proc, calls = _run(tmp_path, srun_status=status)
    assert proc.returncode == exit_status
    assert ("scontrol requeue 4242" in calls) == requeued
    assert "srun --kill-on-bad-exit=1 bash -c" in calls
