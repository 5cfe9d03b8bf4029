"""RegBench examples, splits, metrics, n-gram baselines and model scoring."""

import numpy as np
import pytest
import torch

from mosaics.evaluation import regbench as rb
from mosaics.evaluation.automata import DFA


@pytest.fixture(scope="module")
def data():
    return rb.make_splits(60, n_val=20, n_test=20, seed=3)


def _strings(tokens):
    return rb.decode(tokens).split("|")


def test_examples_have_the_documented_shape(data):
    for ex in data.train + data.test:
        assert ex.tokens.dtype == np.int64
        assert ex.tokens.min() >= 1 and ex.tokens.max() <= rb.SEP  # no padding inside
        strings = _strings(ex.tokens)
        assert 10 <= len(strings) <= 19
        for s in strings:
            assert 1 <= len(s) <= 49
            assert ex.dfa.accepts([rb.LETTERS.index(c) for c in s])


def test_walks_are_uniform_over_outgoing_symbols():
    dfa = DFA(({0: 1, 1: 2, 2: 3}, {3: 0}, {4: 0}, {5: 0}))
    rng = np.random.default_rng(0)
    firsts = [_strings(rb.sample_walks(dfa, rng)) for _ in range(300)]
    counts = np.bincount([rb.LETTERS.index(s[0]) for f in firsts for s in f], minlength=3)[:3]
    freq = counts / counts.sum()
    assert np.all(np.abs(freq - 1 / 3) < 0.05)


def test_splits_are_deterministic_nested_and_disjoint(data):
    again = rb.make_splits(60, n_val=20, n_test=20, seed=3)
    assert again.fingerprint() == data.fingerprint()
    assert rb.make_splits(60, n_val=20, n_test=20, seed=4).fingerprint() != data.fingerprint()
    smaller = rb.make_splits(25, n_val=20, n_test=20, seed=3)
    assert [e.hash for e in smaller.train] == [e.hash for e in data.train[:25]]
    train = {e.hash for e in data.train}
    val = {e.hash for e in data.val}
    test = {e.hash for e in data.test}
    assert not train & test and not train & val and not val & test


def test_disjointness_is_enforced_when_languages_repeat():
    # with tiny automata (4 states, 4 letters) languages repeat often, so exclusion matters
    big = rb.make_splits(300, n_val=50, n_test=50, seed=0)
    train = [e.hash for e in big.train]
    assert len(set(train)) < len(train) or len(big.train) == 300
    assert not set(train) & ({e.hash for e in big.test} | {e.hash for e in big.val})


def _slow_legal(ex):
    rows = []
    for t in range(len(ex.tokens) - 1):
        prefix = list(ex.tokens[: t + 1])
        last_sep = max([i for i, x in enumerate(prefix) if x == rb.SEP], default=-1)
        state = ex.dfa.run([x - 1 for x in prefix[last_sep + 1:]])
        row = np.zeros(rb.VOCAB_SIZE, dtype=bool)
        row[[a + 1 for a in ex.dfa.delta[state]]] = True
        rows.append(row)
    return np.stack(rows)


def test_legal_masks_against_a_slow_reference(data):
    for ex in data.test[:5]:
        np.testing.assert_array_equal(ex.legal_mask(), _slow_legal(ex))
        assert not ex.legal_mask()[:, [rb.PAD, rb.SEP]].any()
        np.testing.assert_array_equal(ex.scored(), ex.tokens[1:] != rb.SEP)


def test_oracle_and_uniform_scores(data):
    res = rb.score_predictor(data.test, rb.oracle_probs)
    assert res["accuracy"] == 1.0 and res["tvd"] == pytest.approx(0.0, abs=1e-12)

    def uniform(ex):
        p = np.zeros((len(ex.tokens) - 1, rb.VOCAB_SIZE))
        p[:, 1:19] = 1 / 18
        return p

    res = rb.score_predictor(data.test, uniform)
    hits = tvd = n = 0
    for ex in data.test:  # argmax of a tie = lowest id = 'a'; TVD = 1 - k/18
        legal = _slow_legal(ex)[ex.tokens[1:] != rb.SEP]
        hits += legal[:, 1].sum()
        tvd += (1 - legal.sum(1) / 18).sum()
        n += len(legal)
    assert res["positions"] == n
    assert res["accuracy"] == pytest.approx(hits / n)
    assert res["tvd"] == pytest.approx(tvd / n)


def test_score_on_hand_made_rows():
    legal = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0]], dtype=torch.bool)
    probs = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.25, 0.75, 0.0]])
    s = rb.Score()
    s.add(probs, legal)
    r = s.result()
    assert r["accuracy"] == 0.5
    assert r["tvd"] == pytest.approx((1.0 + 0.25) / 2)
    with pytest.raises(ValueError, match="no legal"):
        s.add(probs[:1], torch.zeros(1, 4, dtype=torch.bool))


def _slow_ngram(tokens, order):
    toks = list(tokens)
    out = []
    for t in range(len(toks) - 1):
        prefix = toks[: t + 1]
        for k in range(order - 1, -1, -1):
            if k > len(prefix):
                continue
            ctx = prefix[len(prefix) - k:]
            counts = np.zeros(rb.VOCAB_SIZE)
            for i in range(k, len(prefix)):
                if prefix[i - k: i] == ctx:
                    counts[prefix[i]] += 1
            if counts.sum():
                out.append(counts / counts.sum())
                break
    return np.stack(out)


def test_ngram_matches_a_brute_force_count(data):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 5, size=40), data.test[0].tokens[:120]]
    for tokens in seqs:
        for order in (1, 2, 3):
            np.testing.assert_allclose(rb.ngram_probs(tokens, order), _slow_ngram(tokens, order))
    seq = np.array([1, 2, rb.SEP, 1, 2])  # "ab|ab"; row 3 predicts from "ab|a"
    assert rb.ngram_probs(seq, 2)[3, 2] == 1.0
    assert rb.ngram_probs(seq, 3)[3, 2] == 1.0  # "|a" is new: backs off to "a"
    np.testing.assert_allclose(rb.ngram_probs(seq, 2)[2, [1, 2, rb.SEP]], 1 / 3)  # unigram


def test_baselines_are_between_uniform_and_oracle(data):
    res = rb.baseline_scores(data.test)
    assert res["oracle"]["accuracy"] == 1.0
    assert 0.5 < res["2-gram"]["accuracy"] < 1.0
    assert res["3-gram"]["tvd"] < res["2-gram"]["tvd"]


def test_collate_masks_separators_and_padding(data):
    batch = rb.collate(data.test[:4])
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape[1] == max(len(e.tokens) for e in data.test[:4])
    assert bool((labels[ids == rb.SEP] == -100).all())
    assert bool((labels[ids == rb.PAD] == -100).all())
    letters = (ids >= 1) & (ids <= 18)
    assert bool((labels[letters] == ids[letters]).all())


class _OracleLM(torch.nn.Module):
    """Returns log of the true next-symbol distribution (looked up by the unpadded tokens)."""

    def __init__(self, examples):
        super().__init__()
        self.table = {tuple(e.tokens.tolist()): e for e in examples}

    def forward(self, input_ids):
        logits = torch.full((*input_ids.shape, rb.VOCAB_SIZE), -30.0)
        for b, row in enumerate(input_ids.tolist()):
            n = len(row) - row[::-1].index(next(x for x in row[::-1] if x != rb.PAD))
            ex = self.table[tuple(row[:n])]
            logits[b, : n - 1] = torch.log(torch.from_numpy(rb.oracle_probs(ex)) + 1e-13)
        return type("Out", (), {"logits": logits})()


def test_evaluate_model_aligns_positions(data):
    res = rb.evaluate_model(_OracleLM(data.test), data.test, batch_size=3)
    assert res["accuracy"] == 1.0 and res["tvd"] < 1e-6
    assert res["positions"] == sum(int(e.scored().sum()) for e in data.test)
