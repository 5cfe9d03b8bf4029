"""End-to-end runs of eval/regbench.py, eval/extrapolation.py and eval/perplexity.py (tiny)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--no-progress"]


def _cli(name):
    spec = importlib.util.spec_from_file_location(f"eval_{name}", ROOT / "eval" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def regbench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("regbench")
    stdout = _run("eval/regbench.py", "--arch", "mosaics", "gpt2", "--kernel", "gaussian",
                  "--sizes", "8", "16", "--preset", "cpu", "--max-steps", "2", "--eval-every", "1",
                  "--n-val", "4", "--n-test", "6", "--pmem-size", "8", "--save-models",
                  "--out", out, *TINY)
    return out, stdout


def test_regbench_cli_trains_scores_and_plots(regbench_run):
    out, stdout = regbench_run
    assert "mosaics/gaussian" in stdout and "gpt2" in stdout and "3-gram" in stdout
    res = json.loads((out / "results.json").read_text())
    assert {(r["label"], r["size"]) for r in res["runs"]} == {
        ("mosaics/gaussian", 8), ("mosaics/gaussian", 16), ("gpt2", 8), ("gpt2", 16)}
    assert res["baselines"]["oracle"]["accuracy"] == 1.0
    for r in res["runs"]:
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["tvd"] <= 1 and r["train"]["steps"] == 2
    assert (out / "regbench.png").stat().st_size > 0


def test_regbench_cli_scores_saved_models(regbench_run, tmp_path, capsys):
    out, _ = regbench_run
    model = out / "models" / "mosaics-gaussian-n16"
    _cli("regbench")(["--model", str(model), "--n-test", "6", "--out", str(tmp_path),
                      "--no-progress"])
    saved = json.loads((out / "results.json").read_text())
    again = json.loads((tmp_path / "results.json").read_text())
    before = next(r for r in saved["runs"] if r["label"] == "mosaics/gaussian" and r["size"] == 16)
    assert again["runs"][0]["accuracy"] == pytest.approx(before["accuracy"])
    assert again["runs"][0]["tvd"] == pytest.approx(before["tvd"], abs=1e-6)


def test_extrapolation_cli(tmp_path):
    stdout = _run("eval/extrapolation.py", "--task", "sort", "--arch", "mosaics", "llama",
                  "--kernel", "gaussian", "--preset", "cpu", "--steps", "2", "--eval-every", "1",
                  "--n-val", "4", "--n-samples", "3", "--multipliers", "1", "2", "--save-models",
                  "--out", tmp_path, *TINY)
    assert "len 128" in stdout
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["lengths"] == [64, 128]
    assert [r["label"] for r in res["runs"]] == ["mosaics/gaussian", "llama"]
    for run in res["runs"]:
        em = run["exact_match"]
        assert set(em) == {"64", "128"} and all(0 <= v <= 1 for v in em.values())
        assert "val/exact_match" in run["train"]["history"][-1]
    curve = (tmp_path / "runs" / "sort-llama" / "metrics.jsonl").read_text()
    assert "val/exact_match" in curve and "elapsed_s" in curve
    assert (tmp_path / "extrapolation.png").is_file()
    main = _cli("extrapolation")
    main(["--task", "sort", "--model", str(tmp_path / "models" / "sort-gaussian"),
          "--n-samples", "3", "--multipliers", "1", "2", "--out", str(tmp_path / "again"),
          "--no-progress"])
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert again["runs"][0]["token_accuracy"] == res["runs"][0]["token_accuracy"]
    with pytest.raises(SystemExit):  # a sort model is not an MQMTAR model
        main(["--task", "mqmtar", "--model", str(tmp_path / "models" / "sort-gaussian"),
              "--n-samples", "2", "--multipliers", "1", "--out", str(tmp_path / "bad"),
              "--no-progress"])


def test_perplexity_cli_on_tokens_and_text(regbench_run, tmp_path):
    out, _ = regbench_run
    tokens = np.random.default_rng(0).integers(0, 20, size=3000)
    np.save(tmp_path / "toks.npy", tokens)
    stdout = _run("eval/perplexity.py", out / "models" / "mosaics-gaussian-n16", "--data",
                  tmp_path / "toks.npy", "--block-size", "1024", "--out", tmp_path / "p",
                  "--no-progress")
    assert "perplexity" in stdout
    res = json.loads((tmp_path / "p" / "perplexity.json").read_text())
    assert res["windows"] == 2 and len(res["loss_by_position"]) == 1023
    assert (tmp_path / "p" / "loss_by_position.png").is_file()

    from mosaics import MosaicsConfig, MosaicsForCausalLM
    from mosaics.data import train_bpe_tokenizer

    texts = [f"story {i}: the cat sat on mat number {i % 7}." for i in range(60)]
    model_dir = tmp_path / "lm"
    tok = train_bpe_tokenizer(texts, vocab_size=300, save_dir=model_dir)
    cfg = MosaicsConfig(vocab_size=len(tok), n_layer=1, n_embd=16, n_head=2, block_size=32)
    MosaicsForCausalLM(cfg).save_pretrained(model_dir)
    (tmp_path / "val.txt").write_text("\n\n".join(texts))
    _cli("perplexity")([str(model_dir), "--data", str(tmp_path / "val.txt"), "--split", "train",
                        "--block-size", "16", "--out", str(tmp_path / "t"), "--no-progress"])
    res = json.loads((tmp_path / "t" / "perplexity.json").read_text())
    assert res["block_size"] == 16 and np.isfinite(res["loss"])


@pytest.mark.parametrize("name,argv,message", [
    ("regbench", ["--kernel", "no_such_kernel"], "registered kernels: "),
    ("extrapolation", ["--task", "sort", "--kernel", "nope"], "registered kernels: "),
    ("extrapolation", ["--task", "copy"], "invalid choice"),
    ("regbench", ["--kernel-kwargs", "{not json"], "must be a JSON object"),
    ("regbench", ["--sizes", "0"], "positive integer"),
    ("regbench", ["--model", "/no/such/dir"], "not a saved model directory"),
    ("perplexity", ["/no/such/dir", "--data", "x.txt"], "not a saved model directory"),
])
def test_bad_arguments_fail_clearly(name, argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        _cli(name)(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_perplexity_rejects_windows_longer_than_gpt2_positions(regbench_run, tmp_path, capsys):
    out, _ = regbench_run
    np.save(tmp_path / "t.npy", np.zeros(5000, dtype=np.int64))
    with pytest.raises(SystemExit):
        _cli("perplexity")([str(out / "models" / "gpt2-n16"), "--data", str(tmp_path / "t.npy"),
                            "--block-size", "4096", "--no-progress"])
    assert "learned positions" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli("perplexity")([str(out / "models" / "gpt2-n16"), "--data",
                            str(tmp_path / "missing.npy"), "--no-progress"])
    assert "no such file" in capsys.readouterr().err


def test_regbench_merge(regbench_run, tmp_path, capsys):
    out, _ = regbench_run
    main = _cli("regbench")
    main(["--merge", str(out / "results.json"), str(out / "results.json"),
          "--out", str(tmp_path / "m")])
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert len(merged["runs"]) == 8 and (tmp_path / "m" / "regbench.png").is_file()
    other = json.loads((out / "results.json").read_text())
    other["baselines"]["oracle"]["positions"] += 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit):
        main(["--merge", str(out / "results.json"), str(tmp_path / "other.json"),
              "--out", str(tmp_path / "bad")])
    assert "different test sets" in capsys.readouterr().err


def test_compare_loss_table_and_plot(tmp_path, capsys):
    paths = []
    for name, level in [("a", 2.0), ("b", 1.0)]:
        loss = list(level + np.linspace(1.0, 0.0, 40))
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"loss": float(np.mean(loss)), "perplexity": 3.0,
                                    "block_size": 40, "loss_by_position": loss}))
        paths.append(f"{name}={path}")
    _cli("compare_loss")([*paths, "--out", str(tmp_path / "cmp.png")])
    out = capsys.readouterr().out
    assert "| a | 40 | 2.500 | 3.00 | 2.962 | 2.500 | 2.038 |" in out
    assert "| b | 40 | 1.500 |" in out
    assert (tmp_path / "cmp.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        _cli("compare_loss")([f"c={tmp_path / 'missing.json'}"])
