"""Sort and MQMTAR layouts, target masks, exact-match scoring; the training driver's schedule."""

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


def _fit_sort(keep: str, **schedule):
    from mosaics.evaluation.experiments import (
        EXTRAPOLATION_PRESETS,
        extrapolation_model,
        fit_task_model,
        with_overrides,
    )

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
    from mosaics.evaluation.experiments import EXTRAPOLATION_PRESETS, extrapolation_model

    proto = EXTRAPOLATION_PRESETS["paper-code"]
    cfg = extrapolation_model("sort", "mosaics", "epanechnikov", proto, None, 256).config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.pmem_size) == (2, 512, 8, 2688)
    assert cfg.dropout == 0.05 and cfg.kernel == "epanechnikov"
    assert (proto.batch_size, proto.warmup_steps, proto.schedule_steps) == (256, 40000, 156250)
    assert (proto.min_lr, proto.keep) == (5e-5, "last")
