"""`LLM`: the offline Python API with vLLM's names (`LLM(model=...)`, `generate`, `chat`).

A thin loop over `LLMEngine`: queue every prompt, step until all finish, return outputs in prompt order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from mini_infer.chat_template import chat_prompt_ids
from mini_infer.outputs import RequestOutput
from mini_infer.runtime.engine import EngineConfig, LLMEngine
from mini_infer.sampling_params import SamplingParams, model_sampling_defaults

PromptType = str | dict | list[int]


def _check_prompt(prompt, where: str) -> None:
    """ValueError naming `where` unless `prompt` is text, token ids or a {"prompt"/"prompt_token_ids": ...} dict."""
    if isinstance(prompt, (str, dict, Sequence)):
        return
    raise ValueError(f"{where} must be a string, a list of token ids, or a dict with 'prompt' or "
                     f"'prompt_token_ids'; got {type(prompt).__name__}")


class LLM:
    """An engine for offline generation.

    `model` is None (the embedded SmolLM2-135M-Instruct), a local HF directory, a `.gguf` file, or a preset
    name (random weights). Keyword options are `EngineConfig`'s (vLLM's names): `dtype`, `max_model_len`,
    `max_num_seqs`, `max_num_batched_tokens`, `enable_prefix_caching`, `block_size`,
    `gpu_memory_utilization`, `kv_cache_memory_bytes`, `passes`, `seed`, ...
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams `generate` and `chat` use when given none: the model's generation_config
        defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) unless the engine was
        made with generation_config="vllm", else SamplingParams()."""
        eng = self.engine
        defaults = model_sampling_defaults(eng.generation_config,
                                           eng.config.generation_config)
        return SamplingParams(**defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or {"prompt_token_ids": [...]}); outputs in order.

        Without `sampling_params`, `get_default_sampling_params()` (the model's generation_config defaults)."""
        _check_prompt(prompts, "prompts")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        for i, prompt in enumerate(prompts):
            _check_prompt(prompt, f"prompts[{i}]")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(f"llm-{self._counter}", prompt, p))
                self._counter += 1
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm and len(ids) > 1)

    def _run(self, ids: list[str], show: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not show)
        try:
            while pending:
                if not self.engine.has_unfinished_requests():  # they were aborted from elsewhere
                    raise RuntimeError(f"requests {sorted(pending)} ended without a final output")
                for out in self.engine.step(final_only=True):
                    if out.finished and out.request_id in pending:
                        done[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Generate replies to conversations through the model's chat template (the server's rules: see
        mini_infer/chat_template.py; a bad message raises ValueError naming it, e.g. `messages.0.content`)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError(f"model {self.engine.loaded.name!r} has no tokenizer, so no chat template")
        if messages is None or isinstance(messages, (str, dict)):
            raise ValueError(f"messages must be a list of messages (or of conversations), got "
                             f"{type(messages).__name__}")
        conversations = [messages] if messages and not isinstance(messages[0], list) else messages
        prompts = [{"prompt_token_ids": chat_prompt_ids(tok, conv, add_generation_prompt,
                                                        chat_template=chat_template)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
