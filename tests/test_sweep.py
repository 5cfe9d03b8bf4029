"""The sweep engine: job expansion, resume by skipping, failure records, merged tables, the
committed result files and job files, scheduler resources, and real tiny sweeps (local runner
and submitit's local executor) in the integration tier."""

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mosaics.evaluation import runner, sweep, tables
from mosaics.evaluation.jobs import (
    PAPER_SIZES,
    Job,
    expand_jobs,
    failure_path,
    job_file_resources,
    job_record,
    load_job_file,
    make_job,
    paper_jobs,
    result_path,
    write_json,
)

ROOT = Path(__file__).resolve().parents[1]
TINY_SORT = ["--set", "steps=2", "--set", "eval_every=1", "--set", "n_val=4",
             "--set", "n_samples=3", "--set", "multipliers=[1,2]", "--set", "n_layer=1",
             "--set", "n_embd=16", "--set", "n_head=2"]


def test_expand_jobs_is_a_cartesian_product():
    jobs, notes = expand_jobs(["regbench", "sort"], ["gaussian", "gpt2", "llama"], [0, 1],
                              [100, 1000], "cpu", {"steps": 5, "max_steps": 3})
    names = [j.name for j in jobs]
    assert len(names) == len(set(names)) == 3 * 2 * 2 + 2 * 2  # sort x gpt2 left out
    assert any("gpt2" in n for n in notes)
    reg = [j for j in jobs if j.task == "regbench"]
    srt = [j for j in jobs if j.task == "sort"]
    assert {j.size for j in reg} == {100, 1000} and {j.size for j in srt} == {None}
    assert all(j.overrides == {"max_steps": 3} for j in reg)  # each task keeps its own keys
    assert all(j.overrides == {"steps": 5} for j in srt)
    assert {j.model for j in jobs} == {"mosaics/gaussian", "gpt2", "llama"}
    assert jobs[0].kernel == "gaussian" and srt[-1].kernel is None


def test_paper_suite_covers_both_tables():
    jobs = paper_jobs(seeds=[0, 1])
    assert len(jobs) == 2 * (9 * 4 + 9 + 9)
    sort = {j.label for j in jobs if j.task == "sort"}
    assert "llama" in sort and "mosaics/gaussian_knn (k=32)" in sort and "gpt2" not in sort
    assert {j.size for j in jobs if j.task == "regbench"} == set(PAPER_SIZES)
    assert all(j.preset == "reference" and not j.overrides for j in jobs)


def test_job_definitions_import_without_torch(tmp_path):
    """Protocols, presets and jobs are plain data: listing and checking jobs needs no training
    stack. The package root registers the model classes (and so imports torch); the check
    stands in for it with a bare package, so that what it sees is the evaluation modules' own
    imports."""
    code = ("import sys, types\n"
            f"root = types.ModuleType('mosaics'); root.__path__ = [{str(ROOT / 'mosaics')!r}]\n"
            "sys.modules['mosaics'] = root\n"
            "from mosaics.evaluation import jobs, protocols\n"
            "job = jobs.Job('sort', 'llama', preset='cpu', overrides={'steps': 7})\n"
            "assert protocols.resolve(job.task, job.preset, job.overrides).steps == 7\n"
            "assert len(jobs.load_job_file(sys.argv[1])[0]) == 4\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    job_file = tmp_path / "jobs.yaml"  # baselines only: a kernel name reads the registry
    job_file.write_text("defaults: {preset: cpu-learn, overrides: {steps: 9}}\n"
                        "grid: {task: [sort, mqmtar], model: llama, seed: [0, 1]}\n")
    proc = subprocess.run([sys.executable, "-c", code, str(job_file)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


def test_v2_jobs_build_the_v2_block():
    from mosaics.evaluation.models import model_config

    job = make_job("sort", "mosaics-v2/epanechnikov", seed=1, preset="cpu-learn")
    assert (job.arch, job.kernel, job.label) == ("mosaics-v2", "epanechnikov",
                                                 "mosaics-v2/epanechnikov")
    assert job.name == "sort-mosaics-v2-epanechnikov-s1-cpu-learn"
    cfg = model_config(job.arch, 16, 2, 32, 4, kernel=job.kernel)
    assert cfg.three_level_memory and cfg.adaptive_bandwidth and cfg.gated_keys
    assert cfg.persistent_memory == "swiglu" and not cfg.document_masking  # one example, one doc
    assert not model_config("mosaics", 16, 2, 32, 4).three_level_memory


@pytest.mark.parametrize("kwargs,message", [
    ({"task": "copy", "model": "gaussian"}, "unknown task"),
    ({"task": "sort", "model": "nope"}, "registered kernels"),
    ({"task": "sort", "model": "gpt2"}, "llama"),
    ({"task": "sort", "model": "llama", "preset": "huge"}, "preset"),
    ({"task": "sort", "model": "llama", "overrides": {"stepz": 1}}, "unknown protocol"),
    ({"task": "sort", "model": "mosaics-v2/nope"}, "registered kernels"),
    ({"task": "sort", "model": "v3/gaussian"}, "unknown model"),
])
def test_bad_jobs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_job(**kwargs)


def test_job_file_grid_and_list(tmp_path):
    (tmp_path / "jobs.yaml").write_text(
        "defaults: {preset: cpu, overrides: {steps: 7}}\n"
        "grid: {task: sort, model: [gaussian, llama], seed: [0, 1]}\n"
        "jobs:\n"
        "  - {task: regbench, model: gpt2, size: 500, overrides: {max_steps: 4}}\n"
        "  - {task: mqmtar, model: gaussian_knn, kernel_kwargs: {k: 32}}\n")
    jobs, _ = load_job_file(tmp_path / "jobs.yaml")
    assert len(jobs) == 6
    reg = next(j for j in jobs if j.task == "regbench")
    assert reg.size == 500 and reg.overrides == {"max_steps": 4} and reg.preset == "cpu"
    knn = next(j for j in jobs if j.task == "mqmtar")
    assert knn.kernel_kwargs == {"k": 32} and "k32" in knn.name and knn.overrides == {"steps": 7}
    (tmp_path / "list.json").write_text(json.dumps([{"task": "sort", "model": "llama"}]))
    assert [j.name for j in load_job_file(tmp_path / "list.json")[0]] == [
        "sort-llama-s0-reference"]


def _fake_extrapolation(out, job, em):
    record = {"job": job_record(job), "seconds": 1.0,
              "results": {"task": job.task, "lengths": [64, 128], "seed": job.seed, "runs": [{
                  "label": job.model, "exact_match": {"64": em, "128": em / 2},
                  "token_accuracy": {"64": 1.0, "128": 0.9}, "train": {"steps": 2}}]}}
    write_json(result_path(out, job), record)


def _fake_regbench(out, job, acc):
    base = {"oracle": {"accuracy": 1.0, "tvd": 0.0},
            "in-context 2-gram": {"accuracy": 0.8 + job.seed / 100, "tvd": 0.3}}
    record = {"job": job_record(job), "seconds": 1.0,
              "results": {"seed": job.seed, "baselines": base, "runs": [{
                  "label": job.model, "size": job.size, "accuracy": acc, "tvd": 1 - acc,
                  "train": {"steps": 3}}]}}
    write_json(result_path(out, job), record)


def test_existing_results_are_skipped(tmp_path):
    jobs, _ = expand_jobs(["sort"], ["gaussian", "llama"], [0], preset="cpu")
    for job in jobs:
        _fake_extrapolation(tmp_path, job, 0.5)
    lines = []
    done = sweep.run_sweep(jobs, tmp_path, parallel=2, report=lines.append)
    assert done["skipped"] == jobs and not done["finished"] and not done["failed"]
    assert "2 already done, 0 to run" in lines[0]
    assert not (tmp_path / "logs").exists()


@contextlib.contextmanager
def _lock_held_elsewhere(work):
    """Another live process holds the run lock of the folder ``work`` while inside."""
    work.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from mosaics.training.rundir import RunLock; "
         "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)",
         str(work)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()


def test_a_job_another_sweep_is_running_is_left_to_it(tmp_path, monkeypatch):
    """Two sweeps over one --out: the second neither runs nor fails the first's job."""
    busy, free = (make_job("sort", m, preset="cpu") for m in ("gaussian", "llama"))
    spawned = []
    monkeypatch.setattr(runner, "spawn", lambda job, out, device, threads, save_model, children:
                        (spawned.append(job), (job, 1, 0.0))[1])
    lines = []
    with _lock_held_elsewhere(tmp_path / "jobs" / busy.name):
        done = sweep.run_sweep([busy, free], tmp_path, report=lines.append)
    assert spawned == [free] and done["busy"] == [busy] and done["failed"] == [free]
    assert f"1 to run, 1 left to the other sweep that holds it ({busy.name})" in lines[0]
    assert not failure_path(tmp_path, busy).exists()
    spawned.clear()
    sweep.run_sweep([busy], tmp_path, report=lines.append)  # its holder is gone: it runs
    assert spawned == [busy]


def test_a_job_taken_or_finished_after_the_listing_is_left_alone(tmp_path, monkeypatch):
    """A second sweep over the same --out takes (or finishes) a job after the first listed it:
    the first neither starts a process that fails on the lock nor trains a finished job again,
    and writes no failure record or log for it."""
    taken, finished = (make_job("sort", m, preset="cpu") for m in ("gaussian", "llama"))
    with _lock_held_elsewhere(tmp_path / "jobs" / taken.name):
        assert runner.spawn(taken, tmp_path, "cpu", 1) == (taken, runner.EXIT_BUSY, 0.0)
        # ... and if its process starts all the same (the race), it exits with the same status
        child = subprocess.run(runner.child_command(taken, tmp_path, "cpu"),
                               env=runner.child_env(1), capture_output=True, text=True)
        assert child.returncode == runner.EXIT_BUSY, child.stdout + child.stderr
        assert "is in use by PID" in child.stdout
    _fake_extrapolation(tmp_path, finished, 0.5)
    assert runner.spawn(finished, tmp_path, "cpu", 1) == (finished,
                                                          runner.EXIT_DONE_ELSEWHERE, 0.0)
    assert not (tmp_path / "logs").exists() and not (tmp_path / "failed").exists()

    monkeypatch.setattr(runner, "spawn", lambda job, out, device, threads, save_model, children:
                        (job, runner.EXIT_BUSY, 0.0))
    lines = []
    done = sweep.run_sweep([taken], tmp_path, report=lines.append)
    assert done["busy"] == [taken] and not done["failed"]
    assert f"BUSY   {taken.name}" in lines[-1]
    assert not failure_path(tmp_path, taken).exists()

    # a job another sweep finished after this one listed it counts as finished, said so
    later = make_job("sort", "epanechnikov", preset="cpu")
    monkeypatch.setattr(runner, "spawn", lambda job, out, device, threads, save_model, children:
                        (_fake_extrapolation(tmp_path, job, 0.5),
                         (job, runner.EXIT_DONE_ELSEWHERE, 0.0))[1])
    done = sweep.run_sweep([later], tmp_path, report=lines.append)
    assert done["finished"] == [later] and not done["failed"]
    assert f"done   {later.name} (by another sweep over this folder)" in lines[-1]


def test_threads_per_job_split_or_given(tmp_path, monkeypatch):
    assert runner.threads_per_job(2, cores=8) == 4 and runner.threads_per_job(16, cores=8) == 1
    seen = []
    monkeypatch.setattr(runner, "spawn", lambda job, out, device, threads, save_model, children:
                        (seen.append(threads), (job, 1, 0.0))[1])
    job = make_job("sort", "gaussian", preset="cpu")
    lines = []
    sweep.run_sweep([job], tmp_path, parallel=1, report=lines.append, threads=3)
    assert seen == [3] and "with 3 thread(s) each" in lines[0]
    assert runner.child_env(3)["OMP_NUM_THREADS"] == "3"


@pytest.mark.integration
def test_a_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    bad = Job("sort", "mosaics/no_such_kernel", preset="cpu",
              overrides={"steps": 1, "n_val": 2, "n_samples": 1, "multipliers": [1]})
    good = make_job("sort", "gaussian", preset="cpu")
    _fake_extrapolation(tmp_path, good, 1.0)
    done = sweep.run_sweep([bad, good], tmp_path, report=lambda _: None)
    assert done["failed"] == [bad] and done["skipped"] == [good]
    record = json.loads(failure_path(tmp_path, bad).read_text())
    assert record["status"] != 0 and "no_such_kernel" in record["log_tail"]
    assert not result_path(tmp_path, bad).exists()  # so the next sweep retries it
    text = tables.summarize(tmp_path, plot=False)
    assert "failed jobs" in text and bad.name in text


def test_merged_tables_from_result_files(tmp_path):
    for seed, em in [(0, 0.5), (1, 0.7)]:
        _fake_extrapolation(tmp_path, make_job("sort", "gaussian", seed, preset="cpu"), em)
    _fake_extrapolation(tmp_path, make_job("sort", "llama", 0, preset="cpu"), 1.0)
    for seed in (0, 1):
        for size, acc in [(100, 0.6), (1000, 0.9)]:
            _fake_regbench(tmp_path, make_job("regbench", "gpt2", seed, size, "cpu"),
                           acc + seed / 10)
    _fake_extrapolation(tmp_path, make_job("sort", "mosaics-v2/gaussian", 0,
                                           preset="cpu"), 0.25)
    text = tables.summarize(tmp_path)
    # the paper's numbers in parentheses (Sort at 1x and 2x), wall minutes last
    assert "| mosaics/gaussian | 0.600 ± 0.141 (2) (1.00) | 0.300 ± 0.071 (2) (0.06) | 0.0 |" \
        in text
    assert "| llama | 1.000 (1.00) | 0.500 (0.00) | 0.0 |" in text
    assert "| mosaics-v2/gaussian | 0.250 | 0.125 | 0.0 |" in text  # not in the paper
    assert "| mosaics/gaussian | 1.000 ± 0.000 (2) | 0.900 ± 0.000 (2) | 0.0 |" in text
    assert "| gpt2 | 0.650 ± 0.071 (2) / 0.350 ± 0.071 (2) | 0.950 ± 0.071 (2) / 0.050 ± " \
        "0.071 (2) (0.545 / 0.626) | 0.0 |" in text
    assert "| in-context 2-gram | 0.805 ± 0.007 (2) / 0.300 ± 0.000 (2) |" in text
    assert (tmp_path / "summary.md").read_text() == text
    assert (tmp_path / "sort-cpu.png").stat().st_size > 0
    assert (tmp_path / "regbench-cpu.png").stat().st_size > 0


def test_learning_curve_rows_pick_evaluations_at_even_steps(tmp_path):
    def history(last):
        return [{"step": s, "val/loss": 4.0 / s, "val/token_accuracy": s / 1000,
                 "val/exact_match": 0.0, "elapsed_s": 6.0 * s} for s in range(100, last + 1, 100)]
    for model, last in [("gaussian", 1000), ("llama", 500)]:
        job = make_job("sort", model, 0, preset="cpu")
        _fake_extrapolation(tmp_path, job, 0.5)
        path = result_path(tmp_path, job)
        record = json.loads(path.read_text())
        record["results"]["runs"][0]["train"]["history"] = [{"step": 50}, *history(last)]
        write_json(path, record)
    text = tables.curve_markdown(tables.load_results(tmp_path))
    assert "| job | step 250 | step 500 | step 750 | step 1000 |" in text
    # step 250 has no evaluation: the last one before it (step 200, 20 minutes) is shown
    assert "| mosaics/gaussian s0 | 20.0 / 0.020 / 0.200 / 0.000 | 50.0 / 0.008 / 0.500 / " \
        "0.000 | 70.0 / 0.006 / 0.700 / 0.000 | 100.0 / 0.004 / 1.000 / 0.000 |" in text
    assert "| llama s0 | 20.0 / 0.020 / 0.200 / 0.000 | 50.0 / 0.008 / 0.500 / 0.000 | - | - |" \
        in text  # stopped at 500
    assert "validation curve" in tables.summarize(tmp_path, plot=False)


@pytest.mark.integration
def test_tiny_sweep_end_to_end_with_two_processes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "eval/sweep.py", "--task", "sort", "--model", "mosaics/gaussian",
           "llama", "--preset", "cpu", *TINY_SORT, "--jobs", "2", "--device", "cpu",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = sorted(p.name for p in (tmp_path / "results").glob("*.json"))
    assert len(results) == 2 and any("llama" in r for r in results)
    assert "| mosaics/gaussian |" in proc.stdout and "| llama |" in proc.stdout
    metrics = list((tmp_path / "jobs").glob("*/runs/*/metrics.jsonl"))
    assert len(metrics) == 2
    rows = [json.loads(line) for line in metrics[0].read_text().splitlines()]
    assert any("val/exact_match" in r for r in rows)
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0 and "2 already done, 0 to run" in again.stdout


@pytest.mark.integration
def test_a_stopped_sweep_checkpoints_its_job_and_the_next_one_resumes_it(tmp_path):
    """Ctrl-C (SIGINT to the runner's process group) reaches the running job once, as SIGTERM
    from the runner (checkpoint, exit 75), and no other job starts; the same command again
    resumes the job from its checkpoint and runs the other."""
    import signal
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    tiny = [a for pair in zip(TINY_SORT[::2], TINY_SORT[1::2], strict=True)
            if not pair[1].startswith(("steps=", "eval_every=")) for a in pair]
    cmd = [sys.executable, "eval/sweep.py", "--task", "sort", "--model", "mosaics/gaussian",
           "--seed", "0", "1", "--preset", "cpu", *tiny, "--set", "steps=200",
           "--set", "eval_every=5", "--set", "batch_size=4", "--set", "min_len=8",
           "--set", "max_len=12", "--jobs", "1", "--threads", "1", "--device", "cpu",
           "--out", str(tmp_path)]
    runner = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 180
    while not list(tmp_path.glob("jobs/*/runs/*/checkpoints/step_*")):
        assert runner.poll() is None and time.time() < deadline, "no checkpoint was written"
        time.sleep(0.05)
    os.killpg(runner.pid, signal.SIGINT)  # as a terminal's Ctrl-C
    out, _ = runner.communicate(timeout=120)
    assert runner.returncode == 75, out[-3000:]
    assert out.count("STOPPED") == 2 and "not started" in out, out[-3000:]
    assert not list((tmp_path / "results").glob("*.json"))
    first = next(p.parent.parent.parent.parent.name
                 for p in tmp_path.glob("jobs/*/runs/*/checkpoints/step_*"))
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "0 already done, 2 to run (1 from a checkpoint)" in again.stdout
    record = json.loads((tmp_path / "results" / f"{first}.json").read_text())
    train = record["results"]["runs"][0]["train"]
    assert train["steps"] == 200 and 0 < train["resumed_step"] < 200
    assert record["seconds"] >= train["resumed_seconds"] > 0
    log = (tmp_path / "logs" / f"{first}.log").read_text()
    assert log.count("--- attempt started") == 2 and "resumed from" in log
    assert "stopped by SIGTERM" in log and "KeyboardInterrupt" not in log
    assert not list(tmp_path.glob("jobs/*/runs/*/checkpoints"))


@pytest.mark.integration
def test_a_preempted_scheduler_task_is_requeued_and_its_job_resumes(tmp_path):
    """submitit's preemption signal to an array task: the job's process checkpoints, the task
    is requeued, and the requeued task resumes the job from that checkpoint."""
    submitit = pytest.importorskip("submitit")
    import signal
    import time

    from mosaics.evaluation.cluster import ResumableTask

    job = make_job("sort", "gaussian", preset="cpu", overrides={
        "steps": 200, "eval_every": 5, "batch_size": 4, "min_len": 8, "max_len": 12,
        "n_val": 4, "n_samples": 3, "multipliers": [1, 2], "n_layer": 1, "n_embd": 16,
        "n_head": 2})
    ex = submitit.AutoExecutor(folder=tmp_path / "logs" / "submitit", cluster="local")
    ex.update_parameters(timeout_min=5, cpus_per_task=1)
    handle = ex.submit(ResumableTask(grace_s=30), job, tmp_path, "cpu", 1, False)
    deadline = time.time() + 180
    while not list(tmp_path.glob("jobs/*/runs/*/checkpoints/step_*")):
        assert not handle.done() and time.time() < deadline, "no checkpoint was written"
        time.sleep(0.05)
    # SLURM's preemption warning (USR2 under submitit) reaches every process of the task:
    # the job's process (the lock names it) and the task running it (its parent)
    pid = json.loads((tmp_path / "jobs" / job.name / ".lock").read_text())["pid"]
    status_lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    task = int(next(line.split()[1] for line in status_lines if line.startswith("PPid:")))
    os.kill(pid, signal.SIGUSR2)
    os.kill(task, signal.SIGUSR2)
    _, status, _ = handle.result()
    assert status == 0
    train = json.loads(result_path(tmp_path, job).read_text())["results"]["runs"][0][
        "train"]
    assert train["steps"] == 200 and 0 < train["resumed_step"] < 200
    log = (tmp_path / "logs" / f"{job.name}.log").read_text()
    assert log.count("--- attempt started") == 2 and "SIGTERM" in log and "resumed from" in log


def test_paper_rows_and_cells():
    from mosaics.evaluation import paper

    assert paper.paper_row("mosaics/gaussian_knn (k=32)") == "gaussian_knn"
    assert paper.paper_row("llama") == paper.paper_row("gpt2") == "transformer"
    assert paper.paper_row("mosaics-v2/gaussian") is None
    assert paper.extrapolation_cell("sort", "mosaics/epanechnikov", 128) == 0.92
    assert paper.extrapolation_cell("mqmtar", "mosaics/triweight", 64 * 64) == 0.25
    assert paper.extrapolation_cell("sort", "mosaics/epanechnikov", 100) is None
    assert paper.regbench_cell("mosaics/biweight", 5000) == (0.947, 0.166)
    assert paper.regbench_cell("mosaics/biweight", 2500) is None


COMMITTED = sorted((ROOT / "docs" / "results" / "sweeps").glob("*/results"))


@pytest.mark.parametrize("results", COMMITTED, ids=lambda p: p.parent.name)
def test_committed_results_still_merge_into_tables(results, tmp_path):
    import shutil

    shutil.copytree(results, tmp_path / "results")
    records = tables.load_results(tmp_path)
    assert records and all({"job", "seconds", "results"} <= set(r) for r in records)
    text = tables.summarize(tmp_path, plot=False)
    for record in records:
        assert f"| {record['job']['label']} |" in text or \
            f"| {record['job']['label']} s{record['job']['seed']} |" in text
    assert "minutes" in text and "failed" not in text


JOBS_DIR = ROOT / "eval" / "jobs"
# the shared job files, and each research question's own under experiments/<question>/
JOB_FILES = sorted([*JOBS_DIR.glob("*.yaml"), *(ROOT / "experiments").glob("**/*.yaml")])


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: p.name if p.parent == JOBS_DIR
                         else str(p.relative_to(ROOT)))
def test_committed_job_files_load(path):
    jobs, _ = load_job_file(path)
    assert jobs and len({j.name for j in jobs}) == len(jobs)
    assert isinstance(job_file_resources(path), dict)


def test_resources_from_job_file_and_command_line(tmp_path):
    from mosaics.evaluation.cluster import Resources

    (tmp_path / "jobs.yaml").write_text(
        "resources: {partition: gpu, gpus_per_job: 1, time_min: 90, slurm: {account: lab}}\n"
        "grid: {task: sort, model: gaussian}\n")
    spec = job_file_resources(tmp_path / "jobs.yaml")
    res = Resources.from_mapping(spec, "jobs.yaml").merged(time_min=30, cpus_per_job=None,
                                                           slurm={"qos": "high"})
    params = res.executor_parameters("mosaics-x")
    assert params["slurm_partition"] == "gpu" and params["gpus_per_node"] == 1
    assert params["timeout_min"] == 30 and params["cpus_per_task"] == 1  # command line wins
    assert params["slurm_additional_parameters"] == {"account": "lab", "qos": "high"}
    assert "gpus_per_node" not in Resources().executor_parameters("cpu-only")
    with pytest.raises(ValueError, match="unknown resource setting.*gpus"):
        Resources.from_mapping({"gpus": 1}, "jobs.yaml")
    with pytest.raises(ValueError, match="time_min must be positive"):
        Resources.from_mapping({"time_min": 0}, "jobs.yaml")
    (tmp_path / "bad.yaml").write_text("resources: 4\ngrid: {task: sort, model: gaussian}\n")
    with pytest.raises(ValueError, match="'resources' must be a mapping"):
        job_file_resources(tmp_path / "bad.yaml")


def test_unknown_executor_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown executor 'pbs'"):
        sweep.run_sweep([], tmp_path, executor="pbs")


@pytest.mark.integration
def test_submitit_local_executor_runs_skips_and_merges_like_the_local_runner(tmp_path):
    """Real processes through submitit (no scheduler): one job is already done, one runs as
    a submitit task, one fails; the failure is recorded and the rerun skips the done ones."""
    pytest.importorskip("submitit")
    from mosaics.evaluation.cluster import Resources

    tiny = {"steps": 2, "eval_every": 1, "n_val": 4, "n_samples": 3, "multipliers": [1, 2],
            "n_layer": 1, "n_embd": 16, "n_head": 2}
    done_before = make_job("sort", "llama", preset="cpu", overrides=tiny)
    _fake_extrapolation(tmp_path, done_before, 1.0)
    todo = make_job("sort", "gaussian", preset="cpu", overrides=tiny)
    bad = Job("sort", "mosaics/no_such_kernel", preset="cpu", overrides=tiny)
    lines = []
    done = sweep.run_sweep([done_before, todo, bad], tmp_path, device="cpu",
                           report=lines.append, executor="submitit-local",
                           resources=Resources(cpus_per_job=1, time_min=5))
    assert done["skipped"] == [done_before] and done["finished"] == [todo]
    assert done["failed"] == [bad], lines
    assert "1 already done, 2 to submit (submitit-local)" in lines[0]
    assert any(line.startswith("submitted 2 task(s) as local job") for line in lines)
    record = json.loads(result_path(tmp_path, todo).read_text())
    assert record["seconds"] > 0 and record["results"]["runs"][0]["train"]["steps"] == 2
    assert "no_such_kernel" in json.loads(failure_path(tmp_path, bad).read_text())[
        "log_tail"]
    assert (tmp_path / "logs" / f"{todo.name}.log").is_file()
    assert list((tmp_path / "logs" / "submitit").glob("*_log.out"))
    text = tables.summarize(tmp_path, plot=False)
    assert "| mosaics/gaussian |" in text and "| llama |" in text and bad.name in text
    again = sweep.run_sweep([done_before, todo], tmp_path, report=lines.append,
                            executor="submitit-local")
    assert again["skipped"] == [done_before, todo] and not again["finished"]


def test_alibi_is_a_row_of_the_same_table(tmp_path):
    plain = make_job("mqmtar", "epanechnikov", 0, preset="cpu")
    biased = make_job("mqmtar", "epanechnikov", 0, preset="cpu", overrides={"alibi": True})
    assert biased.setting == plain.setting and biased.name != plain.name
    assert biased.label == "mosaics/epanechnikov +alibi"
    from mosaics.evaluation import paper
    assert paper.extrapolation_cell("mqmtar", biased.label, 64 * 64) == 0.14
    assert paper.extrapolation_cell("mqmtar", plain.label, 64 * 64) == 0.31
    assert paper.extrapolation_cell("mqmtar", biased.label, 64 * 8) is None  # not reported
    _fake_extrapolation(tmp_path, plain, 0.8)
    _fake_extrapolation(tmp_path, biased, 0.6)
    text = tables.summarize(tmp_path, plot=False)
    assert "| mosaics/epanechnikov | 0.800 (1.00) |" in text
    assert "| mosaics/epanechnikov +alibi | 0.600 |" in text


def test_an_alibi_job_trains_the_biased_model(tmp_path):
    from mosaics.evaluation import experiments
    from mosaics.evaluation.protocols import EXTRAPOLATION_PRESETS, with_overrides

    proto = with_overrides(EXTRAPOLATION_PRESETS["cpu"], alibi=True)
    model = experiments.extrapolation_model("mqmtar", "mosaics", "epanechnikov", proto, None, 99)
    assert model.config.alibi
    with pytest.raises(ValueError, match="alibi is an option"):
        experiments.extrapolation_model("mqmtar", "llama", None, proto, None, 99)


def test_minutes_per_device_when_a_model_ran_on_several():
    records = [{"job": {"label": "mosaics/gaussian"}, "device": "cpu", "seconds": 3600.0},
               {"job": {"label": "mosaics/gaussian"}, "device": "cpu", "seconds": 2400.0},
               {"job": {"label": "mosaics/gaussian"}, "device": "cuda:0", "seconds": 360.0},
               {"job": {"label": "llama"}, "device": "cuda", "seconds": 240.0}]
    seconds = tables._job_seconds(records)
    assert tables._minutes("mosaics/gaussian", seconds) == "50.0 cpu / 6.0 cuda"
    assert tables._minutes("llama", seconds) == "4.0"
    assert tables._minutes("mosaics/relumax", seconds) == "-"


def test_a_job_in_use_by_another_process_is_refused(tmp_path):
    """Two sweeps over one folder: the second process on a job stops at the job's lock."""
    from mosaics.errors import ConfigError
    from mosaics.training.rundir import LOCK_NAME

    job = make_job("sort", "gaussian", preset="cpu")
    work = tmp_path / "jobs" / job.name
    work.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (work / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(),
                                                  "pid": holder.pid}))
        with pytest.raises(ConfigError, match=f"PID {holder.pid}"):
            runner.run_job(job, tmp_path, "cpu")
    finally:
        holder.kill()
        holder.wait()
    assert not result_path(tmp_path, job).exists()


def test_job_states_for_dry_run(tmp_path):
    """``--dry-run`` says of each job: done, running (a live lock), stopped (an intact
    checkpoint to resume), failed or todo, with the step its learning curve reached."""
    from mosaics.training import checkpoint as ckpt
    from mosaics.training.rundir import LOCK_NAME

    jobs = [make_job("sort", "gaussian", seed=s, preset="cpu") for s in range(5)]
    done, running, stopped, failed, todo = jobs
    _fake_extrapolation(tmp_path, done, 1.0)
    for job in (running, stopped, failed, todo):
        run = tmp_path / "jobs" / job.name / "runs" / "sort-gaussian"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(
            json.dumps({"step": 40, "val/loss": 1.0}) + "\n"
            + json.dumps({"step": 40, "val/exact_match": 0.25}) + "\n")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "jobs" / running.name / LOCK_NAME).write_text(
            json.dumps({"host": socket.gethostname(), "pid": holder.pid}))
        assert runner.job_state(tmp_path, running).startswith(
            f"running  {running.name} (PID {holder.pid} on {socket.gethostname()}; step 40, "
            "val exact match 0.25)")
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock no longer counts and the job is what its files say
    assert runner.job_state(tmp_path, running).startswith("todo")
    step = ckpt.checkpoint_root(tmp_path / "jobs" / stopped.name / "runs" / "sort-gaussian") \
        / ckpt.step_dir_name(40)
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    ckpt.write_manifest(step)
    write_json(failure_path(tmp_path, failed), {"status": 3})
    assert runner.job_state(tmp_path, done).startswith(f"done     {done.name} (")
    assert runner.job_state(tmp_path, stopped) == (
        f"stopped  {stopped.name} (resumes from step_0000040; step 40, val exact match 0.25)")
    assert runner.job_state(tmp_path, failed) == (
        f"failed   {failed.name} (exit 3; step 40, val exact match 0.25)")
    assert runner.job_state(tmp_path, todo) == (
        f"todo     {todo.name} (an attempt reached step 40, val exact match 0.25, no checkpoint)")
    (step / "trainer_state.json").write_text("{ damaged")  # not intact: nothing to resume
    assert runner.job_state(tmp_path, stopped).startswith("todo")


def test_paper_figure_merges_seeds_across_sweeps_beside_the_paper(tmp_path, capsys):
    """Result files of two settings, one model label: one row of two seeds, the paper's cells
    in parentheses; files of another task or missing files are refused by name."""
    from mosaics.evaluation import plots
    from mosaics.evaluation.cli import main

    files = []
    for setting, model, seed, em in [("a", "mosaics/epanechnikov", 0, 1.0),
                                     ("b", "mosaics/epanechnikov", 1, 0.5),
                                     ("b", "llama", 0, 0.25)]:
        job = make_job("mqmtar", model, seed=seed, preset="cpu-recall",
                       overrides={"steps": 10 if setting == "a" else 20})
        record = {"job": job_record(job), "seconds": 60.0, "results": {
            "task": "mqmtar", "lengths": [64, 512], "seed": seed, "runs": [{
                "label": job.label, "exact_match": {"64": em, "512": em / 2},
                "token_accuracy": {"64": 1.0, "512": 0.5}, "train": {"steps": 2}}]}}
        path = tmp_path / f"{job.name}.json"
        write_json(path, record)
        files.append(str(path))
    assert main(["paper-figure", *files, "--out", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    # two settings, one row: seeds 1.0 and 0.5 -> 0.75 ± 0.354; the paper's 1.00 and 0.98 (8x)
    assert "| mosaics/epanechnikov | 0.750 ± 0.354 (2) (1.00) | 0.375 ± 0.177 (2) (0.98) |" in out
    assert "| llama | 0.250 (1.00) | 0.125 (0.09) |" in out
    assert (tmp_path / "t.png").stat().st_size > 0
    merged = tables.extrapolation_rows([json.loads(Path(f).read_text()) for f in files])
    fig_path = plots.plot_against_paper(merged, tmp_path / "u.png")
    assert fig_path.stat().st_size > 0
    regbench = tmp_path / "r.json"
    write_json(regbench, {"job": {"task": "regbench"}, "results": {}})
    with pytest.raises(SystemExit):
        main(["paper-figure", files[0], str(regbench)])
    assert "one extrapolation task" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["paper-figure", str(tmp_path / "t.png.missing")])
    assert "no such file" in capsys.readouterr().err


def test_job_file_takes_command_line_settings_last(tmp_path):
    (tmp_path / "jobs.yaml").write_text(
        "defaults: {task: mqmtar, preset: cpu-recall, overrides: {steps: 6000, batch_size: 64}}\n"
        "grid: {task: sort, model: gaussian}\n"
        "jobs:\n"
        "  - {model: epanechnikov, overrides: {batch_size: 32, alibi: true}}\n"
        "  - {task: regbench, model: gpt2, size: 500, preset: cpu}\n")
    plain = {j.task: j for j in load_job_file(tmp_path / "jobs.yaml")[0]}
    moved = {j.task: j for j in load_job_file(tmp_path / "jobs.yaml",
                                                    {"batch_size": 256})[0]}
    assert plain["mqmtar"].overrides == {"steps": 6000, "batch_size": 32, "alibi": True}
    assert moved["mqmtar"].overrides == {"steps": 6000, "batch_size": 256, "alibi": True}
    assert moved["sort"].overrides["batch_size"] == 256
    assert moved["mqmtar"].name != plain["mqmtar"].name
    assert moved["regbench"].overrides == {"batch_size": 256}


def test_grid_flags_with_a_job_file_are_refused(tmp_path, capsys):
    from mosaics.evaluation.cli import main

    (tmp_path / "jobs.yaml").write_text("jobs: [{task: sort, model: llama}]\n")
    with pytest.raises(SystemExit):
        main(["sweep", "--file", str(tmp_path / "jobs.yaml"), "--seed", "3", "--dry-run",
              "--out", str(tmp_path / "out")])
    assert "--seed choose a grid and do nothing with --file" in capsys.readouterr().err
