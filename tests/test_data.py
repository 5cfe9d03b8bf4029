"""Data layer: story generator, loaders, tokenizer, token stream, window sampler, corpus."""

from __future__ import annotations

import json
import logging
import re

import datasets
import huggingface_hub
import numpy as np
import pytest
import torch

from mosaics.data import (
    EOT,
    MalformedInputError,
    MissingSplitError,
    RandomWindowBatches,
    context_oracle_report,
    fixed_validation_windows,
    generate_stories,
    generate_story_records,
    load_texts,
    load_tokenizer,
    make_default_corpus,
    prepare_corpus,
    stream_dtype,
    tokenize_to_stream,
    train_bpe_tokenizer,
    write_story_file,
)
from mosaics.errors import DataError

DOCS = [
    'Tom had a "red" ball.\nHe liked it.',
    "Ünïcödé story — with emoji 🎈 and tabs\t.",
    "A third, short one.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(generate_stories(200, seed=3) + DOCS, vocab_size=400)


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text)


# ------------------------------------------------------------------------------- generator


def test_generator_is_deterministic_in_seed():
    a, b, c = generate_stories(50, 0), generate_stories(50, 0), generate_stories(50, 1)
    assert a == b
    assert a != c
    assert len(set(a)) == 50  # varied, no duplicate stories


def test_recall_answer_is_stated_only_earlier_in_the_story():
    for s in generate_story_records(400, seed=5):
        assert s.text[s.answer_start :].startswith(s.answer)
        body = s.text[: s.question_start]
        question = s.text[s.question_start : s.answer_start]
        assert s.answer in words(body), s.text
        assert s.answer not in words(question), s.text  # the question does not give it away
        assert s.question_start < s.answer_start


def test_context_predicts_recall_answers_better_than_a_global_model():
    train = generate_story_records(1000, seed=0)
    test = generate_story_records(300, seed=1)
    r = context_oracle_report(train, test)
    assert r["answer_in_story"] == 1.0
    assert r["context_nll"] < r["global_nll"] - 1.0
    assert r["assoc_acc"] > r["global_acc"] + 0.5
    assert r["assoc_nll"] < r["context_nll"]


def test_make_default_corpus_writes_once(tmp_path):
    train, val = make_default_corpus(tmp_path, num_train=30, num_val=5, seed=2)
    assert [json.loads(x) for x in train.read_text().splitlines()] == generate_stories(30, 2)
    assert len(val.read_text().splitlines()) == 5
    mtime = train.stat().st_mtime_ns
    make_default_corpus(tmp_path, num_train=30, num_val=5, seed=2)
    assert train.stat().st_mtime_ns == mtime  # reused
    make_default_corpus(tmp_path, num_train=31, num_val=5, seed=2)
    assert len(train.read_text().splitlines()) == 31  # settings changed: regenerated


# --------------------------------------------------------------------------------- loaders


def test_babistories_file_and_directory(tmp_path):
    write_story_file(tmp_path / "traindataset.txt", DOCS)
    write_story_file(tmp_path / "valdataset.txt", DOCS[:1])
    cache = str(tmp_path / "cache")
    assert load_texts(str(tmp_path / "traindataset.txt"), cache_dir=cache)["text"] == DOCS
    ds = load_texts(str(tmp_path), "train", cache_dir=cache)
    assert ds.column_names == ["text"] and ds["text"] == DOCS
    for split in ("validation", "val"):
        assert load_texts(str(tmp_path), split, cache_dir=cache)["text"] == DOCS[:1]
    with pytest.raises(MissingSplitError):
        load_texts(str(tmp_path / "traindataset.txt"), "validation", cache_dir=cache)


def test_loader_sees_a_rewritten_file(tmp_path):
    f = tmp_path / "stories.txt"
    write_story_file(f, DOCS)
    assert len(load_texts(str(f), cache_dir=str(tmp_path / "c"))) == 3
    write_story_file(f, DOCS[:2])
    assert load_texts(str(f), cache_dir=str(tmp_path / "c"))["text"] == DOCS[:2]


def test_babistories_malformed_line(tmp_path, caplog):
    f = tmp_path / "traindataset.txt"
    f.write_text('"one"\n"two"\n{"text": "not a string"}\n"four"\nnot json\n')
    cache = str(tmp_path / "cache")
    with pytest.raises(MalformedInputError, match=re.escape(f"{f}:3")):
        load_texts(str(f), cache_dir=cache)
    with caplog.at_level(logging.WARNING, logger="mosaics.data.loading"):
        ds = load_texts(str(f), skip_malformed=True, cache_dir=cache)
    assert ds["text"] == ["one", "two", "four"]
    assert "skipped 2 malformed" in caplog.text


def test_plain_text_is_split_into_paragraphs(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text('"Hi," said Tom.\nSame doc.\n\n\nSecond doc.\n  \nThird doc.')
    ds = load_texts(str(f), cache_dir=str(tmp_path / "c"))
    assert ds["text"] == ['"Hi," said Tom.\nSame doc.', "Second doc.", "Third doc."]


def test_jsonl_with_text_column_and_malformed_lines(tmp_path, caplog):
    f = tmp_path / "docs.jsonl"
    f.write_text(
        json.dumps({"story": "a", "id": 1})
        + "\n"
        + json.dumps({"id": 2})
        + "\n"
        + json.dumps(["x"])
        + "\n"
        + json.dumps({"story": "d"})
        + "\n"
    )
    cache = str(tmp_path / "c")
    with pytest.raises(MalformedInputError, match=re.escape(f"{f}:2")) as err:
        load_texts(str(f), text_column="story", cache_dir=cache)
    assert "'story'" in str(err.value)
    with caplog.at_level(logging.WARNING, logger="mosaics.data.loading"):
        ds = load_texts(str(f), text_column="story", skip_malformed=True, cache_dir=cache)
    assert ds["text"] == ["a", "d"] and ds.column_names == ["text"]
    assert "skipped 2 malformed" in caplog.text


def test_saved_datasets_and_data_folders(tmp_path):
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"body": ["x", "y"], "n": [1, 2]}),
            "validation": datasets.Dataset.from_dict({"body": ["z"], "n": [3]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    ds = load_texts(str(tmp_path / "dd"), "val", text_column="body")
    assert ds.column_names == ["text"] and ds["text"] == ["z"]
    dd["train"].save_to_disk(str(tmp_path / "one"))
    assert load_texts(str(tmp_path / "one"), text_column="body")["text"] == ["x", "y"]
    with pytest.raises(ValueError, match="no column 'text'"):
        load_texts(str(tmp_path / "one"))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "p"}\n{"text": "q"}\n')
    assert load_texts(str(folder), cache_dir=str(tmp_path / "c"))["text"] == ["p", "q"]


def test_hub_id_fails_fast_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError, match="save_to_disk") as err:
        load_texts("nobody-here/no-such-dataset", cache_dir=str(tmp_path))
    assert "HF_HUB_OFFLINE" in str(err.value)
    with pytest.raises(FileNotFoundError):
        load_texts(str(tmp_path / "missing.txt"))


# --------------------------------------------------------------------- tokenizer and stream


def test_tokenizer_round_trip_and_save_load(tokenizer, tmp_path):
    assert tokenizer.eos_token == EOT and tokenizer.eos_token_id == 0
    assert tokenizer.pad_token_id == tokenizer.bos_token_id == 0
    assert len(tokenizer) <= 400
    for text in DOCS + generate_stories(5, seed=9):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert tokenizer.eos_token_id not in ids
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    again = load_tokenizer(str(tmp_path / "tok"))
    assert again(DOCS)["input_ids"] == tokenizer(DOCS)["input_ids"]
    assert again.eos_token_id == tokenizer.eos_token_id
    with pytest.raises(DataError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path / "nothing"))


def test_stream_dtype_fits_the_vocabulary():
    assert stream_dtype(65535) == np.uint16
    assert stream_dtype(65536) == np.uint32


def test_stream_is_documents_each_followed_by_eot(tokenizer, tmp_path):
    docs = DOCS + generate_stories(20, seed=4)
    ds = datasets.Dataset.from_dict({"text": docs})
    stream = tokenize_to_stream(ds, tokenizer, cache_dir=tmp_path)
    assert stream.dtype == np.uint16 and stream.ndim == 1
    eos = tokenizer.eos_token_id
    ends = np.flatnonzero(stream == eos)
    assert len(ends) == len(docs) and ends[-1] == len(stream) - 1
    pieces = np.split(stream, ends[:-1] + 1)
    for doc, piece in zip(docs, pieces):
        assert piece.tolist() == tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos]
    assert len(list(tmp_path.glob("tokens-*.npy"))) == 1
    np.testing.assert_array_equal(tokenize_to_stream(ds, tokenizer, cache_dir=tmp_path), stream)
    np.testing.assert_array_equal(tokenize_to_stream(ds, tokenizer, num_proc=2), stream)


# ----------------------------------------------------------------------------------- windows


def test_window_batches_are_deterministic_windows_of_the_stream():
    tokens = np.arange(1000, dtype=np.uint16)
    a = RandomWindowBatches(tokens, block_size=16, batch_size=4, seed=7)
    b = RandomWindowBatches(tokens, block_size=16, batch_size=4, seed=7)
    x = a.batch(3)
    assert x["input_ids"].shape == (4, 16) and x["input_ids"].dtype == torch.int64
    assert torch.equal(x["input_ids"], b.batch(3)["input_ids"])
    assert torch.equal(x["labels"], x["input_ids"])
    assert not torch.equal(x["input_ids"], a.batch(4)["input_ids"])
    off = torch.as_tensor(a.offsets(3), dtype=torch.int64)
    assert torch.equal(x["input_ids"], off[:, None] + torch.arange(16))
    seen = np.concatenate([a.offsets(s) for s in range(500)])
    assert seen.min() >= 0 and seen.max() <= 1000 - 16
    assert seen.min() < 20 and seen.max() > 1000 - 16 - 20  # covers the whole range


def test_ranks_draw_different_slices_of_one_global_batch():
    tokens = np.arange(5000, dtype=np.uint16)
    whole = RandomWindowBatches(tokens, 8, batch_size=6, seed=1)
    parts = [
        RandomWindowBatches(tokens, 8, batch_size=3, seed=1, rank=r, world_size=2) for r in (0, 1)
    ]
    for step in (0, 5):
        r0, r1 = (p.batch(step)["input_ids"] for p in parts)
        assert not torch.equal(r0, r1)
        assert torch.equal(torch.cat([r0, r1]), whole.batch(step)["input_ids"])


def test_a_steps_windows_do_not_depend_on_the_split():
    tokens = np.arange(5000, dtype=np.uint16)
    whole = RandomWindowBatches(tokens, 8, batch_size=8, seed=1)
    for step in (0, 3):
        expect = whole.batch(step)["input_ids"]
        ranks = [RandomWindowBatches(tokens, 8, batch_size=2, seed=1, rank=r, world_size=2,
                                     accumulation=2) for r in (0, 1)]
        parts = [ranks[r].batch(step * 2 + k)["input_ids"] for k in (0, 1) for r in (0, 1)]
        assert torch.equal(torch.cat(parts), expect)
        micro = RandomWindowBatches(tokens, 8, batch_size=4, seed=1, accumulation=2)
        assert torch.equal(torch.cat([micro.batch(step * 2 + k)["input_ids"] for k in (0, 1)]),
                           expect)
    state = whole.state_dict()
    ranks[0].load_state_dict(state)  # same global batch, other split: accepted
    with pytest.raises(DataError, match="global_rows=8, this run has global_rows=4"):
        RandomWindowBatches(tokens, 8, batch_size=4, seed=1).load_state_dict(state)


def test_window_state_refuses_another_stream_or_seed():
    tokens = np.arange(3000, dtype=np.uint16)
    ds = RandomWindowBatches(tokens, 12, batch_size=3, seed=2)
    RandomWindowBatches(tokens, 12, batch_size=3, seed=2).load_state_dict(ds.state_dict())
    with pytest.raises(DataError, match="seed=2, this run has seed=3"):
        RandomWindowBatches(tokens, 12, batch_size=3, seed=3).load_state_dict(ds.state_dict())
    with pytest.raises(DataError, match="num_tokens"):
        RandomWindowBatches(tokens[:2000], 12, batch_size=3, seed=2).load_state_dict(
            ds.state_dict())


def test_fixed_validation_windows():
    tokens = np.arange(1000, dtype=np.uint16)
    all_w = fixed_validation_windows(tokens, 10, max_windows=1000)
    assert all_w.shape == (100, 10)
    assert torch.equal(all_w.flatten(), torch.arange(1000))
    a = fixed_validation_windows(tokens, 10, max_windows=7, seed=1)
    assert a.shape == (7, 10)
    assert torch.equal(a, fixed_validation_windows(tokens, 10, max_windows=7, seed=1))
    assert not torch.equal(a, fixed_validation_windows(tokens, 10, max_windows=7, seed=2))
    starts = a[:, 0]
    assert torch.all(starts % 10 == 0) and torch.all(starts[1:] > starts[:-1])
    assert torch.equal(a, starts[:, None] + torch.arange(10))
    with pytest.raises(ValueError, match="shorter than one window"):
        fixed_validation_windows(tokens[:5], 10, max_windows=3)


# ------------------------------------------------------------------------------------ corpus


def test_prepare_default_corpus_is_cached(tmp_path):
    c = prepare_corpus(cache_dir=tmp_path, num_train_stories=150, vocab_size=500)
    eos = c.tokenizer.eos_token_id
    assert int((c.train_tokens == eos).sum()) == 150
    assert int((c.val_tokens == eos).sum()) == 100
    assert len(c.tokenizer) <= 500 and c.train_tokens.max() < len(c.tokenizer)
    again = prepare_corpus(cache_dir=tmp_path, num_train_stories=150, vocab_size=500)
    np.testing.assert_array_equal(again.train_tokens, c.train_tokens)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1


def test_prepare_corpus_carves_validation_from_a_single_file(tmp_path, tokenizer):
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    src = tmp_path / "docs.jsonl"
    stories = generate_stories(60, seed=8)
    src.write_text("".join(json.dumps({"text": s}) + "\n" for s in stories))
    kwargs = dict(tokenizer=str(tmp_path / "tok"), val_fraction=0.1, cache_dir=tmp_path / "c")
    c = prepare_corpus(str(src), **kwargs)
    eos = c.tokenizer.eos_token_id
    assert int((c.val_tokens == eos).sum()) == 6
    assert int((c.train_tokens == eos).sum()) == 54
    c2 = prepare_corpus(str(src), **kwargs)
    np.testing.assert_array_equal(c2.val_tokens, c.val_tokens)
    c3 = prepare_corpus(str(src), seed=1, **kwargs)
    assert not np.array_equal(c3.val_tokens, c.val_tokens)
