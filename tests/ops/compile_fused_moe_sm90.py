"""Compile fused_moe's down GEMM (`_moe_gemm_kernel`, not GATED, the routing weight in its epilogue) and its slot sum
(`_moe_sum_kernel`) for sm_90 as qwen3-30b-a3b's decode launches build them (E 128, top-8, H 2048, I 768, bf16; the
tiles `moe_tile_config` picks), with their loads before the PDL wait (PRELOAD, fused_moe.MOE_PRELOAD) and without, no
GPU needed; print one JSON line with, for each, cuobjdump's resource line (REG: registers, STACK / LOCAL: spill bytes)
and, from the PTX, the global loads and the stores (st / atom / red) issued before `griddepcontrol.wait`.

Cases: batch 1 (pair-per-block mode, 32 output columns per program), batch 1 on one of two expert-parallel ranks
(an expert map), batch 2 (pair-per-block mode, 64 columns) and batch 4 (the expert-sorted path after align, 128
columns: a B tile past fused_moe's _PRELOAD_MAX_TILE, so its launches do not preload; built to show why). The
interpreter shows no compile error (an early return the GPU compiler rejects, a register spill): this build does.

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_fused_moe_sm90`. Exits
NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by tests/ops/test_fused_moe_preload.py. Builds only.
"""

from __future__ import annotations

import re
import sys

from tests.ops.compile_sm90 import build_sm90, report_main, resource_usage

QWEN3 = dict(num_experts=128, top_k=8, hidden=2048, inter=768)
# (name, tokens, local experts: None for all of them)
CASES = [("qwen3_t1", 1, None), ("qwen3_t1_ep2", 1, 64), ("qwen3_t2", 2, None), ("qwen3_t4", 4, None)]
POINTERS = {"sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "map_ptr": "*i32",
            "ids_ptr": "*i32"}


def usage(built) -> dict:
    """The build's resource line and what its PTX issues before the PDL wait (nothing past the first wait counts)."""
    before = built.asm["ptx"].split("griddepcontrol.wait")[0]
    return {"resources": resource_usage(built.asm["cubin"]),
            "loads_before_wait": len(re.findall(r"\bld\.global\b", before)),
            "vector_loads_before_wait": len(re.findall(r"\bld\.global(?:\.\w+)*\.v[24]\b", before)),
            "stores_before_wait": len(re.findall(r"\b(?:st\.global|atom|red)\.", before))}


def down_gemm(tokens: int, local: int | None, preload: bool):
    """The down GEMM as fused_moe_triton launches it for `tokens` tokens of qwen3-30b-a3b (bf16 routing weights, as
    its router rounds them): pair-per-block mode where `uses_pair_blocks` takes it, else after align."""
    from mini_infer.ops import fused_moe as fm

    e, k, h, inter = QWEN3["num_experts"], QWEN3["top_k"], QWEN3["hidden"], QWEN3["inter"]
    cfg = fm.moe_tile_config(tokens, e, k, h, inter, local_experts=local)
    assert cfg.kind == "decode", cfg
    tile = cfg.down
    pair_blocks = fm.uses_pair_blocks(tokens, k, e)
    constexprs = dict(
        GATED=False, MUL_WEIGHT=True, EVEN_K=inter % tile.block_k == 0, DOT_FP32=False, BLOCK_M=cfg.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m, PAIR_BLOCKS=pair_blocks,
        HAS_MAP=pair_blocks and local is not None, PRELOAD=preload, USE_GDC=True,
        rows_per_a=1, stride_bk=1,  # integer arguments equal to 1: constexpr in a launch's specialization
    )  # fmt: skip
    # pointers 16-byte aligned; integers that are multiples of 16 at these shapes (num_pairs and num_pid_m need not be)
    divisible = ("a_ptr", "b_ptr", "c_ptr", "sorted_ptr", "block_expert_ptr", "num_padded_ptr", "weight_ptr",
                 "map_ptr", "n_out", "k_in", "up_offset", "stride_am", "stride_be", "stride_bn", "stride_cm",
                 "num_experts", "num_global")
    built = build_sm90(fm._moe_gemm_kernel, constexprs, POINTERS, tile.num_warps, tile.num_stages, divisible)
    return {"block_m": cfg.block_m, "block_n": tile.block_n, "block_k": tile.block_k, "pair_blocks": pair_blocks,
            "within_preload_limit": tile.block_n * tile.block_k <= fm._PRELOAD_MAX_TILE, **usage(built)}


def slot_sum(preload: bool):
    """The slot sum of a qwen3-30b-a3b decode call: one token's 8 slots, 1024 columns per program."""
    from mini_infer.ops import fused_moe as fm

    k = QWEN3["top_k"]
    built = build_sm90(fm._moe_sum_kernel, dict(TOP_K=k, BLOCK=1024, BLOCK_K=k, HAS_MAP=False, PRELOAD=preload,
                                                USE_GDC=True),
                       POINTERS, 4, 1, ("src_ptr", "ids_ptr", "out_ptr", "map_ptr", "n_cols", "num_experts"))
    return usage(built)


def cases() -> list[dict]:
    out = [{"kernel": "down_gemm", "name": name, "preload": preload, **down_gemm(tokens, local, preload)}
           for name, tokens, local in CASES for preload in (True, False)]
    return out + [{"kernel": "slot_sum", "name": "qwen3_t1", "preload": p, **slot_sum(p)} for p in (True, False)]


if __name__ == "__main__":
    sys.exit(report_main(cases))
