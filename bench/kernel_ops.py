"""Elementwise work per score of the fused power kernels, counted in their compiled IR.

The passes of ``_power_fwd`` / ``_power_bwd_dq`` / ``_power_bwd_dkv`` are bound by the
arithmetic done on every score (docs/notes/2026-12-07-work-model.md), which the QK^T count
of ``bench/work_model.py`` does not see. This compiles each kernel for sm_90 from a recorded
launch (as ``tests/test_fused_compile.py`` does, no GPU needed) and counts, in the Triton IR
of every key-tile loop, the operations on whole (BLOCK_M, BLOCK_N) tiles: arithmetic,
comparisons, selects, pointer offsets, and each reduction over a tile (its combine, once per
score). Tile products, loads, broadcasts and layout changes are not counted; ops in a branch
(the speculative output of a Newton pass, a masked tile) count as if taken.

    python bench/kernel_ops.py            # bf16 biweight (and with ALiBi), fp32 sparsemax
    python bench/kernel_ops.py --json out.json

Loops are named by what they carry: ``max`` (the row max and the subset sums), ``newton``
(one Newton pass), ``newton + output`` (the speculative last one), ``output`` (the output
pass), ``c`` (the backward's c_i pass), ``dq``,
``dk`` (the dK/dV loop over query blocks).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [  # (label, dtype, SOLVE, ANCHOR_MAX, R_KIND, HAS_BIAS)
    ("biweight bf16", "bf16", True, True, 2, False),
    ("biweight bf16 ALiBi", "bf16", True, True, 2, True),
    ("sparsemax fp32", "fp32", True, True, 1, False),
]
NOT_COUNTED = ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.trans", "tt.load", "tt.dot",
               "tt.make_range", "ttg.convert_layout", "arith.constant", "tt.reshape",
               "tt.store", "arith.truncf")
TILE = re.compile(r"tensor<([2-9]|\d\d+)x([2-9]|\d\d+)x")  # both sides > 1: a tile
LOOP_NAMES = {"m": "max", "f2": "newton", "total": "output", "num": "c", "dq": "dq", "dk": "dk"}


def _loop_name(carried: list[str]) -> str:
    """A loop's name from the values it carries (``LOOP_NAMES``; a Newton pass that also
    makes the output carries its accumulator)."""
    if "f2" in carried and "acc" in carried:
        return "newton + output"
    for name in carried:
        if name in LOOP_NAMES:
            return LOOP_NAMES[name]
    return "/".join(carried)


def tile_ops(ttir: str) -> list[tuple[str, dict[str, int], dict[str, int]]]:
    """[(loop, {op: count}, {op: count on edge tiles only})] for every ``scf.for`` of the IR,
    in order: the ops whose result is a 2-D tile, and each reduction of a 2-D tile. Ops in a
    branch that tests visibility per score (``j >= lo``: the mask of an edge tile) are counted
    apart, as the edge tiles' extra work."""
    found: list[tuple[str, dict[str, int], dict[str, int]]] = []
    # frames: [kind, name, indent, counts, edge counts, whether it tests j >= lo]
    stack: list[list] = []

    def add(counts: dict[str, int], more: dict[str, int]) -> None:
        for key, value in more.items():
            counts[key] = counts.get(key, 0) + value

    for line in ttir.splitlines():
        text = line.strip()
        indent = len(line) - len(line.lstrip())
        head = re.search(r"scf\.for %\w+ = .*iter_args\((.*?)\) ->", text)
        if head:
            carried = [re.sub(r"_\d+$", "", v) for v in re.findall(r"%(\w+) =", head.group(1))]
            stack.append(["for", _loop_name(carried), indent, {}, {}, False])
            continue
        if not stack:
            continue
        if "scf.if" in text:
            stack.append(["if", "", indent, {}, {}, False])
            continue
        if text.startswith("}") and indent == stack[-1][2] and "else" not in text:
            kind, name, _, counts, edge, masks = stack.pop()
            if kind == "for":
                found.append((name, counts, edge))
            elif stack:  # an if closes into its loop (or outer if)
                parent = stack[-1]
                add(parent[4], edge)
                add(parent[4] if masks else parent[3], counts)
            continue
        counts = stack[-1][3]
        if text.startswith("})") and TILE.search(text.split(") -> ")[0]):
            counts["tt.reduce"] = counts.get("tt.reduce", 0) + 1  # a reduce's closing line
            continue
        op = re.search(r'= "?([a-z_]+\.[a-z_.]+)"?', text)
        if op is None or op.group(1) in NOT_COUNTED or op.group(1).startswith("scf."):
            continue
        if op.group(1) != "tt.reduce" and TILE.search(text.split(":")[-1]):
            counts[op.group(1)] = counts.get(op.group(1), 0) + 1
            if op.group(1) == "arith.cmpi" and " sge," in text:
                stack[-1][5] = True
    return found


def _compile_module():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(
        "fused_compile", ROOT / "tests" / "test_fused_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def count(arch: int = 90) -> list[dict]:
    """Per case, kernel and loop: ops per score (compiles in this process; run it without
    TRITON_INTERPRET)."""
    import torch

    from mosaics.ops.power_attention import _blocks

    fc = _compile_module()
    rows = []
    for label, dtype, solve, anchor_max, r_kind, bias in CASES:
        bm, bn, _, _, warps = _blocks(torch.device("cuda"), 64, 64,
                                      getattr(torch, fc.DTYPES[dtype]), arch)
        cuda = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "IEEE": dtype == "fp32"}
        for fn, args, kwargs in fc.record_power_launches(dtype, solve, anchor_max, r_kind, bias):
            kernel, _ = fc.build(fn, args, kwargs | cuda, arch)
            for loop, ops, edge in tile_ops(kernel.asm["ttir"]):
                rows.append({"case": label, "kernel": fn.__name__, "loop": loop,
                             "ops": sum(ops.values()), "edge_ops": sum(edge.values()),
                             "detail": ops})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| case | kernel | loop | ops per score | more on an edge tile | of which |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        detail = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in sorted(r["detail"].items()))
        lines.append(f"| {r['case']} | {r['kernel']} | {r['loop']} | {r['ops']} | "
                     f"{r.get('edge_ops', 0)} | {detail} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # compile in a clean child
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:])], env=env,
                              check=True) and []
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, str(ROOT))
    rows = count(args.arch)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
