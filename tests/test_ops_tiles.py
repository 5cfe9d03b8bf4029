"""The named tiles of the fused ops (``triton_backend.TILES``): the override (``use_tiles``,
``MOSAICS_TILES``), and every tile set giving the float64 reference's values and gradients
under Triton's interpreter."""

from __future__ import annotations

import math

import pytest
import torch

from mosaics.ops import triton_backend as tb

GRID = [(op, name) for op, tiles in tb.TILES.items() for name in tiles]


def test_override_from_the_environment_and_in_code(monkeypatch) -> None:
    monkeypatch.setenv(tb.ENV_TILES, "power=m128n64w8, linear=k16w8s2")
    assert tb.pinned_tiles("power") == tb.TILES["power"]["m128n64w8"]
    assert tb.pinned_tiles("knn") is None
    with tb.use_tiles("power", None):  # the op's own rule, whatever the environment says
        assert tb.pinned_tiles("power") is None
        with tb.use_tiles("power", "m64n32w8"):
            assert tb.pinned_tiles("power") == tb.TILES["power"]["m64n32w8"]
        assert tb.pinned_tiles("power") is None
    assert tb.pinned_tiles("power") == tb.TILES["power"]["m128n64w8"]
    assert tb.pinned_tiles("linear") == tb.TILES["linear"]["k16w8s2"]


@pytest.mark.parametrize("setting,words", [("power=m1", "m128n64w8"), ("attn=m64n64w8", "ops"),
                                           ("power", "op=name")])
def test_bad_override_names_the_choices(monkeypatch, setting: str, words: str) -> None:
    monkeypatch.setenv(tb.ENV_TILES, setting)
    with pytest.raises(ValueError, match=words):
        tb.pinned_tiles("power")
    with pytest.raises(ValueError, match="choose one of"), tb.use_tiles("knn", "m1"):
        pass


def test_every_tile_set_is_valid() -> None:
    for op, tiles in tb.TILES.items():
        for name, params in tiles.items():
            assert all(v > 0 and v & (v - 1) == 0 for k, v in params.items()
                       if k.startswith("B")), (op, name)


@pytest.fixture
def interpreted(monkeypatch):
    triton = pytest.importorskip("triton")
    if not triton.knobs.runtime.interpret:
        pytest.skip("Triton imported without its interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setenv(tb.ENV_SWITCH, "1")


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def _close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        err = (a.double() - b).abs().max()
        assert err <= tol * b.abs().max().clamp_min(1e-12), (i, float(err))


def _run(fn, leaves: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:  # noqa: ANN001
    y = fn(*leaves)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return [y.detach(), *torch.autograd.grad(y, leaves, g.to(y.dtype))]


@pytest.mark.parametrize("op,name", GRID)
def test_tiles_give_the_reference(interpreted, op: str, name: str) -> None:
    g = torch.Generator().manual_seed(3)
    B, H, n, D = 1, 2, 70, 16
    q64 = _unit(torch.randn(B, H, n, D, generator=g, dtype=torch.float64) + 0.5)
    k64 = _unit(torch.randn(B, H, n, D, generator=g, dtype=torch.float64) + 0.5)
    v64 = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    if op == "power":
        from mosaics.ops import power_attention, power_attention_reference

        lo, hi = torch.zeros(1, n, dtype=torch.long), torch.arange(n).view(1, n) - 1
        a64 = torch.full((B * H, n), 4.0, dtype=torch.float64)

        def fused(q, k, v, a):  # noqa: ANN001, ANN202
            return power_attention(q, k, v, a, lo, hi, r=2.0, entmax=True)

        def ref(q, k, v, a):  # noqa: ANN001, ANN202
            return power_attention_reference(q, k, v, a, lo, hi, r=2.0, entmax=True)
        leaves = [q64, k64, v64, a64]
    elif op == "knn":
        from mosaics.ops import knn_attention, knn_attention_reference

        def fused(q, k, v, beta):  # noqa: ANN001, ANN202
            return knn_attention(q, k, v, beta, -1, 8)

        def ref(q, k, v, beta):  # noqa: ANN001, ANN202
            return knn_attention_reference(q, k, v, beta, -1, 8)
        leaves = [q64, k64, v64, torch.tensor([2.0, math.exp(3)], dtype=torch.float64)]
    else:
        from mosaics.ops import causal_linear_attention, causal_linear_attention_reference

        def fused(q, k, v):  # noqa: ANN001, ANN202
            return causal_linear_attention(q, k, v, chunk=16)

        def ref(q, k, v):  # noqa: ANN001, ANN202
            return causal_linear_attention_reference(q, k, v)
        leaves = [q64.abs() + 0.05, k64.abs() + 0.05, v64]
    want = _run(ref, [x.clone().requires_grad_() for x in leaves])
    with tb.use_tiles(op, name):
        got = _run(fused, [x.float().requires_grad_() for x in leaves])
    _close(got, want, 1e-4)


def test_knn_backward_keeps_the_forwards_tiles(interpreted) -> None:
    from mosaics.ops import knn_attention, knn_attention_reference

    g = torch.Generator().manual_seed(5)
    q = torch.randint(-60, 61, (1, 2, 45, 16), generator=g).double() / 128  # exact ties
    k = q[:, :, torch.randint(0, 5, (45,), generator=g)]
    v = torch.randn(1, 2, 45, 16, generator=g, dtype=torch.float64)
    beta = torch.tensor([20.0, 3.0], dtype=torch.float64)
    want = _run(lambda *x: knn_attention_reference(*x, -1, 6), [
        x.clone().requires_grad_() for x in (q, k, v, beta)])
    leaves = [x.float().requires_grad_() for x in (q, k, v, beta)]
    with tb.use_tiles("knn", "m32n32w4"):
        y = knn_attention(*leaves, -1, 6)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with tb.use_tiles("knn", "m128n64w8"):
        grads = torch.autograd.grad(y, leaves, grad.float())
    _close([y.detach(), *grads], want, 1e-4)
