"""Start-up memory of the engine on a GPU: weights, measured activations, CUDA-graph pools, KV cache, and what
the process holds beyond weights + KV cache (allocated and reserved), with the KV capacity in tokens.

    python bench/memory.py [--model qwen2.5-7b] [--max-model-len 4096]

Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    from mini_infer.runtime.engine import EngineConfig, LLMEngine

    start = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=args.model, max_model_len=args.max_model_len))
    startup = time.perf_counter() - start
    torch.cuda.synchronize()
    m = eng.memory
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    free, total = torch.cuda.mem_get_info()
    row = {
        "model": args.model, "device": torch.cuda.get_device_name(), "max_model_len": args.max_model_len,
        "max_num_batched_tokens": eng.max_num_batched_tokens, "max_num_seqs": eng.config.max_num_seqs,
        "weights_gb": m.weights / 1e9, "activations_reserved_gb": m.activations / 1e9,
        "cuda_graphs_gb": m.graphs / 1e9, "kv_cache_gb": m.kv_cache / 1e9, "kv_tokens": m.kv_tokens,
        "kv_bytes_per_token": m.kv_bytes_per_token,
        "allocated_minus_weights_kv_gb": (allocated - m.weights - m.kv_cache) / 1e9,
        "reserved_minus_weights_kv_gb": (reserved - m.weights - m.kv_cache) / 1e9,
        "gpu_used_gb": (total - free) / 1e9, "gpu_total_gb": total / 1e9, "startup_s": startup,
        "compile_s": eng.compile_seconds, "graphs_s": eng.capture_seconds,
    }
    print("| quantity | value |\n|---|---|")
    for k, v in row.items():
        print(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"memory_{args.model}.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
