"""Sort and MQMTAR layouts, target masks, exact-match scoring; the training driver's schedule."""

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from mosaics.evaluation import tasks


@pytest.mark.parametrize("length", [32, 47, 64, 512])
def test_sort_layout(length):
    s = tasks.sort_sample(np.random.default_rng(length), length)
    t = s.tokens
    assert len(t) == 2 * length + 3
    assert t[0] == 32 and t[length + 1] == 33 and t[-1] == 34
    src, trg = t[1: length + 1], t[length + 2: -1]
    assert src.max() < 32 and src.min() >= 0
    assert trg.tolist() == sorted(src.tolist())
    assert s.target_mask.tolist() == [False] * (length + 2) + [True] * (length + 1)
    assert s.score_mask.tolist() == [False] * (length + 2) + [True] * length + [False]


@pytest.mark.parametrize("length", [32, 50, 64, 256])
def test_mqmtar_layout(length):
    s = tasks.mqmtar_sample(np.random.default_rng(length), length)
    t = s.tokens.tolist()
    n_kv = int(0.8 * length // 6)
    assert t[0] == 256 and t[-1] == 258
    sep = t.index(257)
    context, queries, trg = t[1: 1 + length], t[1 + length: sep], t[sep + 1: -1]
    assert len(queries) == 12 and len(trg) == 12 and sep == 1 + length + 12
    assert context.count(tasks.KVSEP) == n_kv
    assert set(context) <= set(range(256)) | {tasks.KVSEP, tasks.FILL}
    pairs = {}
    for i, tok in enumerate(context):
        if tok == tasks.KVSEP:
            assert context[i + 3] == tasks.FILL
            key = tuple(context[i - 2: i])
            assert key not in pairs, "keys are distinct"
            pairs[key] = tuple(context[i + 1: i + 3])
    assert sum(1 for x in context if x == tasks.FILL) == length - 5 * n_kv
    for q in range(4):
        assert queries[3 * q] == tasks.QSEP and trg[3 * q] == tasks.QSEP
        assert tuple(trg[3 * q + 1: 3 * q + 3]) == pairs[tuple(queries[3 * q + 1: 3 * q + 3])]
    assert np.flatnonzero(s.target_mask).tolist() == list(range(sep + 1, len(t)))
    assert np.flatnonzero(s.score_mask).tolist() == [sep + 1 + i for i in (1, 2, 4, 5, 7, 8, 10,
                                                                           11)]


def test_collate_labels_only_targets():
    rng = np.random.default_rng(0)
    samples = [tasks.sort_sample(rng, n) for n in (3, 6)]
    b = tasks.collate(samples, tasks.SORT.pad)
    assert b["input_ids"].shape == (2, 15)
    assert b["input_ids"][0, 9:].eq(tasks.SORT.pad).all()
    for i, s in enumerate(samples):
        lab = b["labels"][i, : len(s.tokens)]
        assert lab[torch.from_numpy(s.target_mask)].tolist() == s.tokens[s.target_mask].tolist()
        assert lab[~torch.from_numpy(s.target_mask)].eq(-100).all()
        assert b["labels"][i, len(s.tokens):].eq(-100).all()


def _perfect_logits(ids, vocab):
    logits = torch.zeros(*ids.shape, vocab)
    logits[:, :-1].scatter_(-1, ids[:, 1:, None], 1.0)
    return logits


@pytest.mark.parametrize("task", ["sort", "mqmtar"])
def test_exact_match_scoring(task):
    samples = tasks.fixed_set(task, 3, 40, seed=1)
    b = tasks.collate(samples, tasks.TASKS[task].pad)
    ids, mask = b["input_ids"], b["score_mask"]
    logits = _perfect_logits(ids, tasks.TASKS[task].vocab_size)
    assert tasks.exact_match(logits, ids, mask).tolist() == [True] * 3
    p = int(np.flatnonzero(samples[1].score_mask)[-1])  # one wrong scored token in row 1
    bad = logits.clone()
    bad[1, p - 1] = 0
    bad[1, p - 1, (ids[1, p] + 1) % bad.shape[-1]] = 1.0
    assert tasks.exact_match(bad, ids, mask).tolist() == [True, False, True]
    q = 3  # a wrong prediction at an unscored (source) position does not count
    bad = logits.clone()
    bad[0, q - 1] = 0
    bad[0, q - 1, (ids[0, q] + 1) % bad.shape[-1]] = 1.0
    assert tasks.exact_match(bad, ids, mask).tolist() == [True] * 3


class _Fixed(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids):
        return type("Out", (), {"logits": _perfect_logits(input_ids, self.vocab)})()


def test_evaluate_exact_match_with_a_perfect_model():
    samples = tasks.fixed_set("mqmtar", 5, 64, seed=2)
    res = tasks.evaluate_exact_match(_Fixed(tasks.MQMTAR.vocab_size), "mqmtar", samples, 2)
    assert res == {"exact_match": 1.0, "token_accuracy": 1.0}


def test_batches_are_seeded_and_within_lengths():
    source = tasks.RandomTaskBatches("sort", 8, 32, 64, seed=0)
    a = source.batch(5)
    b = tasks.RandomTaskBatches("sort", 8, 32, 64, seed=0).batch(5)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert not torch.equal(a["input_ids"][:, :10], source.batch(6)["input_ids"][:, :10])
    with pytest.raises(ValueError, match="same task settings"):
        tasks.RandomTaskBatches("sort", 8, 32, 64, seed=1).load_state_dict(source.state_dict())
    lengths = (a["input_ids"] != tasks.SORT.pad).sum(1)
    assert bool(((lengths >= 2 * 32 + 3) & (lengths <= 2 * 64 + 3)).all())
    with pytest.raises(ValueError, match="length >= 8"):
        tasks.mqmtar_sample(np.random.default_rng(0), 7)


def test_length_curriculum_grows_from_one_pair_to_the_full_range():
    """Batch i < N draws lengths from a range that grows linearly from the task's shortest
    sample (MQMTAR: one key-value pair) to U{min..max}; from batch N on, no change."""
    plain = tasks.RandomTaskBatches("mqmtar", 16, 32, 64, seed=3)
    grown = tasks.RandomTaskBatches("mqmtar", 16, 32, 64, seed=3, curriculum_steps=100)
    assert grown.lengths(0) == (8, 8) and grown.lengths(50) == (20, 36)
    assert grown.lengths(100) == grown.lengths(5000) == (32, 64)

    def pairs(batch):  # key-value blocks per sample: one KVSEP each
        return (batch["input_ids"] == tasks.KVSEP).sum(1)

    assert bool((pairs(grown.batch(0)) == 1).all())
    assert bool((pairs(plain.batch(0)) >= 4).all())
    middle = pairs(grown.batch(50))  # lengths 20..36: 2..4 pairs
    assert bool(((middle >= 2) & (middle <= 4)).all())
    for i in (100, 101, 4000):
        assert torch.equal(grown.batch(i)["input_ids"], plain.batch(i)["input_ids"])
    with pytest.raises(ValueError, match="same task settings"):
        grown.load_state_dict(plain.state_dict())
    plain.load_state_dict({"task": "mqmtar", "batch_size": 16, "min_len": 32, "max_len": 64,
                           "seed": 3})  # a checkpoint written before the option resumes
    with pytest.raises(ValueError, match="curriculum_steps must be >= 0"):
        tasks.RandomTaskBatches("sort", 4, 8, 12, seed=0, curriculum_steps=-1)


def _fit_sort(keep: str, **schedule):
    from mosaics.evaluation.experiments import extrapolation_model, fit_task_model
    from mosaics.evaluation.protocols import EXTRAPOLATION_PRESETS, with_overrides

    proto = with_overrides(EXTRAPOLATION_PRESETS["cpu"], n_embd=32, n_head=2, n_layer=1,
                           pmem_size=24, min_len=8, max_len=12)
    model = extrapolation_model("sort", "mosaics", "gaussian", proto, None, 64)
    val = tasks.collate(tasks.fixed_set("sort", 8, (8, 12), seed=1), tasks.SORT.pad)
    val.pop("score_mask")
    result = fit_task_model(model, tasks.RandomTaskBatches("sort", 4, 8, 12, seed=0), [val],
                            total_steps=6, lr=1e-2, weight_decay=0.1, warmup_frac=0.5,
                            eval_every=2, seed=0, device="cpu", progress=False, keep=keep,
                            **schedule)
    return model, result


def test_task_protocol_schedule_pmem_and_kept_weights():
    model, best = _fit_sort("best")
    assert model.config.pmem_size == 24
    assert best.best_step is not None
    lrs = [row["lr"] for row in best.history if "lr" in row]
    assert lrs[-1] == pytest.approx(3.25e-3)  # step 5 of a cosine to lr / 10 over steps 3..6
    _, last = _fit_sort("last", warmup_steps=1, schedule_steps=1000, min_lr=1e-4)
    assert last.best_step is None  # nothing restored
    lrs = [row["lr"] for row in last.history if "lr" in row]
    assert lrs[0] > 0.99e-2 and lrs[-1] > 0.99e-2  # warm-up of 1 step, a 1000-step cosine
    with pytest.raises(ValueError, match="keep must be"):
        _fit_sort("first")


def test_paper_code_preset_builds_the_paper_scripts_model():
    """`--preset paper-code`: 2 layers of d 512, 8 heads of 64, 2688 persistent slots per head
    and dropout 0.05 for Sort, and the schedule of the paper's training script."""
    from mosaics.evaluation.experiments import extrapolation_model
    from mosaics.evaluation.protocols import EXTRAPOLATION_PRESETS

    proto = EXTRAPOLATION_PRESETS["paper-code"]
    cfg = extrapolation_model("sort", "mosaics", "epanechnikov", proto, None, 256).config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.pmem_size) == (2, 512, 8, 2688)
    assert cfg.dropout == 0.05 and cfg.kernel == "epanechnikov"
    assert (proto.batch_size, proto.warmup_steps, proto.schedule_steps) == (256, 40000, 156250)
    assert (proto.min_lr, proto.keep) == (5e-5, "last")


def _tiny_sort_protocol():
    from mosaics.evaluation.protocols import EXTRAPOLATION_PRESETS, with_overrides

    return with_overrides(EXTRAPOLATION_PRESETS["cpu"], n_embd=32, n_head=2, n_layer=1,
                          pmem_size=24, min_len=8, max_len=12, steps=12, eval_every=3,
                          batch_size=4, lr=1e-2, multipliers=(1, 2), n_samples=8, n_val=8)


def _sigterm_after_evaluation(monkeypatch, step_to_stop: int) -> None:
    """Make the task runs send this process SIGTERM after their evaluation at that step
    (undone with ``monkeypatch.undo()``)."""
    import signal

    from mosaics.evaluation import experiments

    original = experiments.TaskExactMatch.on_evaluate

    def on_evaluate(self, trainer, step, val_loss):
        original(self, trainer, step, val_loss)
        if step == step_to_stop:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(experiments.TaskExactMatch, "on_evaluate", on_evaluate)


def test_an_interrupted_task_run_resumes_to_the_same_result(tmp_path, monkeypatch):
    """A stop signal mid-run writes a checkpoint and raises RunPreempted; the same call again
    resumes from it and ends with the uninterrupted run's weights, scores and history."""

    from safetensors.torch import load_file

    from mosaics.evaluation import experiments
    from mosaics.training import RunPreempted

    proto = _tiny_sort_protocol()

    def run(out):
        return experiments.run_extrapolation("sort", "mosaics", "gaussian", proto, seed=0,
                                             out_dir=out, save_model=True, progress=False,
                                             resume=True)["runs"][0]

    whole = run(tmp_path / "whole")
    _sigterm_after_evaluation(monkeypatch, 6)
    with pytest.raises(RunPreempted, match="stopped by SIGTERM at step 7"):
        run(tmp_path / "split")  # the processes agree on a stop at the next step
    checkpoints = list((tmp_path / "split").glob("runs/*/checkpoints/step_*"))
    assert [p.name for p in checkpoints] == ["step_0000007"]  # the newest only
    monkeypatch.undo()
    split = run(tmp_path / "split")

    assert split["train"]["resumed_step"] == 7 and whole["train"]["resumed_step"] is None
    assert split["exact_match"] == whole["exact_match"]
    assert split["token_accuracy"] == whole["token_accuracy"]
    for key in ("best_val_loss", "best_step", "steps"):
        assert split["train"][key] == whole["train"][key]
    def evaluations(run):
        return [(row["step"], row["val/loss"], row["val/exact_match"], row["lr"])
                for row in run["train"]["history"] if "val/loss" in row]

    assert evaluations(split) == evaluations(whole)
    assert [step for step, *_ in evaluations(whole)] == [3, 6, 9, 12]
    # the stop logs its partial window (step 7), so the log rows differ there, not the run
    assert [row["step"] for row in split["train"]["history"]] == [3, 6, 7, 9, 12]
    a, b = (load_file(Path(r["model_dir"]) / "model.safetensors") for r in (whole, split))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list((tmp_path / "split").glob("runs/*/checkpoints"))  # removed when finished


def test_a_task_time_budget_counts_every_attempt(tmp_path, monkeypatch):
    """A protocol's time budget is a compute budget: a run resumed after it is spent trains
    one step and stops, where a training run's budget (scope "attempt") starts again."""

    from mosaics.evaluation import experiments
    from mosaics.training import RunPreempted
    from mosaics.training import checkpoint as ckpt

    proto = _tiny_sort_protocol()
    _sigterm_after_evaluation(monkeypatch, 6)
    with pytest.raises(RunPreempted, match="at step 7"):
        experiments.run_extrapolation("sort", "mosaics", "gaussian", proto, seed=0,
                                      out_dir=tmp_path, progress=False, resume=True)
    monkeypatch.undo()
    spent = next(tmp_path.glob("runs/*/checkpoints/step_*"))
    before = ckpt.read_trainer_state(spent)["wall_seconds"]
    assert before > 0
    # a budget below what the first attempt spent: the resumed attempt stops at once
    run = experiments.run_extrapolation("sort", "mosaics", "gaussian",
                                        replace(proto, time_budget_s=before / 2), seed=0,
                                        out_dir=tmp_path, progress=False, resume=True)["runs"][0]
    assert run["train"]["resumed_step"] == 7
    assert run["train"]["steps"] == 8 and run["train"]["stopped_early"]
    assert run["train"]["seconds"] >= before


def test_keep_best_state_travels_with_a_checkpoint(tmp_path):
    from mosaics.training import KeepBest

    best = KeepBest()
    best.save_state(tmp_path)  # nothing kept yet: nothing written
    assert not (tmp_path / KeepBest.FILE).exists()
    best.loss, best.step = 0.125, 40
    best.state = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}
    best.save_state(tmp_path)
    again = KeepBest()
    again.load_state(tmp_path)
    assert (again.loss, again.step) == (0.125, 40)
    assert all(torch.equal(again.state[k], best.state[k]) for k in best.state)
    (tmp_path / KeepBest.FILE).unlink()
    again.load_state(tmp_path)  # a checkpoint written before any evaluation
    assert (again.loss, again.step, again.state) == (math.inf, None, None)


def test_an_interrupted_regbench_run_resumes_to_the_same_scores(tmp_path, monkeypatch):
    """The same for RegBench: its epoch batches resume at the interrupted step."""
    import signal

    from mosaics.evaluation import experiments
    from mosaics.evaluation.protocols import REGBENCH_PRESETS, with_overrides
    from mosaics.training import RunPreempted

    proto = with_overrides(REGBENCH_PRESETS["cpu"], max_steps=9, eval_every=3, n_val=6,
                           n_test=6, batch_size=4, n_layer=1, n_embd=32, n_head=2, pmem_size=16)

    def run(out):
        return experiments.run_regbench("mosaics", "gaussian", 20, proto, seed=0, out_dir=out,
                                        save_model=True, progress=False, resume=True)["runs"][0]

    whole = run(tmp_path / "whole")
    original = experiments.Trainer.evaluate

    def signal_at_step_3(self):
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    monkeypatch.setattr(experiments.Trainer, "evaluate", signal_at_step_3)
    with pytest.raises(RunPreempted, match="at step 4"):
        run(tmp_path / "split")
    monkeypatch.setattr(experiments.Trainer, "evaluate", original)
    split = run(tmp_path / "split")
    assert split["train"]["resumed_step"] == 4
    for key in ("accuracy", "tvd"):
        assert split[key] == whole[key]
    assert split["train"]["best_val_loss"] == whole["train"]["best_val_loss"]
    from safetensors.torch import load_file

    a, b = (load_file(Path(r["model_dir"]) / "model.safetensors") for r in (whole, split))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_mqmtar_runs_log_the_recall_paths_at_every_validation(tmp_path, capsys):
    """A Memory Mosaics MQMTAR run logs each path's best-head mass and the v1 / v2 accuracy
    at every validation; the last one equals a fresh profile of the saved model, and
    `mosaics eval routes` reads them back from the result file and from metrics.jsonl."""
    from mosaics.evaluation import experiments
    from mosaics.evaluation.analysis import retrieval
    from mosaics.evaluation.cli import main
    from mosaics.evaluation.models import load_model
    from mosaics.evaluation.protocols import EXTRAPOLATION_PRESETS, with_overrides

    proto = with_overrides(EXTRAPOLATION_PRESETS["cpu"], n_embd=32, n_head=2, n_layer=2,
                           pmem_size=24, min_len=32, max_len=40, steps=4, eval_every=2,
                           batch_size=4, lr=1e-2, multipliers=(1,), n_samples=4, n_val=6,
                           keep="last")
    results = experiments.run_extrapolation("mqmtar", "mosaics", "gaussian", proto, seed=0,
                                            out_dir=tmp_path, save_model=True, progress=False)
    run = results["runs"][0]
    evals = [row for row in run["train"]["history"] if "val/loss" in row]
    assert [row["step"] for row in evals] == [2, 4]
    keys = [f"val/{k}" for k in (*retrieval.PATHS, "v1_accuracy", "v2_accuracy")]
    for row in evals:
        assert all(0 <= row[k] <= 1 for k in keys)
    assert evals[0]["val/direct_mass"] != evals[1]["val/direct_mass"]  # the model moved

    model = load_model(run["model_dir"], "cpu")
    val = tasks.fixed_set("mqmtar", 6, (32, 40), 2000)
    fresh = retrieval.path_summary(retrieval.retrieval_profile(model, "mqmtar", val))
    for key, value in fresh.items():
        assert evals[-1][f"val/{key}"] == pytest.approx(value, abs=1e-5)

    result_file = tmp_path / "lr=1e-2.json"  # a bare path may hold an "="
    result_file.write_text(json.dumps({"job": {}, "results": results}))
    metrics = tmp_path / "runs" / "mqmtar-gaussian" / "metrics.jsonl"
    plot = tmp_path / "routes.png"
    assert main(["routes", str(result_file), f"log={metrics}", "--out", str(plot)]) == 0
    table = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
             if line.startswith("| mosaics/gaussian s0 |") or line.startswith("| log |")]
    assert [cells[:2] for cells in table] == [["| mosaics/gaussian s0", "2"],
                                              ["| mosaics/gaussian s0", "4"],
                                              ["| log", "2"], ["| log", "4"]]
    for cells, row in zip(table, evals + evals):  # the same numbers from either file
        assert cells[3] == f"{row['val/v1_accuracy']:.2f} / {row['val/v2_accuracy']:.2f}"
        assert cells[4] == f"{row['val/direct_mass']:.2f}"
        assert cells[-1] == f"{row['val/second_mass']:.2f} |"
    assert plot.stat().st_size > 0

    for arch, kernel in [("llama", None), ("mosaics-v2", "gaussian"), ("mosaics", "fska")]:
        other = experiments.run_extrapolation("mqmtar", arch, kernel, proto, seed=0,
                                              progress=False)["runs"][0]  # no map: no routes
        rows = other["train"]["history"]
        assert [r["step"] for r in rows if "val/exact_match" in r] == [2, 4]
        assert not any("val/direct_mass" in row for row in rows)


def test_path_logging_refuses_what_has_no_paths():
    from mosaics.evaluation.analysis import retrieval
    from mosaics.evaluation.experiments import TaskExactMatch

    with pytest.raises(ValueError, match="task 'sort' has none"):
        TaskExactMatch("sort", [], 4, "cpu", paths=True)
    with pytest.raises(ValueError, match="not an MQMTAR profile: direct_mass"):
        retrieval.path_summary({"support": [[1.0]]})


def test_route_history_merges_the_rows_of_one_step():
    from mosaics.evaluation.analysis import retrieval

    routes = {f"val/{k}": 0.5 for k in (*retrieval.PATHS, "v1_accuracy", "v2_accuracy")}
    rows = [{"step": 4, "val/loss": 1.0}, {"step": 4, "val/exact_match": 0.25, **routes},
            {"step": 2, "val/loss": 2.0}, {"step": 2, **routes}, {"step": 3, "lr": 1e-3}]
    history = retrieval.route_history(rows)
    assert [(r["step"], r["val/loss"]) for r in history] == [(2, 2.0), (4, 1.0)]
    assert history[1]["val/exact_match"] == 0.25


def test_the_routes_command_names_what_is_wrong(tmp_path, capsys):
    from mosaics.evaluation.cli import main

    with pytest.raises(SystemExit):
        main(["routes", str(tmp_path / "nope.json")])
    assert "nope.json: no such file" in capsys.readouterr().err
    (tmp_path / "other.json").write_text(json.dumps({"x": 1}))
    with pytest.raises(SystemExit):
        main(["routes", str(tmp_path / "other.json")])
    assert "not a result file (no 'runs')" in capsys.readouterr().err
    log = tmp_path / "metrics.jsonl"
    log.write_text(json.dumps({"step": 2, "val/loss": 1.0}) + "\n")
    with pytest.raises(SystemExit):
        main(["routes", str(log)])
    assert "logged no routes" in capsys.readouterr().err


def test_data_seed_keeps_the_init_of_the_seed_and_takes_the_batches_of_another(monkeypatch):
    """``data_seed`` splits a job's seed in two: (seed 1, data_seed 0) trains seed 1's initial
    weights on seed 0's batches."""

    from mosaics.evaluation import experiments

    class Stop(Exception):
        pass

    seen = {}

    def record(model, batches, *args, **kwargs):
        seen["init"] = {k: v.clone() for k, v in model.state_dict().items()}
        seen["batch"] = batches.batch(3)["input_ids"]
        seen["first lengths"] = batches.lengths(0)
        raise Stop

    monkeypatch.setattr(experiments, "fit_task_model", record)

    def start(seed, data_seed=None, curriculum_steps=0):
        proto = replace(_tiny_sort_protocol(), data_seed=data_seed,
                        curriculum_steps=curriculum_steps)
        with pytest.raises(Stop):
            experiments.run_extrapolation("sort", "mosaics", "gaussian", proto, seed=seed,
                                          progress=False)
        return dict(seen)

    s0, s1, split = start(0), start(1), start(1, data_seed=0)
    assert all(torch.equal(split["init"][k], s1["init"][k]) for k in s1["init"])
    assert not all(torch.equal(s0["init"][k], s1["init"][k]) for k in s1["init"])
    assert torch.equal(split["batch"], s0["batch"])
    assert not torch.equal(s1["batch"], s0["batch"])
    # the protocol's curriculum reaches the batches (Sort's shortest sample: 2 tokens)
    proto = _tiny_sort_protocol()
    assert s0["first lengths"] == (proto.min_len, proto.max_len)
    assert start(0, curriculum_steps=10)["first lengths"] == (2, 2)
