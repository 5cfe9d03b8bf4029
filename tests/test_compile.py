"""``torch.compile`` of the model on CPU: a compiled training step (inductor) equals the eager
one in loss and gradients (fp32, 1e-5), later steps of one shape compile nothing new, and the
training forward breaks the graph only at the eager boundaries of :mod:`mosaics.compilation`.

One inductor compile of a tiny model costs tens of seconds on 2 cores: the v1 gaussian model
is compiled once for the module; the other blocks and kernels are in the integration tier."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.compilation import graph_breaks, kernel_traceable

VOCAB, T = 61, 48


def _model(version: str, kernel: str) -> MosaicsForCausalLM:
    base = dict(vocab_size=VOCAB, n_layer=1, n_head=4, n_embd=32, dropout=0.0,
                leaky_chunk_size=8, block_size=T, kernel=kernel)
    if version == "v2":  # token 0 separates documents; a random long-term gap every step
        config = MosaicsConfig.v2(**base, eos_token_id=0, short_term_window=12,
                                  long_term_gap=6, long_term_gap_range=(3, 9))
    else:
        config = MosaicsConfig(**base)
    torch.manual_seed(0)
    return MosaicsForCausalLM(config).train()


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(step))


def _step(model: torch.nn.Module, ids: torch.Tensor, seed: int
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one training forward and backward (RNG seeded: v2's gap)."""
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


class Pair:
    """An eager model and a compiled copy (inductor, compiles counted)."""

    def __init__(self, version: str, kernel: str) -> None:
        self.eager = _model(version, kernel)
        self.compiled = copy.deepcopy(self.eager)
        self.counter = CompileCounterWithBackend("inductor")
        self.compiled.compile(backend=self.counter)

    def compare(self, step: int) -> None:
        ids = _batch(step)
        loss, grads = _step(self.eager, ids, step)
        closs, cgrads = _step(self.compiled, ids, step)
        torch.testing.assert_close(closs, loss, rtol=1e-5, atol=1e-5)
        assert set(cgrads) == set(grads) and len(grads) > 5
        for name, grad in grads.items():
            torch.testing.assert_close(cgrads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def v1_gaussian() -> Pair:
    pair = Pair("v1", "gaussian")
    pair.compare(0)  # compiles
    return pair


def test_compiled_v1_step_is_one_graph_equal_to_eager(v1_gaussian: Pair) -> None:
    assert v1_gaussian.counter.frame_count == 1  # the whole forward: no graph break
    v1_gaussian.compare(1)


def test_compiled_v1_steps_of_one_shape_do_not_recompile(v1_gaussian: Pair) -> None:
    before = v1_gaussian.counter.frame_count
    for step in (2, 3):
        v1_gaussian.compare(step)
    assert v1_gaussian.counter.frame_count == before


@pytest.mark.integration
@pytest.mark.parametrize("version,kernel", [("v1", "relumax"), ("v2", "gaussian"),
                                            ("v2", "relumax")])
def test_compiled_step_equals_eager(version: str, kernel: str) -> None:
    pair = Pair(version, kernel)
    pair.compare(0)
    compiled = pair.counter.frame_count
    pair.compare(1)  # v2: another long-term gap, the same graphs
    assert pair.counter.frame_count == compiled


@pytest.mark.integration
def test_graph_breaks_only_at_eager_boundaries() -> None:
    """v1 with a sparse kernel: the kernel's tiles run eagerly (recall.py, the whole
    sequence); v2: the gap draw (positions.py) and the interval retrievals (recall.py,
    the intervals). Every break is a ``torch.compiler.disable`` boundary (dynamo counts one per
    frame on the stack)."""
    for version, kernel, where in (("v1", "relumax", {"recall.py"}),
                                   ("v2", "gaussian", {"recall.py", "positions.py"})):
        model = _model(version, kernel)
        count, reasons = graph_breaks(lambda ids, m=model: m(input_ids=ids, labels=ids).loss,
                                      _batch(0))
        assert count > 0 and all("disable" in r for r in reasons), reasons
        assert {r.rsplit("/", 1)[-1].split(":")[0] for r in reasons} == where, reasons
    assert kernel_traceable(_model("v1", "gaussian").model.blocks[0].cmem.kernel)
    assert not kernel_traceable(_model("v1", "relumax").model.blocks[0].cmem.kernel)


def test_trainer_compile_field_trains_like_eager(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile=true``: the trainer's steps go through torch.compile (here the aot_eager
    backend: the same graphs and backward without code generation) with the eager losses;
    the module itself stays uncompiled (checkpoints and export unchanged)."""
    from mosaics.training.config import TrainConfig
    from mosaics.training.trainer import Trainer, make_accelerator

    monkeypatch.setenv("MOSAICS_COMPILE_BACKEND", "aot_eager")

    class Windows:
        def batch(self, index: int) -> dict[str, torch.Tensor]:
            ids = _batch(100 + index)
            return {"input_ids": ids, "labels": ids.clone()}

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    losses = {}
    for compiled in (False, True):
        run = tmp_path / str(compiled)
        cfg = TrainConfig(run_dir=str(run), max_steps=3, lr=2e-3, min_lr=2e-4, warmup_steps=1,
                          eval_interval=0, log_interval=1, checkpoint_interval=0,
                          progress_bar=False, log_with="none", compile=compiled)
        trainer = Trainer(cfg, _model("v1", "gaussian"), Windows(),
                          accelerator=make_accelerator(cfg, "cpu"))
        trainer.fit()
        assert isinstance(trainer.train_forward, torch._dynamo.eval_frame.OptimizedModule) \
            == compiled
        assert not any(k.startswith("_orig_mod") for k in trainer.unwrapped_model.state_dict())
        trainer.close()
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        losses[compiled] = [r["train/loss"] for r in rows]
        assert all(r["flops_per_token"] > 0 and r["mfu"] > 0 for r in rows)
    assert len(losses[True]) == 3
    assert losses[True] == pytest.approx(losses[False], rel=1e-5, abs=1e-5)
