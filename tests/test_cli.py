"""The ``mosaics`` command, shipped recipes and the packaging metadata behind them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from setuptools import find_packages
from transformers import AutoModelForCausalLM

import mosaics
from mosaics import cli
from mosaics.shipped_configs import list_recipes, recipe_path, resolve_config
from mosaics.training import load_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for command in ("train", "eval", "convert-reference", "configs", "bench"):
        assert command in out


def test_version_is_defined_once():
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    assert "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "mosaics.__version__"}
    assert mosaics.__version__ in (ROOT / "CHANGELOG.md").read_text()


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"mosaics {mosaics.__version__}"


def test_recipes_package_is_the_configs_folder():
    """The wheel's mosaics.recipes comes from configs/ through the link mosaics/recipes."""
    link = ROOT / "mosaics" / "recipes"
    assert link.is_symlink() and link.resolve() == (ROOT / "configs").resolve()
    assert "mosaics.recipes" in find_packages(where=str(ROOT), include=["mosaics*"])
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["mosaics*"]
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["mosaics.recipes"]
    assert {"*.yaml", "**/*.yaml", "**/*.json"} <= set(patterns)
    assert PYPROJECT["project"]["scripts"] == {"mosaics": "mosaics.cli:main"}


def test_every_config_file_is_a_shipped_recipe():
    on_disk = sorted(p.relative_to(ROOT / "configs").with_suffix("").as_posix()
                     for p in (ROOT / "configs").rglob("*") if p.suffix in (".yaml", ".json"))
    assert list_recipes() == on_disk
    assert "babistories_124m" in on_disk and "accelerate/gpu_ddp" in on_disk
    assert recipe_path("deepspeed/zero2") == ROOT / "configs/deepspeed/zero2.json"
    assert recipe_path("configs/default.yaml") == ROOT / "configs/default.yaml"


def test_recipe_names_do_not_escape_the_folder():
    with pytest.raises(mosaics.errors.InputError, match="No config file or shipped recipe"):
        recipe_path("../pyproject")


def test_print_config_resolves_a_recipe_name(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout: the name must resolve by itself
    rc, out, _ = run(capsys, "train", "--config", "babistories_124m", "--print-config",
                     "max_steps=3", "--lr", "1e-3")
    assert rc == 0
    printed = yaml.safe_load(out)
    expected = load_config(ROOT / "configs/babistories_124m.yaml",
                           {"max_steps": "3", "lr": "1e-3"}).to_dict()
    assert printed == expected
    assert printed["n_embd"] == 768 and printed["max_steps"] == 3
    assert not (tmp_path / "runs").exists()  # printing does not start a run


def test_config_path_still_works(capsys, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: " + str(ROOT / "configs/default.yaml") + "\nn_layer: 3\n")
    rc, out, _ = run(capsys, "train", f"--config={path}", "--print-config")
    assert rc == 0 and yaml.safe_load(out)["n_layer"] == 3


def test_unknown_recipe_is_a_clear_error(capsys):
    rc, _, err = run(capsys, "train", "--config", "babistories_125m", "--print-config")
    assert rc == 2
    assert "No config file or shipped recipe named 'babistories_125m'" in err
    assert "babistories_124m" in err


def test_train_help_names_recipes_and_fields(capsys):
    rc, out, _ = run(capsys, "train", "--help")
    assert rc == 0
    assert "usage: mosaics train" in out and "babistories_124m" in out
    assert "fields:" in out and "max_steps" in out


def test_train_py_is_the_same_entry_point(capsys):
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: train.py" in out and "fields:" in out
    assert script.main(["--config", "nope.yaml"]) == 2
    assert "train.py: error:" in capsys.readouterr().err


def test_configs_subcommands(capsys, tmp_path):
    rc, out, _ = run(capsys, "configs", "list")
    assert rc == 0 and "accelerate/deepspeed_zero2" in out.splitlines()
    rc, out, _ = run(capsys, "configs", "path", "default")
    assert Path(out.strip()) == resolve_config("default")
    rc, out, _ = run(capsys, "configs", "show", "deepspeed/zero2")
    assert out == (ROOT / "configs/deepspeed/zero2.json").read_text()
    rc, out, _ = run(capsys, "configs", "copy", str(tmp_path))
    assert (tmp_path / "configs/deepspeed/zero2.json").is_file()
    assert not (tmp_path / "configs/__init__.py").exists()
    rc, _, err = run(capsys, "configs", "copy", str(tmp_path))
    assert rc == 2 and "already exists" in err
    rc, _, err = run(capsys, "configs", "show")
    assert rc == 2 and "needs a recipe name" in err


def test_eval_delegates_or_says_what_is_missing(capsys):
    from mosaics.evaluation import cli as evaluation_cli

    if hasattr(evaluation_cli, "main"):
        try:
            rc = cli.main(["eval", "--help"])
        except SystemExit as stop:  # argparse's --help exits
            rc = stop.code
        assert rc == 0
        out = capsys.readouterr().out
        for sub in ("regbench", "extrapolation", "perplexity", "sweep"):
            assert sub in out
    else:
        rc, _, err = run(capsys, "eval", "perplexity", "--help")
        assert rc == 2 and "mosaics.evaluation.cli.main is missing" in err


def test_eval_forwards_every_argument(monkeypatch):
    from mosaics.evaluation import cli as evaluation_cli

    seen = []
    monkeypatch.setattr(evaluation_cli, "main", lambda argv: seen.append(argv) or 3,
                        raising=False)
    assert cli.main(["eval", "perplexity", "runs/x/final", "--data", "v.txt"]) == 3
    assert seen == [["perplexity", "runs/x/final", "--data", "v.txt"]]


def test_bench_outside_a_checkout_says_so(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_checkout_bench", lambda: None)
    rc, _, err = run(capsys, "bench", "throughput")
    assert rc == 2 and "only in a git checkout" in err


def test_bench_lists_and_checks_scripts(capsys):
    rc, out, _ = run(capsys, "bench")
    assert rc == 0 and "throughput" in out
    rc, _, err = run(capsys, "bench", "no_such_bench")
    assert rc == 2 and "no script 'no_such_bench'" in err


def test_convert_reference_command(capsys, tmp_path):
    from test_convert_reference import (
        IDS,
        library_args,
        library_forward,
        library_state_dict,
        save_checkpoint,
    )

    sd = library_state_dict(eft=True)
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", sd, library_args(), compiled=True)
    rc, out, _ = run(capsys, "convert-reference", str(ckpt), str(tmp_path / "hf"))
    assert rc == 0 and "wrote" in out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").double().eval()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, library_forward(sd, IDS, True),
                                   rtol=1e-7, atol=1e-7)
    card = (tmp_path / "hf/README.md").read_text()
    assert "memory_mosaics_eft.py" in card and "optimizer steps: 1,200" in card
    assert "\nlicense: apache-2.0\n" in card and "\n- BabiStories\n" in card
    rc, _, err = run(capsys, "convert-reference", str(tmp_path / "missing.pt"),
                     str(tmp_path / "hf2"))
    assert rc == 2 and "Checkpoint not found" in err


def test_convert_reference_help(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["convert-reference", "--help"])
    assert stop.value.code == 0
    assert "--tokenizer" in capsys.readouterr().out


@pytest.mark.integration
def test_python_dash_m_mosaics(tmp_path):
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "mosaics", "configs", "path", "v2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == ROOT / "configs/v2.yaml"


def test_bad_files_end_in_one_line_not_a_traceback(capsys, tmp_path):
    """Files that are not what a command expects: one line on stderr, status 2."""
    import json

    from mosaics import MosaicsConfig

    text, junk = tmp_path / "notes.pt", tmp_path / "junk.pt"
    text.write_text("hello\n")
    junk.write_bytes(b"\x80" + bytes(range(256)) * 3)  # a pickle's first byte, then garbage
    for path in (text, junk):
        rc, _, err = run(capsys, "convert-reference", str(path), str(tmp_path / "out"))
        assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert "is not a PyTorch checkpoint" in err or "Cannot read" in err, err

    good = tmp_path / "good"
    AutoModelForCausalLM.from_config(MosaicsConfig(vocab_size=32, n_layer=1, n_embd=8, n_head=2,
                                                   block_size=8)).save_pretrained(good)
    weights = (good / "model.safetensors").read_bytes()
    cases = {"truncated": "cannot load the weights",
             "no_weights": "holds a config but no weights",
             "other_model": "is not the config of a model",
             "other_shape": "cannot load the weights"}
    for name in cases:
        folder = tmp_path / name
        folder.mkdir()
        config = json.loads((good / "config.json").read_text())
        config.pop("auto_map", None)
        if name == "other_model":
            config["model_type"] = "no-such-model"
        if name == "other_shape":
            config["n_embd"] = 16
        (folder / "config.json").write_text(json.dumps(config))
        if name != "no_weights":
            (folder / "model.safetensors").write_bytes(
                weights[: len(weights) // 2] if name == "truncated" else weights)
    data = tmp_path / "text.txt"
    data.write_text("Once upon a time there was a cat.\n" * 20)
    for name, message in cases.items():
        rc, _, err = run(capsys, "eval", "perplexity", str(tmp_path / name), "--data", str(data))
        last = err.strip().splitlines()[-1]
        assert rc == 2 and message in last and "Traceback" not in err, (name, err[-2000:])


def test_nproc_and_deepspeed_mistakes_are_one_line(capsys, tmp_path, monkeypatch):
    for argv, message in ((["--nproc", "0"], "--nproc must be a positive whole number"),
                          (["--deepspeed", str(tmp_path / "no.json"), "--nproc", "2"],
                           "no such file"),
                          (["--deepspeed", str(ROOT / "configs/deepspeed/zero2.json")],
                           "--deepspeed goes with --nproc N")):
        rc, _, err = run(capsys, "train", *argv)
        assert rc == 2 and message in err and err.count("\n") == 1, err
    monkeypatch.setenv("WORLD_SIZE", "2")  # already started by a launcher
    rc, _, err = run(capsys, "train", "--nproc", "2")
    assert rc == 2 and "drop it when a launcher" in err
