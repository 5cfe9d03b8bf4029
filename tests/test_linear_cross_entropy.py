"""Chunked linear + cross-entropy against F.cross_entropy on materialised logits and the
plain reference :func:`mosaics.ops.linear_cross_entropy_reference`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.ops import linear_cross_entropy, linear_cross_entropy_reference


def _case(n: int = 37, d: int = 8, v: int = 29, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype)
    w = torch.randn(v, d, generator=g, dtype=dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = -100
    return h, w, y


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_loss_and_gradients_match_dense(reduction: str, chunk: int) -> None:
    h, w, y = _case()
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ours = linear_cross_entropy(h1, w1, y, -100, reduction, chunk)  # positional order
    (3.0 * ours).backward()
    for loss in (lambda a, b: F.cross_entropy(a @ b.t(), y, ignore_index=-100,
                                              reduction=reduction),
                 lambda a, b: linear_cross_entropy_reference(a, b, y, -100, reduction)):
        h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
        ref = loss(h2, w2)
        (3.0 * ref).backward()
        torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-8, atol=1e-8)
        torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-8, atol=1e-8)


def test_gradcheck_and_no_grad_path() -> None:
    h, w, y = _case(n=9, d=4, v=6)
    h.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy(a, b, y, chunk_size=4),
                                    (h, w))
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y),
                                   F.cross_entropy(h @ w.t(), y, ignore_index=-100))


def test_all_ignored_gives_zero_not_nan() -> None:
    h, w, y = _case(n=6)
    y[:] = -100
    h.requires_grad_()
    loss = linear_cross_entropy(h, w, y)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.all(h.grad == 0)


def test_bf16_autocast_close_to_fp32() -> None:
    h, w, y = _case(n=64, d=16, v=50, dtype=torch.float32)
    h.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, y, chunk_size=16)
    loss.backward()
    h_ref = h.detach().clone().requires_grad_()
    ref = F.cross_entropy(h_ref @ w.t(), y, ignore_index=-100)
    ref.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref, atol=0.05, rtol=0.02)
    torch.testing.assert_close(h.grad, h_ref.grad, atol=0.01, rtol=0.1)


def test_bad_arguments_are_named() -> None:
    h, w, y = _case()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, y, reduction="none")
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, y[:-1])
    with pytest.raises(ValueError, match="loss_chunk_size"):
        MosaicsConfig(loss_chunk_size=-1)


def test_model_training_loss_equals_materialised_logits() -> None:
    torch.manual_seed(0)
    cfg = MosaicsConfig(vocab_size=97, n_layer=2, n_head=2, n_embd=16, block_size=24,
                        dropout=0.0, loss_chunk_size=7)
    chunked = MosaicsForCausalLM(cfg).train()
    dense = MosaicsForCausalLM(MosaicsConfig(**{**cfg.to_dict(), "loss_chunk_size": 0})).train()
    dense.load_state_dict(chunked.state_dict())
    ids = torch.randint(0, 97, (3, 24))
    labels = ids.clone()
    labels[0, :5] = -100
    out_c = chunked(input_ids=ids, labels=labels)
    out_d = dense(input_ids=ids, labels=labels)
    assert out_c.logits is None and out_d.logits is not None
    torch.testing.assert_close(out_c.loss, out_d.loss)
    out_c.loss.backward()
    out_d.loss.backward()
    for (name, p), q in zip(chunked.named_parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    chunked.eval()  # evaluation keeps the logits
    assert chunked(input_ids=ids, labels=labels).logits.shape == (3, 24, 97)
