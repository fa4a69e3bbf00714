"""Model intake: a local HF directory, a GGUF file, a named preset, or the embedded default.

Everything ends as a transformers causal LM (transformers' own modeling code) on the target device in the
target dtype, in eval mode, with SDPA attention (the form the capture and the attention pass expect), plus
its tokenizer when one exists (presets borrow the embedded SmolLM2 tokenizer when its ids fit their
vocabulary). What a model argument names is model_info.py's `resolve_source`: a hub id or a missing path fails
at once with a message that says what to pass instead.

For one rank of a tensor-parallel group (`tensor_parallel_size > 1`, checkpoints on disk), the weights the
sharding pass slices are not put on the device whole: the model is loaded on the host (safetensors stay memory
maps) and each such weight is a one-element placeholder of its shape on the device that carries the host tensor
(`host_weight`); the pass copies only the rank's slice to the device. Every other weight goes to the device.

Pre-quantized checkpoints (a `quantization_config` in config.json): MXFP4 ones (GPT-OSS as OpenAI publishes it,
its experts' `*_blocks` / `*_scales`) always load dequantized to the target dtype, so the experts are the plain
`GptOssExperts` the capture and route_moe read (never transformers' Triton MXFP4 kernels, which would replace their
forward); any other `quant_method` is refused at start-up with a ModelLoadError naming it (`_quantization_kwargs`).
This module must not capture or rewrite graphs and never touches the network.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
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
from mini_infer.models.tp_plan import TensorParallelPlan, tensor_parallel_plan

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


def attention_implementation(config: PretrainedConfig) -> str:
    """How to load `config`'s model for capture: "sdpa" where its class runs attention through torch's
    scaled_dot_product_attention (the attention pass's pattern) and the config has no attention logit soft cap
    (SDPA cannot apply one: transformers 5.17 still let Gemma 2 run SDPA without it), else "eager" where it takes
    a registered attention function (the capture then routes it through one of mini-infer's, passes/capture.py);
    a class with neither (ALiBi biases in BLOOM's own code, Mamba's state-space layers) is refused, naming it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None:
        return "sdpa"  # (an unknown class: transformers says what it cannot build)
    capped = bool(getattr(config.get_text_config(), "attn_logit_softcapping", None))
    if getattr(cls, "_supports_sdpa", False) and not capped:
        return "sdpa"
    if getattr(cls, "_supports_attention_backend", False):
        return "eager"
    if capped:  # (transformers before 5.2x let Gemma 2 run SDPA, which drops the cap)
        raise ModelLoadError(f"{cls.__name__}: attn_logit_softcapping needs an attention function that applies "
                             "it, and this class takes none but SDPA, which does not")
    raise ModelLoadError(f"{cls.__name__}: its layers attend neither through torch's scaled_dot_product_attention "
                         "nor through a registered attention function (transformers' AttentionInterface), the two "
                         "ways mini-infer captures attention: its attention is code of its own (e.g. ALiBi biases) "
                         "or it has none (state-space and recurrent models)")


def build_random_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                       seed: int = 0) -> PreTrainedModel:
    """Build `config`'s model on the meta device, then materialize random weights on `device`.

    Weights follow transformers' own initializer (normal(0, initializer_range), norms at one), seeded, so
    the same preset and seed give the same model on the same device.
    """
    check_causal_lm(config, f"preset {config.name_or_path}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=attention_implementation(config))
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


_HOST_WEIGHT = "_mini_infer_host_weight"  # attribute of a shard placeholder: the whole tensor, on the host


def host_weight(tensor: torch.Tensor) -> torch.Tensor | None:
    """The whole host tensor that `tensor` stands for when it is a shard placeholder (see
    `place_for_tensor_parallel`), else None."""
    return getattr(tensor, _HOST_WEIGHT, None)


def shard_placeholders(module: torch.nn.Module) -> list[str]:
    """Names of `module`'s parameters and buffers that are shard placeholders (no values on the device)."""
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [name for name, t in tensors if host_weight(t) is not None]


def _device_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of `t` in memory of its own on `device` (never a view of a host file mapping)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device).copy_(t)
    return torch.nn.Parameter(out, requires_grad=False) if isinstance(t, torch.nn.Parameter) else out


def _shard_placeholder(t: torch.Tensor, device: torch.device) -> torch.nn.Parameter:
    """A tensor of `t`'s shape and dtype on `device` that holds one element (every index reads it: stride 0);
    enough for capture, whose values are fake, and it carries `t` for the sharding pass to slice."""
    one = torch.empty((1,) * t.dim(), dtype=t.dtype, device=device)
    placeholder = torch.nn.Parameter(one.expand(t.shape), requires_grad=False)
    setattr(placeholder, _HOST_WEIGHT, t.detach())
    return placeholder


def place_for_tensor_parallel(model: PreTrainedModel, plan: TensorParallelPlan, device: torch.device) -> int:
    """Put `model`, loaded on the host, on `device` for one rank of `plan`: each weight the sharding pass slices
    (`plan.slices`) becomes a shard placeholder carrying the host tensor; every other parameter and buffer is
    copied to `device`. A tensor shared by several modules (tied embeddings) is used whole, so it is copied.
    Returns the bytes left on the host for the pass to slice."""
    head = model.get_output_embeddings()
    slots = [(path, mod, name, p) for path, mod in model.named_modules() for name, p in mod._parameters.items()
             if p is not None]
    owners: dict[int, int] = {}
    for *_, p in slots:
        owners[id(p)] = owners.get(id(p), 0) + 1
    placed: dict[int, torch.Tensor] = {}
    on_host = 0
    for path, mod, name, p in slots:
        if id(p) not in placed:
            if owners[id(p)] == 1 and plan.slices(path, name, is_lm_head=mod is head):
                placed[id(p)] = _shard_placeholder(p, device)
                on_host += p.numel() * p.element_size()
            else:
                placed[id(p)] = _device_copy(p, device)
        mod._parameters[name] = placed[id(p)]
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = _device_copy(b, device)
    return on_host


@contextmanager
def _muted(name: str) -> Iterator[None]:
    """Drop every record of logger `name` for the length of the `with`."""
    log = logging.getLogger(name)

    def drop(record: logging.LogRecord) -> bool:
        return False

    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


# transformers' MXFP4 quantizer: its warnings are about whether its kernels can run, which mini-infer never lets them
_MXFP4_QUANTIZER_LOGGER = "transformers.quantizers.quantizer_mxfp4"


def _quantization_kwargs(config: PretrainedConfig, path: str, dtype: torch.dtype) -> dict:
    """from_pretrained kwargs for `config`'s quantization: none for a plain checkpoint; for an MXFP4 one
    (`quantization_config.quant_method == "mxfp4"`), `Mxfp4Config(dequantize=True)`, whatever packages are installed
    (with transformers' `kernels` package and a GPU it would otherwise keep the experts packed and run them through
    its Triton kernels, a forward the capture cannot see through). Any other quant_method: ModelLoadError naming it
    (checked here, before transformers imports the method's own package)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return {}
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method)  # (transformers' QuantizationMethod enum)
    if method == "mxfp4":
        from transformers import Mxfp4Config

        logger.info("%s: MXFP4 checkpoint (quantization_config.quant_method 'mxfp4'): its experts are dequantized to "
                    "%s at load and run as plain GptOssExperts math", path, str(dtype).removeprefix("torch."))
        return {"quantization_config": Mxfp4Config(dequantize=True)}
    what = f"quantization_config.quant_method is {method!r}" if method is not None else \
        "its quantization_config has no quant_method"
    raise ModelLoadError(f"{path} is a pre-quantized checkpoint ({what}): mini-infer reads no pre-quantized weights "
                         "but MXFP4 experts (quant_method 'mxfp4', dequantized at load). Load the unquantized "
                         "checkpoint instead (mini-infer quantizes it itself with quantization='w8a8' or 'fp8')")


def _cast_dequantized_experts(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Put MXFP4-dequantized expert weights in the model's dtype: transformers 5.17 dequantizes them to bf16
    whatever dtype the model loads in (5.2x: in the parameter's dtype); values of FP4 x 2^scale fit either."""
    for module in model.modules():
        for name in ("gate_up_proj", "down_proj"):
            p = module._parameters.get(name)
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                module._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)


def _load_pretrained(path: str, gguf_file: str | None, dtype: str | torch.dtype, device: torch.device,
                     tensor_parallel_size: int = 1):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kwargs = dict(gguf_file=gguf_file) if gguf_file else {}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **kwargs)
    check_causal_lm(config, path)
    torch_dtype = resolve_dtype(dtype, config, device)
    quant_kwargs = {} if gguf_file else _quantization_kwargs(config, path, torch_dtype)
    if not gguf_file:
        checkpoint_numel(Path(path))  # missing, corrupt or truncated weight files: one line naming the file
    plan = tensor_parallel_plan(config, tensor_parallel_size) if tensor_parallel_size > 1 else None
    if plan is not None:  # the whole model on the host, files mapped; the rank's part goes to the device below
        model_kwargs, load_device = kwargs, torch.device("cpu")
    elif device.type == "cpu" and not gguf_file:
        # Read the weights into process memory instead of mapping the file: the compiled graph replaces some
        # weights (merged, quantized) and pages of a file mapping stay resident while any tensor of that file
        # lives, so the replaced originals would keep costing memory next to their replacements.
        model_kwargs, load_device = dict(kwargs, disable_mmap=True), device
    else:
        model_kwargs, load_device = kwargs, device
    attn = attention_implementation(config)
    try:
        with _muted(_MXFP4_QUANTIZER_LOGGER):
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, attn_implementation=attn, device_map=str(load_device), **model_kwargs,
                **quant_kwargs
            )
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:  # broken: one line naming it
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelLoadError(f"cannot load the weights in {Path(path) / (gguf_file or '')}: "
                             f"{type(exc).__name__}: {first}") from None
    if quant_kwargs:
        _cast_dequantized_experts(model, torch_dtype)
    if plan is not None:
        on_host = place_for_tensor_parallel(model, plan, device)
        logger.info("tensor parallel over %d ranks: %.3f GB of weights left on the host, sliced per rank",
                    tensor_parallel_size, on_host / 1e9)
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
               seed: int = 0, load_format: str = "auto", tensor_parallel_size: int = 1) -> LoadedModel:
    """Load `model`: None (the embedded SmolLM2-135M-Instruct), a local HF directory (config.json +
    safetensors, sharded or not), a `.gguf` file, or a preset name (random weights). With
    `load_format="dummy"`, the model's architecture with random weights (None: the smollm2-135m preset).

    With `tensor_parallel_size > 1`, weights read from files (not presets or dummy ones, which are built whole
    on the device) that the sharding pass slices are shard placeholders (`place_for_tensor_parallel`): the
    model only runs once compiled with that pass, and its device memory is the replicated weights alone.

    A checkpoint with MXFP4 experts (GPT-OSS as published) loads them dequantized to the target dtype; one of any
    other pre-quantized method raises ModelLoadError naming its `quantization_config.quant_method`.

    Raises ModelNotFoundError for anything else, at once: mini-infer never downloads from a hub.
    """
    device = torch.device(device) if device is not None else default_device()
    source = resolve_source(model, load_format)
    if source.kind == "preset":
        config = preset_config(source.name)
        m = build_random_model(config, resolve_dtype(dtype, config, device), device, seed)
        return LoadedModel(m, m.config, preset_tokenizer(config), "preset", source.name)
    if source.kind == "default":
        m, tok = _load_pretrained(str(_embedded_hf_dir()), None, dtype, device, tensor_parallel_size)
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
    m, tok = _load_pretrained(str(where), gguf_file, dtype, device, tensor_parallel_size)
    return LoadedModel(m, m.config, tok, source.kind, source.name)


__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelLoadError", "ModelNotFoundError", "attention_implementation",
           "build_random_model", "default_device", "host_weight", "load_embedded_tokenizer", "load_model",
           "place_for_tensor_parallel", "resolve_dtype", "shard_placeholders"]
