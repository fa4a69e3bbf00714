"""Engine output streams to HTTP responses, shared by /v1/completions and /v1/chat/completions.

`merge` interleaves the outputs of a request's engine streams (one per prompt); `respond` answers either as
Server-Sent Events (`sse_events`: the route's chunks, the usage chunk, an error event if the engine fails or
the server shuts down, and always `data: [DONE]`) or as one body once every stream has finished (`collect`;
499 if the client left first). Closing a stream, or a client going away, aborts its engine requests. This
module knows nothing of the routes' response shapes: they come as pydantic models from the routes' builders.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from mini_infer.outputs import RequestOutput
from mini_infer.runtime.async_engine import AsyncLLMEngine, EngineDeadError, RequestAborted
from mini_infer.serving.errors import engine_failure, error_body, output_failure

Merged = AsyncIterator[tuple[int, RequestOutput]]


class ResponseBuilder(Protocol):
    """What a route supplies to `respond`: the whole body from the final outputs, or stream chunks."""

    def body(self, final: dict[int, RequestOutput]) -> BaseModel: ...

    def first_chunks(self) -> Iterable[BaseModel]: ...

    def chunks(self, index: int, out: RequestOutput) -> Iterable[BaseModel]: ...

    def usage_chunk(self) -> BaseModel | None: ...

    def sse(self, chunk: BaseModel) -> str: ...


async def merge(engine: AsyncLLMEngine, streams: list) -> Merged:
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


def sse(data: str) -> str:
    return f"data: {data}\n\n"


async def collect(merged: Merged) -> dict[int, RequestOutput]:
    """The final output of every stream; an APIError if the engine failed any of them."""
    final: dict[int, RequestOutput] = {}
    try:
        async for i, out in merged:
            if out.finished:
                final[i] = out
    except (EngineDeadError, RequestAborted, RuntimeError) as exc:
        raise engine_failure(exc) from None
    finally:
        await merged.aclose()
    for out in final.values():
        err = output_failure(out)
        if err is not None:
            raise err
    return final


async def sse_events(merged: Merged, builder: ResponseBuilder) -> AsyncIterator[str]:
    """The SSE lines of one streamed response: the builder's chunks as outputs arrive, its usage chunk at the
    end, an error event instead if the engine fails (or the server ends the request), then `data: [DONE]`."""
    try:
        for chunk in builder.first_chunks():
            yield builder.sse(chunk)
        async for i, out in merged:
            err = output_failure(out)
            if err is not None:
                yield sse(error_body(err.status, err.message, code=err.code).model_dump_json())
                break
            for chunk in builder.chunks(i, out):
                yield builder.sse(chunk)
        else:
            usage = builder.usage_chunk()
            if usage is not None:
                yield builder.sse(usage)
    except (EngineDeadError, RequestAborted) as exc:
        err = engine_failure(exc)
        yield sse(error_body(err.status, err.message, code=err.code).model_dump_json())
    finally:
        await merged.aclose()
    yield "data: [DONE]\n\n"


async def unless_disconnected(request: Request, coro):
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


async def respond(request: Request, stream: bool, engine: AsyncLLMEngine, streams: list,
                  builder: ResponseBuilder) -> Response:
    """SSE chunks when `stream`, else the collected body (499 when the client left before the end)."""
    if stream:
        return StreamingResponse(sse_events(merge(engine, streams), builder), media_type="text/event-stream")
    final = await unless_disconnected(request, collect(merge(engine, streams)))
    if final is None:
        return Response(status_code=499)
    return JSONResponse(builder.body(final).model_dump())


def chunk_json(include_usage: bool) -> Callable[[BaseModel], str]:
    """SSE encoder for a stream's chunks: `usage` is in every chunk (null until the last) only when the client
    asked for it (stream_options.include_usage)."""
    exclude = None if include_usage else {"usage"}
    return lambda chunk: sse(chunk.model_dump_json(exclude=exclude))


__all__ = ["ResponseBuilder", "chunk_json", "collect", "merge", "respond", "sse", "sse_events",
           "unless_disconnected"]
