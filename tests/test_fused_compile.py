"""The fused Triton kernels compile for a GPU (sm_80 and sm_90, down to cubin) on this machine:
Triton's interpreter (tests/test_fused_*.py) checks what they compute; this checks what only
the compiler sees (types of loop-carried values, constexpr branches, dot shapes).

The compiles run in a child process without ``TRITON_INTERPRET`` (Triton decides at import
whether its own library functions are interpreted)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1] / "mosaics" / "ops" / "triton_kernels"
FLOATS = {"r", "shift_const", "anchor_const", "tol"}

# (dtype, SOLVE, ANCHOR_MAX, R_KIND, HAS_BIAS, arch): every power form once, both archs
POWER_CASES = [
    ("fp32", True, True, 1, False, 90),   # sparsemax, fp32
    ("bf16", True, True, 2, True, 90),    # biweight, bf16, ALiBi
    ("fp16", True, True, 0, False, 80),   # entmax, any r
    ("bf16", False, True, 1, True, 80),   # relumax
    ("fp32", False, False, 3, False, 90),  # epanechnikov_fixed, r 3
]


def _compile(fn, pointers: dict[str, str], constexprs: dict, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {}
    for name in names:
        if name in pointers:
            signature[name] = pointers[name]
        elif name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    src = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    return bool(kernel.asm["cubin"]) and ".entry" in kernel.asm["ptx"]


def _power_pointers(dtype: str) -> dict[str, str]:
    return {**{k: f"*{dtype}" for k in ("Q", "K", "V", "G")},
            **{k: "*fp32" for k in ("A", "BIAS", "OUT", "M", "SHIFT", "NSUM", "KAPPA", "C",
                                    "INV", "DQ", "RSUM", "RSUMJ", "DK", "DV_OUT")},
            **{k: "*i32" for k in ("LO", "HI", "ARG", "QB_FIRST", "QB_LAST")}}


def compile_all() -> dict[str, bool]:
    """Compile every case (in this process: run it without TRITON_INTERPRET)."""
    spec = importlib.util.spec_from_file_location("power_aot", KERNELS / "power_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    done = {}
    for dtype, solve, anchor_max, r_kind, bias, arch in POWER_CASES:
        pointers = _power_pointers(dtype)
        blocks = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, BLOCK_DV=64, R_KIND=r_kind,
                      IEEE=dtype == "fp32", HAS_BIAS=bias)
        case = f"{dtype}-solve{int(solve)}-max{int(anchor_max)}-r{r_kind}-bias{int(bias)}-sm{arch}"
        done[f"fwd {case}"] = _compile(module._power_fwd, pointers, {
            **blocks, "ANCHOR_MAX": anchor_max, "SOLVE": solve, "N_ITER": 30}, arch)
        done[f"dq {case}"] = _compile(module._power_bwd_dq, pointers,
                                      {**blocks, "SOLVE": solve}, arch)
        done[f"dkv {case}"] = _compile(module._power_bwd_dkv, pointers, blocks, arch)
    return done


@pytest.mark.integration  # 15 compiles, about a minute on one core
def test_power_kernels_compile_for_cuda():
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(done) == 3 * len(POWER_CASES) and all(done.values()), done


if __name__ == "__main__":
    print(json.dumps(compile_all()))
