"""Damaged checkpoints and bad input: resume falls back to the newest intact checkpoint, and
every data or config mistake reaches the user as one line naming the file and the fix."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mosaics.errors import CheckpointError
from mosaics.training import checkpoint as ckpt
from mosaics.training import load_config, train

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2, max_steps=8,
            warmup_steps=2, num_train_stories=120, vocab_size=280, eval_interval=4,
            eval_windows=4, eval_batch_size=4, log_interval=1, checkpoint_interval=3,
            keep_checkpoints=5, progress_bar=False, sample_tokens=0, save_final=False,
            tensorboard=False)


def _main():
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _losses(run_dir: Path) -> dict[tuple[int, str], float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], k): v for r in rows for k, v in r.items()
            if k in ("train/loss", "val/loss", "lr")}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A tiny run with checkpoints at steps 3 and 6, and 8 (the last step)."""
    base = tmp_path_factory.mktemp("robust")
    settings = dict(TINY, data_cache_dir=str(base / "cache"))
    train(load_config(None, dict(settings, run_dir=str(base / "full"))))
    assert [s for s, _ in ckpt.list_checkpoints(base / "full")] == [3, 6, 8]
    return base, settings


def _damaged_copy(finished_run, name: str, damage) -> tuple[Path, dict]:  # noqa: ANN001
    base, settings = finished_run
    run_dir = base / name
    shutil.copytree(base / "full", run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_0000008")  # as if it stopped after step 6
    damage(run_dir / "checkpoints" / "step_0000006")
    return run_dir, settings


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_bytes(folder: Path) -> None:
    path = folder / "optimizer.pt"
    data = bytearray(path.read_bytes())
    for i in range(100, 164):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _remove_rank_state(folder: Path) -> None:
    (folder / "rank_0.pt").unlink()


def _remove_manifest(folder: Path) -> None:
    (folder / "manifest.json").unlink()


@pytest.mark.parametrize(("damage", "bad_file"), [
    (_truncate, "model.safetensors has"),
    (_flip_bytes, "optimizer.pt does not match its checksum"),
    (_remove_rank_state, "rank_0.pt is missing"),
    (_remove_manifest, "manifest.json is missing"),
])
def test_resume_falls_back_to_the_newest_intact_checkpoint(finished_run, capsys, damage,
                                                            bad_file) -> None:
    run_dir, settings = _damaged_copy(finished_run, damage.__name__, damage)
    assert ckpt.verify(run_dir / "checkpoints" / "step_0000003") is None
    capsys.readouterr()
    train(load_config(None, dict(settings, run_dir=str(run_dir), resume=True)))
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "step_0000006" in warnings[0] and bad_file in warnings[0]
    assert "at step 3" in err
    reference = _losses(finished_run[0] / "full")
    resumed = _losses(run_dir)
    assert set(resumed) == set(reference)
    for key, value in reference.items():
        assert resumed[key] == pytest.approx(value, abs=1e-6, rel=0), key


def test_every_checkpoint_damaged_starts_fresh(finished_run, capsys) -> None:
    run_dir, settings = _damaged_copy(finished_run, "all_bad", _truncate)
    _truncate(run_dir / "checkpoints" / "step_0000003")
    capsys.readouterr()
    train(load_config(None, dict(settings, run_dir=str(run_dir), resume=True, max_steps=2,
                                 checkpoint_interval=0)))
    err = capsys.readouterr().err
    assert err.count("warning:") == 2 and "starting fresh" in err


def test_checkpoint_of_another_model_is_refused(finished_run, capsys) -> None:
    base, settings = finished_run
    run_dir = base / "other_model"
    shutil.copytree(base / "full", run_dir)
    args = [f"{k}={v}" for k, v in settings.items()]
    with pytest.raises(CheckpointError, match=r"different model \(.*n_embd: 16 in the "
                                              r"checkpoint, 32 now"):
        train(load_config(None, dict(settings, run_dir=str(run_dir), resume=True, n_embd=32)))
    capsys.readouterr()
    code = _main()([*args, f"run_dir={run_dir}", "resume=true", "kernel=epanechnikov"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "kernel: 'gaussian' in the checkpoint, 'epanechnikov' now" in err[0]


# --- bad input: one line, the file and the fix, exit code 2 --------------------------------

def _fails_with(capsys, args: list[str], *needles: str) -> str:  # noqa: ANN001
    capsys.readouterr()
    code = _main()(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    # progress bars of the data preparation may come first; the error is one line, the last
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert errors == [err.splitlines()[-1]] and "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], err
    return errors[0]


def _run_args(tmp_path: Path, **extra: object) -> list[str]:
    settings = dict(TINY, data_cache_dir=str(tmp_path / "cache"), run_dir=str(tmp_path / "run"),
                    **extra)
    return [f"{k}={v}" for k, v in settings.items()]


def test_empty_data_file(tmp_path, capsys) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    _fails_with(capsys, _run_args(tmp_path, data_source=empty), str(empty), "no documents")


def test_binary_data_file(tmp_path, capsys) -> None:
    blob = tmp_path / "random.jsonl"
    blob.write_bytes(bytes(range(256)) * 64)
    _fails_with(capsys, _run_args(tmp_path, data_source=blob), f"{blob}:1", "not UTF-8 text")


def test_json_lines_without_the_text_field(tmp_path, capsys) -> None:
    data = tmp_path / "stories.jsonl"
    data.write_text('{"text": "one"}\n{"body": "two"}\n')
    _fails_with(capsys, _run_args(tmp_path, data_source=data), f"{data}:2", "'text'",
                "text_column")


def test_dataset_without_the_column(tmp_path, capsys) -> None:
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": ["a b c", "d e f"]}).save_to_disk(str(folder))
    _fails_with(capsys, _run_args(tmp_path, data_source=folder), str(folder),
                "no column 'text'", "text_column")


def test_yaml_syntax_error(tmp_path, capsys) -> None:
    config = tmp_path / "broken.yaml"
    config.write_text("lr: 1e-3\nmax_steps: [10\nn_layer: 2\n")
    _fails_with(capsys, ["--config", str(config)], str(config), "not valid YAML")


def test_tokenizer_folder_without_its_files(tmp_path, capsys) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "notes.txt").write_text("nothing here")
    _fails_with(capsys, _run_args(tmp_path, tokenizer=folder), str(folder),
                "no tokenizer files")


@pytest.mark.integration
def test_missing_data_source_from_the_command_line(tmp_path) -> None:
    """The real entry point: a separate process, one line on stderr, exit code 2."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    missing = tmp_path / "nowhere.txt"
    out = subprocess.run([sys.executable, str(ROOT / "train.py"),
                          *_run_args(tmp_path, data_source=missing)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if "train.py: error:" in line]
    assert len(lines) == 1 and str(missing) in lines[0] and "Traceback" not in out.stderr
