"""Row blocks launch heaviest first: under Triton's interpreter, a row-block kernel launched
with a single program (the grid's first) computes the last row block (the most keys under a
causal mask), and its values and query gradients there are the full launch's."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
if not triton.knobs.runtime.interpret:
    pytest.skip("Triton imported without its interpreter (TRITON_INTERPRET=1)",
                allow_module_level=True)

from triton.runtime import interpreter  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from mosaics.ops.knn_attention import knn_attention  # noqa: E402
from mosaics.ops.power_attention import power_attention  # noqa: E402


def _first_program_only(monkeypatch, kernels: set[str]) -> None:
    """Run only the first program of the named kernels' row-block axis (the others are not
    run; ``tl.num_programs`` still sees the whole grid)."""
    run = InterpretedFunction.run
    set_dims = interpreter.interpreter_builder.set_grid_dim

    def clipped(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        if self.fn.__name__ not in kernels:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        full = (*tuple(grid), 1, 1)[:3]
        interpreter.interpreter_builder.set_grid_dim = lambda *_: set_dims(*full)
        try:
            return run(self, *args, grid=(1, *tuple(grid)[1:]), warmup=warmup, **kwargs)
        finally:
            interpreter.interpreter_builder.set_grid_dim = set_dims

    monkeypatch.setattr(InterpretedFunction, "run", clipped)


def _inputs(n: int, D: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, D, generator=g) for _ in range(3))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    return [x.requires_grad_() for x in (q, k, v)]


def _out_and_dq(fn, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    q = inputs[0]
    y = fn(*inputs)
    (dq,) = torch.autograd.grad(y, q, torch.ones_like(y))
    return y.detach(), dq


def test_power_first_program_takes_the_last_row_block(monkeypatch) -> None:
    n = 70  # row blocks of 32 under the interpreter: rows 64..69 last
    inputs = _inputs(n)
    a = torch.full((2, n), 3.0)
    lo, hi = torch.zeros(1, n, dtype=torch.long), torch.arange(n).view(1, n) - 1

    def fn(q, k, v):  # noqa: ANN001, ANN202
        return power_attention(q, k, v, a, lo, hi, r=1.0, entmax=True)

    y, dq = _out_and_dq(fn, inputs)
    _first_program_only(monkeypatch, {"_power_fwd", "_power_bwd_dq"})
    y1, dq1 = _out_and_dq(fn, inputs)
    assert torch.allclose(y1[:, :, 64:], y[:, :, 64:], atol=1e-6)
    assert torch.allclose(dq1[:, :, 64:], dq[:, :, 64:], atol=1e-6)
    assert not y1[:, :, :64].any() and not dq1[:, :, :64].any()
    assert y[:, :, 1:64].abs().sum() > 0


# the rows no program computed hold whatever torch.empty gave (the dk/dv kernel reads them)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_knn_first_program_takes_the_last_row_block(monkeypatch) -> None:
    n = 100  # row blocks of 64 under the interpreter: rows 64..99 last
    inputs = _inputs(n, seed=1)

    def fn(q, k, v):  # noqa: ANN001, ANN202
        return knn_attention(q, k, v, torch.tensor([3.0, 5.0]), -1, 5)

    y, dq = _out_and_dq(fn, inputs)
    _first_program_only(monkeypatch, {"_knn_fwd", "_knn_bwd_dq"})
    y1, dq1 = _out_and_dq(fn, inputs)
    assert torch.allclose(y1[:, :, 64:], y[:, :, 64:], atol=1e-6)
    assert torch.allclose(dq1[:, :, 64:], dq[:, :, 64:], atol=1e-6)
    assert not dq1[:, :, :64].any() and dq[:, :, 1:64].abs().sum() > 0
