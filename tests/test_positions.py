"""``call_positions``: where a call's tokens sit, its documents and padding, and the document
state a cache keeps between decoding calls."""

from __future__ import annotations

import torch

from mosaics.cache import MosaicsCache
from mosaics.positions import call_positions, padding_starts


def test_v1_without_padding_has_no_positions(tiny_config) -> None:
    ids = torch.randint(0, 61, (2, 5))
    assert call_positions(tiny_config(), ids, None, ids.shape, None, ids.device) == (None, None)


def test_documents_continue_across_calls(tiny_config) -> None:
    cfg = tiny_config(document_masking=True, document_separator_id=0)
    ids = torch.tensor([[5, 0, 7, 8], [5, 6, 7, 0]])
    cache = MosaicsCache(cfg.n_layer)
    pos, docs = call_positions(cfg, ids, None, ids.shape, cache, ids.device)
    assert pos.start == 0 and pos.restart is None
    assert pos.documents.tolist() == [[1, 1, 2, 2], [1, 1, 1, 1]]
    assert pos.doc_starts.tolist() == [[0, 0, 2, 2], [0, 0, 0, 0]]
    assert docs.last_is_separator.tolist() == [False, True]
    cache.documents, cache.seen_tokens = docs, 4
    nxt = torch.tensor([[9], [9]])
    pos, docs = call_positions(cfg, nxt, None, nxt.shape, cache, nxt.device)
    assert pos.start == 4 and pos.restart.tolist() == [False, True]
    assert pos.doc_starts.tolist() == [[2], [4]] and docs.id.tolist() == [2, 2]
    assert call_positions(cfg, nxt, None, nxt.shape, None, nxt.device)[1] is None  # no cache


def test_left_padding_starts_a_document_at_the_first_real_token(tiny_config) -> None:
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    real, begins = padding_starts(mask, 4, 0)
    assert begins.tolist() == [[False, False, True, False], [False] * 4]
    ids = torch.randint(1, 61, (2, 4))
    pos, docs = call_positions(tiny_config(), ids, None, ids.shape, None, ids.device, mask)
    assert pos.keep.tolist() == real.tolist() and docs is None
    assert pos.doc_starts.tolist() == [[0, 0, 2, 2], [0, 0, 0, 0]]


def test_the_gap_is_drawn_in_training_only(tiny_config) -> None:
    cfg = tiny_config(three_level_memory=True, short_term_window=6, long_term_gap=4,
                      long_term_gap_range=[2, 9])
    ids = torch.randint(0, 61, (1, 6))
    torch.manual_seed(0)
    gaps = {call_positions(cfg, ids, None, ids.shape, None, ids.device, training=True)[0].gap
            for _ in range(30)}
    assert len(gaps) > 1 and gaps <= set(range(2, 10))
    assert call_positions(cfg, ids, None, ids.shape, None, ids.device)[0].gap == 4
