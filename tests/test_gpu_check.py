"""bench/gpu_check.py runs end to end (tiny sizes, on CPU) and writes its report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_run_on_cpu(tmp_path: Path) -> None:
    from mosaics import available_kernels

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.main(["--device", "cpu", "--quick", "--sections", "throughput", "kernels",
                        "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["device"] == "cpu" and report["quick"] is True
    assert {r["model"] for r in report["throughput"]} == {"mosaics", "gpt2"}
    assert all(r["tok_s"] > 0 for r in report["throughput"])
    kernels = [r for r in report["kernels"] if r["T"] == 64]
    assert {r["kernel"] for r in kernels} == set(available_kernels())
    assert all("error" not in r for r in kernels), [r for r in kernels if "error" in r]
    assert next(r for r in kernels if r["kernel"] == "gaussian")["vs_gaussian"] == 1.0
