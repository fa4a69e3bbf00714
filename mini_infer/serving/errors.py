"""Every failure the server answers, as OpenAI's error body `{"error": {"message", "type", "param", "code"}}`.

`APIError` is raised by routes; `install_error_handlers(app)` makes FastAPI render it, its own validation
errors (always 400, never 422), Starlette's HTTP errors and anything unexpected (500, logged) in that shape.
`engine_failure` / `check_output` map what the async engine reports to an APIError. This module knows the
engine's exception types and nothing else of it; it must not know about routes.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mini_infer.outputs import RequestOutput
from mini_infer.runtime.async_engine import EngineDeadError, RequestAborted
from mini_infer.sampling_params import ContextLengthExceeded
from mini_infer.serving import protocol as P

logger = logging.getLogger("mini_infer.serving")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
                500: "internal_server_error", 503: "service_unavailable"}

ERROR_DOCS = {s: {"model": P.ErrorResponse} for s in (400, 401, 404, 413, 503)}


class APIError(Exception):
    """An error with its HTTP status, rendered as OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def _utf8(text: str | None) -> str | None:
    """`text` with anything UTF-8 cannot encode (lone surrogates from a request) replaced, so it can be sent."""
    return text.encode("utf-8", "replace").decode("utf-8") if text is not None else None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> P.ErrorResponse:
    return P.ErrorResponse(error=P.ErrorInfo(message=_utf8(message), type=_ERROR_TYPES.get(status, "error"),
                                             param=_utf8(param), code=code))


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code).model_dump(), status_code=status, headers=headers)


def context_length_error(exc: ContextLengthExceeded, max_tokens_param: str = "max_tokens") -> APIError:
    """OpenAI's context_length_exceeded 400; `param` is the prompt when it alone is too long."""
    param = exc.where if exc.prompt_too_long else max_tokens_param
    return APIError(400, str(exc), param=param, code="context_length_exceeded")


def engine_failure(exc: BaseException) -> APIError:
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, RequestAborted):
        return APIError(503, str(exc), code="aborted")
    return APIError(500, f"{type(exc).__name__}: {exc}", code="internal_error")


def output_failure(out: RequestOutput) -> APIError | None:
    """The error of an engine output that failed (its step raised), if it did."""
    if out.error or any(o.finish_reason == "error" for o in out.outputs):
        return APIError(500, f"the engine failed this request: {out.error}", code="engine_error")
    return None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line for pydantic's errors, and the field they are about."""
    errors = exc.errors()
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
        return f"{where or 'body'}: invalid value, expected one of: {kinds}", where or None
    msg = "; ".join(f"{'.'.join(loc) or 'body'}: {e.get('msg')}" for loc, e in zip(locs[:5], errors))
    return msg or "invalid request", where or None


def install_error_handlers(app: FastAPI) -> None:
    """Render every exception a route can raise as OpenAI's error body."""

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
        msg, param = _validation_message(exc)
        return error_response(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
