"""bench/work_model.py: the replica of the fused kernels' loops counts what they do."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wm() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("bench_work_model_test",
                                                  ROOT / "bench" / "work_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("r", [1.0, 2.0, 3.0])
def test_newton_replica_reaches_the_entmax_threshold(wm, r: float) -> None:
    """The replicated solve ends where the kernel's does: each row's weights sum to one."""
    torch.manual_seed(0)
    x = -torch.rand(128, 300) * 3
    x[torch.arange(128), torch.randint(0, 300, (128,))] = 0.0  # the row max, as scaled
    x[:, 250:] = float("-inf")  # entries a row does not see
    blocks = torch.arange(128) // 64
    tau, its = wm.newton(x, r, blocks, 2)
    mass = (x - tau).clamp_min(0).pow(r).sum(1)
    torch.testing.assert_close(mass, torch.ones(128), rtol=1e-4, atol=1e-4)
    assert its.shape == (2,) and bool((its >= 1).all()) and bool((its < wm.NEWTON_STEPS).all())


def test_power_counts_follow_the_loops(wm) -> None:
    T = 200  # 199 query rows: 4 row blocks of 64, 1 + 2 + 3 + 4 causal tiles
    keys = wm.check_keys(T, 1, 16)
    beta = torch.full((1,), wm.BETA)
    sparsemax = wm.power_counts("epanechnikov", keys, beta)
    assert sparsemax["causal_tiles"] == 10
    # a row-max sweep, the Newton sweeps, the output sweep
    assert sparsemax["fwd_sweeps"] == pytest.approx(2 + sparsemax["newton_sweeps"])
    assert 1 <= sparsemax["newton_sweeps"] <= sparsemax["newton_max"] < wm.NEWTON_STEPS
    assert 0 < sparsemax["live_fine"] <= 1 and 0 < sparsemax["live"] <= 1
    assert sparsemax["bwd_products"] == pytest.approx(3 + 6 * sparsemax["live"])
    relu = wm.power_counts("relumax", keys, beta)
    assert relu["fwd_sweeps"] == 2 and "newton_max" in relu and relu["newton_sweeps"] == 0
    # at beta e^2 random unit keys never reach cosine 0.865: no live tile, 1 sweep
    fixed = wm.power_counts("epanechnikov_fixed", keys, beta)
    assert fixed["live"] == 0 and fixed["empty_rows"] == 1
    assert (fixed["fwd_products"], fixed["bwd_products"]) == (1, 2)
    clustered = wm.power_counts("epanechnikov_fixed", wm.clustered_keys(T, 1, 16, clusters=4),
                                beta)
    assert clustered["live"] > 0.5 and clustered["empty_rows"] < 0.1


def test_knn_counts(wm) -> None:
    keys = wm.check_keys(200, 2, 16)
    row = wm.knn_counts("gaussian_knn", keys, k_top=16)
    assert row["causal_tiles"] == 10
    assert 0 < row["merge"] <= 1 and 0 < row["live"] <= 1 and 0 <= row["tie_tiles"] <= 1
    assert (row["fwd_products"], row["bwd_products"]) == (3, 7)
    assert wm.knn_counts("uniform_knn", keys, k_top=16)["bwd_products"] == 2


def test_fska_counts_one_chunk(wm) -> None:
    row = wm.fska_counts(65, 64, features=192, chunk=64)  # one chunk, one causal tile
    assert (row["fwd_products"], row["bwd_products"], row["causal_tiles"]) == (10, 26, 1)


def test_main_prints_a_table(wm, capsys) -> None:
    rows = wm.main(["--lengths", "130", "--heads", "1", "--head-size", "16"])
    kernels = {r["kernel"] for r in rows}
    assert {"epanechnikov", "relumax", "gaussian_knn", "fska",
            "epanechnikov_fixed (clustered keys)"} <= kernels
    assert "| FlashAttention-2 | 1 |" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["epanechnikov", "biweight", "triweight"])
def test_newton_sweeps_match_the_interpreted_kernel(wm, name: str, monkeypatch) -> None:
    """The fused kernel run under Triton's interpreter (row blocks of 32 there), capped at N
    Newton sweeps: each row block's output stops changing at exactly the replica's count."""
    pytest.importorskip("triton")
    import sys

    import mosaics.ops  # noqa: F401
    from mosaics.ops.triton_backend import triton_available

    if triton_available(cpu=True) is not None:
        pytest.skip("Triton's interpreter is not on in this process")
    ops = sys.modules["mosaics.ops.power_attention"]
    monkeypatch.setenv("MOSAICS_FUSED", "1")
    form = wm.kernel_form(name)
    keys = wm.check_keys(65, 1, 16)[0, 0]
    q, k = keys[1:], keys[:-1]
    n, bm = q.shape[0], 32
    scale = form["scale"] * wm.BETA
    a = torch.full((1, n), scale)
    lo, hi = torch.zeros(1, n, dtype=torch.long), torch.arange(n).view(1, n)
    v = torch.eye(n, 16).view(1, 1, n, 16)

    def run(sweeps: int) -> torch.Tensor:
        monkeypatch.setattr(ops, "NEWTON_STEPS", sweeps)
        return ops.power_attention(q.view(1, 1, n, 16), k.view(1, 1, n, 16), v, a, lo, hi,
                                   r=form["r"], entmax=True)[0, 0]

    full = run(wm.NEWTON_STEPS)
    c = q @ k.T
    vis = torch.arange(n).view(1, -1) <= torch.arange(n).view(-1, 1)
    m = c.masked_fill(~vis, float("-inf")).amax(1, keepdim=True)
    x = (scale * (c - m)).masked_fill(~vis, float("-inf"))
    _, its = wm.newton(x, form["r"], torch.arange(n) // bm, 2)
    for block, count in enumerate(its.long().tolist()):
        rows = slice(block * bm, (block + 1) * bm)
        assert torch.equal(run(count)[rows], full[rows])
        assert not torch.equal(run(count - 1)[rows], full[rows])
