"""RegBench examples, splits, metrics, n-gram baselines and model scoring."""

from collections import Counter

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
        np.testing.assert_array_equal(ex.letter_targets(), ex.tokens[1:] != rb.SEP)


def test_oracle_and_uniform_scores_count_every_output(data):
    n_out = sum(len(ex.tokens) - 1 for ex in data.test)
    res = rb.score_predictor(data.test, rb.oracle_probs)
    assert res["accuracy"] == 1.0 and res["tvd"] == pytest.approx(0.0, abs=1e-12)
    assert res["positions"] == n_out

    def uniform(ex):
        p = np.zeros((len(ex.tokens) - 1, rb.VOCAB_SIZE))
        p[:, 1:19] = 1 / 18
        return p

    res = rb.score_predictor(data.test, uniform)
    hits = tvd = 0
    for ex in data.test:  # argmax of a tie = lowest id = 'a'; TVD = 1 - k/18
        legal = _slow_legal(ex)
        hits += legal[:, 1].sum()
        tvd += (1 - legal.sum(1) / 18).sum()
    assert res["accuracy"] == pytest.approx(hits / n_out)
    assert res["tvd"] == pytest.approx(tvd / n_out)
    n_letters = sum(int((ex.tokens[1:] != rb.SEP).sum()) for ex in data.test)
    assert res["positions_letters"] == n_letters < n_out


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


def _encode(text):
    return np.array([rb.SEP if c == "|" else rb.LETTERS.index(c) + 1 for c in text])


def _ngram(prefix, n):
    """{letter: p} of the order-n estimator after ``prefix`` (nonzero entries only)."""
    model = rb.InContextNgram(n)
    for tok in _encode(prefix):
        model.add(int(tok))
    p = model.probs()
    assert p[rb.PAD] == 0 and p[rb.SEP] == 0
    return {rb.LETTERS[i - 1]: float(p[i]) for i in range(1, 19) if p[i]}


def _assert_dist(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-12), k


def test_ngram_first_position_and_empty_vocabulary():
    for n in (1, 2, 3, 4):
        assert not rb.InContextNgram(n).probs().any()  # nothing seen: no letter gets mass
        assert not any(_ngram("|", n).values())
        _assert_dist(_ngram("a", n), {"a": 1.0})


def test_ngram_back_off_is_shared_in_proportion_to_the_lower_order():
    # "_ab _cdd _a": c(a) = 2 (one trailing), c(ab) = 1, so b gets 1/2; the other 1/2 goes
    # to the unseen a, c, d in proportion to unigrams 2 : 1 : 2
    _assert_dist(_ngram("ab|cdd|a", 2), {"b": 0.5, "a": 0.2, "c": 0.1, "d": 0.2})
    # nothing ever followed c: all mass to the unigrams renormalised over the vocabulary
    _assert_dist(_ngram("aabc|c", 2), {"a": 0.4, "b": 0.2, "c": 0.4})
    # "__ca __bcd __c": p2(.|c) = a 1/3, d 1/3, then 1/3 on b, c as unigrams 1 : 3;
    # p3(.|_c): c(_c) = 2, c(_ca) = 1 so a 1/2; b, c, d share 1/2 as p2 = 1/12 : 3/12 : 4/12
    _assert_dist(_ngram("ca|bcd|c", 3), {"a": 0.5, "b": 1 / 16, "c": 3 / 16, "d": 0.25})


def test_ngram_rows_sum_below_one_without_unseen_letters():
    # c(a) = 3 counts the trailing a; c(aa) = 1; no unseen letter takes the other 2/3
    _assert_dist(_ngram("aa|a", 2), {"a": 1 / 3})
    _assert_dist(_ngram("abba|b", 2), {"a": 1 / 3, "b": 1 / 3})


def test_ngram_context_after_separator_is_the_padding():
    # right after "|" the context is all "_"; c(__) = 3 includes the empty current string
    _assert_dist(_ngram("ab|ba|", 2), {"a": 1 / 3, "b": 1 / 3})
    _assert_dist(_ngram("ab|ba|", 3), {"a": 1 / 3, "b": 1 / 3})
    _assert_dist(_ngram("ab|ab|ba|", 4), {"a": 0.5, "b": 0.25})
    _assert_dist(_ngram("ab|", 4), {"a": 0.5, "b": 0.5})


def test_ngram_unigrams_count_the_padding():
    model = rb.InContextNgram(3)
    for tok in _encode("ab|c"):  # "__ab __c": 4 pads + 3 letters
        model.add(int(tok))
    p1, p2, p3 = model.orders()
    np.testing.assert_allclose(p1[1:4], 1 / 7)
    assert p1.sum() == pytest.approx(3 / 7)
    assert p2[1:4].sum() == pytest.approx(1.0) and p3.sum() == pytest.approx(1.0)


def _reference_ngram(prefix, n):
    """The estimator written out from scratch on the whole prefix (no incremental counts)."""
    padded = [["_"] * (n - 1) + list(s) for s in prefix.split("|")]
    grams = Counter(tuple(s[i: i + k]) for s in padded for k in range(1, n + 1)
                    for i in range(len(s) - k + 1))
    vocab = sorted(set(prefix) - {"|"})
    total = sum(c for g, c in grams.items() if len(g) == 1)
    p = {v: grams[(v,)] / total for v in vocab}
    cur = padded[-1]
    for k in range(2, n + 1):
        h = tuple(cur[len(cur) - k + 1:])
        q = {v: grams[h + (v,)] / grams[h] for v in vocab if grams[h + (v,)]}
        unseen = [v for v in vocab if v not in q]
        rest, z = 1 - sum(q.values()), sum(p[v] for v in unseen)
        q.update({v: rest * p[v] / z for v in unseen})
        p = q
    return p


def test_ngram_matches_the_estimator_written_from_scratch(data):
    rng = np.random.default_rng(0)
    seqs = [data.test[0].tokens[:150]]
    for _ in range(3):
        seq = rng.integers(1, 6, size=60)
        seq[rng.random(60) < 0.2] = rb.SEP
        seq[0] = 1
        seqs.append(seq)
    for tokens in seqs:
        for n in (1, 2, 3, 4):
            got = rb.ngram_probs(tokens, n)
            assert got.shape == (len(tokens) - 1, rb.VOCAB_SIZE)
            for t in range(len(tokens) - 1):
                want = np.zeros(rb.VOCAB_SIZE)
                for c, v in _reference_ngram(rb.decode(tokens[: t + 1]), n).items():
                    want[rb.LETTERS.index(c) + 1] = v
                np.testing.assert_allclose(got[t], want, atol=1e-12, err_msg=f"n={n} t={t}")


def test_baselines_are_between_uniform_and_oracle(data):
    res = rb.baseline_scores(data.test)
    assert list(res) == ["oracle", "2-gram", "3-gram", "4-gram"]
    assert res["oracle"]["accuracy"] == 1.0
    n_out = sum(len(ex.tokens) - 1 for ex in data.test)
    for name in ("2-gram", "3-gram", "4-gram"):
        assert res[name]["positions"] == n_out
        assert 0.5 < res[name]["accuracy"] < 1.0 and 0.0 < res[name]["tvd"] < 0.5
    assert res["3-gram"]["accuracy"] > res["2-gram"]["accuracy"]
    assert res["3-gram"]["tvd"] < res["2-gram"]["tvd"]


def test_collate_masks_separators_and_padding(data):
    batch = rb.collate(data.test[:4])
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape[1] == max(len(e.tokens) for e in data.test[:4])
    assert bool((labels[ids == rb.SEP] == -100).all())
    assert bool((labels[ids == rb.PAD] == -100).all())
    letters = (ids >= 1) & (ids <= 18)
    assert bool((labels[letters] == ids[letters]).all())


class _TableLM(torch.nn.Module):
    """Logits = log of ``probs(example)`` looked up by the unpadded tokens; -30 on padding."""

    def __init__(self, examples, probs):
        super().__init__()
        self.table = {tuple(e.tokens.tolist()): e for e in examples}
        self.probs = probs

    def forward(self, input_ids):
        logits = torch.full((*input_ids.shape, rb.VOCAB_SIZE), -30.0)
        for b, row in enumerate(input_ids.tolist()):
            n = len(row) - row[::-1].index(next(x for x in row[::-1] if x != rb.PAD))
            ex = self.table[tuple(row[:n])]
            logits[b, : n - 1] = torch.log(torch.from_numpy(self.probs(ex)) + 1e-13)
        return type("Out", (), {"logits": logits})()


def _all_on_sep(ex):
    p = np.zeros((len(ex.tokens) - 1, rb.VOCAB_SIZE))
    p[:, rb.SEP] = 1.0
    return p


def _oracle_but_sep_at_sep_targets(ex):
    p = rb.oracle_probs(ex)
    p[~ex.letter_targets()] = _all_on_sep(ex)[~ex.letter_targets()]
    return p


def test_evaluate_model_scores_every_output_and_no_padding(data):
    n_out = sum(len(e.tokens) - 1 for e in data.test)
    n_letters = sum(int(e.letter_targets().sum()) for e in data.test)
    res = rb.evaluate_model(_TableLM(data.test, rb.oracle_probs), data.test, batch_size=3)
    assert res["accuracy"] == 1.0 and res["tvd"] < 1e-6
    assert res["positions"] == n_out and res["positions_letters"] == n_letters < n_out

    res = rb.evaluate_model(_TableLM(data.test, _all_on_sep), data.test, batch_size=3)
    assert res["accuracy"] == 0.0 and res["tvd"] == pytest.approx(1.0, abs=1e-6)
    assert res["positions"] == n_out

    # right on letter targets, all mass on "|" where "|" comes next: those count as wrong
    res = rb.evaluate_model(_TableLM(data.test, _oracle_but_sep_at_sep_targets), data.test,
                            batch_size=3)
    assert res["accuracy_letters"] == 1.0 and res["tvd_letters"] < 1e-6
    assert res["accuracy"] == pytest.approx(n_letters / n_out)
    assert res["tvd"] == pytest.approx(1 - n_letters / n_out, abs=1e-6)
