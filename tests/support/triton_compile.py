"""Compile the project's Triton kernels for a Hopper GPU (sm_90) on a machine without one.

Run as a script, without TRITON_INTERPRET (the interpreter replaces the kernels with Python and
never runs Triton's front end, which is where a loop-carried type change or a non-constexpr global
fails): `python tests/support/triton_compile.py`. Prints one line per kernel, "ok NAME" or the
error, and exits 1 if any failed. test_triton_compile.py runs it.
"""

from __future__ import annotations

import inspect
import sys


def _signature(fn, pointers: dict[str, str], floats: set[str], constexprs: dict[str, object]):
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        sig[name] = pointers.get(name) or ("constexpr" if name in constexprs else "fp32" if name in floats else "i32")
    params = list(sig)
    return sig, {(params.index(k),): v for k, v in constexprs.items()}


def main() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddtree.engine.reference.fast import triton_gemv, triton_kernels, triton_rope, triton_row_ops, triton_tree

    f32, bf16 = "*fp32", "*bf16"
    cases = []
    tree_ptrs = {"TV": f32, "TI": "*i64", "ROOTS": "*i64", "STEPS": "*i32", "ROWS": "*i64", "COLS": "*i64",
                 "DEPTHS": "*i64", "SC": f32, "PAR": "*i32", "TOK": "*i64", "SLOT": "*i32", "KEYS": "*i64", "OUT_TOK": "*i64",
                 "OUT_DEP": "*i64", "OUT_PAR": "*i64", "OUT_SC": f32, "VIS": "*u8"}
    for pc, pt, warps in ((64, 512, 4), (2048, 4096, 8), (4096, 8192, 16)):  # small, budgets 256 and 512
        cases.append((f"build_tree PC={pc} PT={pt}", triton_tree.build_tree, tree_ptrs, set(),
                      {"PK": pt // 16, "PM": pt // 16, "PC": pc, "PS": min(pc, pt // 16), "PT": pt,
                       "PF": pt // 4, "PN": pt // 8}, warps))
    for dtype in (bf16, f32):
        ptrs = {"Q": dtype, "K": dtype, "V": dtype, "LENGTHS": "*i64", "TREE": "*u8", "SLOTS": "*i64",
                "OUT": dtype, "PART": f32, "ML": f32}
        for final, slots in ((True, False), (False, False), (False, True)):
            cases.append((f"attend_split {dtype} final={final} slots={slots}", triton_kernels.attend_split, ptrs,
                          {"scale"}, {"D": 128, "BLOCK_M": 16, "BLOCK_N": 64, "HAS_TREE": True, "HAS_SLOTS": slots,
                                      "IEEE": dtype == f32, "FINAL": final}, 4))
        cases.append((f"merge_splits {dtype}", triton_kernels.merge_splits,
                      {"PART": f32, "ML": f32, "OUT": dtype, "LENGTHS": "*i64"}, set(),
                      {"D": 128, "BLOCK_R": 16, "BLOCK_N": 64}, 4))
    for dtype in (bf16, f32):
        gemv_ptrs = {"X": dtype, "W": dtype, "BIAS": dtype, "Y": dtype, "RES": dtype, "NORM": dtype}
        for even, pre, res in ((True, 0, False), (False, 0, False), (True, 1, True), (False, 2, False)):
            cases.append((f"gemv {dtype} even={even} pre={pre} res={res}", triton_gemv.gemv, gemv_ptrs, {"eps"},
                          {"HAS_BIAS": True, "BLOCK_N": 8, "BLOCK_K": 512, "EVEN": even, "PRE": pre, "HAS_RES": res}, 4))
        cases.append((f"gemv {dtype} 16x1024", triton_gemv.gemv, gemv_ptrs, {"eps"},
                      {"HAS_BIAS": False, "BLOCK_N": 16, "BLOCK_K": 1024, "EVEN": True, "PRE": 2, "HAS_RES": True}, 8))
        for pre, res, tile in ((0, False, (16, 64, 64)), (1, True, (32, 32, 64)), (2, False, (64, 64, 32))):
            cases.append((f"rows {dtype} pre={pre} res={res} tile={tile}", triton_gemv.rows, gemv_ptrs, {"eps"},
                          {"HAS_BIAS": pre == 0, "BLOCK_M": tile[0], "BLOCK_N": tile[1], "BLOCK_K": tile[2],
                           "PRE": pre, "HAS_RES": res, "IEEE": dtype == f32}, 4))
        if dtype == f32:  # the elementwise kernel: float32 weights (the demo pair)
            for pre, res in ((0, False), (1, True), (2, True)):
                cases.append((f"rows_fma pre={pre} res={res}", triton_gemv.rows_fma, gemv_ptrs, {"eps"},
                              {"HAS_BIAS": pre == 0, "BLOCK_M": 4, "BLOCK_N": 8, "BLOCK_K": 256, "PRE": pre,
                               "HAS_RES": res}, 4))
        for norm, slots in ((True, False), (False, True)):
            cases.append((f"rope_write {dtype} norm={norm} slots={slots}", triton_rope.rope_write,
                          {"QKV": dtype, "QW": dtype, "KW": dtype, "COS": dtype, "SIN": dtype, "KC": dtype,
                           "VC": dtype, "SLOTS": "*i64", "ROWS": "*i64", "QOUT": dtype}, {"eps"},
                          {"D": 128, "HAS_NORM": norm, "HAS_SLOTS": slots}, 1))
        cases.append((f"silu_mul {dtype}", triton_row_ops.silu_mul, {"X": dtype, "OUT": dtype}, set(),
                      {"BLOCK": 1024}, 4))
        for width, warps in ((2048, 8), (4096, 16)):
            cases.append((f"rms_norm {dtype} {width}", triton_row_ops.rms_norm, {"X": dtype, "W": dtype, "OUT": dtype},
                          {"eps"}, {"BLOCK": width}, warps))
    failed = 0
    for name, fn, ptrs, floats, consts, warps in cases:
        sig, constexprs = _signature(fn, ptrs, floats, consts)
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            print(f"ok {name}", flush=True)
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[-600:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
