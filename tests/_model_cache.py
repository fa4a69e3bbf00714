"""Loaded and compiled models shared by the engine, LLM and CLI tests of one pytest process.

Compiling SmolLM2-135M takes 20-80 s on a busy 2-core machine and a tiny preset several seconds, so each is
compiled once per process. `patch_engine(monkeypatch)` makes `LLMEngine` (and so `LLM` and the CLI) take
its model from here: the code under test is the same, only `load_model` / `compile_model` are memoized.
A compiled graph holds no per-engine state (the KV cache and metadata are its inputs), so engines with
different cache sizes or batching limits can share one.
"""

from __future__ import annotations

import functools
import inspect

import torch

from mini_infer.compiler import compile_model
from mini_infer.models.loader import load_model


@functools.cache
def _load(name: str | None, dtype, device: str | None, seed: int):
    return load_model(name, dtype=dtype, device=device, seed=seed)


@functools.cache
def _compile(model_id: int, passes: tuple | None, device: str | None, model_name: str, options: tuple):
    model = _MODELS[model_id]
    return compile_model(model, passes=list(passes) if passes is not None else None, device=device,
                         model_name=model_name, **dict(options))


_MODELS: dict[int, torch.nn.Module] = {}


def loaded(name: str | None):
    """`load_model(name)` on the CPU, once per process."""
    return _load(name, "auto", "cpu", 0)


def compiled(name: str | None):
    """The loaded model of `name` compiled with the default pipeline, once per process."""
    lm = loaded(name)
    return cached_compile(lm.model, device="cpu", model_name=lm.name)


def cached_compile(model, passes=None, dump_dir=None, verify=False, device=None, model_name="", **options):
    """`compile_model`, memoized by model, passes, device and the options that can change the graph (quantization,
    kv_cache_dtype, ...: `_key_options`).

    `max_positions` (the engine's max_model_len) is dropped: position tables then cover the config's
    max_position_embeddings, which every max_model_len preflight lets through fits, and engines with different
    max_model_len share one compile."""
    options.pop("max_positions", None)
    if dump_dir is not None or verify:
        return compile_model(model, passes=passes, dump_dir=dump_dir, verify=verify, device=device,
                             model_name=model_name, **options)
    _MODELS[id(model)] = model
    return _compile(id(model), tuple(passes) if passes is not None else None,
                    str(device) if device is not None else None, model_name, _key_options(passes, options))


_DEFAULTS = {name: p.default for name, p in inspect.signature(compile_model).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _key_options(passes, options: dict) -> tuple:
    """The options that can change the compiled graph, sorted: those at compile_model's defaults are left out (the
    engine passes rank=0, world_size=1, ... explicitly), and so is the tokenizer where no pass reads it (only
    quantize_w8a8's calibration does, in the recommended pipeline with quantization="w8a8"), so that a test's
    direct compile and an engine's share one."""
    kept = {k: v for k, v in options.items() if k not in _DEFAULTS or v != _DEFAULTS[k]}
    if passes is None and kept.get("quantization") != "w8a8":
        kept.pop("tokenizer", None)
    return tuple(sorted(kept.items()))


def cached_load(model=None, dtype="auto", device=None, seed=0, load_format="auto", tensor_parallel_size=1):
    if load_format != "auto" or tensor_parallel_size > 1:  # random weights of a checkpoint, or a rank's shards
        from mini_infer.models import load_model

        return load_model(model, dtype=dtype, device=device, seed=seed, load_format=load_format,
                          tensor_parallel_size=tensor_parallel_size)
    return _load(model, str(dtype) if not isinstance(dtype, str) else dtype,
                 str(device) if device is not None else "cpu", seed)


def patch_engine(monkeypatch) -> None:
    """Route the engine's `load_model` / `compile_model` through the per-process caches."""
    import mini_infer.runtime.engine as engine_mod

    monkeypatch.setattr(engine_mod, "load_model", cached_load)
    monkeypatch.setattr(engine_mod, "compile_model", cached_compile)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF `generate` greedy continuation of one unpadded prompt: exactly n tokens (no EOS stop), the oracle."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=0)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, len(prompt):].tolist()
