"""The compiled CPU slot-bank kernel (mosaics/csrc/bank_attention.cpp): exact against the
softmax formula, chosen by ``bank_attention`` where it applies, and a clean fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.ops import bank_attention
from mosaics.ops import banks as cpu_extension

ext = cpu_extension.bank_extension()
needs_ext = pytest.mark.skipif(ext is None, reason="the compiled CPU kernel does not build here")


def reference(q, k, v, g):
    """Output and (dq, dk, dv) of softmax(q k^T) v in fp64 autograd."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    y = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
    return (y, *torch.autograd.grad(y, (q, k, v), g.double()))


@needs_ext
@pytest.mark.parametrize("H,N,P,hs,rows,threads", [
    (3, 45, 70, 8, 16, 1),     # a last block of 13 rows
    (2, 300, 600, 32, 256, 1),  # the default block, a short last block
    (1, 64, 40, 16, 8, 2),      # one head on two threads: row blocks split in groups
    (4, 33, 17, 4, 64, 3),      # one block holding every row
])
def test_stored_kernel_matches_softmax_formula(H, N, P, hs, rows, threads):
    torch.manual_seed(0)
    q = F.normalize(torch.randn(H, N, hs), dim=-1)
    k, v, g = torch.randn(H, P, hs), torch.randn(H, P, hs), torch.randn(H, N, hs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y, *probs = ext.forward(q, k, v, rows)
        grads = ext.backward(g, q, k, v, y, probs, rows)
    finally:
        torch.set_num_threads(before)
    expected = reference(q, k, v, g)
    torch.testing.assert_close(y.double(), expected[0], rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(grads, expected[1:], strict=True):
        torch.testing.assert_close(mine.double(), theirs, rtol=1e-4, atol=1e-4)
    # the kept probabilities are the softmax rows
    p = torch.softmax(q.double() @ k.double().transpose(1, 2), dim=-1)
    torch.testing.assert_close(torch.stack(probs).double(), p, rtol=1e-5, atol=1e-6)


@needs_ext
def test_stored_kernel_refuses_bad_input():
    q, k = torch.randn(2, 5, 8), torch.randn(2, 7, 8)
    with pytest.raises(RuntimeError, match="contiguous \\(H, n, D\\) float32"):
        ext.forward(q.double(), k, k, 4)
    with pytest.raises(RuntimeError, match="bank shapes"):
        ext.forward(q, torch.randn(3, 7, 8), torch.randn(3, 7, 8), 4)
    y, *probs = ext.forward(q, k, k, 4)
    with pytest.raises(RuntimeError, match="g and y must be shaped as q"):
        ext.backward(torch.randn(2, 6, 8), q, k, k, y, probs, 4)


def bank_inputs(H=2, N=40, P=30, hs=8):
    torch.manual_seed(1)
    q = F.normalize(torch.randn(H, N, hs), dim=-1).requires_grad_()
    k, v = (torch.randn(H, P, hs).requires_grad_() for _ in range(2))
    return q, k, v


def forms_used(monkeypatch) -> list[str]:
    """Record which autograd function each bank_attention call takes."""
    used = []
    for cls in (cpu_extension._StoredBankAttention, cpu_extension._BankAttention):
        original = cls.apply

        def spy(*args, _cls=cls, _original=original):
            used.append(_cls.__name__)
            return _original(*args)
        monkeypatch.setattr(cls, "apply", spy)
    return used


@needs_ext
def test_bank_attention_takes_the_kernel_when_training_in_fp32(monkeypatch):
    used = forms_used(monkeypatch)
    q, k, v = bank_inputs()
    bank_attention(q, k, v).sum().backward()
    assert used == ["_StoredBankAttention"]
    with torch.no_grad():  # inference: the fused call
        bank_attention(q, k, v)
    bank_attention(q.double(), k.double(), v.double())  # fp64: not the kernel
    monkeypatch.setattr(cpu_extension, "STORED_PROBS_MAX_BYTES", 4 * 2 * 40 * 30 - 1)
    bank_attention(q, k, v)  # probabilities over the budget: recomputed
    assert used == ["_StoredBankAttention"]


@needs_ext
def test_model_gradients_equal_with_and_without_the_kernel(monkeypatch):
    """A training step's loss and gradients through the compiled kernel and through PyTorch's
    fused attention (P 600 > BANK_BLOCK: the blocked backward) agree."""
    cfg = MosaicsConfig(vocab_size=50, n_layer=2, n_head=4, n_embd=32, pmem_size=600,
                        block_size=24, dropout=0.0)
    torch.manual_seed(2)
    model = MosaicsForCausalLM(cfg).train()
    ids = torch.randint(0, 50, (3, 24))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    used = forms_used(monkeypatch)
    loss, grads = step()
    assert used == ["_StoredBankAttention"] * 2
    monkeypatch.setattr(cpu_extension, "bank_extension", lambda: None)
    loss_ref, grads_ref = step()
    assert used[2:] == ["_BankAttention"] * 2
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_build_failure_warns_and_falls_back(monkeypatch, tmp_path):
    broken = tmp_path / "bank_attention.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_extension, "SOURCE", broken)
    # its own name: a build of another source under the kernel's name would make the next
    # load in this process rebuild the kernel (torch versions builds by name and source)
    monkeypatch.setattr(cpu_extension, "NAME", "mosaics_bank_broken_test")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    cpu_extension.bank_extension.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="unavailable .*fused attention"):
            assert cpu_extension.bank_extension() is None
        q, k, v = bank_inputs()
        out = bank_attention(q, k, v)  # still trains, through PyTorch's fused attention
        out.sum().backward()
        assert q.grad is not None
    finally:
        cpu_extension.bank_extension.cache_clear()


def test_disabled_by_the_environment_and_without_a_source(monkeypatch, tmp_path):
    cpu_extension.bank_extension.cache_clear()
    try:
        monkeypatch.setenv(cpu_extension.ENV, "0")
        assert cpu_extension.bank_extension() is None
        cpu_extension.bank_extension.cache_clear()
        monkeypatch.setenv(cpu_extension.ENV, "1")
        monkeypatch.setattr(cpu_extension, "SOURCE", tmp_path / "missing.cpp")
        assert cpu_extension.bank_extension() is None  # a flat remote-code copy: silent
    finally:
        cpu_extension.bank_extension.cache_clear()
