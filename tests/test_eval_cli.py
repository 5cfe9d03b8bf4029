"""``mosaics.evaluation.cli.main``: regbench / extrapolation as front ends of the sweep engine
(tiny real runs in the integration tier), perplexity, compare-loss, merging and argument errors."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mosaics.evaluation.cli import COMMANDS, main
from mosaics.evaluation.jobs import Job, job_record, make_job, result_path, write_json

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def regbench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("regbench")
    status = main(["regbench", "--arch", "mosaics", "gpt2", "--kernel", "gaussian",
                   "--sizes", "8", "--preset", "cpu", "--max-steps", "2", "--eval-every", "1",
                   "--n-val", "4", "--n-test", "6", "--pmem-size", "8", "--save-models",
                   "--jobs", "2", "--device", "cpu", "--out", str(out), *TINY])
    assert status == 0
    return out


def _record(out, model):
    return next(json.loads(p.read_text()) for p in sorted((out / "results").glob("*.json"))
                if json.loads(p.read_text())["job"]["model"] == model)


@pytest.mark.integration
def test_regbench_front_end_runs_one_job_per_model_through_the_engine(regbench_run):
    out = regbench_run
    names = sorted(p.stem for p in (out / "results").glob("*.json"))
    assert len(names) == 2 and names[0].startswith("regbench-gpt2-n8-s0-cpu")
    for model in ("gpt2", "mosaics/gaussian"):
        record = _record(out, model)
        assert record["seconds"] > 0 and record["device"] == "cpu"
        (run,) = record["results"]["runs"]
        assert run["label"] == model and run["size"] == 8 and run["train"]["steps"] == 2
        assert 0 <= run["accuracy"] <= 1 and 0 <= run["tvd"] <= 1
        assert record["results"]["baselines"]["oracle"]["accuracy"] == 1.0
    summary = (out / "summary.md").read_text()
    assert "| mosaics/gaussian |" in summary and "| gpt2 |" in summary and "3-gram" in summary
    assert "minutes" in summary
    assert list(out.glob("regbench-cpu-*.png"))


@pytest.mark.integration
def test_regbench_scores_saved_models_like_the_run_that_trained_them(regbench_run, tmp_path):
    out = regbench_run
    trained = _record(out, "mosaics/gaussian")
    model_dir = trained["results"]["runs"][0]["model_dir"]
    assert main(["regbench", "--model", model_dir, "--preset", "cpu", "--n-val", "4",
                 "--n-test", "6", "--device", "cpu", "--out", str(tmp_path)]) == 0
    again = _record(tmp_path, "saved")["results"]["runs"][0]
    assert again["label"] == model_dir and again["size"] is None
    assert again["accuracy"] == pytest.approx(trained["results"]["runs"][0]["accuracy"])
    assert again["tvd"] == pytest.approx(trained["results"]["runs"][0]["tvd"], abs=1e-6)
    assert "saved model accuracy / TVD" in (tmp_path / "summary.md").read_text()


@pytest.mark.integration
def test_extrapolation_front_end_trains_scores_and_rescores(tmp_path, capsys):
    assert main(["extrapolation", "--task", "sort", "--arch", "mosaics", "llama", "--kernel",
                 "gaussian", "--preset", "cpu", "--steps", "2", "--eval-every", "1", "--n-val",
                 "4", "--n-samples", "3", "--multipliers", "1", "2", "--save-models", "--jobs",
                 "2", "--device", "cpu", "--out", str(tmp_path), *TINY]) == 0
    assert "len 128" in capsys.readouterr().out
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "results").glob("*.json"))]
    assert [r["job"]["model"] for r in records] == ["llama", "mosaics/gaussian"]
    for record in records:
        (run,) = record["results"]["runs"]
        assert record["results"]["lengths"] == [64, 128]
        assert set(run["exact_match"]) == {"64", "128"}
        assert all(0 <= v <= 1 for v in run["exact_match"].values())
        assert "val/exact_match" in run["train"]["history"][-1]
    curve = next(tmp_path.glob("jobs/sort-llama-*/runs/sort-llama/metrics.jsonl")).read_text()
    assert "val/exact_match" in curve and "elapsed_s" in curve
    log = next(tmp_path.glob("logs/sort-llama-*.log")).read_text()
    assert "step 1: val loss" in log and "step 1: val exact match" in log
    model_dir = records[1]["results"]["runs"][0]["model_dir"]
    assert main(["extrapolation", "--task", "sort", "--model", model_dir, "--preset", "cpu",
                 "--n-samples", "3", "--multipliers", "1", "2", "--device", "cpu",
                 "--out", str(tmp_path / "again")]) == 0
    again = _record(tmp_path / "again", "saved")["results"]["runs"][0]
    assert again["token_accuracy"] == records[1]["results"]["runs"][0]["token_accuracy"]
    # a Sort model is not an MQMTAR model: the job fails with the reason in its record
    assert main(["extrapolation", "--task", "mqmtar", "--model", model_dir, "--preset", "cpu",
                 "--n-samples", "2", "--multipliers", "1", "--device", "cpu",
                 "--out", str(tmp_path / "bad")]) == 1
    (failure,) = (tmp_path / "bad" / "failed").glob("*.json")
    assert "vocab_size" in json.loads(failure.read_text())["log_tail"]


@pytest.mark.integration
def test_perplexity_on_tokens_and_text(regbench_run, tmp_path):
    model_dir = _record(regbench_run, "mosaics/gaussian")["results"]["runs"][0]["model_dir"]
    np.save(tmp_path / "toks.npy", np.random.default_rng(0).integers(0, 20, size=3000))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "eval/perplexity.py", model_dir, "--data",
                           str(tmp_path / "toks.npy"), "--block-size", "1024", "--out",
                           str(tmp_path / "p"), "--no-progress"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "perplexity" in proc.stdout
    res = json.loads((tmp_path / "p" / "perplexity.json").read_text())
    assert res["windows"] == 2 and len(res["loss_by_position"]) == 1023
    assert (tmp_path / "p" / "loss_by_position.png").is_file()

    from mosaics import MosaicsConfig, MosaicsForCausalLM
    from mosaics.data import train_bpe_tokenizer

    texts = [f"story {i}: the cat sat on mat number {i % 7}." for i in range(60)]
    lm_dir = tmp_path / "lm"
    tok = train_bpe_tokenizer(texts, vocab_size=300, save_dir=lm_dir)
    cfg = MosaicsConfig(vocab_size=len(tok), n_layer=1, n_embd=16, n_head=2, block_size=32)
    MosaicsForCausalLM(cfg).save_pretrained(lm_dir)
    (tmp_path / "val.txt").write_text("\n\n".join(texts))
    assert main(["perplexity", str(lm_dir), "--data", str(tmp_path / "val.txt"), "--split",
                 "train", "--block-size", "16", "--out", str(tmp_path / "t"),
                 "--no-progress"]) == 0
    res = json.loads((tmp_path / "t" / "perplexity.json").read_text())
    assert res["block_size"] == 16 and np.isfinite(res["loss"])


@pytest.mark.integration
def test_perplexity_refuses_windows_longer_than_gpt2_positions(regbench_run, tmp_path,
                                                               capsys):
    gpt2_dir = _record(regbench_run, "gpt2")["results"]["runs"][0]["model_dir"]
    np.save(tmp_path / "t.npy", np.zeros(5000, dtype=np.int64))
    with pytest.raises(SystemExit):
        main(["perplexity", gpt2_dir, "--data", str(tmp_path / "t.npy"), "--block-size",
              "4096", "--no-progress"])
    assert "learned positions" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["perplexity", gpt2_dir, "--data", str(tmp_path / "missing.npy")])
    assert "no such file" in capsys.readouterr().err


@pytest.fixture
def alibi_model_dir(tmp_path):
    """A tiny MQMTAR-sized Memory Mosaics model trained with ALiBi, saved."""
    import torch

    from mosaics import MosaicsConfig, MosaicsForCausalLM

    torch.manual_seed(0)
    model = MosaicsForCausalLM(MosaicsConfig(vocab_size=263, n_layer=1, n_embd=16, n_head=2,
                                             pmem_size=8, block_size=64, kernel="epanechnikov",
                                             alibi=True))
    model.save_pretrained(tmp_path / "alibi")
    return tmp_path / "alibi"


def test_a_saved_model_is_loaded_with_config_changes(alibi_model_dir):
    """--model-set: the same weights in the changed model (here: without the position bias),
    whose logits are those of a model built without it and given the weights."""
    import torch

    from mosaics import MosaicsConfig, MosaicsForCausalLM
    from mosaics.evaluation.models import load_model

    ids = torch.randint(0, 263, (2, 40), generator=torch.Generator().manual_seed(1))
    as_saved = load_model(alibi_model_dir)
    changed = load_model(alibi_model_dir, config_changes={"alibi": False})
    assert as_saved.config.alibi and not changed.config.alibi
    built = MosaicsForCausalLM(MosaicsConfig.from_pretrained(alibi_model_dir, alibi=False))
    built.load_state_dict(as_saved.state_dict())
    with torch.no_grad():
        ref, got = built.eval()(ids).logits, changed(ids).logits
        assert torch.allclose(got, ref, atol=1e-6, rtol=0)
        assert not torch.allclose(as_saved(ids).logits, got, atol=1e-3)
    with pytest.raises(ValueError, match="has no field 'alibj'"):
        load_model(alibi_model_dir, config_changes={"alibj": False})


def test_a_changed_saved_model_is_its_own_job(alibi_model_dir):
    plain = make_job("mqmtar", "saved", model_dir=str(alibi_model_dir), preset="cpu")
    off = make_job("mqmtar", "saved", model_dir=str(alibi_model_dir), preset="cpu",
                   config_changes={"alibi": False})
    assert off.name != plain.name and off.name.startswith(plain.name.split("-s0-")[0])
    assert off.label == f"{plain.label} (alibi=False)"
    record = json.loads(json.dumps(dataclasses.asdict(off)))  # what the job's process gets
    assert Job(**record).name == off.name
    with pytest.raises(ValueError, match="has no field 'nope'"):
        make_job("mqmtar", "saved", model_dir=str(alibi_model_dir),
                 config_changes={"nope": 1})
    with pytest.raises(ValueError, match="saved model directory only"):
        make_job("mqmtar", "mosaics/gaussian", config_changes={"alibi": False})


@pytest.mark.integration
def test_extrapolation_scores_a_saved_model_with_a_config_change(alibi_model_dir, tmp_path):
    args = ["extrapolation", "--task", "mqmtar", "--model", str(alibi_model_dir), "--preset",
            "cpu", "--n-samples", "2", "--multipliers", "1", "--device", "cpu", "--threads",
            "1", "--out", str(tmp_path)]
    assert main([*args, "--model-set", "alibi=false"]) == 0 and main(args) == 0
    runs = {r["results"]["runs"][0]["label"]: r["results"]["runs"][0]
            for r in (json.loads(p.read_text()) for p in (tmp_path / "results").glob("*.json"))}
    assert set(runs) == {str(alibi_model_dir), f"{alibi_model_dir} (alibi=False)"}
    assert runs[f"{alibi_model_dir} (alibi=False)"]["config_changes"] == {"alibi": False}
    assert runs[str(alibi_model_dir)]["config_changes"] == {}
    assert "(alibi=False)" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("argv,message", [
    (["regbench", "--kernel", "no_such_kernel", "--dry-run"], "registered kernels: "),
    (["extrapolation", "--task", "sort", "--kernel", "nope", "--dry-run"],
     "registered kernels: "),
    (["extrapolation", "--task", "copy"], "invalid choice"),
    (["regbench", "--kernel-kwargs", "{not json"], "must be a JSON object"),
    (["regbench", "--sizes", "0"], "positive integer"),
    (["regbench", "--model", "/no/such/dir"], "not a saved model directory"),
    (["extrapolation", "--task", "mqmtar", "--model-set", "alibi=false"], "pass them with --model"),
    (["perplexity", "/no/such/dir", "--data", "x.txt"], "not a saved model directory"),
    (["sweep", "--task", "sort", "--file", "x.yaml"], "give one of"),
    (["sweep", "--task", "sort", "--executor", "pbs"], "invalid choice"),
    (["sweep", "--task", "sort", "--time-min", "0"], "positive integer"),
    (["regbench", "--merge", "/no/such/folder"], "no result files"),
])
def test_bad_arguments_fail_clearly(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as err:
        main([command, "--help"])
    assert err.value.code == 0
    assert "usage: mosaics eval " + command in capsys.readouterr().out


def test_front_ends_map_their_flags_onto_sweep_jobs(tmp_path, capsys):
    assert main(["regbench", "--arch", "mosaics", "gpt2", "--kernel", "gaussian",
                 "epanechnikov", "--sizes", "100", "1000", "--seed", "0", "1", "--preset",
                 "cpu", "--max-steps", "7", "--time-budget-min", "2", "--out", str(tmp_path),
                 "--dry-run"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3 * 2 * 2
    assert all(state == "todo" and name.startswith("regbench-") for state, name in lines)
    expected = make_job("regbench", "mosaics/epanechnikov", 1, 100, "cpu",
                        {"max_steps": 7, "time_budget_s": 120.0})
    assert ["todo", expected.name] in lines
    write_json(result_path(tmp_path, expected), {"done": True})
    main(["regbench", "--arch", "mosaics", "--kernel", "epanechnikov", "--sizes", "100",
          "--seed", "1", "--preset", "cpu", "--max-steps", "7", "--time-budget-min", "2",
          "--out", str(tmp_path), "--dry-run"])
    assert capsys.readouterr().out.split()[:2] == ["done", expected.name]
    main(["extrapolation", "--task", "sort", "mqmtar", "--arch", "mosaics", "llama",
          "--kernel", "biweight", "--multipliers", "1", "4", "--preset", "cpu-learn",
          "--dry-run"])
    names = capsys.readouterr().out.split()[1::2]
    job = make_job("mqmtar", "llama", 0, None, "cpu-learn", {"multipliers": [1, 4]})
    assert len(names) == 4 and job.name in names


def test_merge_copies_result_folders_into_one_table(tmp_path, capsys):
    parts = []
    for i, (model, acc) in enumerate([("gaussian", 0.9), ("gpt2", 0.6)]):
        job = make_job("regbench", model, 0, 1000, "cpu")
        base = {"oracle": {"accuracy": 1.0, "tvd": 0.0}}
        write_json(result_path(tmp_path / f"p{i}", job), {
            "job": job_record(job), "seconds": 120.0, "results": {
                "seed": 0, "baselines": base, "runs": [{
                    "label": job.label, "size": 1000, "accuracy": acc, "tvd": 1 - acc,
                    "train": {"steps": 3}}]}})
        parts.append(str(tmp_path / f"p{i}"))
    assert main(["regbench", "--merge", *parts, "--out", str(tmp_path / "m")]) == 0
    text = (tmp_path / "m" / "summary.md").read_text()
    assert "| mosaics/gaussian | 0.900 / 0.100 (0.939 / 0.341) | 2.0 |" in text
    assert "| gpt2 | 0.600 / 0.400 (0.545 / 0.626) | 2.0 |" in text
    assert "merged 2 result file(s)" in capsys.readouterr().out
    first = next(Path(parts[0]).glob("results/*.json"))
    record = json.loads(first.read_text())
    record["results"]["runs"][0]["accuracy"] = 0.1  # the same job, another result
    write_json(tmp_path / "p2" / "results" / first.name, record)
    with pytest.raises(SystemExit):
        main(["regbench", "--merge", str(tmp_path / "p2"), "--out", str(tmp_path / "m")])
    assert "different results for the same job" in capsys.readouterr().err


def test_compare_loss_table_and_plot(tmp_path, capsys):
    paths = []
    for name, level in [("a", 2.0), ("b", 1.0)]:
        loss = list(level + np.linspace(1.0, 0.0, 40))
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"loss": float(np.mean(loss)), "perplexity": 3.0,
                                    "block_size": 40, "loss_by_position": loss}))
        paths.append(f"{name}={path}")
    assert main(["compare-loss", *paths, "--out", str(tmp_path / "cmp.png")]) == 0
    out = capsys.readouterr().out
    assert "| a | 40 | 2.500 | 3.00 | 2.962 | 2.500 | 2.038 |" in out
    assert "| b | 40 | 1.500 |" in out
    assert (tmp_path / "cmp.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["compare-loss", f"c={tmp_path / 'missing.json'}"])


def test_slurm_executor_off_a_cluster_says_where_to_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("submitit")
    from mosaics.evaluation import cluster

    monkeypatch.setattr(cluster.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as err:
        main(["sweep", "--task", "sort", "--model", "gaussian", "--preset", "cpu",
              "--executor", "slurm", "--out", str(tmp_path)])
    assert err.value.code == 2
    assert "needs SLURM's sbatch and srun on PATH" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()
