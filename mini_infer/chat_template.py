"""Chat messages to prompt token ids through a tokenizer's chat template: one set of rules for `LLM.chat` and
the server's /v1/chat/completions and /tokenize.

`conversation(messages)` checks the messages (OpenAI's shape: a role and a string or a list of text parts) and
flattens text parts; a bad message raises `InvalidMessages` naming it by path (`messages.0.content`).
`chat_prompt_ids(tokenizer, messages, ...)` applies the template. This module must not sample, queue requests
or know about HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "developer", "tool")


class InvalidMessages(ValueError):
    """A chat message the template cannot take; `param` is its path (`messages.0.content`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _content_text(content: Any, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":  # OpenAI allows an assistant turn without content
            return ""
        raise InvalidMessages(where, f"a {role} message needs content (a string or a list of text parts), got None")
    if not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
        raise InvalidMessages(where, "content must be a string or a list of parts like "
                                     f'{{"type": "text", "text": "..."}}, got {type(content).__name__}')
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidMessages(f"{where}.{j}", 'only text parts ({"type": "text", "text": "..."}) are '
                                                  f"supported, got type {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def conversation(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The messages as the template takes them (`{"role", "content"[, "name"]}` with text content); raises
    InvalidMessages naming the first bad one."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidMessages("messages", f"must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise InvalidMessages("messages", "must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidMessages(f"messages.{i}", f'must be a dict like {{"role": "user", "content": "..."}}, '
                                                   f"got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidMessages(f"messages.{i}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        msg = {"role": role, "content": _content_text(m.get("content"), f"messages.{i}.content", role)}
        if m.get("name") is not None:
            msg["name"] = m["name"]
        out.append(msg)
    return out


def chat_prompt_ids(tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template (or `chat_template`).

    Raises InvalidMessages for bad messages, ValueError when there is no template or it fails on them."""
    conv = conversation(messages)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidMessages("messages", "this model's tokenizer has no chat template: send a plain prompt")
    try:
        ids = tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt and
                                            not continue_final_message,
                                            continue_final_message=continue_final_message,
                                            chat_template=chat_template, tokenize=True, return_dict=False)
    except Exception as exc:  # noqa: BLE001 - a template error is the messages' fault
        raise InvalidMessages("messages", f"the chat template failed on these messages: {exc}") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
