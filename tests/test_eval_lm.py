"""Language-model evaluation: windows, loss / perplexity, loss by position."""

import math

import numpy as np
import pytest
import torch

from mosaics.evaluation import lm


def test_windows_are_contiguous_slices():
    tokens = np.arange(103)
    w = lm.windows(tokens, 10)
    assert w.shape == (10, 10) and w[3].tolist() == list(range(30, 40))
    sub = lm.windows(tokens, 10, max_windows=4, seed=1)
    assert sub.shape == (4, 10)
    starts = sub[:, 0].tolist()
    assert starts == sorted(starts) and all(s % 10 == 0 for s in starts)
    with pytest.raises(ValueError, match="shorter than one window"):
        lm.windows(tokens, 200)


class _Bigram(torch.nn.Module):
    """logits[t] = table[x_t]: a fixed bigram model."""

    def __init__(self, table):
        super().__init__()
        self.table = table
        self.head = torch.nn.Linear(1, table.shape[0], bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.table[input_ids]})()


def test_loss_and_loss_by_position_against_a_manual_sum():
    torch.manual_seed(0)
    vocab = 7
    table = torch.randn(vocab, vocab)
    wins = torch.randint(0, vocab, (5, 12))
    res = lm.evaluate_windows(_Bigram(table), wins, batch_size=2)
    logp = torch.log_softmax(table, -1)
    manual = torch.tensor([[-float(logp[w[t - 1], w[t]]) for t in range(1, 12)] for w in wins])
    np.testing.assert_allclose(res["loss_by_position"], manual.mean(0).numpy(), rtol=1e-5)
    assert res["loss"] == pytest.approx(float(manual.mean()), rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(res["loss"]), rel=1e-9)
    assert res["tokens_scored"] == 5 * 11
    uniform = lm.evaluate_windows(_Bigram(torch.zeros(vocab, vocab)), wins)
    assert uniform["loss"] == pytest.approx(math.log(vocab))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        lm.evaluate_windows(_Bigram(table), wins + vocab)


def test_plain_text_fallback_reader(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "one"}\n"two"\n\n')
    assert lm._read_plain(p, "text") == ["one", "two"]
    p.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="a.jsonl:1"):
        lm._read_plain(p, "text")
    t = tmp_path / "b.txt"
    t.write_text("first doc\nline\n\nsecond\n")
    assert lm._read_plain(t, "text") == ["first doc\nline", "second\n"]
