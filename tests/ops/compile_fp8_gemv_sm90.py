"""Compile the W8A8 one-row GEMV (int8_linear.py's `_scaled_gemv_kernel`) for sm_90 as a launch at qwen2.5-7b's
shapes builds it, no GPU needed, and count what its K loop executes per weight byte; print one JSON line.

Cases: fp8 "dot" (tensor cores, `_padded_row_dot`) and fp8 "cuda-cores" (fp8 -> fp32 conversions and FMAs) at
their default tiles for short and long rows, the int8 GEMV (int32 words, dp4a) beside them, "dot" inside
linear_add_rms_norm.py's fused GEMV + add + norm + quantize kernel, and fp8's "dot" cut into 4 splits of K (mode
suffix "-split<S>", at down_proj's shape). For each: whether
the PTX has an e4m3 tensor-core instruction (mma.sync / wgmma with .e4m3 operands) and the conversion
instructions (`cvt.*e4m3*`), cuobjdump's resource line (STACK: where ptxas puts spilled registers; LOCAL stays 0)
and, from the SASS, the K loop (the longest backward branch's body) by instruction class, as warp instructions per
weight byte (body count x warps / (BLOCK_N x BLOCK_K bytes of weights an iteration reads)).

Each build is the launch its op's launcher makes (`scaled_gemv_triton`; `scaled_linear_add_rms_norm_quant_triton`
for fp8-dot-fused, into bf16 and an fp8 quantized row) at the case's tile and fp8 GEMV mode for one row times
qwen2.5-7b's o_proj weight (N = K = 3584), or its down_proj (N 3584, K 18944) for a tile whose BLOCK_K passes 3584
(the long-K tile), recorded by calling the launcher on CPU tensors with the kernel replaced by a recorder and
specialized as Triton's launcher specializes it (compile_sm90's `launch_signature`: fresh tensors 16-byte aligned;
N, K and the row stride, in int32 words for int8, multiples of 16), with what a CUDA launch on sm_90 sets otherwise
(the PDL wait, and int8's dp4a inline asm).

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_fp8_gemv_sm90
[mode BLOCK_N BLOCK_K num_warps num_stages ...]` (mode fp8-dot, fp8-cuda-cores, int8 or fp8-dot-fused, the dot modes optionally
with "-split<S>"; no arguments: the default cases). Exits NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by
tests/ops/test_fp8_linear.py; the numbers go into the report of an experiment, not into the kernels.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from tests.ops.compile_sm90 import build_launch, record_launches, report_main, resource_usage

# SASS opcode (the part before the first dot) -> class; anything else counts as "other"
SASS_CLASSES = {
    "tensor": ("HGMMA", "QGMMA", "IGMMA", "HMMA", "QMMA", "IMMA", "WARPGROUP"),
    "convert": ("F2FP", "F2F", "I2F", "HADD2", "PRMT"),  # HADD2.F32 / PRMT: how fp8 -> fp16 / fp32 unpacks
    "fma": ("FFMA", "FADD", "FMUL", "HFMA2", "IDP", "IMAD", "IADD3"),
    "global_load": ("LDG", "LDGSTS", "UBLKCP", "UTMALDG"),
    "shared": ("LDS", "STS", "LDSM"),
}
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def sass_of(cubin: bytes) -> str:
    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def k_loop(sass: str) -> Counter:
    """Opcodes of the longest loop in the SASS: the instructions from a backward branch's target to the branch."""
    code = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in SASS_LINE.finditer(sass)]
    best: list = []
    for addr, op, operands in code:
        target = re.match(r"\s*(0x[0-9a-f]+)", operands)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in code if int(target.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return Counter(best)


def classify(body: Counter) -> dict[str, int]:
    out = {c: 0 for c in (*SASS_CLASSES, "other")}
    for op, n in body.items():
        base = op.split(".")[0]
        out[next((c for c, ops in SASS_CLASSES.items() if base in ops), "other")] += n
    out["total"] = sum(body.values())
    return out


def launch(mode: str, block_n: int, block_k: int, num_warps: int, num_stages: int) -> tuple[object, tuple, dict]:
    """(kernel, args, kwargs) of the case's launch. Mode int8, fp8-cuda-cores, fp8-dot: `_scaled_gemv_kernel` by
    `scaled_gemv_triton`; fp8-dot-fused: linear_add_rms_norm.py's kernel that runs the same GEMV body before the
    add + norm + fp8 quantization, by `scaled_linear_add_rms_norm_quant_triton` (its GPU check of fp8 support
    passed on the CPU)."""
    import torch

    from mini_infer.ops import int8_linear as il
    from mini_infer.ops import linear_add_rms_norm as lar

    mode, split = split_of(mode)
    n, k = (3584, 18944) if block_k > 3584 or split > 1 else (3584, 3584)
    operand = torch.int8 if mode.startswith("int8") else torch.float8_e4m3fn
    x_q, x_scale = torch.empty(1, k, dtype=operand), torch.empty(1, 1)
    w_q, w_scale = torch.empty(n, k, dtype=operand), torch.empty(n)
    fp8_gemv = {"int8": None, "fp8-cuda-cores": "cuda-cores"}.get(mode, "dot")
    config = (block_n, block_k, num_warps, num_stages) + ((split,) if split > 1 else ())
    if mode == "fp8-dot-fused":
        module, kernel = lar, "_scaled_gemv_add_rms_norm_quant_kernel"
        residual, norm_weight = torch.empty(1, n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        with record_launches(lar, kernel, fp8_supported=lambda device: True) as calls, \
                record_launches(il, FP8_GEMV=fp8_gemv, SCALED_GEMV_CONFIG_FP8_DOT=config):
            lar.scaled_linear_add_rms_norm_quant_triton(x_q, x_scale, w_q, w_scale, None, torch.bfloat16, residual,
                                                        norm_weight, 1e-6, torch.float8_e4m3fn)
    else:
        module, kernel = il, "_scaled_gemv_kernel"
        with record_launches(il, kernel) as calls:
            il.scaled_gemv_triton(x_q, x_scale, w_q, w_scale, None, torch.bfloat16, config, fp8_gemv=fp8_gemv)
    (args, kwargs), = calls[kernel]
    # a CUDA launch: int8's packed words through the dp4a inline asm (`launch_scaled_gemv`; the PDL wait: build_launch)
    kwargs = dict(kwargs, ASM=kwargs["PACKED"])
    return getattr(module, kernel), args, kwargs


def build(mode: str, block_n: int, block_k: int, num_warps: int, num_stages: int):
    """The case's kernel compiled for sm_90 as `launch` launches it (its recorded tile checked against the case's)."""
    kernel, args, kwargs = launch(mode, block_n, block_k, num_warps, num_stages)
    mode, split = split_of(mode)
    expected_k = block_k // 4 if mode == "int8" else block_k  # int8: the K step in int32 words
    assert (kwargs["BLOCK_N"], kwargs["BLOCK_K"], kwargs["num_warps"], kwargs["num_stages"], kwargs["DOT"],
            kwargs["PACKED"], kwargs["SPLIT_K"]) == (block_n, expected_k, num_warps, num_stages,
                                                     mode.startswith("fp8-dot"),
                                                     mode == "int8", split), (mode, kwargs)
    return build_launch(kernel, args, kwargs)[0]


def split_of(mode: str) -> tuple[str, int]:
    """A case's mode without its "-split<S>" suffix (a tensor-core GEMV cut into S splits of K), and S (1 without)."""
    m = re.fullmatch(r"(.*)-split(\d+)", mode)
    return (m[1], int(m[2])) if m else (mode, 1)


def report(mode: str, block_n: int, block_k: int, num_warps: int, num_stages: int) -> dict:
    kernel = build(mode, block_n, block_k, num_warps, num_stages)
    ptx = kernel.asm["ptx"]
    body = k_loop(sass_of(kernel.asm["cubin"]))
    classes = classify(body)
    weight_bytes = block_n * block_k  # one byte a weight (int8 and fp8)
    return {"mode": mode, "tile": [block_n, block_k, num_warps, num_stages],
            "ptx_e4m3_tensor_core": sorted({m for m in re.findall(r"\b((?:wg)?mma\.[\w.]*e4m3[\w.]*)", ptx)}),
            "ptx_cvt_e4m3": len(re.findall(r"\bcvt\.[\w.]*e4m3", ptx)),
            "usage": resource_usage(kernel.asm["cubin"]), "shared_bytes": kernel.metadata.shared,
            "k_loop": classes, "k_loop_ops": dict(body.most_common()),
            "per_weight_byte": {c: round(n * num_warps / weight_bytes, 4) for c, n in classes.items()}}


def default_cases() -> list[tuple]:
    from mini_infer.ops import int8_linear as il

    return [("fp8-dot", *il.SCALED_GEMV_CONFIG_FP8_DOT), ("fp8-cuda-cores", *il.SCALED_GEMV_CONFIG_FP8),
            ("fp8-cuda-cores", *il.SCALED_GEMV_CONFIG_FP8_LONG_K), ("int8", *il.SCALED_GEMV_CONFIG),
            ("fp8-dot-fused", *il.SCALED_GEMV_CONFIG_FP8_DOT), ("fp8-dot-split4", *il.SCALED_GEMV_CONFIG_FP8_DOT)]


def main(argv: list[str]) -> int:
    cases = [(argv[i], *map(int, argv[i + 1 : i + 5])) for i in range(0, len(argv), 5)] if argv else None
    return report_main(lambda: [report(*case) for case in cases or default_cases()])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
