"""`GuardMiddleware`: pure-ASGI checks before any route runs.

401 without the API key (except /health); 400 for a non-JSON content type; 413 for a body over the limit (by
Content-Length and by the bytes actually read); 400 for a JSON body holding a lone UTF-16 surrogate
(`"\\ud800"`), which no tokenizer, log or response can encode: it is refused here with its field as `param`,
so it never reaches a route, a tokenizer or an error message. This module must not parse requests beyond that.
"""

from __future__ import annotations

import hmac
import json
import re

from mini_infer.serving.errors import error_response
from mini_infer.serving.state import ServerState

# A JSON escape of a UTF-16 surrogate, or one encoded raw as (invalid) UTF-8: only then is the body parsed here.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate_path(value, path: str = "") -> str | None:
    """The dotted path (`messages.0.content`) of the first string (value or key) in `value` that holds a lone
    surrogate; None when there is none."""
    if isinstance(value, str):
        return (path or "body") if _has_lone_surrogate(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if _has_lone_surrogate(k):
                return sub
            found = lone_surrogate_path(v, sub)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = lone_surrogate_path(v, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def body_surrogate_path(body: bytes) -> str | None:
    """Where a JSON request body holds a lone surrogate, if it does (invalid JSON is left to the route)."""
    if not _MAYBE_SURROGATE.search(body):
        return None
    try:
        return lone_surrogate_path(json.loads(body))
    except ValueError:
        return None


class GuardMiddleware:
    """API key (401), JSON content type (400), body size (413), lone surrogates (400), before any route."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        settings = self.state.settings
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if settings.api_key and scope["path"] != "/health":
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                      settings.api_key.encode()):
                resp = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        ctype = headers.get("content-type")
        if ctype is not None:
            media = ctype.split(";")[0].strip().lower()
            if media != "application/json" and not media.endswith("+json"):
                resp = error_response(400, f"Content-Type must be application/json, got {ctype!r}",
                                      code="invalid_content_type")
                return await resp(scope, receive, send)
        limit = settings.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None:
            try:
                too_big = int(declared) > limit
            except ValueError:
                return await error_response(400, f"invalid Content-Length {declared!r}")(scope, receive, send)
            if too_big:
                return await self._too_large(scope, receive, send, int(declared))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await self._too_large(scope, receive, send, size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        where = body_surrogate_path(body)
        if where is not None:
            resp = error_response(400, f"{where}: the text holds a lone UTF-16 surrogate (e.g. \\ud800), which is "
                                  "not valid Unicode", param=where, code="invalid_unicode")
            return await resp(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send, size: int) -> None:
        limit = self.state.settings.max_body_bytes
        resp = error_response(413, f"request body is {size} bytes (or more); the limit is {limit} bytes",
                              code="request_too_large")
        await resp(scope, receive, send)
