"""Every fused Triton kernel, with each op's own tiles and every named tile set, lowers to
Triton IR and moves each pointer argument by an int64 offset first, so that (batch x head) x
stride offsets past 2^31 elements stay right (a compile-level check).

The ops run on small CPU tensors with Triton's launch replaced by a recorder (no kernel
runs), so each kernel is seen with the argument types of its real launch; each recorded
launch is lowered to Triton IR (no GPU needed) and every ``tt.addptr`` on a pointer
argument, or on its splat, must take an int64 offset. Offsets added to an already-moved
pointer (rows and columns inside one (batch, head) slice) may stay int32. Runs in a child
process without ``TRITON_INTERPRET`` (Triton decides at import whether it interprets)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
         "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "bool": "i1"}
ADDPTR = re.compile(r"tt\.addptr (%[\w#:]+), %[\w#:]+ : .*, (tensor<[^<>]*>|i\d+) loc\(")


def narrow_pointer_offsets(ttir: str) -> list[str]:
    """The ``tt.addptr`` lines of Triton IR that move a kernel's pointer argument (or its
    splat) by an offset narrower than int64 (its helpers, private functions before inlining,
    take pointers the kernel has already moved)."""
    bad = []
    for func in re.split(r"\n(?=  tt\.func )", ttir):
        header = func.split("\n", 1)[0]
        if "tt.func public" not in header:  # a helper's pointers arrive already moved
            continue
        roots = {f"%{name}" for name in re.findall(r"%(\w+): !tt\.ptr<", header)}
        splats = re.findall(r"(%[\w#:]+) = tt\.splat (%\w+) :", func)
        roots |= {dst for dst, src in splats if src in roots}
        for line in func.splitlines():
            match = ADDPTR.search(line)
            if match and match.group(1) in roots and not match.group(2).endswith("i64>") \
                    and match.group(2) != "i64":
                bad.append(line.strip().split(" loc(")[0])
    return bad


def record_launches() -> list[tuple]:
    """(kernel, positional args, keyword args) of every Triton launch of the fused ops'
    forward and backward (power, kNN, linear attention) on small CPU tensors: every form
    with each op's own tiles, then each op once per named tile set."""
    import torch
    from triton.runtime.jit import JITFunction

    from mosaics.ops.triton_backend import TILES, use_tiles

    calls = []

    def record(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        calls.append((self, args, kwargs))

    JITFunction.run = record
    from mosaics.ops.knn_attention import knn_attention
    from mosaics.ops.linear_attention import fused_backward, fused_forward
    from mosaics.ops.power_attention import power_attention

    B, H, n, D = 1, 2, 40, 16
    q, k, v = (torch.randn(B, H, n, D, requires_grad=True) for _ in range(3))
    a = torch.ones(B * H, n, requires_grad=True)
    beta = torch.ones(H, requires_grad=True)
    lo, hi = torch.zeros(1, n, dtype=torch.long), torch.arange(n).view(1, n) - 1

    def power(kw: dict) -> None:
        power_attention(q, k, v, a, lo, hi, r=1.0, **kw).sum().backward()

    def knn(uniform: bool) -> None:
        bounds = (lo.expand(B, n), hi.expand(B, n)) if uniform else (None, None)
        knn_attention(q, k, v, beta, -1, 4, uniform, *bounds).sum().backward()

    def linear() -> None:
        with torch.no_grad():
            y, den = fused_forward(q.abs(), k.abs(), v, 1e-6)
            fused_backward(q.abs(), k.abs(), v, y, den, torch.randn_like(y))

    for kw in ({"entmax": True, "bias": torch.ones(B * H, n)}, {"shift": -1.0},
               {"anchor": 1.0, "shift": -1.0}):
        power(kw)
    knn(False)
    knn(True)
    linear()
    runs = {"power": lambda: power({"entmax": True}), "knn": lambda: knn(False),
            "linear": linear}
    for op, tiles in TILES.items():
        for name in tiles:
            with use_tiles(op, name):
                runs[op]()
    return calls


def lower(fn, args: tuple, kwargs: dict) -> str:  # noqa: ANN001
    """Triton IR (before optimization) of ``fn`` specialized as this launch, for sm_90."""
    import torch
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    names = fn.arg_names
    values = dict(zip(names, args)) | {k: kwargs[k] for k in names if k in kwargs}
    signature, constexprs = {}, {}
    for i, (name, param) in enumerate(zip(names, fn.params)):
        value = values[name]
        if param.is_constexpr or value is None:
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": kwargs.get("num_warps", 4),
                                     "sanitize_overflow": False})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(fn, signature, constexprs=constexprs)
    module = source.make_ir(target, options, backend.get_codegen_implementation(options),
                            backend.get_module_map(), context)
    return str(module)


def check_all() -> dict[str, list[str]]:
    """{kernel: its narrow pointer offsets} over every recorded launch."""
    found: dict[str, list[str]] = {}
    for fn, args, kwargs in record_launches():
        bad = narrow_pointer_offsets(lower(fn, args, kwargs))
        found.setdefault(fn.__name__, [])
        found[fn.__name__] += [line for line in bad if line not in found[fn.__name__]]
    return found


def test_narrow_offsets_are_found() -> None:
    ttir = """  tt.func public @k(%X: !tt.ptr<f32> loc("X"), %n: i32 loc("n")) {
    %x = tt.splat %X : !tt.ptr<f32> -> tensor<4x!tt.ptr<f32>> loc(#loc1)
    %y = tt.addptr %x, %o : tensor<4x!tt.ptr<f32>>, tensor<4xi32> loc(#loc2)
    %z = tt.addptr %X, %w : !tt.ptr<f32>, i64 loc(#loc3)
    %u = tt.addptr %z, %o : !tt.ptr<f32>, i32 loc(#loc4)
  tt.func private @helper(%P: !tt.ptr<f32> loc("P")) {
    %v = tt.addptr %P, %o : !tt.ptr<f32>, i32 loc(#loc5)"""
    assert narrow_pointer_offsets(ttir) == [
        "%y = tt.addptr %x, %o : tensor<4x!tt.ptr<f32>>, tensor<4xi32>"]


@pytest.mark.integration  # a child process; ~80 lowerings to Triton IR, ~20 s
def test_every_fused_kernel_offsets_its_pointers_in_int64() -> None:
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"_power_fwd", "_power_bwd_dq", "_power_bwd_dkv", "_knn_fwd", "_knn_bwd_dkdv",
            "_knn_bwd_dq", "chunk_states", "chunk_forward", "output_grad",
            "chunk_backward"} <= set(found), sorted(found)
    assert not any(found.values()), found


if __name__ == "__main__":
    print(json.dumps(check_all()))
