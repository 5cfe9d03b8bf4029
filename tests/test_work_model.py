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
    x[torch.arange(128), torch.randint(0, 250, (128,))] = 0.0  # the row max, as scaled
    x[:, 250:] = float("-inf")  # entries a row does not see
    blocks = torch.arange(128) // 64
    tau, its, read, live, _, _ = wm.newton(x, r, blocks, 2, bn=50)
    mass = (x - tau).clamp_min(0).pow(r).sum(1)
    torch.testing.assert_close(mass, torch.ones(128), rtol=1e-4, atol=1e-4)
    assert its.shape == (2,) and bool((its >= 1).all()) and bool((its < wm.NEWTON_STEPS).all())
    # the first pass reads all 6 tiles; the last (keys 250..299, never visible) dies in it
    assert bool((read >= 6).all()) and bool((read <= 6 + 5 * (its - 1)).all())
    assert live.shape == (2, 6) and not live[:, 5].any()
    # from the subset bound: below the root, and no more passes than from -1
    start = wm.subset_start(x, 1.0, r, 50)
    assert bool((start >= -1).all()) and bool((start <= tau + 1e-6).all())
    _, its_bound, _, _, _, _ = wm.newton(x, r, blocks, 2, start, bn=50)
    assert bool((its_bound <= its).all())


def test_power_counts_follow_the_loops(wm) -> None:
    T = 200  # 199 query rows: 4 row blocks of 64, 1 + 2 + 3 + 4 causal tiles
    keys = wm.check_keys(T, 1, 16)
    beta = torch.full((1,), wm.BETA)
    sparsemax = wm.power_counts("epanechnikov", keys, beta)
    assert sparsemax["causal_tiles"] == 10
    # a row-max sweep, the Newton passes and (unless the last Newton pass made the output)
    # the output pass over the tiles left live
    assert 1 <= sparsemax["newton_sweeps"] <= sparsemax["newton_max"] < wm.NEWTON_STEPS
    assert 1 <= sparsemax["newton_read"] <= sparsemax["newton_sweeps"]
    assert 0 <= sparsemax["fused"] <= 1
    assert sparsemax["live"] <= sparsemax["fwd_products"] - sparsemax["fwd_sweeps"] <= 2
    assert sparsemax["fwd_sweeps"] == pytest.approx(
        1 + sparsemax["newton_read"] + sparsemax["output_read"])
    assert 0 < sparsemax["live_fine"] <= 1 and 0 < sparsemax["live"] <= 1
    assert sparsemax["bwd_products"] == pytest.approx(9 * sparsemax["live"])
    loose = wm.power_counts("epanechnikov", keys, beta, tol=1e-3)
    assert loose["newton_sweeps"] <= sparsemax["newton_sweeps"]
    relu = wm.power_counts("relumax", keys, beta)
    assert relu["fwd_sweeps"] == 2 and "newton_max" in relu and relu["newton_sweeps"] == 0
    # at beta e^2 random unit keys never reach cosine 0.865: no live tile, 1 sweep, and the
    # backward skips every tile
    fixed = wm.power_counts("epanechnikov_fixed", keys, beta)
    assert fixed["live"] == 0 and fixed["empty_rows"] == 1
    assert (fixed["fwd_products"], fixed["bwd_products"]) == (1, 0)
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
@pytest.mark.parametrize("sharp", [1.0, 8.0])
def test_the_replica_counts_what_the_interpreted_kernel_does(wm, name: str, sharp: float,
                                                             monkeypatch) -> None:
    """The fused kernel run under Triton's interpreter (32 x 32 tiles there) records, per row
    block, its Newton passes and its live tiles: the replica's, pass for pass and tile for
    tile (sharp: a narrower bandwidth, where tiles die)."""
    pytest.importorskip("triton")
    import sys

    import mosaics.ops  # noqa: F401
    from mosaics.ops.triton_backend import triton_available

    if triton_available(cpu=True) is not None:
        pytest.skip("Triton's interpreter is not on in this process")
    ops = sys.modules["mosaics.ops.power_attention"]
    monkeypatch.setenv("MOSAICS_FUSED", "1")
    monkeypatch.setattr(ops, "RECORD", [])
    form = wm.kernel_form(name)
    g = torch.Generator().manual_seed(0)  # two clusters of keys: positions < 48, the rest
    centers = torch.nn.functional.normalize(torch.randn(2, 16, generator=g), dim=-1)
    keys = centers[(torch.arange(97) >= 48).long()] + 0.05 * torch.randn(97, 16, generator=g)
    keys = torch.nn.functional.normalize(keys, dim=-1)
    q, k = keys[1:], keys[:-1]
    n, tile = q.shape[0], 32
    scale = form["scale"] * wm.BETA * sharp
    lo, hi = torch.zeros(1, n, dtype=torch.long), torch.arange(n).view(1, n)
    v = torch.eye(n, 16).view(1, 1, n, 16)
    ops.power_attention(q.view(1, 1, n, 16), k.view(1, 1, n, 16), v, torch.full((1, n), scale),
                        lo, hi, r=form["r"], entmax=True)
    (rec,) = ops.RECORD
    c = q @ k.T
    vis = torch.arange(n).view(1, -1) <= torch.arange(n).view(-1, 1)
    cv = c.masked_fill(~vis, float("-inf"))
    x = scale * (cv - cv.amax(1, keepdim=True))
    blocks = torch.arange(n) // tile
    n_blocks = int(blocks.max()) + 1
    tiles = (torch.clamp(torch.arange(n_blocks) * tile + tile, max=n) - 1) // tile + 1
    tau0 = wm.subset_start(cv, scale, form["r"], tile)
    tau, its, _, _, fused, _ = wm.newton(x, form["r"], blocks, n_blocks, tau0, wm.NEWTON_TOL, tile,
                                      tiles)
    assert rec["iters"][0].tolist() == (its + ~fused).long().tolist()
    if name == "epanechnikov":  # sparsemax: a block whose last Newton pass made the output
        assert bool(fused.any())
    u = (x - tau).clamp_min(0)
    live = wm._tile_any(u, 0, tile, tile)
    causal = torch.arange(live.shape[1]).view(1, -1) < tiles.view(-1, 1)
    assert torch.equal(rec["live"][0].bool() & causal, live & causal)
    if sharp > 1:
        assert not bool(live[causal].all())  # some tile died
