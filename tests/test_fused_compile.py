"""The fused Triton kernels compile for a GPU (sm_80 and sm_90, down to cubin) on this machine:
Triton's interpreter (tests/test_fused_*.py) checks what they compute; this checks what only
the compiler sees (types of loop-carried values, constexpr branches, dot shapes), on the build
a launch makes: each kernel is compiled from a recorded launch of the op (CPU tensors of a
GPU-like shape, Triton's launch replaced by a recorder), its tiles and products those of the
op's CUDA rule, specialized by Triton's own binder (16-divisible sizes and strides, aligned
pointers: the ``tt.divisibility`` hints of the real launch).

The compiles run in a child process without ``TRITON_INTERPRET`` (Triton decides at import
whether its own library functions are interpreted)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# (dtype, SOLVE, ANCHOR_MAX, R_KIND, HAS_BIAS, arch): every power form once, both archs
POWER_CASES = [
    ("fp32", True, True, 1, False, 90),   # sparsemax, fp32
    ("bf16", True, True, 2, True, 90),    # biweight, bf16, ALiBi
    ("fp16", True, True, 0, False, 80),   # entmax, any r
    ("bf16", False, True, 1, True, 80),   # relumax
    ("fp32", False, False, 3, False, 90),  # epanechnikov_fixed, r 3
]
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _resources(cubin: bytes) -> dict[str, int | None]:
    """Per-thread registers and stack (spilled registers) of a cubin, from Triton's bundled
    cuobjdump (None without one)."""
    import shutil
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists() and shutil.which("cuobjdump") is None:
        return {"regs": None, "stack": None}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        out = subprocess.run([str(tool) if tool.exists() else "cuobjdump",
                              "--dump-resource-usage", handle.name],
                             capture_output=True, text=True).stdout

    def field(name: str) -> int | None:
        found = [int(part.split(":")[1]) for part in out.split() if part.startswith(name + ":")]
        return max(found) if found else None

    return {"regs": field("REG"), "stack": field("STACK")}


def record_power_launches(dtype: str, solve: bool, anchor_max: bool, r_kind: int,
                          bias: bool, n: int = 128, D: int = 64) -> list[tuple]:
    """(kernel, args, kwargs) of the power op's forward and backward launches on CPU tensors
    (B 1, H 2, n rows, head size D), no kernel run."""
    import torch
    from triton.runtime.jit import JITFunction

    from mosaics.ops.power_attention import power_attention

    calls: list[tuple] = []

    def record(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        calls.append((self, args, kwargs))

    original = JITFunction.run
    JITFunction.run = record
    try:
        B, H = 1, 2
        dt = getattr(torch, DTYPES[dtype])
        q, k, v = (torch.randn(B, H, n, D, dtype=dt, requires_grad=True) for _ in range(3))
        a = torch.ones(B * H, n, requires_grad=True)
        lo, hi = torch.zeros(1, n, dtype=torch.long), torch.arange(n).view(1, n) - 1
        r = {0: 1.5, 1: 1.0, 2: 2.0, 3: 3.0}[r_kind]
        form = ({"entmax": True} if solve else {"shift": -0.5} if anchor_max
                else {"anchor": 1.0, "shift": -1.0})
        slope = torch.full((B * H, n), 0.01) if bias else None
        power_attention(q, k, v, a, lo, hi, r=r, bias=slope, **form).sum().backward()
    finally:
        JITFunction.run = original
    return calls


def build(fn, args: tuple, kwargs: dict, arch: int):  # noqa: ANN001, ANN201
    """The compiled kernel of one recorded launch for sm_``arch``, specialized as Triton's
    launcher would (``bench/kernel_ops.py`` reads its IR)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                            options=options.__dict__)
    return kernel, sum(1 for v in attrs.values() if v)


def unpipelined_loops(ttgir: str) -> list[str]:
    """The loops of Triton GPU IR that multiply tiles (a dot in their body) but prefetch
    nothing (no asynchronous copy in their body): loads the compiler left synchronous, as it
    does for loads inside a branch."""
    lines = ttgir.splitlines()
    bad = []
    for i, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        for nxt in lines[i + 1:]:
            if nxt.strip().startswith("}") and len(nxt) - len(nxt.lstrip()) == indent:
                break
            body.append(nxt)
        text = "\n".join(body)
        if re.search(r"\b(tt\.dot|ttng\.warp_group_dot)\b", text) and \
                "async_copy_global_to_local" not in text:
            bad.append(line.strip()[:60])
    return bad


def compile_launch(fn, args: tuple, kwargs: dict, arch: int) -> dict:  # noqa: ANN001
    """Compile one recorded launch for sm_``arch`` as Triton's launcher would specialize it."""
    kernel, hinted = build(fn, args, kwargs, arch)
    ok = bool(kernel.asm["cubin"]) and ".entry" in kernel.asm["ptx"]
    # the warps of the score tile's tensor-core layout along (rows, keys): 1 along the keys
    # keeps each row inside one warp (its sums and maxima need no shared memory)
    mma = re.search(r"nvidia_mma<\{.*warpsPerCTA = \[(\d+), (\d+)\]", kernel.asm["ttgir"])
    return {"ok": ok, "hinted": hinted, "shared": kernel.metadata.shared,
            "mma_warps": [int(mma.group(1)), int(mma.group(2))] if mma else None,
            "barriers": len(re.findall(r"\bbar\.sync\b", kernel.asm["ptx"])),
            "unpipelined": unpipelined_loops(kernel.asm["ttgir"]),
            **_resources(kernel.asm["cubin"])}


def compile_all() -> dict[str, dict]:
    """Compile every case's three kernels with the op's CUDA tiles (in this process: run it
    without TRITON_INTERPRET)."""
    import torch

    from mosaics.ops.power_attention import _blocks

    done = {}
    for dtype, solve, anchor_max, r_kind, bias, arch in POWER_CASES:
        bm, bn, _, _, warps = _blocks(torch.device("cuda"), 64, 64,
                                      getattr(torch, DTYPES[dtype]), arch)
        cuda = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "IEEE": dtype == "fp32"}
        case = f"{dtype}-solve{int(solve)}-max{int(anchor_max)}-r{r_kind}-bias{int(bias)}-sm{arch}"
        names = {"_power_fwd": "fwd", "_power_bwd_dq": "dq", "_power_bwd_dkv": "dkv"}
        for fn, args, kwargs in record_power_launches(dtype, solve, anchor_max, r_kind, bias):
            done[f"{names[fn.__name__]} {case}"] = compile_launch(fn, args, kwargs | cuda, arch)
    return done


@pytest.mark.integration  # 15 compiles, one to three minutes on one core
def test_power_kernels_compile_for_cuda():
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(done) == 3 * len(POWER_CASES) and all(r["ok"] for r in done.values()), done
    assert all(r["hinted"] > 0 for r in done.values()), done  # the launch's divisibility hints
    # bf16 / fp16 tiles fit in registers on sm_90 (fp32's three TF32 products spill a little)
    spills = {k: r["stack"] for k, r in done.items()
              if "sm90" in k and not k.split()[1].startswith("fp32") and r["stack"]}
    assert not spills, spills
    # on sm_90 every row of the forward's and dq's score tiles stays inside one warp
    split = {k: r["mma_warps"] for k, r in done.items()
             if "sm90" in k and not k.startswith("dkv") and r["mma_warps"][1] != 1}
    assert not split, split
    # every key-tile loop (the max, Newton and output passes, dq's two, dkv's) prefetches its
    # loads: it walks a list of live blocks instead of branching on a flag around them
    serial = {k: r["unpipelined"] for k, r in done.items() if r["unpipelined"]}
    assert not serial, serial


if __name__ == "__main__":
    print(json.dumps(compile_all()))
