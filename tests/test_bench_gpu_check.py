"""bench/gpu_check.py's dry run (CPU, tiny sizes), its final table and its time limits."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_bench(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}_test", ROOT / "bench" /
                                                  f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check() -> types.ModuleType:
    return load_bench("gpu_check")


def test_dry_run_writes_rows_as_it_goes_and_ends_with_one_table(gpu_check,
                                                                 tmp_path: Path) -> None:
    """Every kernel section, the warm-up processes and the golden losses run on CPU; each
    row lands in rows.jsonl; the run ends with table.md."""
    kernels = ["epanechnikov", "epanechnikov_fixed", "fska"]
    code = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--kernels", *kernels])
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    sections = {r["section"] for r in rows}
    assert sections == {"warm", "kernels_bf16", "adasplash", "golden", "tiles", "kernels_fp32"}
    assert code == 0, [r for r in rows if "error" in r]
    timed = [r for r in rows if r["section"] == "kernels_bf16"]
    assert [(r["kernel"], r.get("variant")) for r in timed] == [
        ("gaussian", None), ("epanechnikov", None), ("epanechnikov_fixed", None),
        ("fska", None), ("fska", "train"), ("fska", "op")]
    assert all(r["ms"] > 0 and r["path"] for r in timed)
    assert next(r for r in timed if r["kernel"] == "epanechnikov_fixed")["keys"] == "clustered"
    assert "adasplash section" in next(r for r in timed if r["kernel"] == "epanechnikov")[
        "adasplash"] or "CUDA" in timed[1]["adasplash"]
    assert all("CUDA" in r["skipped"] for r in rows if r["section"] == "adasplash")
    warm = [r for r in rows if r["section"] == "warm"]
    assert len(warm) == 2 and all("error" not in r for r in warm), warm
    golden = {r["kernel"]: r for r in rows if r["section"] == "golden"}
    assert set(golden) == set(kernels) and all(r["ok"] and r["steps"] == 2
                                               for r in golden.values())
    tiled = [r for r in rows if r["section"] == "tiles"]
    assert [r["op"] for r in tiled if "tile" in r] == ["power", "knn", "linear"]
    assert all(r["ms"] > 0 and r["path"] for r in tiled if "tile" in r)
    assert {r["op"] for r in tiled if "winner" in r} == {"power", "knn", "linear"}
    table = (tmp_path / "table.md").read_text()
    assert "| kernel | T | dtype |" in table and "| fska (op) | 64 | fp32 |" in table
    assert "| op | tiles | kernel |" in table and "| power | m64n64w8" in table
    assert "| golden loss |" in table
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["sections"] == gpu_check.DRY_RUN_SECTIONS


def test_final_table_compares_with_the_fastest_bf16_gaussian(gpu_check, tmp_path: Path) -> None:
    rows = [{"section": "kernels_bf16", "kernel": "gaussian", "T": 8, "dtype": "bf16",
             "ms": 2.0, "first_call_s": 0.1, "path": "sdpa"},
            {"section": "kernels_bf16", "kernel": "gaussian", "variant": "sdpa-cudnn", "T": 8,
             "dtype": "bf16", "ms": 1.0, "first_call_s": 0.1, "path": "sdpa-cudnn"},
            {"section": "kernels_bf16", "kernel": "relumax", "T": 8, "dtype": "bf16",
             "ms": 3.0, "first_call_s": 4.0, "path": "fused", "peak_mb": 12.0},
            {"section": "kernels_fp32", "kernel": "gaussian", "T": 8, "dtype": "fp32",
             "ms": 5.0, "first_call_s": 0.1, "path": "sdpa"},
            {"section": "kernels_fp32", "kernel": "relumax", "T": 8, "dtype": "fp32",
             "error": "OutOfMemoryError: ..."}]
    text = "\n".join(json.dumps(r) for r in rows) + '\n{"section": "kern'  # a torn last line
    (tmp_path / "rows.jsonl").write_text(text)
    table = gpu_check.final_table(tmp_path)
    assert "| relumax | 8 | bf16 | 3.00 | 3.00 | fused | 4.00 | 12 |" in table
    assert "| gaussian | 8 | fp32 | 5.00 | 5.00 | sdpa |" in table  # against bf16's 1.0
    assert "| relumax | 8 | fp32 | - | - | OutOfMemoryError" in table
    assert (tmp_path / "table.md").read_text() == table


def test_a_section_past_the_total_budget_is_skipped(gpu_check, tmp_path: Path) -> None:
    code = gpu_check.main(["--device", "cpu", "--quick", "--sections", "deepspeed",
                           "--total-budget", "3", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 1 and "left of the total budget" in report["deepspeed"]["skipped"]


def test_clustered_keys_give_epanechnikov_fixed_a_support(gpu_check) -> None:
    """At beta e^2 epanechnikov_fixed weighs cosines above 1 - 1/beta = 0.865: random unit
    keys (head size 64) never get there; with the clustered ones, every row after its
    cluster's first member (T 512, 64 clusters: ~7/8 of them)."""
    def supported(keys: torch.Tensor) -> float:
        k = keys[0, 0]
        cos = (k[1:] @ k[:-1].T).tril()
        return ((cos > 1 - 1 / gpu_check.BETA).any(1)).float().mean().item()

    random_keys, _ = gpu_check.check_keys(512, 1, 64)
    assert supported(random_keys) == 0.0
    assert supported(gpu_check.clustered_keys(512, 1, 64)) > 0.8


def test_adasplash_autotuners_are_cut(gpu_check, monkeypatch) -> None:
    triton = pytest.importorskip("triton")

    def body(x):  # noqa: ANN001, ANN202
        return x

    tuned = triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (1, 2, 4, 8)],
                            key=[])(triton.jit(body))
    under = triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (1, 2, 4)],
                            key=[])(triton.jit(body))
    stub = types.ModuleType("adasplash_stub")
    stub.kernel = tuned
    stub.wrapped = triton.heuristics({"X": lambda args: 1})(under)
    monkeypatch.setitem(sys.modules, "adasplash_stub", stub)
    assert gpu_check.trim_autotune(2) == 2
    assert len(tuned.configs) == 2 and len(under.configs) == 2


def test_sdpa_baseline_is_the_gaussian_kernel(gpu_check) -> None:
    """The forced-backend baseline computes the Gaussian kernel's rows 1.. (flash runs on CPU
    too; cuDNN only on CUDA)."""
    from mosaics import get_kernel

    keys, values = gpu_check.check_keys(100, 2, 16)
    beta = torch.full((2,), gpu_check.BETA)
    expected = get_kernel("gaussian")(keys, values, beta)[:, :, 1:]
    torch.testing.assert_close(gpu_check.SdpaBaseline("flash")(keys, values, beta), expected)


@pytest.mark.integration
def test_warm_compiles_each_variant_in_its_own_process(gpu_check, tmp_path: Path) -> None:
    args = gpu_check.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path),
                                 "--kernels", "relumax", "fska", "--warm-workers", "2"])
    rows = gpu_check.warm(args)
    assert {(r["kernel"], r["dtype"]) for r in rows} == {("relumax", "fp32"), ("fska", "fp32"),
                                                         ("fska-op", "fp32")}
    assert all("error" not in r and r["warm_s"] > 0 for r in rows), rows
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 3


def test_final_table_marks_the_fastest_tile_set(gpu_check, tmp_path: Path) -> None:
    rows = [{"section": "tiles", "op": "power", "tile": name, "kernel": "epanechnikov",
             "T": 8, "dtype": "bf16", "ms": ms, "path": "fused"}
            for name, ms in (("m64n64w8", 2.0), ("m128n64w8", 1.5))]
    rows.append({"section": "tiles", "op": "power", "winner": "m128n64w8", "T": 8,
                 "dtype": "bf16", "ms": 1.5})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = gpu_check.final_table(tmp_path)
    assert "| power | m128n64w8 (fastest) | epanechnikov | 8 | bf16 | 1.50 | fused |" in table
    assert "| power | m64n64w8 | epanechnikov | 8 | bf16 | 2.00 | fused |" in table
