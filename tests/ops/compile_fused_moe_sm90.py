"""Compile fused_moe's down GEMM (`_moe_gemm_kernel`, not GATED, the routing weight in its epilogue) and its slot sum
(`_moe_sum_kernel`) for sm_90 as qwen3-30b-a3b's decode launches build them (E 128, top-8, H 2048, I 768, bf16; the
tiles `moe_tile_config` picks), with their loads before the PDL wait (PRELOAD, fused_moe.MOE_PRELOAD) and without, no
GPU needed; print one JSON line with, for each, cuobjdump's resource line (REG: registers, STACK: where ptxas puts
spilled registers; LOCAL stays 0) and, from the PTX, the global loads and the stores (st / atom / red) issued before
`griddepcontrol.wait`.

Each build is the launch `fused_moe_triton` makes (given `moe_tile_config`'s tiles: the grouped GEMMs' path) for the
case's tokens, bf16 hidden rows and routing weights and int32 ids, recorded by calling it on CPU tensors with every
kernel of fused_moe replaced by a recorder and specialized as Triton's launcher specializes it (compile_sm90's
`launch_signature`: a pointer marked divisible by 16 where its data is 16-byte aligned, which the align step's views
into one int32 buffer need not be; integers where they are multiples of 16, an integer 1 a constant), with what a
CUDA launch on sm_90 sets otherwise (16-bit dots, the PDL wait) and the case's PRELOAD (which the launcher would not
give batch 4's down GEMM).

Cases: batch 1 (pair-per-block mode, 32 output columns per program), batch 1 on one of two expert-parallel ranks
(an expert map), batch 2 (pair-per-block mode, 64 columns) and batch 4 (the expert-sorted path after align, 128
columns: a B tile past fused_moe's _PRELOAD_MAX_TILE, so its launches do not preload; built to show why); and the
pair-per-block cases' down GEMM with the slot sum in its launch (fused_moe.MOE_MERGE_SLOTS, `merge`). The
interpreter shows no compile error (an early return the GPU compiler rejects, a register spill): this build does.

With the argument `gpt_oss`: every kernel launch `fused_moe_triton` makes for gpt-oss-20b's experts (E 32, top-4,
H = I = 2,880, bf16; the "swigluoai" activation and both biases) at 1, 8 and 512 tokens, each with its resource line
and its epilogue switches (HAS_BIAS, ACTIVATION). With `mxfp4`: the same for `fused_moe_mxfp4_triton` (the experts in
MXFP4; its GEMM kernel and the slot sum), at 8,192 tokens too (fused_moe's widest tiles); `mxfp4 gemv`: its decode
GEMVs at 1 and 8 tokens; `mxfp4 dequant`: its dequantizing kernel at 2,048 tokens.

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_fused_moe_sm90`. Exits
NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by tests/ops/test_fused_moe_preload.py. Builds only.
"""

from __future__ import annotations

import re
import sys

from tests.ops.compile_sm90 import build_launch, record_launches, report_main, resource_usage

QWEN3 = dict(num_experts=128, top_k=8, hidden=2048, inter=768)
# (name, tokens, local experts: None for all of them)
CASES = [("qwen3_t1", 1, None), ("qwen3_t1_ep2", 1, 64), ("qwen3_t2", 2, None), ("qwen3_t4", 4, None)]
KERNELS = ("_moe_gemm_kernel", "_moe_sum_kernel", "_align_single_kernel", "_align_count_kernel", "_align_scan_kernel",
           "_align_scatter_kernel")


def usage(built) -> dict:
    """The build's resource line and what its PTX issues before the PDL wait (nothing past the first wait counts)."""
    before = built.asm["ptx"].split("griddepcontrol.wait")[0]
    return {"resources": resource_usage(built.asm["cubin"]),
            "loads_before_wait": len(re.findall(r"\bld\.global\b", before)),
            "vector_loads_before_wait": len(re.findall(r"\bld\.global(?:\.[\w:]+)*\.v[24]\b", before)),
            "stores_before_wait": len(re.findall(r"\b(?:st\.global|atom|red)\.", before))}


def launches(tokens: int, local: int | None, merge: bool = False) -> tuple[object, dict]:
    """(the tile config, {kernel: [(args, kwargs), ...]}): the launches `fused_moe_triton` makes for `tokens` tokens
    of qwen3-30b-a3b (bf16 routing weights, as its router rounds them; with `local`, the first `local` experts on this
    rank through an expert map; with `merge`, MOE_MERGE_SLOTS)."""
    import torch

    from mini_infer.ops import fused_moe as fm

    e, k, h, inter = QWEN3["num_experts"], QWEN3["top_k"], QWEN3["hidden"], QWEN3["inter"]
    experts = local or e
    cfg = fm.moe_tile_config(tokens, e, k, h, inter, local_experts=experts)
    assert cfg.kind == "decode", cfg
    hidden, weights = torch.empty(tokens, h, dtype=torch.bfloat16), torch.empty(tokens, k, dtype=torch.bfloat16)
    ids = torch.zeros(tokens, k, dtype=torch.int32)
    w13 = torch.empty(experts, 2 * inter, h, dtype=torch.bfloat16)  # never touched: not backed by memory
    w2 = torch.empty(experts, h, inter, dtype=torch.bfloat16)
    expert_map = None if local is None else torch.zeros(e, dtype=torch.int32)
    with record_launches(fm, *KERNELS, MOE_PRELOAD=True, MOE_MERGE_SLOTS=merge, _TILE_OK={}) as calls:
        fm.fused_moe_triton(hidden, weights, ids, w13, w2, expert_map=expert_map, config=cfg)
    return cfg, calls


def down_gemm(tokens: int, local: int | None, preload: bool, merge: bool = False):
    """The down GEMM as fused_moe_triton launches it for `tokens` tokens of qwen3-30b-a3b: pair-per-block mode where
    `uses_pair_blocks` takes it, else after align; with `merge`, the slot sum in its launch."""
    from mini_infer.ops import fused_moe as fm

    cfg, calls = launches(tokens, local, merge)
    (args, kwargs), = [call for call in calls["_moe_gemm_kernel"] if not call[1]["GATED"]]
    tile = cfg.down
    pair_blocks = fm.uses_pair_blocks(tokens, QWEN3["top_k"], QWEN3["num_experts"])
    assert (kwargs["BLOCK_N"], kwargs["BLOCK_K"], kwargs["num_warps"], kwargs["PAIR_BLOCKS"], kwargs["MERGE_SLOTS"]) == (
        tile.block_n, tile.block_k, tile.num_warps, pair_blocks, QWEN3["top_k"] if merge else 0), kwargs
    assert ("_moe_sum_kernel" in calls and calls["_moe_sum_kernel"] != []) == (not merge), calls.keys()
    # a CUDA launch: 16-bit dots (the CPU's are fp32; the PDL wait: build_launch); the case's preload
    kwargs = dict(kwargs, DOT_FP32=False, PRELOAD=preload)
    built, _ = build_launch(fm._moe_gemm_kernel, args, kwargs)
    return {"block_m": cfg.block_m, "block_n": tile.block_n, "block_k": tile.block_k, "pair_blocks": pair_blocks,
            "within_preload_limit": tile.block_n * tile.block_k <= fm._PRELOAD_MAX_TILE, **usage(built)}


def slot_sum(preload: bool):
    """The slot sum of a qwen3-30b-a3b decode call: one token's 8 slots, 1024 columns per program."""
    from mini_infer.ops import fused_moe as fm

    _, calls = launches(1, None)
    (args, kwargs), = calls["_moe_sum_kernel"]
    assert (kwargs["TOP_K"], kwargs["BLOCK"], kwargs["num_warps"]) == (QWEN3["top_k"], 1024, 4), kwargs
    built, _ = build_launch(fm._moe_sum_kernel, args, dict(kwargs, PRELOAD=preload))
    return usage(built)


def cases() -> list[dict]:
    out = [{"kernel": "down_gemm", "name": name, "preload": preload, "merge": False,
            **down_gemm(tokens, local, preload)} for name, tokens, local in CASES for preload in (True, False)]
    out += [{"kernel": "down_gemm", "name": name, "preload": True, "merge": True, **down_gemm(tokens, local, True, True)}
            for name, tokens, local in CASES if tokens <= 2]
    return out + [{"kernel": "slot_sum", "name": "qwen3_t1", "preload": p, **slot_sum(p)} for p in (True, False)]


GPT_OSS = dict(num_experts=32, top_k=4, hidden=2880, inter=2880)


def gpt_oss_cases() -> list[dict]:
    """Every launch of fused_moe_triton for gpt-oss-20b's experts (module docstring), built for sm_90."""
    import torch

    from mini_infer.ops import _moe_gemv as mg
    from mini_infer.ops import fused_moe as fm

    e, k, h, inter = (GPT_OSS[key] for key in ("num_experts", "top_k", "hidden", "inter"))
    gemv = ("_moe_gemv_gate_up_kernel", "_moe_gemv_down_kernel")
    out = []
    for tokens in (1, 8, 512):
        hidden, weights = torch.empty(tokens, h, dtype=torch.bfloat16), torch.empty(tokens, k, dtype=torch.bfloat16)
        ids = torch.zeros(tokens, k, dtype=torch.int32)
        w13, w2 = torch.empty(e, 2 * inter, h, dtype=torch.bfloat16), torch.empty(e, h, inter, dtype=torch.bfloat16)
        b13, b2 = torch.empty(e, 2 * inter, dtype=torch.bfloat16), torch.empty(e, h, dtype=torch.bfloat16)
        with record_launches(fm, *KERNELS) as calls, record_launches(mg, *gemv) as gemv_calls:
            fm.fused_moe_triton(hidden, weights, ids, w13, w2, "swigluoai", None, b13, b2, 1.702, 7.0)
        for module, launched in ((fm, calls), (mg, gemv_calls)):
            for kernel, launches in launched.items():
                for args, kwargs in launches:
                    kwargs = dict(kwargs, **({"DOT_FP32": False} if "DOT_FP32" in kwargs else {}))  # 16-bit dots
                    built, constexprs = build_launch(getattr(module, kernel), args, kwargs)
                    out.append({"tokens": tokens, "kernel": kernel, "gated": bool(constexprs.get("GATED", False)),
                                "has_bias": bool(constexprs.get("HAS_BIAS", False)),
                                "activation": int(constexprs.get("ACTIVATION", 0)),
                                "resources": resource_usage(built.asm["cubin"])})
    return out


def mxfp4_cases(path: str = "grouped") -> list[dict]:
    """Every launch of fused_moe_mxfp4_triton for gpt-oss-20b's experts in MXFP4 (module docstring) on `path`
    (forced by its switches), built for sm_90."""
    import torch

    from mini_infer.ops import fused_moe as fm
    from mini_infer.ops import fused_moe_mxfp4 as fx4

    e, k, h, inter = (GPT_OSS[key] for key in ("num_experts", "top_k", "hidden", "inter"))
    out = []
    tokens_of = {"grouped": (1, 8, 512, 8192), "gemv": (1, 8), "dequant": (2048,)}
    for tokens in tokens_of[path]:
        hidden, weights = torch.empty(tokens, h, dtype=torch.bfloat16), torch.empty(tokens, k, dtype=torch.bfloat16)
        ids = torch.zeros(tokens, k, dtype=torch.int32)
        packed = [torch.empty(e, rows, cols, dtype=torch.uint8)
                  for rows, cols in ((2 * inter, h // 2), (2 * inter, h // 32), (h, inter // 2), (h, inter // 32))]
        b13, b2 = torch.empty(e, 2 * inter, dtype=torch.bfloat16), torch.empty(e, h, dtype=torch.bfloat16)
        with (record_launches(fx4, "_moe_mxfp4_gemm_kernel", "_mx_gemv_gate_up_kernel", "_mx_gemv_down_kernel",
                              "_mx_dequant_kernel", _TILE_OK={}, _GEMV_MAX_PAIRS=64 if path == "gemv" else 0,
                              _DEQUANT_MIN_PAIRS=1 if path == "dequant" else 1 << 62) as calls,
              record_launches(fm, *KERNELS) as fm_calls):  # (the dequant path's fused_moe GEMMs: not built here)
            fx4.fused_moe_mxfp4_triton(hidden, weights, ids, *packed, "swigluoai", None, b13, b2, 1.702, 7.0)
        sums = [] if path == "dequant" else [(fm, "_moe_sum_kernel", fm_calls["_moe_sum_kernel"])]
        for module, kernel, launches in [*((fx4, *c) for c in calls.items()), *sums]:
            for args, kwargs in launches:
                kwargs = dict(kwargs, **({"DOT_FP32": False} if "DOT_FP32" in kwargs else {}))  # 16-bit dots
                built, constexprs = build_launch(getattr(module, kernel), args, kwargs)
                out.append({"tokens": tokens, "kernel": kernel, "gated": bool(constexprs.get("GATED", False)),
                            "block_n": constexprs.get("BLOCK_N"), "block_k": constexprs.get("BLOCK_K"),
                            "resources": resource_usage(built.asm["cubin"])})
    return out


if __name__ == "__main__":
    sys.exit(report_main({"gpt_oss": gpt_oss_cases, "mxfp4": mxfp4_cases,
                          "mxfp4 gemv": lambda: mxfp4_cases("gemv"),
                          "mxfp4 dequant": lambda: mxfp4_cases("dequant")}.get(" ".join(sys.argv[1:]), cases)))
