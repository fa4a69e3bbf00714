"""Checks of an `EngineConfig` against the machine and the model, before anything is loaded or compiled.

`check_before_load(config)` reads only the model's config and file headers (see models/model_info.py) and
answers in well under a second with one ValueError naming the option or file: a device that is not there, a
model that is missing or broken, a `max_model_len` above the model's limit, a KV-cache budget that cannot hold
one block (or `max_model_len` tokens), weights larger than the memory available (a tensor-parallel rank's
share of a checkpoint), FP8 (weights or KV cache) on a
GPU without FP8. `LLMEngine` calls it first;
the CLI calls it before it starts a server. What passes here can still fail later (the real KV cache size is
known only after compile); this module only refuses early what would surely fail. It must not load weights.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from mini_infer.contract import DEFAULT_BLOCK_SIZE
from mini_infer.models.model_info import ModelInfo, inspect_model

if TYPE_CHECKING:
    from mini_infer.models.loader import LoadedModel
    from mini_infer.runtime.engine import EngineConfig

logger = logging.getLogger("mini_infer")

_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float8_e4m3fn: 1}


def check_device(device: str | None) -> torch.device:
    """The device `device` names, if this machine has it; ValueError naming the option otherwise."""
    if device is None:
        from mini_infer.models.loader import default_device

        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but no CUDA GPU is available here (torch {torch.__version__}, "
                             f"CUDA build: {torch.version.cuda or 'none'}): use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}, but this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r}: only 'cuda' and 'cpu' are supported")
    return dev


def kv_bytes_per_token_at_least(config, dtype: torch.dtype) -> int:
    """A lower bound of the KV cache's bytes per token: K and V of `num_key_value_heads x head_dim` in every
    layer (models that decompress latent attention store more, never less)."""
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device` (None when unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_fp8(config: EngineConfig, device: torch.device) -> None:
    """FP8 weights or an FP8 KV cache on a GPU without FP8 (compute capability < 8.9): refused naming both."""
    from mini_infer.ops.fp8_linear import FP8_MIN_CAPABILITY, fp8_supported

    asked = [f"{k}={v!r}" for k, v in (("quantization", config.quantization),
                                        ("kv_cache_dtype", config.kv_cache_dtype)) if str(v).startswith("fp8")]
    if asked and device.type == "cuda" and not fp8_supported(device):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        need = ".".join(map(str, FP8_MIN_CAPABILITY))
        raise ValueError(f"{' and '.join(asked)}: {torch.cuda.get_device_name(device)} ({device}) has compute "
                         f"capability {cap}; FP8 needs >= {need} (Ada, Hopper or later)")


def _check_kv_budget(config: EngineConfig, info_config, dtype: torch.dtype) -> None:
    if config.num_kv_blocks is not None or config.kv_cache_memory_bytes is None:
        return
    from mini_infer.runtime.engine import resolve_kv_cache_dtype

    per_token = kv_bytes_per_token_at_least(info_config, resolve_kv_cache_dtype(config.kv_cache_dtype) or dtype)
    budget = config.kv_cache_memory_bytes
    # None: the caches' choice, known after compiling (DEFAULT_BLOCK_SIZE or more)
    block_size = config.block_size or DEFAULT_BLOCK_SIZE
    block = per_token * block_size
    if budget < block:
        raise ValueError(f"kv_cache_memory_bytes={budget} cannot hold one KV block of this model: a block of "
                         f"{block_size} tokens needs at least {block} bytes")
    if config.max_model_len is not None and budget < per_token * config.max_model_len:
        raise ValueError(f"kv_cache_memory_bytes={budget} holds at most {budget // per_token} tokens of this "
                         f"model's KV cache, fewer than max_model_len={config.max_model_len}: raise it or lower "
                         "max_model_len")


def _check_memory(info: ModelInfo, dtype: torch.dtype, device: torch.device, shards: int = 1) -> None:
    """Weights that cannot fit: the whole model, or with `shards` > 1 (a tensor-parallel rank loading its shard of
    a checkpoint, models/loader.py) at least 1/shards of it."""
    if not info.weight_numel:
        return
    need = info.weight_numel * _DTYPE_BYTES.get(dtype, 2) // shards
    free = available_memory(device)
    if free is None:
        return
    where = "GPU" if device.type == "cuda" else "CPU"
    if need > free:
        raise ValueError(
            f"{info.source.name} has {info.weight_numel / 1e9:.2f}B parameters: {need / 1e9:.1f} GB in "
            f"{str(dtype).removeprefix('torch.')}{f' per rank of {shards}' if shards > 1 else ''}, more than the "
            f"{free / 1e9:.1f} GB of {where} memory available here: run it on a GPU (device='cuda'), in a smaller "
            "dtype, or pick a smaller model")
    if need * 3 // 2 > free:
        logger.warning("%s needs %.1f GB for its weights and about half as much again while compiling (merged "
                       "projections); %.1f GB are available", info.source.name, need / 1e9, free / 1e9)


def _check_tensor_parallel(config: EngineConfig, model_config, device: torch.device) -> None:
    """The model has a tp plan that splits over the size, and each rank has a GPU (of this machine: under
    torchrun, the ranks started here)."""
    import os

    from mini_infer.models.tp_plan import check_tensor_parallel_devices, tensor_parallel_plan

    size = config.tensor_parallel_size
    tensor_parallel_plan(model_config, size, config.enable_expert_parallel)
    if device.type == "cuda" and device.index is not None:
        raise ValueError(f"device={config.device!r} with tensor_parallel_size={size}: each rank takes its own GPU; "
                         "pass device='cuda'")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    check_tensor_parallel_devices(local, device.type, torch.cuda.device_count() if device.type == "cuda" else 0)


def check_before_load(config: EngineConfig, loaded: LoadedModel | None = None) -> ModelInfo | None:
    """Refuse, before loading, an engine that cannot run (see the module docstring). Returns what was learnt
    about the model (None when `loaded` was given: then only the options are checked against it)."""
    from mini_infer.models.loader import resolve_dtype

    device = check_device(config.device)
    _check_fp8(config, device)
    info = None
    if loaded is not None:
        model_config = loaded.config
    else:
        info = inspect_model(config.model, config.load_format)
        model_config = info.config
    limit = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    if config.max_model_len is not None and limit is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} is above this model's limit of {limit} tokens "
                         "(max_position_embeddings in its config)")
    if config.tensor_parallel_size > 1:
        _check_tensor_parallel(config, model_config, device)
    dtype = resolve_dtype(config.dtype, model_config, device)
    _check_kv_budget(config, model_config, dtype)
    if info is not None:  # a rank loads its shard of a checkpoint, a whole preset or dummy model
        from_files = info.source.kind != "preset" and config.load_format != "dummy"
        _check_memory(info, dtype, device, config.tensor_parallel_size if from_files else 1)
    return info
