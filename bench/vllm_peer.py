"""vLLM as a peer in the bench scripts: the same model config, the same workload, its own process.

The bench scripts (throughput.py, latency.py, serving.py) call `run_offline` / `serve_command` from here when
given `--peers vllm`. vLLM runs with its defaults (FA3 attention, torch.compile, CUDA graphs, prefix caching,
chunked prefill) and `load_format="dummy"` (random weights) from a model directory holding the preset's
config.json (with `architectures`, which vLLM needs) and, where the preset borrows one, the embedded SmolLM2
tokenizer; mini-infer's peers load the same directory. Offline runs take token-id prompts
(`skip_tokenizer_init=True`, `detokenize=False`), so no tokenizer is needed there.

Each vLLM run is a child process (`python bench/vllm_peer.py throughput|latency SPEC.json`) that prints one JSON
line; the parent must have freed its own GPU memory first (vLLM takes 90% of the device). A run that fails comes
back as {"error": ...} with vLLM's last log lines, so a table can name what did not run and why.
This file must not import mini_infer's engine (only the preset configs and the embedded tokenizer).

On the GPU machines vLLM comes from `../shared/peers/vllm/build.sh` (three parts carried one per call, unpacked
once, `PYTHONPATH=...:vllm-site/site`). Carry them as git-ignored paths (e.g. `.peer/partN`) and copy each out of
the working tree in its own call (`mkdir -p /tmp/peer && cp -r .peer/part1 /tmp/peer/`): a call that carries
another path removes the one an earlier call left in the tree; /tmp stays while the machine is held (calls back
to back, within its 30 s idle release). The third call unpacks /tmp/peer/part*/ and runs. Its OpenAI server (serving.py --peers vllm) also imports
`model_hosting_container_standards`, which needs `jmespath` and `supervisor`; that pack lacks all three: carry
their wheels (bench/RESULTS.md, fifth session, has the exact calls).

    python bench/vllm_peer.py write-dirs --out .models qwen3-0.6b qwen2.5-7b   # config + tokenizer, to carry
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIRS = ROOT / ".models"  # written here and carried to the GPU machine (git-ignored)


def model_dir(preset: str | None, root: Path = DEFAULT_DIRS) -> Path:
    """A directory vLLM (and mini-infer with load_format="dummy") can load `preset` from: the one under `root`
    if it exists (written ahead, with the tokenizer), else written now (config only where the embedded
    tokenizer is not installed). None: the smollm2-135m preset (the embedded model's architecture)."""
    preset = preset or "smollm2-135m"
    d = root / preset
    if (d / "config.json").is_file():
        return d
    if Path(preset).is_dir():  # already a model directory
        return Path(preset)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from mini_infer.models.presets import preset_config

    config = preset_config(preset)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    d.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(d)
    try:
        from mini_infer.models.loader import preset_tokenizer

        tok = preset_tokenizer(config)
    except Exception as exc:  # no embedded package here: token-id prompts only
        print(f"vllm_peer: {preset}: no tokenizer written ({type(exc).__name__}: {exc})", file=sys.stderr)
        tok = None
    if tok is not None:
        tok.save_pretrained(d)
    return d


def run_offline(kind: str, spec: dict, timeout: float = 900.0) -> dict:
    """Run one offline vLLM measurement (`kind` = throughput | latency) in a child process; its JSON result, or
    {"error": ...} naming what failed."""
    out = Path(spec.get("out", "bench/out"))
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / f"vllm_{kind}_spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = out / f"vllm_{kind}.log"
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            r = subprocess.run([sys.executable, __file__, kind, str(spec_path)], stdout=subprocess.PIPE,
                               stderr=log, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"vLLM {kind} run timed out after {timeout:g}s (log {log_path})"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-6:]
        return {"error": f"vLLM {kind} run exited with {r.returncode} after {time.perf_counter() - t0:.0f}s: "
                         + " | ".join(tail)}
    return json.loads(lines[-1])


def serve_command(model_path: Path, port: int, max_model_len: int | None) -> list[str]:
    """`vllm serve` as a module call of this interpreter (the `vllm` script may not be on PATH there)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
           "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd


# ------------------------------------------------------------------------------------------- child process
def _build(spec: dict):
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(spec["model_dir"], load_format="dummy", skip_tokenizer_init=True, seed=0,
              max_model_len=spec["max_model_len"])
    return llm, time.perf_counter() - t0


def _throughput(spec: dict) -> dict:
    from vllm import SamplingParams

    llm, startup = _build(spec)
    params = [SamplingParams(temperature=spec["temperature"], ignore_eos=True, max_tokens=n, detokenize=False)
              for n in spec["output_lens"]]
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=4, detokenize=False),
                 use_tqdm=False)  # warm-up, as nano-vllm's bench.py does
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens": produced, "seconds": seconds, "startup_seconds": startup}


def _latency(spec: dict) -> dict:
    """Batch-1 decode as (new - 1) / (time for `new` tokens - time for 1 token), medians of 3 (the prompt is
    prefix-cached after the warm-up in both, so the difference is decode steps)."""
    from vllm import SamplingParams

    llm, startup = _build(spec)
    prompt = [{"prompt_token_ids": spec["prompt"]}]

    def timed(n: int) -> tuple[float, list[int]]:
        p = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)
        start = time.perf_counter()
        out = llm.generate(prompt, p, use_tqdm=False)[0]
        return time.perf_counter() - start, list(out.outputs[0].token_ids)

    timed(8)
    timed(spec["new_tokens"])  # warm-up at the timed length
    ones = sorted(timed(1)[0] for _ in range(3))
    runs = [timed(spec["new_tokens"]) for _ in range(3)]
    fulls = sorted(t for t, _ in runs)
    t1, tn = ones[1], fulls[1]
    return {"decode_tok_s": (spec["new_tokens"] - 1) / (tn - t1), "one_token_s": t1, "full_s": tn,
            "startup_seconds": startup, "tokens": len(runs[0][1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["throughput", "latency", "write-dirs"])
    ap.add_argument("args", nargs="*", help="SPEC.json (throughput, latency) or preset names (write-dirs)")
    ap.add_argument("--out", default=str(DEFAULT_DIRS), help="write-dirs: where the model directories go")
    a = ap.parse_args()
    if a.kind == "write-dirs":
        sys.path.insert(0, str(ROOT))
        for name in a.args:
            d = model_dir(name, Path(a.out))
            print(f"{name}: {d} ({', '.join(sorted(p.name for p in d.iterdir()))})")
        return
    spec = json.loads(Path(a.args[0]).read_text())
    import vllm

    result = (_throughput if a.kind == "throughput" else _latency)(spec)
    result["version"] = vllm.__version__
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
