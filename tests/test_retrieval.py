"""The contextual memory's retrieval weights and the retrieval analysis of task models."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.evaluation import retrieval, tasks
from mosaics.evaluation.cli import main
from mosaics.memory import NORM_EPS, merge_heads
from mosaics.ops import lookahead_values

KERNELS = [("gaussian", {}), ("epanechnikov", {}), ("biweight", {}), ("triweight", {}),
           ("relumax", {}), ("epanechnikov_fixed", {}), ("gaussian_knn", {"k": 4}),
           ("uniform_knn", {"k": 4})]


def tiny(kernel="gaussian", kernel_kwargs=None, alibi=False, vocab=50, n_layer=1, **extra):
    torch.manual_seed(0)
    cfg = MosaicsConfig(vocab_size=vocab, n_layer=n_layer, n_embd=32, n_head=4, kernel=kernel,
                        kernel_kwargs=kernel_kwargs or {}, block_size=128, alibi=alibi, **extra)
    return MosaicsForCausalLM(cfg).eval()


@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize(("kernel", "kwargs"), KERNELS)
def test_the_weights_reproduce_the_memory_output(kernel, kwargs, alibi):
    """y = c_proj(merge_heads(W V)) with W from retrieval_weights equals the memory's forward."""
    mem = tiny(kernel, kwargs, alibi).model.blocks[0].cmem
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        y, _ = mem(x)
    w = mem.retrieval_weights(x)
    assert w.shape == (2, 4, 21, 21)
    assert torch.all(w.triu() == 0)  # strict past: w_ts = 0 for s >= t
    p = mem.weights()
    v_raw = F.linear(x, p.kv[32:]).view(2, 21, 4, 8).transpose(1, 2)
    values = lookahead_values(v_raw, p.mix, eps=NORM_EPS)
    expected = F.linear(merge_heads(w @ values.float()), p.out)
    torch.testing.assert_close(y, expected, atol=2e-6, rtol=1e-5)
    if kernel != "epanechnikov_fixed":  # a normalized ReLU row may have no support
        torch.testing.assert_close(w[:, :, 1:].sum(-1), torch.ones(2, 4, 20))


def test_the_weights_of_some_rows_are_those_rows_of_the_whole_map():
    mem = tiny("epanechnikov").model.blocks[0].cmem
    x = torch.randn(1, 30, 32)
    rows = torch.tensor([0, 5, 29, 17])
    torch.testing.assert_close(mem.retrieval_weights(x, rows), mem.retrieval_weights(x)[:, :, rows])
    assert torch.all(mem.retrieval_weights(x, rows)[:, :, 0] == 0)  # row 0 sees nothing


def test_the_weights_refuse_v2_memories_and_feature_kernels():
    x = torch.randn(1, 8, 32)
    v2 = tiny(**{"document_masking": False, "short_term_window": 4, "three_level_memory": True})
    with pytest.raises(ValueError, match="visible intervals"):
        v2.model.blocks[0].cmem.short.retrieval_weights(x)
    with pytest.raises(ValueError, match="no score normalizer"):
        tiny("fska").model.blocks[0].cmem.retrieval_weights(x)


@pytest.mark.parametrize("length", [64, 256])
def test_mqmtar_rows_point_at_the_block_that_holds_the_answer(length):
    for sample in tasks.fixed_set("mqmtar", 5, length, 3):
        tokens = sample.tokens
        rows, blocks, entries = retrieval.mqmtar_rows(tokens)
        assert len(rows) == len(blocks) == len(entries) == 2 * tasks.N_QUERIES
        # the rows predict exactly the scored tokens
        assert sorted(r + 1 for r in rows) == np.flatnonzero(sample.score_mask).tolist()
        for r, block, entry in zip(rows, blocks, entries):
            k1, k2, kvsep, v1, v2, fill = tokens[block]
            assert (kvsep, fill) == (tasks.KVSEP, tasks.FILL)
            # the token the row predicts is the block's value token at the same place
            assert tokens[r + 1] == (v1 if tokens[r] == tasks.QSEP else v2)
            # and the answering entry's one-step-ahead value is that token
            assert entry in block and entry < r and tokens[entry + 1] == tokens[r + 1]
            answer = r if tokens[r] == tasks.QSEP else r - 1  # the answer's QSEP in trg
            query = answer - 3 * tasks.N_QUERIES  # its query's k1 in src
            assert (tokens[query], tokens[query + 1]) == (k1, k2)


def test_row_statistics_count_and_spread():
    w = torch.zeros(2, 3, 10)
    w[0, 0, 4] = 1.0  # one entry
    w[0, 1, :5] = 0.2  # five equal entries
    w[1, 0] = torch.softmax(torch.randn(10), 0)  # all entries, unequal
    s = retrieval.row_statistics(w)
    assert s["support"][0].tolist() == [1, 5, 0]
    torch.testing.assert_close(s["effective"][0], torch.tensor([1.0, 5.0, 0.0]))
    p = w[1, 0]
    torch.testing.assert_close(s["effective"][1, 0], torch.exp(-(p * p.log()).sum()))
    assert 1.0 < float(s["effective"][1, 0]) < 10.0


def test_the_profile_averages_the_rows_of_every_layer_and_head():
    """retrieval_profile against a slow loop over samples, rows and blocks on the full maps."""
    model = tiny("epanechnikov", vocab=263, n_layer=2)
    samples = tasks.fixed_set("mqmtar", 3, 64, 0)
    profile = retrieval.retrieval_profile(model, "mqmtar", samples)
    mass = np.zeros((2, 4))
    entry_mass = np.zeros((2, 4))
    by_kind = np.zeros((2, 2, 4))  # rows that predict v1, v2
    support = np.zeros((2, 4))
    n = 0
    for sample in samples:
        ids = torch.from_numpy(sample.tokens).view(1, -1)
        xs, _ = retrieval.memory_inputs(model, ids)
        rows, blocks, entries = retrieval.mqmtar_rows(sample.tokens)
        for layer, (mem, x) in enumerate(zip(retrieval.memory_modules(model), xs)):
            w = mem.retrieval_weights(x)[0].numpy()
            for r, block, entry in zip(rows, blocks, entries):
                mass[layer] += w[:, r, block].sum(-1)
                entry_mass[layer] += w[:, r, entry]
                by_kind[int(sample.tokens[r] != tasks.QSEP), layer] += w[:, r, entry]
                support[layer] += (w[:, r] > 0).sum(-1)
        n += len(rows)
    np.testing.assert_allclose(profile["block_mass"], mass / n, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(profile["entry_mass"], entry_mass / n, rtol=1e-5, atol=1e-7)
    assert (np.asarray(profile["entry_mass"]) <= np.asarray(profile["block_mass"]) + 1e-7).all()
    for kind, key in enumerate(("v1_entry_mass", "v2_entry_mass")):  # half the rows each
        np.testing.assert_allclose(profile[key], by_kind[kind] / (n / 2), rtol=1e-5, atol=1e-7)
        layer, head = retrieval.retrieval_head(profile, key)
        assert profile[key][layer][head] == np.max(profile[key])
    np.testing.assert_allclose(profile["support"], support / n)
    assert 0.0 <= profile["exact_match"] <= 1.0
    assert profile["beta"] == [m.weights().beta.tolist() for m in retrieval.memory_modules(model)]
    layer, head = retrieval.retrieval_head(profile)
    assert profile["block_mass"][layer][head] == np.max(profile["block_mass"])


def test_the_command_writes_a_table_per_model_and_length(tmp_path, capsys):
    d = tmp_path / "model"
    tiny("epanechnikov", vocab=263, n_layer=2).save_pretrained(d)
    assert main(["retrieval", "--model", str(d), str(d), "--labels", "tiny", "again",
                 "--seed", "0", "5", "--lengths", "128", "64", "--samples", "2",
                 "--device", "cpu", "--out", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    assert "| tiny | 64 |" in table and "| again | 128 |" in table
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert "entry mass" in lines[0] and "v1 rows: head, entry mass" in lines[0]
    assert len(lines) == 1 + 4 and all(line.count("|") == 12 for line in lines)
    saved = json.loads((tmp_path / "out" / "retrieval.json").read_text())
    assert set(saved["profiles"]["tiny"]) == {"64", "128"}
    assert saved["seeds"] == {"tiny": 0, "again": 5}
    # the same model on the test samples of another seed: other rows, other means
    assert saved["profiles"]["tiny"]["64"] != saved["profiles"]["again"]["64"]
    assert len(saved["profiles"]["tiny"]["64"]["block_mass"]) == 2  # layers
    assert (tmp_path / "out" / "retrieval.md").read_text().startswith("| model |")
    assert (tmp_path / "out" / "retrieval.png").stat().st_size > 0


def test_the_command_names_what_is_wrong(tmp_path, capsys):
    d = tmp_path / "model"
    tiny("fska", vocab=263).save_pretrained(d)
    with pytest.raises(SystemExit):
        main(["retrieval", "--model", str(d), "--labels", "a", "b"])
    assert "one per folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["retrieval", "--model", str(d), str(d), "--seed", "1", "2", "3"])
    assert "--seed: 3 value(s) for 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["retrieval", "--model", str(d), str(d)])
    assert "share a label" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["retrieval", "--model", str(d), "--lengths", "64", "--samples", "1",
              "--device", "cpu"])
    assert "no score normalizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["retrieval", "--model", str(d), "--task", "sort", "--lengths", "64",
              "--device", "cpu"])
    assert "vocab_size 263, but sort uses 36" in capsys.readouterr().err


def test_a_set_bandwidth_changes_that_head_only():
    model = tiny("epanechnikov", n_layer=2)
    before = [m.weights().beta.clone() for m in retrieval.memory_modules(model)]
    retrieval.set_bandwidth(model, 1, 2, 15.0)
    after = [m.weights().beta for m in retrieval.memory_modules(model)]
    torch.testing.assert_close(after[0], before[0])
    expected = before[1].clone()
    expected[2] = 15.0
    torch.testing.assert_close(after[1], expected)
    for bad, match in (((2, 0, 1.0), "layers 0..1"), ((0, 4, 1.0), "heads 0..3"),
                       ((0, 0, 0.0), "out of range"), ((0, 0, 3e4), "out of range")):
        with pytest.raises(ValueError, match=match):
            retrieval.set_bandwidth(model, *bad)


def test_the_command_applies_a_bandwidth_intervention(tmp_path, capsys):
    """A sharper head spreads its weight over fewer entries; the label says what was set."""
    d = tmp_path / "model"
    model = tiny("epanechnikov", vocab=263)
    retrieval.set_bandwidth(model, 0, 1, 1.0)
    model.save_pretrained(d)
    for beta in ("1", "20000"):
        assert main(["retrieval", "--model", str(d), "--bandwidth", f"0.1={beta}",
                     "--lengths", "128", "--samples", "2", "--device", "cpu",
                     "--out", str(tmp_path / beta)]) == 0
    assert f"{d}, beta 0.1=20000 |" in capsys.readouterr().out
    blunt, sharp = (json.loads((tmp_path / b / "retrieval.json").read_text())["profiles"]
                    for b in ("1", "20000"))
    (blunt,), (sharp,) = blunt.values(), sharp.values()
    assert sharp["128"]["beta"][0][1] == pytest.approx(20000, rel=1e-4)
    assert sharp["128"]["support"][0][1] < blunt["128"]["support"][0][1]
    assert sharp["128"]["support"][0][0] == blunt["128"]["support"][0][0]  # other heads alike
    with pytest.raises(SystemExit):
        main(["retrieval", "--model", str(d), "--bandwidth", "3=15"])
    assert "LAYER.HEAD=BETA" in capsys.readouterr().err
