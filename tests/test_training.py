"""Pretraining pipeline: config parsing, optimizer groups and schedule, atomic checkpoints,
and end-to-end runs of train.py (kill -9 and resume, HF export, remote-code loading)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.errors import ConfigError
from mosaics.training import checkpoint as ckpt
from mosaics.training.config import (
    TrainConfig,
    config_from_argv,
    field_names,
    load_config,
    parse_overrides,
)
from mosaics.training.optim import build_scheduler, cosine_with_warmup, param_groups

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, batch_size=4, max_steps=24,
            warmup_steps=4, num_train_stories=200, vocab_size=300, eval_interval=8,
            eval_windows=8, eval_batch_size=8, log_interval=1, checkpoint_interval=6,
            keep_checkpoints=5, dropout=0.1, progress_bar=False, sample_tokens=0)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _args(settings: dict) -> list[str]:
    return [f"{k}={v}" for k, v in settings.items()]


def _metrics(run_dir: Path) -> dict[tuple[int, str], float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], k): v for r in rows for k, v in r.items() if k != "step"}


# --- config -----------------------------------------------------------------------------------

def test_override_forms_and_types(tmp_path: Path) -> None:
    path, over = parse_overrides(["lr=1e-3", "--max-steps", "7", "--n_embd=64", "--resume",
                                  "--config", "x.yaml", "kernel_kwargs={k: 3}", "pmem_size=null"])
    assert path == "x.yaml"
    cfg = load_config(None, over)
    assert cfg.lr == 1e-3 and isinstance(cfg.lr, float)
    assert cfg.max_steps == 7 and cfg.n_embd == 64 and cfg.resume is True
    assert cfg.kernel_kwargs == {"k": 3} and cfg.pmem_size is None
    assert config_from_argv(["--resume", "false"]).resume is False


def test_yaml_base_and_override_precedence(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("lr: 5e-3\nmax_steps: 10\nn_layer: 3\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nmax_steps: 20\n")
    cfg = config_from_argv(["--config", str(tmp_path / "b.yaml"), "n_layer=5"])
    assert (cfg.lr, cfg.max_steps, cfg.n_layer) == (5e-3, 20, 5)


def test_unknown_and_bad_fields_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Unknown config field 'n_layers'.*'n_layer'") as err:
        config_from_argv(["n_layers=3"])
    assert all(name in str(err.value) for name in field_names())
    (tmp_path / "c.yaml").write_text("learning_rate: 1.0\n")
    with pytest.raises(ValueError, match="learning_rate.*Valid fields"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ValueError, match="'max_steps' expects int"):
        config_from_argv(["max_steps=ten"])
    with pytest.raises(ValueError, match="model_type"):
        config_from_argv(["model_type=lstm"])
    with pytest.raises(ValueError, match="global_batch_size=10 is not a multiple"):
        load_config(None, {"global_batch_size": 10, "batch_size": 4}).accumulation_steps(1)
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_shipped_configs_load_and_default_matches_dataclass() -> None:
    assert load_config(ROOT / "configs/default.yaml") == TrainConfig()
    big = load_config(ROOT / "configs/babistories_124m.yaml")
    assert (big.n_layer, big.n_embd, big.n_head, big.block_size) == (12, 768, 12, 512)
    assert big.accumulation_steps(8) * big.batch_size * 8 == 512
    base = load_config(ROOT / "configs/gpt2_baseline.yaml")
    assert base.model_type == "gpt2"
    assert {k: v for k, v in base.to_dict().items() if k not in ("model_type", "run_dir")} == \
        {k: v for k, v in TrainConfig().to_dict().items() if k not in ("model_type", "run_dir")}


# --- optimizer ----------------------------------------------------------------------------------

def test_weight_decay_only_on_matrices() -> None:
    model = MosaicsForCausalLM(MosaicsConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=8))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = {id(p) for p in model.parameters()}
    got_decay = {id(p) for p in decay["params"]}
    got_none = {id(p) for p in no_decay["params"]}
    assert got_decay | got_none == ids and not got_decay & got_none
    for name, p in model.named_parameters():
        assert (id(p) in got_decay) == (p.dim() >= 2), name
    assert any(p.dim() == 1 and "cmem" in n for n, p in model.named_parameters())  # scalars


def test_cosine_schedule_against_formula() -> None:
    lr, min_lr, warm, total = 1.0, 0.1, 5, 25
    values = [cosine_with_warmup(s, lr, min_lr, warm, total) for s in range(total + 3)]
    assert values[:warm] == pytest.approx([(s + 1) / warm for s in range(warm)])
    mid = warm + (total - warm) // 2
    assert values[mid] == pytest.approx(min_lr + (lr - min_lr) * 0.5 *
                                        (1 + math.cos(math.pi * (mid - warm) / (total - warm))))
    assert values[total] == pytest.approx(min_lr) and values[-1] == pytest.approx(min_lr)
    assert all(a >= b for a, b in zip(values[warm:], values[warm + 1:]))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_scheduler(opt, lr, min_lr, warm, total)
    seen = []
    for _ in range(total):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx(values[:total])


# --- checkpoints --------------------------------------------------------------------------------

def _write_checkpoint(run_dir: Path, step: int, model, opt, sched) -> None:
    tmp = ckpt.prepare_save(run_dir, step)
    ckpt.save_rank_state(tmp, 0, {"step": step})
    ckpt.save_main_state(tmp, model, opt, sched, {"step": step, "world_size": 1})
    ckpt.finalize_save(run_dir, step)


def test_incomplete_checkpoints_are_skipped(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = build_scheduler(opt, 1e-3, 0.0, 1, 10)
    _write_checkpoint(tmp_path, 10, model, opt, sched)
    _write_checkpoint(tmp_path, 20, model, opt, sched)
    (tmp_path / "checkpoints/step_0000020/manifest.json").unlink()  # e.g. a copy cut short
    ckpt.prepare_save(tmp_path, 30)  # an interrupted save: only a temporary folder
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [10]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_0000010"
    with pytest.raises(ValueError, match="incomplete"):
        ckpt.load_checkpoint(tmp_path / "checkpoints/step_0000020", model, opt, sched, 0)
    assert ckpt.latest_checkpoint(tmp_path / "nothing") is None


def test_checkpoint_roundtrip_restores_weights_optimizer_and_rng(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = build_scheduler(opt, 1e-2, 1e-3, 2, 10)
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    _write_checkpoint(tmp_path, 3, model, opt, sched)
    expected_draw = torch.rand(4)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    other = torch.nn.Linear(4, 3)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other_sched = build_scheduler(other_opt, 1e-2, 1e-3, 2, 10)
    state, data = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), other, other_opt,
                                       other_sched, 0)
    assert state["step"] == 3 and data == {"step": 3}
    assert torch.equal(torch.rand(4), expected_draw)
    for k, v in other.state_dict().items():
        assert torch.equal(v, weights[k])
    assert other_sched.get_last_lr() == sched.get_last_lr()
    a, b = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert all(torch.equal(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"]) for i in a)
    path = ckpt.latest_checkpoint(tmp_path)
    # another process count: weights and optimizer load, the per-process RNG does not
    torch.manual_seed(123)
    after = torch.rand(4)
    torch.manual_seed(123)
    ckpt.load_checkpoint(path, other, other_opt, other_sched, 1, world_size=2)
    assert torch.equal(torch.rand(4), after)
    with pytest.raises(ValueError, match="written by a DDP or one process run"):
        ckpt.load_deepspeed_checkpoint(path, None, other_sched, 0, world_size=1)
    state = json.loads((path / "trainer_state.json").read_text())
    (path / "trainer_state.json").write_text(json.dumps(dict(state, deepspeed=True)))
    with pytest.raises(ValueError, match="partitioned over 1 processes and this run has 2"):
        ckpt.load_deepspeed_checkpoint(path, None, other_sched, 0, world_size=2)


# --- end to end ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted tiny run, in this process (it also warms the data cache)."""
    from mosaics.training import train

    base = tmp_path_factory.mktemp("train")
    settings = dict(TINY, data_cache_dir=str(base / "cache"), save_final=False)
    cfg = load_config(None, dict(settings, run_dir=str(base / "reference")))
    train(cfg)
    return base, settings


@pytest.mark.slow
@pytest.mark.integration
def test_kill_and_resume_matches_uninterrupted_run(reference_run) -> None:
    base, settings = reference_run
    run_dir = base / "killed"
    cmd = [sys.executable, str(ROOT / "train.py"), *_args(settings), f"run_dir={run_dir}",
           "save_final=true", "sample_tokens=8"]
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while ckpt.latest_checkpoint(run_dir) is None:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "final").exists()  # killed mid-training
    killed_at = int(ckpt.latest_checkpoint(run_dir).name.split("_")[1])
    assert killed_at < settings["max_steps"]

    out = subprocess.run([*cmd, "--resume"], env=_env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"at step {killed_at}" in out.stderr

    reference, resumed = _metrics(base / "reference"), _metrics(run_dir)
    assert set(reference) == set(resumed)
    for key, value in reference.items():
        if key[1] in ("train/loss", "val/loss", "grad_norm", "lr"):
            assert resumed[key] == pytest.approx(value, abs=1e-5, rel=0), key

    final = run_dir / "final"
    names = {p.name for p in final.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "modeling_mosaics.py"} <= names

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=6, do_sample=False,
                               pad_token_id=tok.pad_token_id)
    assert generated.shape == (1, ids.shape[1] + 6)
    with torch.no_grad():
        logits = model(ids).logits[0, -1]

    # the exported directory loads with trust_remote_code where the package is not importable
    script = (
        "import sys, json; sys.modules['mosaics'] = None\n"
        "import torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"d = {str(final)!r}\n"
        "tok = AutoTokenizer.from_pretrained(d)\n"
        "m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()\n"
        "assert not type(m).__module__.startswith('mosaics'), type(m).__module__\n"
        "ids = tok('Once upon a time', return_tensors='pt').input_ids\n"
        "g = m.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)\n"
        "with torch.no_grad():\n"
        "    print(json.dumps({'gen': g[0].tolist(), 'logits': m(ids).logits[0, -1].tolist()}))\n"
    )
    env = dict(_env(), HF_MODULES_CACHE=str(base / "hf_modules"))
    env["PYTHONPATH"] = ""
    remote = subprocess.run([sys.executable, "-c", script], env=env, cwd=base,
                            capture_output=True, text=True, timeout=300)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert '{"gen"' in remote.stdout, remote.stdout[-3000:]
    result = json.loads(remote.stdout[remote.stdout.rindex('{"gen"'):].splitlines()[0])
    assert result["gen"] == generated[0].tolist()
    assert torch.allclose(torch.tensor(result["logits"]), logits, atol=1e-5)


def test_gpt2_baseline_trains_resumes_and_exports(reference_run) -> None:
    from transformers import AutoModelForCausalLM

    from mosaics.training import train

    base, settings = reference_run
    run_dir = base / "gpt2"
    settings = dict(settings, model_type="gpt2", max_steps=6, checkpoint_interval=3,
                    eval_interval=3, run_dir=str(run_dir), save_final=True, sample_tokens=4)
    result = train(load_config(None, settings))
    assert result.sample is not None and result.sample.startswith("Once upon a time")
    first = _metrics(run_dir)
    import shutil

    shutil.rmtree(run_dir / "checkpoints" / "step_0000006")  # as if it stopped after step 3
    train(load_config(None, dict(settings, resume=True)))
    again = _metrics(run_dir)
    assert set(first) == set(again)
    for key, value in first.items():
        if key[1] in ("train/loss", "val/loss"):
            assert again[key] == pytest.approx(value, abs=1e-5, rel=0), key
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.config.n_embd == settings["n_embd"]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_builds_its_model_config(path):
    from mosaics.training.build import mosaics_config

    cfg = config_from_argv(["--config", str(path)])
    model_cfg = mosaics_config(cfg, 512, eos_token_id=0)
    if path.name == "v2.yaml":  # the preset of MosaicsConfig.v2, at the default size
        preset = MosaicsConfig.v2(vocab_size=512, eos_token_id=0)
        for field in ("gated_keys", "adaptive_bandwidth", "three_level_memory",
                      "short_term_window", "long_term_gap", "long_term_gap_range",
                      "persistent_memory", "document_masking"):
            assert getattr(model_cfg, field) == getattr(preset, field), field
        assert model_cfg.separator_id == 0


def test_denormals_flushed_inside_the_block_only():
    from mosaics.training.trainer import denormals_flushed

    tiny = torch.tensor([1e-39])  # subnormal in fp32
    assert (tiny * 2).item() > 0
    with denormals_flushed(True) as on:
        if not on:
            pytest.skip("this CPU cannot flush subnormals")
        assert (tiny * 2).item() == 0.0
    assert (tiny * 2).item() > 0
    with denormals_flushed(False) as on:
        assert not on and (tiny * 2).item() > 0
    torch.set_flush_denormal(True)  # set before (as flush_denormals_early): kept after
    try:
        with denormals_flushed(True):
            pass
        assert (tiny * 2).item() == 0.0
    finally:
        torch.set_flush_denormal(False)
