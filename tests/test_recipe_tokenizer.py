"""The 124M recipe's GPT-2 tokenizer by hub id: a hub id reaches the hub loader (cache or
download), offline it fails in one line that names both ways out, and the recipe asks for it."""

from pathlib import Path

import pytest

from mosaics.data import load_tokenizer, prepare_corpus
from mosaics.errors import DataError
from mosaics.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_a_hub_id_goes_to_the_hub_loader_without_local_only(monkeypatch):
    import transformers

    calls = []

    class Loaded:
        eos_token_id = 50256

    def fake(name, **kwargs):
        calls.append((name, kwargs))
        return Loaded()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake)
    assert load_tokenizer("gpt2").eos_token_id == 50256
    assert calls == [("gpt2", {})]  # may download: HF_HUB_OFFLINE decides, not this code


def test_offline_without_the_files_fails_in_one_line_naming_both_ways_out(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError) as err:
        load_tokenizer("mosaics-tests/no-such-tokenizer")
    message = str(err.value)
    assert "\n" not in message
    assert "local folder" in message and "tokenizer=null" in message
    assert "save_pretrained" in message
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(ROOT / "no" / "such" / "folder"))


def test_the_recipe_uses_gpt2_and_the_corpus_reaches_the_hub_loader(tmp_path, monkeypatch):
    cfg = load_config(str(ROOT / "configs" / "babistories_124m.yaml"))
    assert cfg.tokenizer == "gpt2" and cfg.vocab_size == 50257
    assert (cfg.dropout, cfg.attn_dropout, cfg.global_batch_size) == (0.05, 0.05, 512)
    text = (ROOT / "configs" / "babistories_124m.yaml").read_text()
    assert "Differences from the reference run" in text
    (tmp_path / "train.txt").write_text("one story.\n\nanother story.\n")
    try:
        prepare_corpus(str(tmp_path / "train.txt"), tokenizer=cfg.tokenizer,
                       cache_dir=tmp_path / "cache")
    except DataError as err:  # offline, GPT-2 not in the cache
        assert "tokenizer=null" in str(err) and "'gpt2'" in str(err)
    else:  # GPT-2 was in the local HF cache
        assert len(load_tokenizer("gpt2")) == 50257
