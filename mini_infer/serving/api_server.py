"""The OpenAI-compatible HTTP app (FastAPI), talking only to an `AsyncLLMEngine`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`, `GET /version`,
`GET /metrics`, `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` (what lm-evaluation-harness's
remote tokenizer reads), `GET /openapi.json` (FastAPI's).

Every error is OpenAI's body `{"error": {"message", "type", "param", "code"}}`: bad input of any kind is a
400 (FastAPI's 422 included), never a 500, and never reaches the engine loop. A guard middleware answers
401 (API key), 413 (body over the limit, by Content-Length and by the bytes actually read) and 400 (a
non-JSON content type) before a route runs. A client that goes away aborts its requests: streaming
responses are cancelled by Starlette, non-streaming ones by a disconnect watcher.

`build_app(state)` makes the app; `ServerState` holds the engine once it is loaded (until then every engine
route answers 503 with Retry-After, and so does /health).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import mini_infer
from mini_infer.outputs import RequestOutput
from mini_infer.runtime.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloaded, RequestAborted
from mini_infer.sampling_params import SamplingParams
from mini_infer.serving import protocol as P
from mini_infer.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mini_infer.serving.metrics import ServerMetrics

logger = logging.getLogger("mini_infer.serving")

DEFAULT_MAX_BODY_BYTES = 10 * 2**20

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
                503: "service_unavailable"}


# ------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error with its HTTP status, rendered as OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


_ERROR_DOCS = {s: {"model": P.ErrorResponse} for s in (400, 401, 404, 413, 503)}


# ------------------------------------------------------------------------------------------- state
@dataclass
class ServerSettings:
    served_model_name: str
    model: str | None = None  # what was asked to load (also accepted as the model name)
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    retry_after_s: int = 1


class ServerState:
    """What the routes share: settings, metrics, and the engine once it has loaded."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: AsyncLLMEngine | None = None
        self.tokenizer = None  # the server's own copy: the engine's is used by the loop thread
        self.load_error: BaseException | None = None
        self.metrics = ServerMetrics(settings.served_model_name, self._stats)
        self.model_names = {settings.served_model_name}
        if settings.model:
            self.model_names.add(settings.model)

    def _stats(self) -> dict | None:
        return self.engine.stats() if self.engine is not None else None

    def set_engine(self, engine: AsyncLLMEngine) -> None:
        tok = engine.tokenizer
        if tok is not None:
            import copy

            try:
                tok = copy.deepcopy(tok)
            except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared (reads only)
                logger.warning("could not copy the tokenizer; sharing the engine's")
        self.tokenizer = tok
        engine.add_observer(self.metrics)
        self.engine = engine

    def require_engine(self) -> AsyncLLMEngine:
        if self.engine is None:
            msg = f"the model is not loaded: {self.load_error}" if self.load_error else "the model is loading"
            raise APIError(503, msg, code="not_ready", headers={"Retry-After": str(self.settings.retry_after_s)})
        if self.engine.is_dead:
            raise APIError(503, f"the engine has stopped: {self.engine.dead_error!r}", code="engine_dead")
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist. Served: "
                           f"{self.settings.served_model_name}.", param="model", code="model_not_found")

    def require_tokenizer(self, what: str, param: str):
        if self.tokenizer is None:
            raise APIError(400, f"model {self.settings.served_model_name!r} has no tokenizer, so {what} is not "
                           "supported: send token ids", param=param, code="no_tokenizer")
        return self.tokenizer


# ------------------------------------------------------------------------------------------- guard
class GuardMiddleware:
    """Pure-ASGI checks before any route: API key (401), JSON content type (400), body size (413)."""

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
        if scope["method"] in ("POST", "PUT", "PATCH"):
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
                    resp = error_response(400, f"invalid Content-Length {declared!r}")
                    return await resp(scope, receive, send)
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
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)

    async def _too_large(self, scope, receive, send, size: int) -> None:
        limit = self.state.settings.max_body_bytes
        resp = error_response(413, f"request body is {size} bytes (or more); the limit is {limit} bytes",
                              code="request_too_large")
        await resp(scope, receive, send)


# ------------------------------------------------------------------------------------------- helpers
def _param_of(message: str, fields: Iterable[str], prompt_param: str) -> str | None:
    """The request field an engine/SamplingParams ValueError is about (its first word), if any."""
    word = message.split(" ", 1)[0].strip(":,'\"")
    if word in fields:
        return word
    if word.startswith("prompt") or "prompt" in message.split(" ", 3)[:3]:
        return prompt_param
    return None


_SAMPLING_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs",
                    "prompt_logprobs", "skip_special_tokens", "include_stop_str_in_output"}


def _context_error(max_model_len: int, prompt_len: int, max_tokens: int, where: str) -> APIError:
    return APIError(
        400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the {where}, {max_tokens} in the completion). "
        f"Please reduce the length of the {where} or completion.",
        param="max_tokens" if prompt_len < max_model_len else ("messages" if where == "messages" else "prompt"),
        code="context_length_exceeded")


def _sampling_params(body: P._SamplingFields, *, max_tokens: int, logprobs: int | None,
                     prompt_logprobs: int | None, vocab_size: int, has_tokenizer: bool) -> SamplingParams:
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    stop = body.stop
    if stop and not has_tokenizer:
        raise APIError(400, "stop strings need a tokenizer; this model has none (use stop_token_ids)",
                       param="stop")
    top_k = -1 if body.top_k is None else body.top_k
    if top_k >= vocab_size:  # the whole vocabulary: the same as no top-k
        top_k = -1
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) must be <= max_tokens ({max_tokens})",
                       param="min_tokens")
    try:
        return SamplingParams(
            n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            seed=body.seed, max_tokens=max(1, max_tokens), min_tokens=body.min_tokens, stop=stop,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param=_param_of(str(exc), _SAMPLING_FIELDS, "prompt")) from None


async def _add_all(engine: AsyncLLMEngine, request_id: str, prompts: list[list[int]],
                   params: list[SamplingParams], priority: int, prompt_param: str) -> list:
    """Queue every prompt as its own engine request; all or nothing."""
    streams = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            streams.append(await engine.add_request({"prompt_token_ids": ids}, p, f"{request_id}-{i}", priority))
    except BaseException as exc:
        for s in streams:
            engine.abort(s.request_id)
        if isinstance(exc, (ValueError, TypeError, OverflowError)):
            raise APIError(400, str(exc), param=_param_of(str(exc), _SAMPLING_FIELDS, prompt_param)) from None
        if isinstance(exc, EngineOverloaded):
            raise APIError(503, str(exc), code="overloaded", headers={"Retry-After": "1"}) from None
        if isinstance(exc, EngineDeadError):
            raise APIError(503, str(exc), code="engine_dead") from None
        raise
    return streams


async def _merge(engine: AsyncLLMEngine, streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several request streams as they arrive; closing it aborts them all."""
    if len(streams) == 1:
        outputs = engine.iterate(streams[0])
        try:
            async for out in outputs:
                yield 0, out
        finally:
            await outputs.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for out in engine.iterate(stream):
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            engine.abort(s.request_id)  # harmless for finished ones


def _engine_failure(exc: BaseException) -> APIError:
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, RequestAborted):
        return APIError(503, str(exc), code="aborted")
    return APIError(500, f"{type(exc).__name__}: {exc}", code="internal_error")


def _check_output(out: RequestOutput) -> None:
    if out.error or any(o.finish_reason == "error" for o in out.outputs):
        raise APIError(500, f"the engine failed this request: {out.error}", code="engine_error")


async def _unless_disconnected(request: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it (its requests are aborted) and return None."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _TokenText:
    """Token id -> text for logprobs, caching decodes; 'token_id:N' when there is no tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int, entry: dict | None = None) -> str:
        if entry is not None and tid in entry and entry[tid].decoded_token is not None:
            return entry[tid].decoded_token
        s = self.cache.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else f"token_id:{tid}"
            self.cache[tid] = s
        return s


def _legacy_logprobs(items: list[tuple[int, dict | None]], k: int, text: _TokenText,
                     offset: int) -> tuple[dict, int]:
    """OpenAI's legacy completions logprobs for (token id, position logprobs) pairs, from `offset`."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in items:
        s = text(tid, entry)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry[tid].logprob)
        top: dict[str, float] = {}
        for t, lp in entry.items():
            if t == tid or (lp.rank is not None and lp.rank <= k):
                key = text(t, entry)
                top[key] = max(top.get(key, float("-inf")), lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def _chat_logprobs(items: list[tuple[int, dict]], k: int, text: _TokenText) -> list[dict]:
    content = []
    for tid, entry in items:
        s = text(tid, entry)
        ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in entry.items()
                         if lp.rank is not None and lp.rank <= k), key=lambda r: r[0])
        top = [{"token": text(t, entry), "logprob": lp, "bytes": list(text(t, entry).encode())}
               for _, t, lp in ranked]
        content.append({"token": s, "logprob": entry[tid].logprob, "bytes": list(s.encode()), "top_logprobs": top})
    return content


# ------------------------------------------------------------------------------------------- the app
def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="mini-infer", version=mini_infer.__version__,
                  description="OpenAI-compatible API of a compiler-style LLM inference engine")
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            msg = f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
            return error_response(400, msg, code="invalid_json")
        locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
        # A value that matches no member of a union gives one error per member (loc ends in the member's
        # type name): report the field itself, and the types it may take.
        common = locs[0] if locs else []
        for loc in locs[1:]:
            n = 0
            while n < min(len(common), len(loc)) and common[n] == loc[n]:
                n += 1
            common = common[:n]
        where = ".".join(common)
        if len(errors) > 1 and all(len(loc) == len(common) + 1 for loc in locs):
            kinds = ", ".join(loc[-1] for loc in locs)
            msg = f"{where or 'body'}: invalid value, expected one of: {kinds}"
        else:
            msg = "; ".join(f"{'.'.join(loc) or 'body'}: {e.get('msg')}" for loc, e in zip(locs[:5], errors))
        return error_response(400, msg or "invalid request", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")

    # ---------------------------------------------------------------- simple routes
    @app.get("/health", response_model=P.HealthResponse, responses={503: {"model": P.ErrorResponse}})
    async def health():
        state.require_engine()
        return {"status": "ok"}

    @app.get("/version", response_model=P.VersionResponse)
    async def version():
        return {"version": mini_infer.__version__}

    @app.get("/v1/models", response_model=P.ModelList)
    async def models():
        eng = state.engine
        card = P.ModelCard(id=state.settings.served_model_name, root=state.settings.model,
                           max_model_len=eng.max_model_len if eng is not None else None)
        return P.ModelList(data=[card])

    @app.get("/metrics", response_class=Response)
    async def metrics():
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/tokenizer_info", response_model=P.TokenizerInfoResponse, responses=_ERROR_DOCS)
    async def tokenizer_info():
        eng = state.require_engine()
        tok = state.require_tokenizer("tokenizer_info", "model")
        tmpl = getattr(tok, "chat_template", None)
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": tmpl if isinstance(tmpl, str) else None,
                "model_max_length": eng.max_model_len}

    def chat_prompt_ids(messages: list[P.ChatMessage], add_generation_prompt: bool,
                        continue_final_message: bool = False) -> list[int]:
        if not messages:
            raise APIError(400, "messages must not be empty", param="messages")
        conversation = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(400, f"messages[{i}].content[{j}]: only text parts "
                                       "({\"type\": \"text\", \"text\": \"...\"}) are supported, got type "
                                       f"{part.get('type')!r}", param=f"messages.{i}.content.{j}")
                    texts.append(part["text"])
                content = "\n".join(texts)
            msg = {"role": m.role, "content": content if content is not None else ""}
            if m.name is not None:
                msg["name"] = m.name
            conversation.append(msg)
        tok = state.require_tokenizer("chat", "messages")
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions",
                           param="messages")
        try:
            ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt and
                                          not continue_final_message,
                                          continue_final_message=continue_final_message, tokenize=True,
                                          return_dict=False)
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise APIError(400, f"the chat template failed on these messages: {exc}", param="messages") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=_ERROR_DOCS)
    async def tokenize(body: P.TokenizeRequest):
        eng = state.require_engine()
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            ids = chat_prompt_ids(body.messages, body.add_generation_prompt)
            if body.add_special_tokens:
                ids = _with_special(state.tokenizer, ids)
        else:
            tok = state.require_tokenizer("tokenize", "prompt")
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = list(tok.encode(body.prompt, add_special_tokens=add))
        return {"tokens": ids, "count": len(ids), "max_model_len": eng.max_model_len}

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=_ERROR_DOCS)
    async def detokenize(body: P.DetokenizeRequest):
        eng = state.require_engine()
        state.check_model(body.model)
        tok = state.require_tokenizer("detokenize", "tokens")
        bad = [t for t in body.tokens if not 0 <= t < eng.vocab_size]
        if bad:
            raise APIError(400, f"tokens must be integers in [0, {eng.vocab_size}); got {bad[:5]}", param="tokens")
        return {"prompt": tok.decode(body.tokens)}

    # ---------------------------------------------------------------- completions
    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=_ERROR_DOCS)
    async def completions(body: P.CompletionRequest, request: Request):
        eng = state.require_engine()
        state.check_model(body.model)
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, f"best_of must equal n ({body.n}) or be omitted; got {body.best_of}",
                           param="best_of")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        texts, prompts = _completion_prompts(body.prompt)
        max_len = eng.max_model_len
        params, limits = [], []
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt must not be empty", param="prompt")
            mt = body.max_tokens if body.max_tokens is not None else max(0, max_len - len(ids))
            if len(ids) + max(1, mt) > max_len:
                raise _context_error(max_len, len(ids), mt, "prompt")
            limits.append(mt)
        for mt in limits:
            k = body.logprobs
            params.append(_sampling_params(
                body, max_tokens=mt, logprobs=k, prompt_logprobs=k if body.echo and k is not None else None,
                vocab_size=eng.vocab_size, has_tokenizer=state.tokenizer is not None))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await _add_all(eng, request_id, prompts, params, body.priority, "prompt")
        gen = _CompletionBuilder(state, body, request_id, texts, prompts, limits)
        return await _respond(request, body, eng, streams, gen)

    async def _respond(request: Request, body, eng, streams, gen) -> Response:
        """A stream of SSE chunks, or the collected body (499 when the client left before the end)."""
        if body.stream:
            return StreamingResponse(gen.stream(_merge(eng, streams)), media_type="text/event-stream")
        result = await _unless_disconnected(request, gen.collect(_merge(eng, streams)))
        if result is None:
            return Response(status_code=499)
        return JSONResponse(result)

    def _completion_prompts(prompt) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        texts, ids = [], []
        for p in prompt:
            if isinstance(p, str):
                tok = state.require_tokenizer("a text prompt", "prompt")
                texts.append(p)
                ids.append(list(tok.encode(p)) if p else [])
            else:
                texts.append(None)
                ids.append(list(p))
        return texts, ids

    # ---------------------------------------------------------------- chat
    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=_ERROR_DOCS)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        eng = state.require_engine()
        state.check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if body.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if body.response_format is not None and body.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        ids = chat_prompt_ids(body.messages, body.add_generation_prompt, body.continue_final_message)
        max_len = eng.max_model_len
        field_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        mt = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if mt is None:
            mt = max_len - len(ids)
        elif mt < 1:
            raise APIError(400, f"{field_name} must be >= 1, got {mt}", param=field_name)
        if len(ids) + max(1, mt) > max_len:
            err = _context_error(max_len, len(ids), mt, "messages")
            if err.param == "max_tokens":
                err.param = field_name
            raise err
        params = _sampling_params(body, max_tokens=mt, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                                  prompt_logprobs=None, vocab_size=eng.vocab_size,
                                  has_tokenizer=state.tokenizer is not None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await _add_all(eng, request_id, [ids], [params], body.priority, "messages")
        gen = _ChatBuilder(state, body, request_id, len(ids))
        return await _respond(request, body, eng, streams, gen)

    return app


def _with_special(tokenizer, ids: list[int]) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids if bos is None or (ids and ids[0] == bos) else [bos, *ids]


# ------------------------------------------------------------------------------------------- responses
class _CompletionBuilder:
    """Turns engine outputs into /v1/completions bodies: one response, or SSE chunks."""

    def __init__(self, state: ServerState, body: P.CompletionRequest, request_id: str,
                 texts: list[str | None], prompts: list[list[int]], limits: list[int]) -> None:
        self.state, self.body, self.id = state, body, request_id
        self.prompts, self.limits = prompts, limits
        self.model = state.settings.served_model_name
        self.created = int(time.time())
        self.text = _TokenText(state.tokenizer)
        tok = state.tokenizer
        self.prompt_texts = [t if t is not None else (tok.decode(ids) if tok is not None else "")
                             for t, ids in zip(texts, prompts)]

    def _prompt_logprobs(self, i: int, out: RequestOutput) -> list[tuple[int, dict | None]]:
        plp = list(out.prompt_logprobs or [])
        ids = self.prompts[i]
        plp += [None] * (len(ids) - len(plp))
        return list(zip(ids, plp))

    def _choice_index(self, i: int, j: int) -> int:
        return i * self.body.n + j

    async def collect(self, merged) -> dict:
        final: dict[int, RequestOutput] = {}
        try:
            async for i, out in merged:
                if out.finished:
                    final[i] = out
        except (EngineDeadError, RequestAborted, RuntimeError) as exc:
            raise _engine_failure(exc) from None
        finally:
            await merged.aclose()
        body, choices, completion_tokens = self.body, [], 0
        for i in range(len(self.prompts)):
            out = final[i]
            _check_output(out)
            keep = self.limits[i] > 0  # max_tokens=0: the engine ran one token; drop it
            for j, c in enumerate(out.outputs):
                text = (self.prompt_texts[i] if body.echo else "") + (c.text if keep else "")
                lp = None
                if body.logprobs is not None:
                    items = self._prompt_logprobs(i, out) if body.echo else []
                    if keep:
                        items += list(zip(c.token_ids, c.logprobs or []))
                    lp, _ = _legacy_logprobs(items, body.logprobs, self.text, 0)
                completion_tokens += len(c.token_ids) if keep else 0
                choices.append({"index": self._choice_index(i, j), "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason if keep else "length",
                                "stop_reason": c.stop_reason if keep else None})
        choices.sort(key=lambda c: c["index"])
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": _usage(sum(len(p) for p in self.prompts), completion_tokens)}

    async def stream(self, merged) -> AsyncIterator[str]:
        body = self.body
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        offsets: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        started: set[int] = set()
        finished: set[int] = set()
        completion_tokens = 0

        def chunk(index, text, logprobs=None, finish_reason=None, stop_reason=None):
            c = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                              "stop_reason": stop_reason}]}
            if include_usage:
                c["usage"] = None
            return _sse(c)

        try:
            async for i, out in merged:
                if out.error or any(c.finish_reason == "error" for c in out.outputs):
                    yield _sse(error_body(500, f"the engine failed this request: {out.error}",
                                          code="engine_error"))
                    break
                keep = self.limits[i] > 0
                for j, c in enumerate(out.outputs):
                    index = self._choice_index(i, j)
                    new_text, new_ids = out.deltas[j] if j < len(out.deltas) else ("", [])
                    text, items = "", []
                    if index not in started:
                        started.add(index)
                        if body.echo:
                            text = self.prompt_texts[i]
                            items = self._prompt_logprobs(i, out)
                    if keep:
                        text += new_text
                        if body.logprobs is not None:
                            all_lp = c.logprobs or []
                            n_old = sent_lp.get(index, 0)
                            new = list(zip(c.token_ids[n_old:], all_lp[n_old:]))
                            sent_lp[index] = n_old + len(new)
                            items += new
                        completion_tokens += len(new_ids)
                    finish = None
                    if c.finish_reason is not None and index not in finished:
                        finished.add(index)
                        finish = c.finish_reason if keep else "length"
                    if not text and not items and finish is None:
                        continue
                    lp = None
                    if body.logprobs is not None:
                        lp, offsets[index] = _legacy_logprobs(items, body.logprobs, self.text,
                                                              offsets.get(index, 0))
                    yield chunk(index, text, lp, finish, c.stop_reason if finish and keep else None)
            else:
                if include_usage:
                    yield _sse({"id": self.id, "object": "text_completion", "created": self.created,
                                "model": self.model, "choices": [],
                                "usage": _usage(sum(len(p) for p in self.prompts), completion_tokens)})
        except (EngineDeadError, RequestAborted) as exc:
            err = _engine_failure(exc)
            yield _sse(error_body(err.status, err.message, code=err.code))
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"


class _ChatBuilder:
    """Turns engine outputs into /v1/chat/completions bodies: one response, or SSE chunks."""

    def __init__(self, state: ServerState, body: P.ChatCompletionRequest, request_id: str, prompt_len: int):
        self.state, self.body, self.id, self.prompt_len = state, body, request_id, prompt_len
        self.model = state.settings.served_model_name
        self.created = int(time.time())
        self.text = _TokenText(state.tokenizer)
        self.k = body.top_logprobs or 0

    async def collect(self, merged) -> dict:
        final = None
        try:
            async for _, out in merged:
                if out.finished:
                    final = out
        except (EngineDeadError, RequestAborted, RuntimeError) as exc:
            raise _engine_failure(exc) from None
        finally:
            await merged.aclose()
        _check_output(final)
        choices = []
        for c in final.outputs:
            lp = None
            if self.body.logprobs:
                lp = {"content": _chat_logprobs(list(zip(c.token_ids, c.logprobs or [])), self.k, self.text)}
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": _usage(self.prompt_len, completion_tokens)}

    async def stream(self, merged) -> AsyncIterator[str]:
        body = self.body
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        sent_lp: dict[int, int] = {}
        finished: set[int] = set()
        completion_tokens = 0

        def chunk(index, delta, logprobs=None, finish_reason=None, stop_reason=None):
            c = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": finish_reason, "stop_reason": stop_reason}]}
            if include_usage:
                c["usage"] = None
            return _sse(c)

        try:
            for j in range(body.n):
                yield chunk(j, {"role": "assistant", "content": ""})
            async for _, out in merged:
                if out.error or any(c.finish_reason == "error" for c in out.outputs):
                    yield _sse(error_body(500, f"the engine failed this request: {out.error}",
                                          code="engine_error"))
                    break
                for j, c in enumerate(out.outputs):
                    new_text, new_ids = out.deltas[j] if j < len(out.deltas) else ("", [])
                    completion_tokens += len(new_ids)
                    lp = None
                    if body.logprobs:
                        n_old = sent_lp.get(j, 0)
                        new = list(zip(c.token_ids[n_old:], (c.logprobs or [])[n_old:]))
                        sent_lp[j] = n_old + len(new)
                        if new:
                            lp = {"content": _chat_logprobs(new, self.k, self.text)}
                    if new_text or lp:
                        yield chunk(j, {"content": new_text}, lp)
                    if c.finish_reason is not None and j not in finished:
                        finished.add(j)
                        yield chunk(j, {}, None, c.finish_reason, c.stop_reason)
            else:
                if include_usage:
                    yield _sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                "model": self.model, "choices": [],
                                "usage": _usage(self.prompt_len, completion_tokens)})
        except (EngineDeadError, RequestAborted) as exc:
            err = _engine_failure(exc)
            yield _sse(error_body(err.status, err.message, code=err.code))
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"
