"""GPU check of the FP8 paths in the compiled graph: fp8 weights (`quantization="fp8"`) and the fp8 KV cache,
Triton / `torch._scaled_mm` kernels against the plain-torch references, on the GPU; and, when a prefill
disagrees, which of two causes it is: an imprecise fp8 GEMM (Hopper's wgmma accumulates fp8 products with fewer
mantissa bits than fp32 unless Triton promotes them, see int8_linear.FP8_DOT), or a tiny difference amplified by
the chain of per-token fp8 quantizers (a 1e-7 change before one can flip a rounding: a whole e4m3 step, ~6% of
that element), which no end-to-end bar can tell from a bug.

Model level. For every tiny preset (float32, TF32 off; DeepSeek with fp8 weights only: its latent cache refuses
fp8) one compile on CUDA, then the graph as compiled (bound to the CUDA kernels) runs a 37-token prefill (M > 16:
the GEMM path; fp32 outputs take the Triton GEMM tile, bf16/fp16 ones torch._scaled_mm) and a 1-token step
(M = 1: the Triton GEMV, the decode attention kernel). Its logits are compared (err = max |diff| /
max(1, max |reference|), and top-1 agreement) with:
  * reference: the graph bound to the plain-torch references (the comparison this script always made). It
    quantizes its own activations, so a last-bit difference upstream may flip fp8 roundings. Bar: max(TOL,
    AMPLIFY x floor), where `floor` is the same comparison between two references whose fp8 GEMMs differ only
    in accumulation rounding (fp32 vs float64): what amplification alone does to this model and input.
  * forced: the references again, but every discrete choice is the kernel path's: its quantized activations
    (the x_q and scale of every quantizer, also the one inside fp8_w8a8_linear), its fp8 KV-cache writes and its
    MoE routing; the fp8 GEMMs multiply those in fp32. Nothing can flip, so the difference is what the GEMMs
    and the other kernels' fp32 rounding add up to. Bar: TOL.
  * per GEMM: every fp8 GEMM node of the kernel run against the exact (float64) product of its own quantized
    inputs, on the model's real activations: fp32 outputs max |diff| / max |exact|, bar OP_TOL; bf16/fp16
    outputs the share of outputs that are not the exact value rounded to their dtype, bar MISMATCH_TOL.
Then an engine with CUDA graphs and chunked prefill generates greedily for 5 prompts: it must run, leak no
block, and its tokens are compared with an eager engine's (reported; fp8 GEMM tiles differ by M bucket, so a
near-tie may flip).

Op level, after the models, on the (K, N) of every fp8 GEMM of the models checked (random x with outlier
channels quantized per token, random weights quantized per channel; every path gets the same quantized
inputs), each path against the exact (float64) product, with the same two measures:
  * triton: scaled_mm_triton, fp32 output, at M in OP_MS (1: the skinny tile, a control that never uses wgmma;
    17, 37: the 64-row GEMM tile; 128: 64x128; 512: 128x256), for each FP8_DOT_CANDIDATES value: tl.dot's
    max_num_imprecise_acc 0 (no wgmma: mma.sync), 32 (wgmma promoted to fp32 every instruction: the default),
    128, block_k (promoted once per tl.dot), None (Triton's default: 2**30 on sm_90, never promoted), and
    fp16 (both tiles converted to fp16, exact for e4m3, then a 16-bit dot). Judged: the default at M > 16 (what
    fp32 outputs run), bar OP_TOL; the others are reported, and a line names the values within OP_TOL at every
    shape and M > 1: if the default fails and one of them passes, make it FP8_DOT (int8_linear.py);
  * triton-bf16 (default FP8_DOT) and scaled_mm (torch._scaled_mm, rowwise scales: what bf16/fp16 outputs
    run at M > 16): bf16 output, reported;
  * fp32-cublas: the reference's own GEMM (fp32 matmul of the dequantized operands): the fp32 floor, reported.

`--model qwen3-0.6b` adds a real-shape preset in --model-dtype (bfloat16 by default; float32 makes its prefill
take the Triton GEMM tile at the real shapes): reported, not judged. Exits 1 on a judged failure, a leak or an
error. Needs compute capability >= 8.9. Prints a summary table; the JSON goes to
bench/results/fp8_gpu_check_<gpu>.json (--out). `--device cpu` runs the same code on the CPU with the Triton
kernels interpreted (no engine part): a smoke test of this script, whose numbers say nothing about a GPU.

    python bench/fp8_gpu_check.py
    python bench/fp8_gpu_check.py --only tiny-llama --only tiny-mistral --model qwen3-0.6b --model-dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.fx as fx

TOL = 1e-3  # logits: max |kernel path - reference| / max(1, max |reference|), fp32 models, forced reference
AMPLIFY = 10.0  # the unforced comparison's bar: max(TOL, AMPLIFY x what rounding-level noise alone gives)
# One fp32-output GEMM: max |kernel - exact| / max |exact|. fp32 accumulation gives ~1e-7 (the fp32-cublas row;
# 1e-7 under the interpreter); ~14-bit accumulation (what DeepSeek-V3 measured for Hopper's fp8 wgmma) gives
# 2**-14 of a partial sum: ~2e-5..1e-4 here. The bar sits between.
OP_TOL = 1e-5
# One bf16/fp16-output GEMM: the share of outputs that are not the exact value rounded to that dtype. fp32
# accumulation: ~1e-5 (near-ties only); ~14-bit accumulation: ~1e-2.
MISMATCH_TOL = 1e-3
OP_MS = (1, 17, 37, 128, 512)
FP8_DOT_CANDIDATES = (0, 32, 128, "block_k", None, "fp16")
FP8 = torch.float8_e4m3fn
DEVICE = "cuda"  # --device cpu: a smoke run of this script (Triton under TRITON_INTERPRET=1), not a check


def rebound(gm: fx.GraphModule, backend: str) -> fx.GraphModule:
    """A copy of a compiled graph whose ops call their `backend` kernels (node names are kept)."""
    from mini_infer.compiler import bind_kernels

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if "op" in node.meta:
            node.target = node.meta["op"]  # the op bind_kernels replaced
    copy = fx.GraphModule(gm, graph)
    bind_kernels(copy, torch.device(DEVICE), backend=backend)
    return copy


# --------------------------------------------------------------------------------------------------
# error measures
# --------------------------------------------------------------------------------------------------


def exact_scaled_mm(x_q, x_scale, w_q, w_scale, bias) -> torch.Tensor:
    """The W8A8 product in float64: exact products, float64 sums (the value every path approximates)."""
    k = x_q.shape[-1]
    y = (x_q.reshape(-1, k).double() @ w_q.double().t()) * x_scale.reshape(-1, 1).double() * w_scale.double()
    return y + bias.double() if bias is not None else y


def gemm_error(got: torch.Tensor, exact: torch.Tensor) -> dict:
    """rel: max |got - exact| / max |exact|; mismatch: the fraction of outputs that are not `exact` rounded to
    got's dtype (for 16-bit outputs, where rel is mostly the output rounding itself)."""
    got = got.reshape(exact.shape)
    scale = exact.abs().max().item() or 1.0
    out = {"rel": (got.double() - exact).abs().max().item() / scale}
    if got.dtype != torch.float32:
        out["mismatch"] = (got != exact.to(got.dtype)).float().mean().item()
    return out


def judged_error(err: dict) -> tuple[float, float]:
    """(value, bar) of the measure that applies: mismatch for 16-bit outputs, else rel."""
    return (err["mismatch"], MISMATCH_TOL) if "mismatch" in err else (err["rel"], OP_TOL)


def logits_error(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |a - ref| / max(1, max |ref|), top-1 agreement)."""
    err = (a - ref).abs().max().item() / max(1.0, ref.abs().max().item())
    return err, (a.argmax(-1) == ref.argmax(-1)).float().mean().item()


# --------------------------------------------------------------------------------------------------
# model level: the kernel run recorded, the forced and the float64-GEMM references
# --------------------------------------------------------------------------------------------------


def _ops():
    mi = torch.ops.mini_infer
    quantizers = {mi.quantize_per_token.default, mi.rms_norm_quant.default, mi.silu_and_mul_quant.default,
                  mi.fused_add_rms_norm_quant.default}
    return mi, quantizers


class KernelRun(fx.Interpreter):
    """Runs the graph as compiled and records what the forced reference reuses (by node name): the outputs of
    the quantizers and of moe_topk, the (x_q, scale) that fp8_w8a8_linear quantizes inside (recomputed with the
    same Triton kernel: the same bits), the k / v an fp8-cache paged_attention writes; and each fp8 GEMM's
    error against the exact product of its own quantized inputs."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.forced: dict[str, object] = {}
        self.gemms: list[dict] = []

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        op = n.meta.get("op")
        if n.op != "call_function" or op is None:
            return out
        mi, quantizers = _ops()
        if op in quantizers or op is mi.moe_topk.default:
            self.forced[n.name] = out
            return out
        args, _ = self.fetch_args_kwargs_from_env(n)
        if op is mi.paged_attention.default and args[3].dtype == FP8:
            self.forced[n.name] = (args[1].clone(), args[2].clone())
        elif op is mi.fp8_w8a8_linear.default:
            from mini_infer.ops.quant import quantize_per_token_triton

            x, w_q, w_scale, bias = args
            x_q, x_scale = quantize_per_token_triton(x, FP8)
            self.forced[n.name] = (x_q, x_scale)
            self._gemm(n.name, out, x_q, x_scale, w_q, w_scale, bias)
        elif op is mi.fp8_linear.default:
            self._gemm(n.name, out, *args[:5])
        return out

    def _gemm(self, name, out, x_q, x_scale, w_q, w_scale, bias) -> None:
        from mini_infer.ops.fp8_linear import FP8_TRITON_MAX_M, _scaled_mm_takes

        k, n = x_q.shape[-1], w_q.shape[0]
        m = x_q.numel() // k
        path = ("triton-gemv" if m == 1 else "triton-skinny" if m <= FP8_TRITON_MAX_M else
                "scaled_mm" if _scaled_mm_takes(m, k, n, out.dtype) else "triton-gemm")
        err = gemm_error(out, exact_scaled_mm(x_q, x_scale, w_q, w_scale, bias))
        self.gemms.append({"node": name, "M": m, "K": k, "N": n, "path": path, "out": str(out.dtype), **err})


class ForcedReference(fx.Interpreter):
    """Runs the reference-bound graph with the kernel run's discrete choices (KernelRun.forced): quantized
    activations, fp8-cache K/V, MoE routing. fp8_w8a8_linear becomes fp8_linear_reference on the forced x_q."""

    def __init__(self, gm: fx.GraphModule, forced: dict):
        super().__init__(gm)
        self.forced = forced

    def run_node(self, n: fx.Node):
        op = n.meta.get("op")
        if n.op != "call_function" or op is None:
            return super().run_node(n)
        mi, quantizers = _ops()
        if op is mi.fused_add_rms_norm_quant.default:  # the residual sum stays the reference's own
            x_q, scale, _ = self.forced[n.name]
            return x_q, scale, super().run_node(n)[2]
        if op in quantizers or op is mi.moe_topk.default:
            return self.forced[n.name]
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if op is mi.fp8_w8a8_linear.default:
            from mini_infer.ops.fp8_linear import fp8_linear_reference

            x, w_q, w_scale, bias = args
            return fp8_linear_reference(*self.forced[n.name], w_q, w_scale, bias, x.dtype)
        if op is mi.paged_attention.default and n.name in self.forced:
            args = (args[0], *self.forced[n.name], *args[3:])
        return self.call_function(n.target, tuple(args), kwargs)


class Float64GemmReference(fx.Interpreter):
    """Runs the reference-bound graph with its fp8 GEMMs accumulated (and their epilogue) in float64 instead of
    fp32: a change at the level of rounding, so its difference from the plain reference is the amplification
    floor of this model and input."""

    def run_node(self, n: fx.Node):
        op = n.meta.get("op")
        mi, _ = _ops()
        if n.op != "call_function" or op not in (mi.fp8_linear.default, mi.fp8_w8a8_linear.default):
            return super().run_node(n)
        args, _ = self.fetch_args_kwargs_from_env(n)
        if op is mi.fp8_w8a8_linear.default:
            from mini_infer.ops.quant import quantize_per_token_reference

            x, w_q, w_scale, bias = args
            args = (*quantize_per_token_reference(x, FP8), w_q, w_scale, bias, x.dtype)
        x_q, x_scale, w_q, w_scale, bias, out_dtype = args
        y = exact_scaled_mm(x_q, x_scale, w_q, w_scale, bias)
        return y.to(out_dtype).reshape(*x_q.shape[:-1], w_q.shape[0])


def interpret(interpreter: fx.Interpreter, cm, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return interpreter.run(*(inputs[n] for n in cm.input_names)).float()


def compare_step(cm, fast_gm: fx.GraphModule, ref_gm: fx.GraphModule, ids: torch.Tensor,
                 judged: bool) -> tuple[dict, list[str]]:
    """One sequence `ids` through the kernel graph and the three references: the errors, and what fails."""
    pos = torch.arange(ids.shape[1], device=DEVICE)[None]

    def fresh() -> dict:  # fresh caches for every run
        return cm.example_inputs(ids, pos) | {"logits_indices": torch.arange(ids.shape[1], device=DEVICE)}

    kernel = KernelRun(fast_gm)
    fast = interpret(kernel, cm, fresh())
    inputs = fresh()
    with torch.no_grad():
        ref = ref_gm(*(inputs[n] for n in cm.input_names)).float()
    forced = interpret(ForcedReference(ref_gm, kernel.forced), cm, fresh())
    ref64 = interpret(Float64GemmReference(ref_gm), cm, fresh())
    res: dict = {"T": ids.shape[1]}
    res["reference"], res["top1"] = logits_error(fast, ref)
    res["floor"], _ = logits_error(ref64, ref)
    res["forced"], res["forced_top1"] = logits_error(fast, forced)
    res["reference_bar"] = max(TOL, AMPLIFY * res["floor"])
    res["gemms"] = kernel.gemms
    fails = []
    if judged and not res["reference"] <= res["reference_bar"]:
        fails.append(f"reference {res['reference']:.1e} > {res['reference_bar']:.1e}")
    if judged and not res["forced"] <= TOL:
        fails.append(f"forced {res['forced']:.1e} > {TOL:.0e}")
    over = [g for g in kernel.gemms if not judged_error(g)[0] <= judged_error(g)[1]]
    if judged and over:
        g = max(over, key=lambda g: judged_error(g)[0] / judged_error(g)[1])
        value, bar = judged_error(g)
        fails.append(f"{len(over)}/{len(kernel.gemms)} GEMMs over their bar, worst {g['node']} ({g['path']}, "
                     f"M={g['M']} K={g['K']} N={g['N']}) {value:.1e} > {bar:.0e}")
    return res, fails


def describe_step(res: dict) -> str:
    worst = max(res["gemms"], key=lambda g: judged_error(g)[0] / judged_error(g)[1], default=None)
    gemm = "no fp8 GEMM" if worst is None else (
        f"worst GEMM {worst['node']} ({worst['path']}) " + ", ".join(f"{k} {worst[k]:.1e}" for k in ("rel", "mismatch")
                                                                      if k in worst))
    return (f"T={res['T']}: vs reference {res['reference']:.1e} (bar {res['reference_bar']:.0e}; floor "
            f"{res['floor']:.1e}), top-1 {res['top1']:.2f}; vs forced {res['forced']:.1e} (bar {TOL:.0e}); {gemm}")


def check(name: str, dtype: str, judged: bool) -> tuple[bool, str, dict]:
    from mini_infer.compiler import compile_model
    from mini_infer.llm import LLM
    from mini_infer.models import load_model
    from mini_infer.passes.mla_latent_cache import is_mla_config
    from mini_infer.runtime.engine import EngineConfig, LLMEngine
    from mini_infer.sampling_params import SamplingParams

    loaded = load_model(name, dtype=dtype, device=DEVICE)
    kv = None if is_mla_config(loaded.config.get_text_config()) else torch.float8_e4m3fn
    t = time.perf_counter()
    cm = compile_model(loaded.model, device=DEVICE, model_name=name, quantization="fp8", kv_cache_dtype=kv)
    print(f"[{name}] compiled in {time.perf_counter() - t:.1f}s (fp8 weights, KV cache {kv or 'model dtype'}, "
          f"{dtype}, {'judged' if judged else 'reported'})")
    vocab = loaded.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    ok, notes, report = True, [], {"model": name, "dtype": dtype, "judged": judged, "steps": []}
    ref_gm = rebound(cm.graph_module, "reference")
    fast_gm = cm.graph_module if DEVICE == "cuda" else rebound(cm.graph_module, "triton")  # cpu: interpreted
    for num in (37, 1):
        ids = torch.randint(0, min(vocab, 5000), (1, num), generator=gen).to(DEVICE)
        res, fails = compare_step(cm, fast_gm, ref_gm, ids, judged)
        report["steps"].append(res)
        ok &= not fails
        notes.append(describe_step(res) + "".join(f"; MISMATCH {f}" for f in fails))
        print(f"[{name}] {notes[-1]}")
    if DEVICE != "cuda":  # the smoke run stops here: the engine part needs CUDA graphs
        return ok, "; ".join(notes), report
    prompts = [torch.randint(0, min(vocab, 5000), (n,), generator=gen).tolist() for n in (5, 17, 64, 130, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for cname, kw in (("graphs", {"max_num_batched_tokens": 16}), ("eager", {"enforce_eager": True})):
        eng = LLMEngine(EngineConfig(model=name, max_num_seqs=8, max_model_len=512, kv_cache_memory_bytes=256 << 20,
                                     quantization="fp8", kv_cache_dtype="fp8" if kv else "auto", **kw),
                        loaded=loaded, compiled=cm)
        llm = LLM.__new__(LLM)
        llm.engine, llm._counter = eng, 0
        tokens[cname] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        if eng.block_manager.num_used_blocks:
            ok = False
            notes.append(f"{cname}: {eng.block_manager.num_used_blocks} blocks leaked")
        del eng, llm
    same = sum(a == b for x, y in zip(tokens["graphs"], tokens["eager"]) for a, b in zip(x, y))
    notes.append(f"graphs vs eager greedy: {same}/{24 * len(prompts)}")
    report["graphs_vs_eager"] = [same, 24 * len(prompts)]
    print(f"[{name}] {notes[-1]}")
    return ok, "; ".join(notes), report


# --------------------------------------------------------------------------------------------------
# op level
# --------------------------------------------------------------------------------------------------


def op_inputs(m: int, k: int, n: int, seed: int) -> tuple:
    """(x_q, x_scale, w_q, w_scale) on CUDA: x ~ N(0, 1) with every 64th channel x10 (LLM-like outliers),
    quantized per token by the Triton kernel; w ~ N(0, 1/K) quantized per output channel."""
    from mini_infer.ops.quant import quantize_per_token_reference, quantize_per_token_triton

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=DEVICE)
    x[:, ::64] *= 10.0
    w = torch.randn(n, k, generator=g, device=DEVICE) / k**0.5
    w_q, w_scale = quantize_per_token_reference(w, FP8)
    return (*quantize_per_token_triton(x, FP8), w_q, w_scale.reshape(n))


def fp32_cublas(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> torch.Tensor:
    """The reference's own GEMM: the dequantized operands' fp32 matmul (TF32 off), then the epilogue."""
    return (x_q.float() @ w_q.float().t()) * x_scale * w_scale


def measure(exact: torch.Tensor, fn, *args, **kwargs) -> dict:
    """gemm_error of fn(*args, **kwargs) against `exact`, or the error it raised (a candidate Triton cannot
    compile here is reported, not fatal)."""
    try:
        row = gemm_error(fn(*args, **kwargs), exact)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}", "pass": False}
    value, bar = judged_error(row)
    return row | {"pass": value <= bar}


def op_level(shapes: list[tuple[int, int]]) -> tuple[bool, list[dict], list[str]]:
    """Every path and FP8_DOT candidate on every (K, N) at every M of OP_MS: rows, pass, summary lines."""
    from mini_infer.ops.fp8_linear import scaled_mm_fp8
    from mini_infer.ops.int8_linear import FP8_DOT, SMALL_M, scaled_mm_config, scaled_mm_triton

    rows = []
    for k, n in shapes:
        for m in OP_MS:
            x = op_inputs(m, k, n, seed=m * 7919 + k + n)
            exact = exact_scaled_mm(*x, None)
            block_k = scaled_mm_config(m, fp8=True)[2]
            dots = [FP8_DOT] if m <= SMALL_M else list(dict.fromkeys([FP8_DOT, *FP8_DOT_CANDIDATES]))
            for dot in dots:
                row = measure(exact, scaled_mm_triton, *x, None, torch.float32,
                              fp8_dot=block_k if dot == "block_k" else dot)
                shipped = dot == FP8_DOT and m > SMALL_M
                rows.append({"path": "triton", "fp8_dot": str(dot), "shipped": shipped, "judged": shipped} | row)
            rows.append({"path": "triton-bf16", "fp8_dot": str(FP8_DOT), "shipped": False, "judged": False}
                        | measure(exact, scaled_mm_triton, *x, None, torch.bfloat16))
            shipped = DEVICE == "cuda" and m > SMALL_M and k % 16 == 0 and n % 16 == 0
            rows.append({"path": "scaled_mm", "fp8_dot": "-", "shipped": shipped, "judged": False}
                        | measure(exact, scaled_mm_fp8, *x, None, torch.bfloat16))
            rows.append({"path": "fp32-cublas", "fp8_dot": "-", "shipped": False, "judged": False}
                        | measure(exact, fp32_cublas, *x, None, torch.float32))
            for row in rows[-len(dots) - 3:]:
                row.update(M=m, K=k, N=n)
    ok = all(r["pass"] for r in rows if r["judged"])
    return ok, rows, summarize_ops(rows)


def summarize_ops(rows: list[dict]) -> list[str]:
    """One line per (path, fp8_dot): worst measure over shapes at each M; then the candidates within OP_TOL."""
    lines = []
    keys = list(dict.fromkeys((r["path"], r["fp8_dot"]) for r in rows))
    for path, dot in keys:
        mine = [r for r in rows if (r["path"], r["fp8_dot"]) == (path, dot)]
        cells = []
        for m in OP_MS:
            at_m = [r for r in mine if r["M"] == m]
            if not at_m:
                continue
            if any("error" in r for r in at_m):
                cells.append(f"M={m}: error")
                continue
            measure = "mismatch" if "mismatch" in at_m[0] else "rel"
            cells.append(f"M={m}: {measure} {max(r[measure] for r in at_m):.1e}")
        role = " (judged)" if any(r["judged"] for r in mine) else " (shipped)" if any(r["shipped"] for r in mine) else ""
        lines.append(f"{path:<12}fp8_dot={dot:<8}{role:<11}" + "; ".join(cells))
    good = [dot for path, dot in keys if path == "triton" and all(
        r.get("pass") for r in rows if (r["path"], r["fp8_dot"]) == ("triton", dot) and r["M"] > OP_MS[0])]
    lines.append(f"triton fp8_dot values within {OP_TOL:.0e} at every shape and M > {OP_MS[0]}: {good or 'none'}")
    errors: dict[tuple, list[str]] = {}
    for r in rows:
        if "error" in r:
            errors.setdefault((r["path"], r["fp8_dot"], r["error"]), []).append(f"M={r['M']} K={r['K']} N={r['N']}")
    for (path, dot, error), where in errors.items():
        lines.append(f"  {path} fp8_dot={dot}: {error} (at {', '.join(where[:4])}{', ...' if len(where) > 4 else ''})")
    return lines


def gemm_shapes(reports: list[dict]) -> list[tuple[int, int]]:
    return sorted({(g["K"], g["N"]) for rep in reports for s in rep.get("steps", []) for g in s["gemms"]})


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------


def main() -> int:
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help="real-shape presets to add (reported)")
    ap.add_argument("--model-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="dtype of the --model presets (float32: prefill takes the Triton GEMM tile)")
    ap.add_argument("--only", action="append", default=None, help="check only these tiny presets")
    ap.add_argument("--out", default=None, help="folder for fp8_gpu_check_<gpu>.json (default bench/results; "
                                                "--device cpu: bench/out)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: smoke-run this script's code (sets TRITON_INTERPRET=1; no engine part, and "
                         "interpreter errors say nothing about a GPU)")
    args = ap.parse_args()
    DEVICE = args.device
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernel_norm import git_info  # the sibling scripts' helpers
    from kernel_quant import gpu_slug

    from mini_infer.models.presets import TINY_PRESETS
    from mini_infer.ops.fp8_linear import fp8_supported
    from mini_infer.ops.int8_linear import FP8_DOT

    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (TRITON_INTERPRET=1 smoke run)"
    if not fp8_supported(DEVICE):
        print(f"{device_name}: no FP8 (compute capability < 8.9)", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runs = [(n, "float32", True) for n in (args.only or TINY_PRESETS)]
    runs += [(m, args.model_dtype, False) for m in args.model]
    rows, reports = [], []
    for name, dtype, judged in runs:
        try:
            ok, note, report = check(name, dtype, judged)
        except Exception as exc:  # a preset that fails to compile or run is a failure, with its error
            traceback.print_exc()
            ok, note, report = False, f"{type(exc).__name__}: {exc}", {"model": name, "error": str(exc)}
        rows.append((name, ok, note))
        reports.append(report | {"ok": ok})
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    t = time.perf_counter()
    shapes = gemm_shapes(reports)
    try:
        op_ok, op_rows, op_lines = op_level(shapes)
    except Exception as exc:
        traceback.print_exc()
        op_ok, op_rows, op_lines = False, [], [f"op level failed: {type(exc).__name__}: {exc}"]
    print(f"\nop level ({len(shapes)} (K, N) shapes, {time.perf_counter() - t:.0f}s; fp32 out: rel = max |err| / "
          f"max |exact|, bar {OP_TOL:.0e}; bf16 out: mismatch = share != exact rounded, bar {MISMATCH_TOL:.0e})")
    for line in op_lines:
        print("  " + line)
    print(f"\n{device_name}, torch {torch.__version__}, FP8_DOT = {FP8_DOT!r}")
    for name, ok, note in rows:
        print(f"{name:<20}{'ok' if ok else 'FAIL':<6}{note}")
    verdict = f"within {OP_TOL:.0e}" if op_ok else f"over {OP_TOL:.0e} (see above)"
    print(f"{'op level':<20}{'ok' if op_ok else 'FAIL':<6}the shipped Triton GEMM tile (fp8_dot={FP8_DOT!r}, M > 16) "
          f"{verdict}")
    out = Path(args.out or ("bench/results" if DEVICE == "cuda" else "bench/out"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fp8_gpu_check_{gpu_slug()}.json"
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_info(), "argv": sys.argv[1:],
            "device": device_name, "torch": torch.__version__, "fp8_dot": FP8_DOT,
            "bars": {"TOL": TOL, "AMPLIFY": AMPLIFY, "OP_TOL": OP_TOL, "MISMATCH_TOL": MISMATCH_TOL}}
    path.write_text(json.dumps({"meta": meta, "models": reports, "op_level": op_rows, "op_summary": op_lines},
                               indent=2, default=str))
    print(f"wrote {path}")
    return 0 if op_ok and all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
