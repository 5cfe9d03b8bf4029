"""bench/kernel_ops.py's counter of elementwise work per score in a kernel's Triton IR."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "kernel_ops", Path(__file__).resolve().parents[1] / "bench" / "kernel_ops.py")
kernel_ops = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(kernel_ops)

IR = """
    %r = scf.for %j0 = %a to %b step %c iter_args(%f2 = %z, %s2 = %z) -> (tensor<64x64xf32>) {
      %row = arith.addi %j, %rows : tensor<64xi32>
      %k = tt.load %p : tensor<64x64x!tt.ptr<bf16>>
      %c = tt.dot %q, %k, %z : tensor<64x64xbf16> * tensor<64x64xbf16> -> tensor<64x64xf32>
      %d = arith.subf %c, %m : tensor<64x64xf32>
      %u = scf.if %edge -> (tensor<64x64xf32>) {
        %v = arith.cmpi sge, %jj, %lo : tensor<64x64xi32>
        %w = arith.select %v, %d, %z : tensor<64x64xi1>, tensor<64x64xf32>
        scf.yield %w : tensor<64x64xf32>
      } else {
        scf.yield %d : tensor<64x64xf32>
      }
      %p2 = arith.mulf %u, %u : tensor<64x64xf32>
      %mx = "tt.reduce"(%u) <{axis = 1 : i32}> ({
      ^bb0(%x: f32, %y: f32):
        %n = arith.maxnumf %x, %y : f32
        tt.reduce.return %n : f32
      }) : (tensor<64x64xf32>) -> tensor<64xf32>
      %col = arith.mulf %t, %t : tensor<64x1xf32>
      scf.yield %p2, %u : tensor<64x64xf32>, tensor<64x64xf32>
    }
"""


def test_tile_ops_counts_tile_arithmetic_and_keeps_the_edge_mask_apart():
    [(name, ops, edge)] = kernel_ops.tile_ops(IR)
    assert name == "newton"  # it carries f2
    # subf, mulf and one tile reduction; not the load, the product, 1-D or (64, 1) values
    assert ops == {"arith.subf": 1, "arith.mulf": 1, "tt.reduce": 1}
    assert edge == {"arith.cmpi": 1, "arith.select": 1}


def test_a_branch_without_the_visibility_test_counts_as_taken():
    ir = IR.replace("arith.cmpi sge", "arith.cmpi slt")
    [(_, ops, edge)] = kernel_ops.tile_ops(ir)
    assert edge == {}
    assert ops["arith.cmpi"] == 1 and ops["arith.select"] == 1
