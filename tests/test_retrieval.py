"""The contextual memory's retrieval weights and the retrieval analysis of task models."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.evaluation import tasks
from mosaics.evaluation.analysis import retrieval
from mosaics.evaluation.cli import main
from mosaics.memory import NORM_EPS, merge_heads
from mosaics.ops import lookahead_values

KERNELS = [("gaussian", {}), ("epanechnikov", {}), ("biweight", {}), ("triweight", {}),
           ("relumax", {}), ("epanechnikov_fixed", {}), ("gaussian_knn", {"k": 4}),
           ("uniform_knn", {"k": 4}),
           ("epanechnikov_fixed", {"parametrization": "regbench-code"}),
           ("epanechnikov_fixed", {"parametrization": "synthetic-code"}),
           ("relumax", {"parametrization": "regbench-code"})]


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
    assert not retrieval.has_retrieval_weights(v2)
    assert not retrieval.has_retrieval_weights(tiny("fska"))
    assert retrieval.has_retrieval_weights(tiny("relumax", alibi=True))
    assert not retrieval.has_retrieval_weights(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("length", [64, 256])
def test_mqmtar_rows_point_at_the_block_that_holds_the_answer(length):
    for sample in tasks.fixed_set("mqmtar", 5, length, 3):
        tokens = sample.tokens
        layout = retrieval.mqmtar_rows(tokens)
        rows, blocks, targets = layout.rows, layout.blocks, layout.targets
        assert len(rows) == len(blocks) == len(targets) == 2 * tasks.N_QUERIES
        # the rows predict exactly the scored tokens
        assert sorted(r + 1 for r in rows) == np.flatnonzero(sample.score_mask).tolist()
        for r, block, target in zip(rows, blocks, targets):
            k1, k2, kvsep, v1, v2, fill = tokens[block]
            assert (kvsep, fill) == (tasks.KVSEP, tasks.FILL)
            # the token the row predicts is the block's value token at the same place
            assert tokens[r + 1] == (v1 if tokens[r] == tasks.QSEP else v2)
            assert target in block and tokens[target] == tokens[r + 1]
            answer = r if tokens[r] == tasks.QSEP else r - 1  # the answer's QSEP in trg
            query = answer - 3 * tasks.N_QUERIES  # its query's k1 in src
            assert (tokens[query], tokens[query + 1]) == (k1, k2)
        for i, lookup in enumerate(layout.lookups):  # right after query i's key k1 k2
            block = blocks[2 * i]
            assert tuple(tokens[lookup - 2:lookup]) == tuple(tokens[block[:2]])
            assert tokens[lookup] in (tasks.QSEP, tasks.MQMTAR.sep) and lookup > block[-1]
            assert rows[2 * i] - lookup == 10  # the copy reaches 10 positions back
        for i, key_row in enumerate(layout.key_rows):  # query i's k1
            assert tokens[key_row - 1] == tasks.QSEP
            assert tokens[key_row] == tokens[blocks[2 * i][0]]
            assert rows[2 * i] - key_row == 12  # the k1 copy reaches 12 positions back


def test_the_carrier_entry_holds_the_target_token_in_its_value():
    """Values mix an entry's own token with the next (c): the carrier of position p is the
    entry whose value is nearest v~_p, p - 1 for c <= 1/2 and p for c > 1/2."""
    mem = tiny().model.blocks[0].cmem
    with torch.no_grad():
        mem.lookahead_c.copy_(torch.tensor([0.0, 0.3, 0.7, 1.05]))
    own = retrieval.own_token_heads(mem)
    assert own.tolist() == [False, False, True, True]
    # orthonormal raw values: an entry's similarity to v~_p is the share of p in it
    v_raw = torch.linalg.qr(torch.randn(4, 16, 12)).Q.transpose(1, 2).unsqueeze(0)  # (1,H,12,16)
    values = lookahead_values(v_raw, mem.weights().mix.detach(), eps=NORM_EPS)
    targets = torch.tensor([3, 7, 10])  # not the last entry, whose next token is missing
    entries = retrieval.carrier_entries(targets, own)  # (H, n)
    assert entries.tolist() == [[2, 6, 9], [2, 6, 9], [3, 7, 10], [3, 7, 10]]
    for h in range(4):
        for j, p in enumerate(targets.tolist()):
            similarity = values[0, h] @ v_raw[0, h, p]  # every entry's value against v~_p
            assert int(similarity[:p + 1].argmax()) == int(entries[h, j])


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
    """retrieval_profile against a slow loop over samples, rows and heads on the full maps."""
    model = tiny("epanechnikov", vocab=263, n_layer=2)
    mems = retrieval.memory_modules(model)
    with torch.no_grad():  # two look-ahead heads and two own-token heads in each layer
        for mem in mems:
            mem.lookahead_c.copy_(torch.tensor([0.2, 0.9, 0.4, 0.6]))
    samples = tasks.fixed_set("mqmtar", 3, 64, 0)
    profile = retrieval.retrieval_profile(model, "mqmtar", samples)
    keys = ("block_mass", "entry_mass", "direct_mass", "second_mass", "lookup_mass",
            "copy_mass", "k1_lookup_mass", "k1_copy_mass", "support")
    slow = {k: np.zeros((2, 4)) for k in keys}
    right = np.zeros(2)
    for sample in samples:
        tokens = sample.tokens
        ids = torch.from_numpy(tokens).view(1, -1)
        xs, logits = retrieval.memory_inputs(model, ids)
        layout = retrieval.mqmtar_rows(tokens)
        for j, r in enumerate(layout.rows):
            right[j % 2] += int(logits[0, r].argmax()) == tokens[r + 1]
        for layer, (mem, x) in enumerate(zip(mems, xs)):
            w = mem.retrieval_weights(x)[0].numpy()
            for h in range(4):
                shift = 0 if h in (0, 2) else 1  # the carrier of position p: p - 1 or p
                for j, (r, block, p) in enumerate(zip(layout.rows, layout.blocks,
                                                      layout.targets)):
                    slow["block_mass"][layer, h] += w[h, r, block].sum()
                    slow["entry_mass"][layer, h] += w[h, r, p - 1 + shift]
                    slow["direct_mass" if j % 2 == 0 else "second_mass"][layer, h] += (
                        w[h, r, p - 1 + shift])
                    slow["support"][layer, h] += (w[h, r] > 0).sum()
                for i, lookup in enumerate(layout.lookups):
                    v1 = layout.targets[2 * i]
                    slow["lookup_mass"][layer, h] += w[h, lookup, v1 - 1 + shift]
                    slow["copy_mass"][layer, h] += w[h, layout.rows[2 * i], lookup - 1 + shift]
                    k1 = layout.key_rows[i]
                    slow["k1_lookup_mass"][layer, h] += w[h, k1, v1 - 1 + shift]
                    slow["k1_copy_mass"][layer, h] += w[h, layout.rows[2 * i], k1 - 1 + shift]
    n = 8 * len(samples)
    for key in keys:
        per_row = n if key in ("block_mass", "entry_mass", "support") else n / 2
        np.testing.assert_allclose(profile[key], slow[key] / per_row, rtol=1e-5, atol=1e-7)
    assert (np.asarray(profile["entry_mass"]) <= np.asarray(profile["block_mass"]) + 1e-7).all()
    assert [profile["v1_accuracy"], profile["v2_accuracy"]] == (right / (n / 2)).tolist()
    assert 0.0 <= profile["exact_match"] <= 1.0
    assert profile["beta"] == [m.weights().beta.tolist() for m in mems]
    for key in ("block_mass", "direct_mass", "copy_mass", "k1_copy_mass"):
        layer, head = retrieval.retrieval_head(profile, key)
        assert profile[key][layer][head] == np.max(profile[key])


def test_the_sort_profile_covers_the_sorted_tokens_only(tmp_path, capsys):
    """Sort has no blocks: support and spread of the rows that predict the sorted tokens,
    the head with the smallest spread, and no paths table."""
    model = tiny("triweight", vocab=tasks.TASKS["sort"].vocab_size, n_layer=2)
    samples = tasks.fixed_set("sort", 2, 32, 0)
    profile = retrieval.retrieval_profile(model, "sort", samples)
    assert not any(k.endswith("_mass") or k.endswith("_accuracy") for k in profile)
    support = np.zeros((2, 4))
    n = 0
    for sample in samples:
        xs, _ = retrieval.memory_inputs(model, torch.from_numpy(sample.tokens).view(1, -1))
        rows = np.flatnonzero(sample.score_mask) - 1
        for layer, (mem, x) in enumerate(zip(retrieval.memory_modules(model), xs)):
            support[layer] += (mem.retrieval_weights(x)[0].numpy()[:, rows] > 0).sum((1, 2))
        n += len(rows)
    np.testing.assert_allclose(profile["support"], support / n)
    layer, head = retrieval.retrieval_head(profile)
    assert profile["effective"][layer][head] == np.min(profile["effective"])
    assert retrieval.paths_table({"tiny": {32: profile}}) == ""
    d = tmp_path / "model"
    model.save_pretrained(d)
    assert main(["retrieval", "--model", str(d), "--task", "sort", "--lengths", "32",
                 "--samples", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| - | - |" in out and "paths" not in out


def test_the_command_writes_a_table_per_model_and_length(tmp_path, capsys):
    d = tmp_path / "model"
    tiny("epanechnikov", vocab=263, n_layer=2).save_pretrained(d)
    assert main(["retrieval", "--model", str(d), str(d), "--labels", "tiny", "again",
                 "--seed", "0", "5", "--lengths", "128", "64", "--samples", "2",
                 "--device", "cpu", "--out", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    assert "| tiny | 64 |" in table and "| again | 128 |" in table
    heads = [line for line in table.splitlines() if line.startswith("| ")]
    assert "entry mass" in heads[0]
    assert "| direct | lookup | copy | k1 lookup | k1 copy | second |" in heads[5]
    # two tables: the retrieval head's, then the paths', each a header and 2 x 2 rows
    assert len(heads) == 10 and [h.count("|") for h in heads] == [10] * 5 + [11] * 5
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


@pytest.mark.parametrize("kwargs", [{}, {"parametrization": "regbench-code"},
                                    {"parametrization": "synthetic-code"}])
@pytest.mark.parametrize("chunk", [256, 5])
def test_empty_rows_are_the_rows_with_no_entry_inside_the_bandwidth(kwargs, chunk, monkeypatch):
    """Fixed bandwidth: row t is empty iff max_{s < t} cos(k_t, k_s) <= 1 - 1 / beta'. A chunk
    of 5 rows splits the 28 rows unevenly."""
    monkeypatch.setattr(retrieval, "ROW_CHUNK", chunk)
    model = tiny("epanechnikov_fixed", kwargs, n_layer=2)
    with torch.no_grad():  # one wide head and three narrow ones per layer
        for block in model.model.blocks:
            block.cmem.bandwidth_b.copy_(torch.tensor([0.0, 0.05, 0.1, 0.2]))
    ids = torch.randint(0, 50, (3, 30))
    shares = retrieval.empty_rows(model, ids, first=2)
    assert len(shares) == 2 and len(shares[0]) == 4
    inputs, _ = retrieval.memory_inputs(model, ids)
    for layer, (mem, x) in enumerate(zip(retrieval.memory_modules(model), inputs)):
        w = mem.weights()
        k_raw = F.linear(x, w.kv[:32]).view(3, 30, 4, 8).transpose(1, 2)
        keys = mem.unit_keys(x, k_raw, w)[0].double()
        edge = 1 - 1 / w.beta.double()
        for h in range(4):
            empty = [float(max(keys[b, h, t] @ keys[b, h, s] for s in range(t)) <= edge[h])
                     for b in range(3) for t in range(2, 30)]
            assert shares[layer][h] == pytest.approx(np.mean(empty), abs=1e-12)
    flat = [v for layer in shares for v in layer]
    assert min(flat) < max(flat)  # the heads differ, so the check is not vacuous


def test_the_empty_rows_command_measures_saved_and_fresh_models(tmp_path, capsys):
    d = tmp_path / "model"
    tiny("epanechnikov_fixed", vocab=263, n_layer=2).save_pretrained(d)
    assert main(["empty-rows", "--model", str(d), "--labels", "saved", "--init",
                 "epanechnikov_fixed", 'epanechnikov_fixed:{"parametrization": '
                 '"synthetic-code"}', "--init-seed", "0", "1", "--samples", "2",
                 "--device", "cpu"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| model | empty rows") and len(rows) == 1 + 1 + 4
    assert rows[1].startswith("| saved |") and rows[1].count("/") == 1  # two layers
    assert rows[2].startswith("| epanechnikov_fixed s0, init |")
    assert rows[4].startswith("| epanechnikov_fixed (parametrization=synthetic-code) s0, init")
    assert rows[5].count("/") == 3  # the cpu-recall preset's model has four layers
    mean = [float(r.split("|")[2]) for r in rows[2:]]
    assert min(mean[:2]) > max(mean[2:])  # the published code's scores start wider


def test_the_empty_rows_command_names_what_is_wrong(capsys):
    with pytest.raises(SystemExit):
        main(["empty-rows"])
    assert "nothing to measure" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["empty-rows", "--init", "relumax:{r: 2}"])
    assert "expected KERNEL or KERNEL:{json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["empty-rows", "--init", "relumax", "--preset", "nope"])
    assert "--preset 'nope': choose from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["empty-rows", "--init", "fska", "--samples", "1", "--device", "cpu"])
    assert "--init fska: " in capsys.readouterr().err
    with pytest.raises(ValueError, match="first=30: rows t >= first must exist"):
        retrieval.empty_rows(tiny("epanechnikov_fixed"), torch.zeros(1, 30, dtype=torch.long),
                             first=30)
