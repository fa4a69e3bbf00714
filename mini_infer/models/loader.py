"""Model intake: a local HF directory, a GGUF file, a named preset, or the embedded default.

Everything ends as a transformers causal LM (transformers' own modeling code) on the target device in the
target dtype, in eval mode, with SDPA attention (the form the capture and the attention pass expect), plus
its tokenizer when one exists (presets borrow the embedded SmolLM2 tokenizer when its ids fit their
vocabulary). What a model argument names is model_info.py's `resolve_source`: a hub id or a missing path fails
at once with a message that says what to pass instead. This module must not capture or rewrite graphs and never
touches the network.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from mini_infer.models.model_info import (
    DEFAULT_MODEL,
    TOKENIZER_FILES,
    ModelLoadError,
    ModelNotFoundError,
    check_causal_lm,
    checkpoint_numel,
    embedded_checkpoint_dir,
    embedded_gguf_path,
    preset_takes_embedded_tokenizer,
    resolve_source,
)
from mini_infer.models.presets import preset_config

logger = logging.getLogger("mini_infer")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass
class LoadedModel:
    """A loaded model and what came with it."""

    model: PreTrainedModel
    config: PretrainedConfig
    tokenizer: object | None
    source: str  # "hf-dir", "gguf", "preset", "dummy" or "default"
    name: str


def _embedded_hf_dir() -> Path:
    """The embedded GGUF converted once to a HF directory (safetensors + tokenizer), for fast later loads.

    transformers de-quantizes GGUF in Python (tens of seconds, every time); the converted copy loads in about
    a second. The conversion keeps the de-quantized float32 values exactly.
    """
    gguf = embedded_gguf_path()
    target = embedded_checkpoint_dir()
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    from safetensors.torch import save_model

    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = "float32"
    config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process converted it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_embedded_tokenizer():
    """The tokenizer of the embedded SmolLM2 model: from its converted directory when a previous run made it,
    else straight from the GGUF file (no model conversion)."""
    target = embedded_checkpoint_dir()
    if (target / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(target))
    gguf = embedded_gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def preset_tokenizer(config: PretrainedConfig):
    """The tokenizer a preset's text goes through: the embedded SmolLM2 one when its ids fit the preset's
    vocabulary (see `preset_takes_embedded_tokenizer`), else None (token-id prompts only)."""
    if not preset_takes_embedded_tokenizer(config):
        return None
    logger.info("%s: text goes through the embedded SmolLM2 tokenizer (its ids fit the vocabulary of %d)",
                config.name_or_path, config.get_text_config().vocab_size)
    return load_embedded_tokenizer()


def resolve_dtype(dtype: str | torch.dtype, config: PretrainedConfig | None, device: torch.device) -> torch.dtype:
    """'auto' is the checkpoint's dtype on a GPU and float32 on the CPU (bf16 matmuls are slow there)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = _DTYPES.get(cfg_dtype)
        return cfg_dtype if cfg_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {dtype!r}")
    return _DTYPES[dtype]


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def build_random_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                       seed: int = 0) -> PreTrainedModel:
    """Build `config`'s model on the meta device, then materialize random weights on `device`.

    Weights follow transformers' own initializer (normal(0, initializer_range), norms at one), seeded, so
    the same preset and seed give the same model on the same device.
    """
    check_causal_lm(config, f"preset {config.name_or_path}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.to_empty(device=device)
    gen_state = torch.random.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            model.initialize_weights()
            model.tie_weights()
    finally:
        torch.random.set_rng_state(gen_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)
    return model.eval().requires_grad_(False)


def _load_pretrained(path: str, gguf_file: str | None, dtype: str | torch.dtype, device: torch.device):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kwargs = dict(gguf_file=gguf_file) if gguf_file else {}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **kwargs)
    check_causal_lm(config, path)
    if not gguf_file:
        checkpoint_numel(Path(path))  # missing, corrupt or truncated weight files: one line naming the file
    torch_dtype = resolve_dtype(dtype, config, device)
    if device.type == "cpu" and not gguf_file:
        # Read the weights into process memory instead of mapping the file: the compiled graph replaces some
        # weights (merged, quantized) and pages of a file mapping stay resident while any tensor of that file
        # lives, so the replaced originals would keep costing memory next to their replacements.
        model_kwargs = dict(kwargs, disable_mmap=True)
    else:
        model_kwargs = kwargs
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, attn_implementation="sdpa", device_map=str(device), **model_kwargs
        )
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:  # broken: one line naming it
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelLoadError(f"cannot load the weights in {Path(path) / (gguf_file or '')}: "
                             f"{type(exc).__name__}: {first}") from None
    tokenizer = None  # a checkpoint without tokenizer files still runs on token ids
    if gguf_file or any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        except Exception as exc:
            logger.warning("no usable tokenizer in %s (%s): prompts must be token ids", path, exc)
    return model.eval().requires_grad_(False), tokenizer


def _config_of(path: Path, gguf_file: str | None) -> PretrainedConfig:
    from transformers import AutoConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return AutoConfig.from_pretrained(str(path), **({"gguf_file": gguf_file} if gguf_file else {}))


def load_model(model: str | None = None, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
               seed: int = 0, load_format: str = "auto") -> LoadedModel:
    """Load `model`: None (the embedded SmolLM2-135M-Instruct), a local HF directory (config.json +
    safetensors, sharded or not), a `.gguf` file, or a preset name (random weights). With
    `load_format="dummy"`, the model's architecture with random weights (None: the smollm2-135m preset).

    Raises ModelNotFoundError for anything else, at once: mini-infer never downloads from a hub.
    """
    device = torch.device(device) if device is not None else default_device()
    source = resolve_source(model, load_format)
    if source.kind == "preset":
        config = preset_config(source.name)
        m = build_random_model(config, resolve_dtype(dtype, config, device), device, seed)
        return LoadedModel(m, m.config, preset_tokenizer(config), "preset", source.name)
    if source.kind == "default":
        m, tok = _load_pretrained(str(_embedded_hf_dir()), None, dtype, device)
        return LoadedModel(m, m.config, tok, "default", DEFAULT_MODEL)
    gguf_file = source.path.name if source.kind == "gguf" else None
    where = source.path.parent if gguf_file else source.path
    if load_format == "dummy":  # the architecture with random weights: config and tokenizer, never weights
        config = _config_of(where, gguf_file)
        m = build_random_model(config, resolve_dtype(dtype, config, device), device, seed)
        tokenizer = None
        if gguf_file or any((where / f).is_file() for f in TOKENIZER_FILES):
            tokenizer = AutoTokenizer.from_pretrained(str(where), **({"gguf_file": gguf_file} if gguf_file else {}))
        return LoadedModel(m, m.config, tokenizer, "dummy", source.name)
    m, tok = _load_pretrained(str(where), gguf_file, dtype, device)
    return LoadedModel(m, m.config, tok, source.kind, source.name)


__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelLoadError", "ModelNotFoundError", "build_random_model",
           "default_device", "load_embedded_tokenizer", "load_model", "resolve_dtype"]
