"""The needle recall probe: prompts (one gold fact, exact lengths, seeded), scores (a model
that reads the fact scores 1.0, without the fact chance) and the report on each model family."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mosaics.data.storygen import COLOURS, generate_stories
from mosaics.evaluation.needle import NeedleBuilder, NeedleError, run_cell

BLOCK = 64


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from mosaics.data import train_bpe_tokenizer

    d = tmp_path_factory.mktemp("tok")
    tok = train_bpe_tokenizer(generate_stories(1500, seed=5), vocab_size=1200, save_dir=d)
    tok.saved_to = d
    return tok


@pytest.fixture(scope="module")
def texts():
    return generate_stories(300, seed=11)


def _colour_ids(tok):
    ids = [tok(" " + c, add_special_tokens=False)["input_ids"] for c in COLOURS]
    assert all(len(i) == 1 for i in ids), "the test tokenizer should keep colours whole"
    return [i[0] for i in ids]


def test_prompts_hold_one_gold_fact_at_exact_lengths(tok, texts):
    b = NeedleBuilder(tok, texts, facts=3, block_size=BLOCK, seed=0)
    assert b.mode == "story"
    for length in (2 * BLOCK, 4 * BLOCK, 16 * BLOCK):
        for i in range(3):
            p = b.build(length, i, depth=0.5)
            assert len(p.ids) == length
            text = tok.decode(p.ids)
            assert re.search(r"What color was the (\w+)\? The \1 was$", text)
            assert len(re.findall(rf"\b{p.answer}\b", text)) == 1  # only in the gold fact
            gold = tok.decode(p.ids[p.gold_at:])
            assert re.match(rf"\s*\S.*\b{p.answer}\b", gold)
            assert len(p.facts_at) == 2
            none = b.build(length, i, control="no_gold")
            assert len(none.ids) == length and none.gold_at is None
            assert not re.search(rf"\b{p.answer}\b", tok.decode(none.ids))


def test_prompts_are_seeded_and_depth_moves_only_the_gold_fact(tok, texts):
    a = NeedleBuilder(tok, texts, facts=2, block_size=BLOCK, seed=3)
    b = NeedleBuilder(tok, texts, facts=2, block_size=BLOCK, seed=3)
    assert a.build(8 * BLOCK, 4, depth=0.25).ids == b.build(8 * BLOCK, 4, depth=0.25).ids
    assert a.build(8 * BLOCK, 4, depth=0.25).ids != a.build(8 * BLOCK, 5, depth=0.25).ids
    assert (NeedleBuilder(tok, texts, facts=2, block_size=BLOCK, seed=4)
            .build(8 * BLOCK, 4, depth=0.25).ids != a.build(8 * BLOCK, 4, depth=0.25).ids)
    at = [a.build(8 * BLOCK, 1, depth=d).gold_at for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert at == sorted(at) and at[0] <= 12 and at[-1] >= 8 * BLOCK - 80
    answers = {a.build(8 * BLOCK, 1, depth=d).answer for d in (0.0, 0.5, 1.0)}
    assert len(answers) == 1
    for i in range(5):  # the recent control: the gold fact inside the last training window
        p = a.build(16 * BLOCK, i, control="recent")
        assert p.gold_at >= 16 * BLOCK - BLOCK


def test_passkey_mode_and_clear_errors(tok, texts):
    b = NeedleBuilder(tok, ["plain text without the question. " * 5] * 30, facts=2,
                      block_size=BLOCK)
    assert b.mode == "passkey"
    p = b.build(4 * BLOCK, 0, depth=0.5)
    text = tok.decode(p.ids)
    assert len(p.ids) == 4 * BLOCK and text.endswith("The pass key is")
    assert text.count(p.answer) == 2 and p.answer in p.candidates and len(p.candidates) == 12
    with pytest.raises(NeedleError, match="no haystack"):
        NeedleBuilder(tok, texts, facts=3, block_size=BLOCK).build(20, 0, depth=0.0)
    with pytest.raises(NeedleError, match="at least 20"):
        NeedleBuilder(tok, texts[:5], mode="story")
    with pytest.raises(NeedleError, match="exactly one"):
        b.build(BLOCK, 0)


class ReadingModel(nn.Module):
    """Puts all its mass on the colour that the prompt states for the asked object, and draws
    random logits when the prompt does not state it."""

    def __init__(self, tok, vocab: int) -> None:
        super().__init__()
        self.tok, self.vocab = tok, vocab
        self.colour_ids = dict(zip(COLOURS, _colour_ids(tok), strict=True))
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, input_ids, use_cache=False, past_key_values=None):
        logits = torch.randn(*input_ids.shape, self.vocab, generator=self.gen)
        for b, row in enumerate(input_ids.tolist()):
            text = self.tok.decode(row)
            obj = re.search(r"What color was the (\w+)\? The \1 was$", text).group(1)
            said = re.search(rf"\b({'|'.join(COLOURS)}) {obj}\b", text)
            if said:
                logits[b, -1] = -10.0
                logits[b, -1, self.colour_ids[said.group(1)]] = 10.0
        return SimpleNamespace(logits=logits, past_key_values=None)


def test_a_model_that_reads_the_fact_scores_one_and_without_it_chance(tok, texts):
    model = ReadingModel(tok, len(tok))
    b = NeedleBuilder(tok, texts, facts=3, block_size=BLOCK, seed=1)
    for depth in (0.0, 0.5, 1.0):
        cell = run_cell(model, b, tok, 4 * BLOCK, depth, None, 12, batch_size=5)
        assert cell.exact_match == 1.0 and cell.top1 == 1.0 and cell.mean_rank == 1.0
        assert cell.distractor == 0.0
    none = run_cell(model, b, tok, 4 * BLOCK, None, "no_gold", 240, batch_size=40)
    assert none.chance == pytest.approx(1 / 12)
    assert 0.02 <= none.top1 <= 0.16  # chance 1/12 among the candidates (random logits)
    assert none.exact_match <= none.top1  # greedy over the whole vocabulary: below that
    assert 5.0 <= none.mean_rank <= 8.0  # chance 6.5


def _save_family(tok, kind: str, out):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from mosaics import MosaicsConfig, MosaicsForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=BLOCK,
                                           **common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=2, **common))
    else:
        build = MosaicsConfig.v2 if kind == "v2" else MosaicsConfig
        extra = dict(short_term_window=32, long_term_gap=8, long_term_gap_range=(8, 32)) \
            if kind == "v2" else {}
        model = MosaicsForCausalLM(build(n_layer=1, n_embd=16, n_head=2, block_size=BLOCK,
                                         **extra, **common))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["v1", "v2", "gpt2", "llama"])
def test_the_report_runs_on_each_model_family(tok, kind, tmp_path):
    from mosaics.evaluation.recall_probe import probe

    model_dir = _save_family(tok, kind, tmp_path / kind)
    out = tmp_path / "recall"
    res = probe(model_dir, out, None, (1, 2), (0.0, 1.0), prompts=2, facts=1, own_prompts=2,
                loss_multiplier=2, loss_windows=1, progress=False, block_size=BLOCK)
    cells = {(c["multiplier"], c["depth"], c["control"]): c for c in res["cells"]}
    assert len(cells) == 2 * (2 + 2)
    assert all(c["status"] == "ok" for (m, _, _), c in cells.items() if m == 1)
    long = [c for (m, _, _), c in cells.items() if m == 2]
    if kind == "gpt2":  # a learned position table: nothing past its length
        assert all(c["status"].startswith("n/a") for c in long)
        assert res["loss_by_length"]["window"] == BLOCK
    else:
        assert all(c["status"] == "ok" and 0 <= c["exact_match"] <= 1 for c in long)
        assert len(res["loss_by_length"]["segment_loss"]) == 2
    assert res["own_question"]["prompts"] == 2
    assert len(list((out / "cells").glob("*.json"))) == 8
    assert (out / "needle_heatmap.png").is_file()
    assert "| depth 0% |" in (out / "recall.md").read_text()
    again = probe(model_dir, out, None, (1, 2), (0.0, 1.0), prompts=2, facts=1,
                  own_prompts=0, loss_multiplier=0, progress=False, block_size=BLOCK)
    assert [c["exact_match"] for c in again["cells"]] == [c["exact_match"] for c in res["cells"]]


def test_the_command_names_a_missing_tokenizer_and_split(tok, tmp_path, capsys):
    from mosaics.evaluation.cli import main

    model_dir = _save_family(tok, "v1", tmp_path / "m")
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(SystemExit):
        main(["needle", str(model_dir), "--no-progress"])
    assert "holds no tokenizer" in capsys.readouterr().err
    model_dir = _save_family(tok, "v1", tmp_path / "m2")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "train.txt").write_text("a story.\n\nanother story.\n")
    with pytest.raises(SystemExit):
        main(["needle", str(model_dir), "--data", str(tmp_path / "corpus" / "train.txt"),
              "--no-progress"])
    assert "no validation split" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["needle", str(model_dir), "--model-set", "no_such_field=1", "--no-progress"])
    assert "no field 'no_such_field'" in capsys.readouterr().err
    assert main(["needle", str(model_dir), "--lengths", "1", "--depths", "1", "--prompts", "2",
                 "--facts", "1", "--loss-multiplier", "0", "--no-progress", "--out",
                 str(tmp_path / "gap"), "--model-set", "long_term_gap=1000000000"]) == 0
    gap = json.loads((tmp_path / "gap" / "recall.json").read_text())
    assert gap["config_changes"] == {"long_term_gap": 1000000000}
    assert main(["needle", str(model_dir), "--lengths", "1", "--depths", "1", "--prompts", "2",
                 "--facts", "1", "--loss-multiplier", "0", "--no-progress", "--out",
                 str(tmp_path / "r")]) == 0
    res = json.loads((tmp_path / "r" / "recall.json").read_text())
    assert res["block_size"] == BLOCK and len(res["cells"]) == 3


@pytest.mark.integration
def test_a_pretrain_job_trains_saves_and_reports(tmp_path):
    from mosaics.evaluation.jobs import make_job
    from mosaics.evaluation.recall_tables import pretrain_markdown
    from mosaics.evaluation.runner import run_job

    tiny = dict(max_steps=3, eval_interval=3, warmup_steps=1, n_layer=1, n_embd=32, n_head=2,
                block_size=96, multipliers=[1, 2], depths=[1.0], prompts=2, facts=1,
                own_prompts=2, loss_multiplier=2, train={"num_train_stories": 300})
    records = [run_job(make_job("pretrain", model, 0, preset="cpu", overrides=tiny), tmp_path,
                       "cpu") for model in ("mosaics/gaussian", "gpt2")]
    for rec in records:
        run = rec["results"]["runs"][0]
        assert run["train"]["steps"] == 3 and run["train"]["val_loss"] > 0
        assert (tmp_path / "jobs" / rec["job"]["name"] / "run" / "final" / "tokenizer.json"
                ).is_file()
        assert len(run["recall"]["cells"]) == 2 * 3
    table = pretrain_markdown(records)
    assert "| gpt2 | " in table and "| mosaics/gaussian | " in table
    gpt2_row = next(line for line in table.splitlines() if line.startswith("| gpt2 |"))
    assert gpt2_row.split(" | ")[2] == "n/a"  # 2x: past its 96 learned positions


def test_pretrain_jobs_give_the_transformers_their_own_lr_unless_train_sets_one(tmp_path):
    from mosaics.evaluation.pretraining import train_config
    from mosaics.evaluation.protocols import PRETRAIN_PRESETS, with_overrides

    cpu = PRETRAIN_PRESETS["cpu"]
    lrs = {arch: train_config(arch, kernel, cpu, 0, None, tmp_path, tmp_path).lr
           for arch, kernel in (("mosaics", "gaussian"), ("mosaics-v2", "gaussian"),
                                ("gpt2", None), ("llama", None))}
    assert lrs == {"mosaics": 5e-3, "mosaics-v2": 5e-3, "gpt2": cpu.transformer_lr,
                   "llama": cpu.transformer_lr} and cpu.transformer_lr != 5e-3
    pinned = with_overrides(cpu, train={"lr": 2e-3})
    assert train_config("llama", None, pinned, 0, None, tmp_path, tmp_path).lr == 2e-3
