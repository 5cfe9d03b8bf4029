"""The fused power-kernel retrieval (alpha-entmax, relumax, epanechnikov_fixed) against its
dense float64 reference and the kernels' chunked paths, run on CPU under Triton's
interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` where there is no CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")
if not (triton.knobs.runtime.interpret or torch.cuda.is_available()):
    pytest.skip("Triton imported without its interpreter (TRITON_INTERPRET=1)",
                allow_module_level=True)

from mosaics.kernels import get_kernel  # noqa: E402
from mosaics.ops import power_attention, power_attention_reference  # noqa: E402
from mosaics.ops import triton_backend as tb  # noqa: E402

FORMS = {  # name: (r, anchor, shift, entmax, score scale)
    "sparsemax": (1.0, None, None, True, 1.0),
    "entmax15": (2.0, None, None, True, 0.5),
    "entmax43": (3.0, None, None, True, 1 / 3),
    "entmax_r1.5": (1.5, None, None, True, 2 / 3),
    "relumax": (1.0, None, -1.0, False, 1.0),
    "relumax_r2_b0.5": (2.0, None, -0.5, False, 1.0),
    "fixed": (1.0, 1.0, -1.0, False, 1.0),
    "fixed_r1.5": (1.5, 1.0, -1.0, False, 1.0),
}


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def inputs(B: int, H: int, n: int, S: int, D: int, seed: int, spread: float = 1.0):
    """Unit queries and keys around a shared direction (cosines spread over [-1, 1])."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(1, 1, 1, D, generator=g, dtype=torch.float64)
    q = unit(spread * torch.randn(B, H, n, D, generator=g, dtype=torch.float64) + common)
    k = unit(spread * torch.randn(B, H, S, D, generator=g, dtype=torch.float64) + common)
    v = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    return q, k, v


def run_both(form: str, q, k, v, beta: torch.Tensor, lo, hi, dtype=torch.float32,
             slopes: torch.Tensor | None = None, pos0: int = 0):
    """(fused output and grads, float64 reference output and grads) for one form; the last
    gradient is the one of ``a`` (or, with ``slopes``, of the ALiBi bias)."""
    r, anchor, shift, entmax, scale = FORMS[form]
    B, H, n, _ = q.shape
    beta = beta.view(1, H, 1) if beta.dim() == 1 else beta  # per head, or (1, 1, n) per row
    a64 = (scale * beta).expand(B, H, n).reshape(B * H, n).contiguous()
    bias64 = None
    if slopes is not None:
        bias64 = (slopes.view(1, H, 1) / beta).expand(B, H, n).reshape(B * H, n).contiguous()
    rounded = [x.to(dtype).double() for x in (q, k, v)]  # the fused inputs, exactly
    fused_in = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    a32 = a64.float().requires_grad_()
    ref_in = [x.clone().requires_grad_() for x in rounded]
    a_ref = a64.clone().requires_grad_()
    kw = dict(r=r, anchor=anchor, shift=shift, entmax=entmax, pos0=pos0)
    b32 = b_ref = None
    if bias64 is not None:
        b32, b_ref = bias64.float().requires_grad_(), bias64.clone().requires_grad_()
    y = power_attention(*fused_in, a32, lo, hi, bias=b32, **kw)
    y_ref = power_attention_reference(*ref_in, a_ref, lo, hi, bias=b_ref, **kw)
    g = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (y.double() * g).sum().backward()
    (y_ref * g).sum().backward()
    got = [y.double()] + [x.grad.double() for x in fused_in] + [a32.grad.double()]
    want = [y_ref] + [x.grad for x in ref_in] + [a_ref.grad]
    if b32 is not None:
        got.append(b32.grad.double())
        want.append(b_ref.grad)
    return got, want


def assert_close(got, want, rtol: float, atol: float) -> None:
    for name, x, y in zip(("y", "dq", "dk", "dv", "da", "dbias"), got, want):
        scale = y.abs().max().item() + 1.0
        err = (x - y).abs().max().item()
        assert err <= atol * scale + rtol * y.abs().max().item(), (name, err, scale)


def past(n: int, offset: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    hi = (torch.arange(n) + offset).view(1, n)
    return torch.zeros_like(hi), hi


@pytest.mark.parametrize("form", list(FORMS))
def test_strict_past_matches_reference_fp32(form):
    q, k, v = inputs(1, 2, 37, 37, 16, seed=1)
    fixed = FORMS[form][1] is not None  # a narrow fixed window would leave most rows empty
    beta = torch.tensor([1.5, 3.0] if fixed else [6.0, 15.0], dtype=torch.float64)
    got, want = run_both(form, q, k, v, beta, *past(37))
    assert want[0].abs().sum() > 0
    assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", ["sparsemax", "relumax"])
def test_long_odd_rows_head_sizes_and_batches(form):
    """T 130 (several key blocks, a ragged last one), head size 24 (padded to 32), B 2."""
    q, k, v = inputs(2, 1, 130, 130, 24, seed=2)
    got, want = run_both(form, q, k, v, torch.tensor([9.0], dtype=torch.float64), *past(130))
    assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", ["sparsemax", "entmax43", "relumax", "fixed"])
def test_bf16_inputs_accumulate_in_fp32(form):
    q, k, v = inputs(1, 2, 33, 33, 16, seed=3)
    got, want = run_both(form, q, k, v, torch.tensor([2.0, 8.0], dtype=torch.float64),
                         *past(33), dtype=torch.bfloat16)
    assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 outputs and products


@pytest.mark.parametrize("form", ["sparsemax", "entmax15", "fixed"])
def test_sharp_bandwidth_e10(form):
    """beta = e^10: supports of one or two entries, and (fixed) mostly empty rows."""
    q, k, v = inputs(1, 1, 29, 29, 16, seed=4, spread=0.05)
    beta = torch.tensor([math.exp(10.0)], dtype=torch.float64)
    got, want = run_both(form, q, k, v, beta, *past(29))
    # scores carry the fp32 rounding of the cosines times e^10
    assert_close(got[:1] + got[3:4], want[:1] + want[3:4], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("form", ["sparsemax", "entmax15", "fixed"])
def test_ties_and_repeated_keys(form):
    """Exactly repeated keys (tied scores) split their weight the same way as the reference."""
    q, k, v = inputs(1, 1, 21, 21, 16, seed=5)
    k = k[:, :, [0, 1, 2] * 7]
    q = k.clone()
    got, want = run_both(form, q, k, v, torch.tensor([5.0], dtype=torch.float64), *past(21))
    assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", ["entmax15", "relumax", "fixed"])
def test_intervals_per_batch_row_and_per_row_scales(form):
    """Windows that differ across the batch, rows that see nothing (hi < lo, or past the end)
    and one scale per query row (an adaptive bandwidth)."""
    B, n, S = 2, 19, 23
    q, k, v = inputs(B, 2, n, S, 16, seed=6)
    i = torch.arange(n)
    lo = torch.stack([i - 4, i - 9])
    hi = torch.stack([i + 2, i - 1])
    if form == "relumax":  # bounds with different batch sizes, as v2's documents give them
        lo, hi = lo[1:].expand(B, n).clone(), hi[1:].clone()
    hi[0, 5] = lo[0, 5] - 1  # an empty row
    lo[1, -2:] = S + 3  # rows that see nothing past the end
    beta = torch.linspace(2.0, 12.0, n, dtype=torch.float64).view(1, 1, n)
    got, want = run_both(form, q, k, v, beta, lo, hi)
    if form != "relumax":
        assert got[0][0, :, 5].abs().max() == 0 and got[0][1, :, -2:].abs().max() == 0
    assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", ["sparsemax", "entmax15", "relumax"])
def test_dead_tiles_are_skipped_with_the_reference_values(form, monkeypatch):
    """Two clusters of keys (positions < 48, the rest) at a sharp bandwidth: the later rows
    give the first cluster no weight, whole tiles die, and the passes and both backward
    kernels walk only the live ones (their lists); values and gradients stay the
    reference's."""
    g = torch.Generator().manual_seed(0)
    centers = unit(torch.randn(2, 16, generator=g, dtype=torch.float64))
    keys = unit(centers[(torch.arange(97) >= 48).long()]
                + 0.05 * torch.randn(97, 16, generator=g, dtype=torch.float64))
    q, k = keys[1:].view(1, 1, 96, 16), keys[:-1].view(1, 1, 96, 16)
    v = torch.randn(1, 1, 96, 16, generator=g, dtype=torch.float64)
    monkeypatch.setattr(power_attention_module(), "RECORD", [])
    got, want = run_both(form, q, k, v, torch.tensor([60.0], dtype=torch.float64),
                         *past(96, offset=0))
    (rec,) = power_attention_module().RECORD
    live = rec["live"][0]  # (row blocks, key blocks) of 32 under the interpreter
    causal = torch.arange(3).view(1, 3) <= torch.arange(3).view(3, 1)
    assert not bool(live[causal].all()), live  # some tile inside the causal range died
    assert_close(got, want, rtol=1e-4, atol=1e-5)


def power_attention_module():  # noqa: ANN201
    import sys

    return sys.modules["mosaics.ops.power_attention"]


@pytest.mark.parametrize("form", ["sparsemax", "entmax15", "relumax", "fixed"])
def test_alibi_bias_and_its_gradient(form):
    """Scores beta cos - m_h (t_i - j), t_i = i + pos0 (queries 1..T-1 of a sequence)."""
    q, k, v = inputs(1, 2, 31, 31, 16, seed=11)
    fixed = FORMS[form][1] is not None
    beta = torch.tensor([1.5, 3.0] if fixed else [5.0, 10.0], dtype=torch.float64)
    slopes = torch.tensor([0.25, 0.0625], dtype=torch.float64)
    got, want = run_both(form, q, k, v, beta, *past(31, offset=0), slopes=slopes, pos0=1)
    assert want[-1].abs().max() > 0
    assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_no_entry_anywhere_is_zero_with_zero_gradients():
    q, k, v = inputs(1, 1, 5, 5, 16, seed=7)
    lo, hi = past(5, offset=-6)  # nobody sees anything
    got, _ = run_both("sparsemax", q, k, v, torch.tensor([3.0], dtype=torch.float64), lo, hi)
    assert all(float(x.detach().abs().max()) == 0 for x in got)


KERNELS = ["epanechnikov", "biweight", "triweight", "relumax", "epanechnikov_fixed"]


@pytest.mark.parametrize("name", KERNELS)
def test_registry_kernels_take_the_fused_path(name, monkeypatch):
    """Each kernel's training forward and backward equal its chunked path, and the fused path
    is the one recorded."""
    torch.manual_seed(0)
    q, k, v = inputs(2, 2, 25, 25, 16, seed=8)
    keys, values = q.float(), v.float()
    beta = torch.tensor([3.0, 11.0])
    kernel = get_kernel(name)
    runs = []
    for mode in ("0", "1"):
        monkeypatch.setenv(tb.ENV_SWITCH, mode)
        k_, v_, b_ = (x.clone().requires_grad_() for x in (keys, values, beta))
        y = kernel(k_, v_, b_)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        runs.append((y.detach(), k_.grad, v_.grad, b_.grad, tb.PATHS[name]))
    chunked, fused = runs
    assert chunked[4].startswith("chunked") and fused[4] == "fused"
    assert chunked[0][:, :, 1:].abs().sum() > 0
    for a, b in zip(chunked[:4], fused[:4]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("name", ["biweight", "relumax"])
def test_alibi_retrieval_takes_the_fused_path(name, monkeypatch):
    """The model's ALiBi retrieval (``biased_retrieval``) equals its chunked path, gradients
    of the bandwidth included."""
    from mosaics.kernels.position_bias import alibi_slopes, biased_retrieval

    q, k, v = inputs(1, 2, 23, 23, 16, seed=12)
    kernel = get_kernel(name)
    slopes = alibi_slopes(2).float()
    runs = []
    for mode in ("0", "1"):
        monkeypatch.setenv(tb.ENV_SWITCH, mode)
        q_, k_, b_ = q.float().requires_grad_(), k.float().requires_grad_(), torch.tensor(
            [4.0, 9.0], requires_grad=True)
        y = biased_retrieval(kernel, q_[:, :, 1:], k_[:, :, :-1], v.float()[:, :, :-1], b_,
                             slopes, 0)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        runs.append((y.detach(), q_.grad, k_.grad, b_.grad, tb.PATHS[name]))
    assert runs[0][4].startswith("chunked") and runs[1][4] == "fused"
    for a, b in zip(runs[0][:4], runs[1][:4]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-5)


def test_attend_intervals_take_the_fused_path(monkeypatch):
    """v2's retrieval over windows (attend) with one bandwidth per query."""
    q, k, v = inputs(1, 2, 17, 17, 16, seed=9)
    i = torch.arange(17).view(1, 17)
    beta = torch.linspace(2.0, 9.0, 17).view(1, 1, 17).expand(1, 2, 17)
    kernel = get_kernel("biweight")
    outs = []
    for mode in ("0", "1"):
        monkeypatch.setenv(tb.ENV_SWITCH, mode)
        outs.append(kernel.attend(q.float(), k.float(), v.float(), beta, i - 5, i - 1))
    assert tb.PATHS["biweight"] == "fused"
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=2e-5)


def test_switch_values(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.setenv(tb.ENV_SWITCH, "0")
    assert tb.fused_reason(x) == "MOSAICS_FUSED=0"
    monkeypatch.delenv(tb.ENV_SWITCH)
    assert "CPU tensors" in tb.fused_reason(x)
    monkeypatch.setenv(tb.ENV_SWITCH, "1")
    assert tb.fused_reason(x) is None
    monkeypatch.setenv(tb.ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match="MOSAICS_FUSED"):
        tb.fused_reason(x)


def test_bad_arguments_are_named():
    q, k, v = inputs(1, 1, 4, 4, 16, seed=10)
    a = torch.ones(1, 4)
    lo, hi = past(4)
    with pytest.raises(ValueError, match="r >= 1"):
        power_attention(q.float(), k.float(), v.float(), a, lo, hi, r=0.5, entmax=True)
    with pytest.raises(ValueError, match="shape"):
        power_attention(q.float(), k.float(), v.float(), a[:, :3], lo, hi, r=1.0, shift=-1.0)



@pytest.mark.parametrize("name,v2", [("epanechnikov", False), ("relumax", False),
                                     ("biweight", True)])
def test_model_training_step_equals_the_chunked_one(name, v2, tiny_config, monkeypatch):
    """A whole model's loss and gradients with the fused kernels equal the chunked ones (v1,
    and v2: gated keys, adaptive bandwidth, short- and long-term windows, documents)."""
    from mosaics import MosaicsConfig, MosaicsForCausalLM

    extra = dict(kernel=name, n_layer=1)
    if v2:
        base = tiny_config(**extra).to_dict()
        base.update(short_term_window=6, long_term_gap=4, long_term_gap_range=(4, 8))
        config = MosaicsConfig.v2(**{k: v for k, v in base.items() if k in {
            "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "leaky_chunk_size",
            "block_size", "kernel", "short_term_window", "long_term_gap", "long_term_gap_range"}},
            eos_token_id=0)
    else:
        config = tiny_config(**extra)
    torch.manual_seed(0)
    model = MosaicsForCausalLM(config).eval()
    ids = torch.randint(1, config.vocab_size, (2, 21))
    ids[1, 9] = 0  # a document boundary (v2)
    runs = []
    for mode in ("0", "1"):
        monkeypatch.setenv(tb.ENV_SWITCH, mode)
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()],
                     tb.PATHS[name]))
    assert runs[1][2] == "fused"
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_remote_code_carries_the_kernel_sources(tmp_path, monkeypatch):
    """A saved model's flat code (``trust_remote_code`` without the package) holds the Triton
    sources, and its flat op modules find and run them."""
    import importlib.util
    import sys

    from mosaics.remote_code import save_model_code

    written = save_model_code(tmp_path)
    for name in ("power_attention", "knn_attention", "linear_attention"):
        assert f"ops_triton_kernels_{name}.py" in written
    (tmp_path / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("flat_model_code", tmp_path / "__init__.py",
                                                  submodule_search_locations=[str(tmp_path)])
    package = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "flat_model_code", package)
    spec.loader.exec_module(package)
    flat = importlib.import_module("flat_model_code.ops_power_attention")
    assert tmp_path / "ops_triton_kernels_power_attention.py" == flat.KERNELS
    q, k, v = inputs(1, 1, 9, 9, 16, seed=13)
    lo, hi = past(9)
    a = torch.full((1, 9), 4.0)
    got = flat.power_attention(q.float(), k.float(), v.float(), a, lo, hi, r=1.0, entmax=True)
    want = power_attention_reference(q, k, v, a.double(), lo, hi, r=1.0, entmax=True)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
