"""Model cards: written next to the model, a YAML header the hub parses, the facts in the body."""

from __future__ import annotations

import pytest
import yaml
from huggingface_hub import ModelCard

from mosaics import MosaicsForCausalLM
from mosaics.errors import InputError
from mosaics.model_card import format_count, write_model_card, write_training_card
from mosaics.training import TrainConfig, TrainResult


def _header(text: str) -> dict:
    assert text.startswith("---\n")
    head, _, _ = text[4:].partition("\n---\n")
    return yaml.safe_load(head)


def test_training_card_header_and_body(tiny_config, tmp_path):
    model = MosaicsForCausalLM(tiny_config(kernel="gaussian"))
    model.save_pretrained(tmp_path)
    cfg = TrainConfig(data_source="roneneldan/TinyStories", tokenizer="gpt2", max_steps=7,
                      global_batch_size=16, block_size=64)
    result = TrainResult(run_dir=tmp_path, steps=7, train_loss=2.25, val_loss=2.5,
                         wall_seconds=1.0)
    path = write_training_card(tmp_path, cfg, result)
    assert path == tmp_path / "README.md"
    text = path.read_text()
    header = _header(text)
    assert header["library_name"] == "transformers"
    assert header["pipeline_tag"] == "text-generation"
    assert header["license"] == "mit"
    assert header["datasets"] == ["roneneldan/TinyStories"]
    assert "memory-mosaics" in header["tags"] and "kernel-gaussian" in header["tags"]
    card = ModelCard.load(path)  # the hub's own parser
    assert card.data.pipeline_tag == "text-generation"
    n_params = sum(p.numel() for p in model.parameters())  # tied head counted once
    assert f"({n_params:,} parameters)" in text
    for fact in ("2 blocks", "width d = 32, 4 heads of 8", "optimizer steps: 7 of 1,024 tokens",
                 "final train loss: 2.2500", "final validation loss: 2.5000",
                 "tokenizer: `gpt2`", "AutoModelForCausalLM.from_pretrained",
                 "arXiv:2405.06394", "arXiv:2507.03285"):
        assert fact in text, fact


def test_local_data_is_described_but_not_a_hub_dataset(tiny_config, tmp_path):
    MosaicsForCausalLM(tiny_config()).save_pretrained(tmp_path)
    cfg = TrainConfig(data_source=str(tmp_path), max_steps=3)
    result = TrainResult(run_dir=tmp_path, steps=3, train_loss=None, val_loss=3.0,
                         wall_seconds=1.0)
    text = write_training_card(tmp_path, cfg, result).read_text()
    assert "datasets" not in _header(text)
    assert f"- data: {tmp_path}" in text
    assert "final train loss" not in text and "final validation loss: 3.0000" in text


def test_parameter_counts_read_well():
    assert format_count(123_588_336) == "123.6M" and format_count(20_544) == "20,544"


def test_card_with_evaluation_results(tiny_config, tmp_path):
    MosaicsForCausalLM(tiny_config()).save_pretrained(tmp_path)
    text = write_model_card(tmp_path, results={"regbench accuracy": 0.875}).read_text()
    assert "| regbench accuracy | 0.875 |" in text


def test_card_needs_the_saved_model(tmp_path):
    with pytest.raises(InputError, match="config.json"):
        write_model_card(tmp_path)
    assert not (tmp_path / "README.md").exists()


@pytest.mark.integration
def test_trainer_final_directory_has_a_card(tmp_path):
    """End to end: ``train`` writes final/README.md whose numbers are the run's."""
    from mosaics.training import train

    cfg = TrainConfig(run_dir=str(tmp_path / "run"), max_steps=2, num_train_stories=200,
                      vocab_size=300, n_layer=1, n_embd=32, n_head=2, block_size=32,
                      batch_size=2, eval_interval=0, eval_windows=2, checkpoint_interval=0,
                      sample_tokens=0, progress_bar=False, tensorboard=False)
    result = train(cfg)
    text = (result.final_dir / "README.md").read_text()
    assert _header(text)["pipeline_tag"] == "text-generation"
    assert "optimizer steps: 2" in text
    assert f"final validation loss: {result.val_loss:.4f}" in text
