"""The OpenAI-compatible HTTP front door (FastAPI): ``/v1/completions``, ``/v1/chat/completions``
(both with SSE streaming), ``/v1/models``, ``/health`` and ``/metrics``.

Accepts vLLM's extension fields (``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``). Every error, malformed JSON included, is answered in OpenAI's
error shape with 400 / 404 / 429 / 500 (``router.errors.map_error``), never FastAPI's 422.
A client that disconnects (streaming or not) aborts its request, which frees its KV.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from engine.request import SamplingParams
from router.backend import (
    GenerateInput,
    GenerationBackend,
    GenerationChunk,
    InvalidRequestError,
    new_request_id,
)
from router.errors import map_error, openai_error_body
from router.metrics import CONTENT_TYPE, Metrics

__all__ = ["create_app"]

log = logging.getLogger(__name__)


class _StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """OpenAI sampling fields plus vLLM's extensions; None means "server default"."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    # vLLM extensions
    top_k: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None

    def to_sampling(self, default_max_tokens: int | None) -> SamplingParams:
        """Raises ValueError naming an unsupported or bad field."""
        if self.n != 1:
            raise InvalidRequestError(f"n must be 1 (got {self.n}): one choice per request")
        if self.logprobs:
            raise InvalidRequestError("logprobs are not supported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name} is not supported (must be 0 or unset)")
        kw: dict[str, Any] = {k: getattr(self, k) for k in (
            "max_tokens", "temperature", "top_p", "seed", "top_k", "min_tokens", "ignore_eos",
            "include_stop_str_in_output") if getattr(self, k) is not None}
        if "max_tokens" not in kw and default_max_tokens is not None:
            kw["max_tokens"] = default_max_tokens
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids is not None:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        return SamplingParams(**kw)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class _ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[_ContentPart] | None = None

    def to_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise InvalidRequestError("only text content parts are supported")
            content = "\n".join(p.text or "" for p in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[_ChatMessage]
    max_completion_tokens: int | None = None


@dataclass
class _Collected:
    """A whole (non-streamed) generation."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _error_response(exc: BaseException, param: str | None = None) -> JSONResponse:
    err = map_error(exc)
    if err.http_status >= 500:
        log.error("request failed: %s", err.message, exc_info=exc)
    return JSONResponse(openai_error_body(err, param), status_code=err.http_status)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


_DISCONNECTED = object()


async def _run_until_disconnect(request: Request, coro) -> Any:
    """Await ``coro``; if the client disconnects first, cancel it (which aborts the request)
    and return ``_DISCONNECTED``. The body was already read, so ``receive`` only reports the
    disconnect."""
    work = asyncio.ensure_future(coro)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    return _DISCONNECTED if work.cancelled() else work.result()


# Nginx's "client closed request": nobody reads it, but logs show why the request ended.
_CLIENT_CLOSED = 499


def create_app(backend: GenerationBackend, metrics: Metrics) -> FastAPI:
    """The FastAPI app over ``backend``; set ``app.state.draining = True`` to fail /health."""
    app = FastAPI(title="pdcluster", docs_url=None, redoc_url=None)
    app.state.draining = False

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', msg)}"
        elif loc:
            msg = f"{loc}: {msg}"
        return _error_response(InvalidRequestError(msg), param=loc)

    def _open(inp: GenerateInput) -> AsyncIterator[GenerationChunk]:
        return metrics.track(backend.generate(inp), api="http")

    async def _collect(inp: GenerateInput) -> _Collected:
        out = _Collected(inp.request_id or "")
        stream = _open(inp)
        try:
            async for c in stream:
                out.text += c.text
                out.token_ids.extend(c.token_ids)
                if c.finished:
                    out.finish_reason = c.finish_reason
                    if c.usage is not None:
                        out.prompt_tokens = c.usage.prompt_tokens
                        out.completion_tokens = c.usage.completion_tokens
        finally:
            await stream.aclose()
        return out

    async def _start_stream(inp: GenerateInput
                            ) -> tuple[GenerationChunk | None, AsyncIterator[GenerationChunk]]:
        """Wait for the first chunk so errors become a status code, not a broken stream."""
        stream = _open(inp)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return None, stream
        except BaseException:
            await stream.aclose()
            raise
        return first, stream

    async def _events(first: GenerationChunk | None, stream: AsyncIterator[GenerationChunk],
                      render, finish) -> AsyncIterator[str]:
        """SSE body: ``render(chunk)`` gives a payload (or None to skip) per chunk, ``finish()``
        the trailing payloads; the stream is closed (aborting the request) however this ends."""
        try:
            try:
                if first is not None:
                    payload = render(first)
                    if payload is not None:
                        yield _sse(payload)
                async for c in stream:
                    payload = render(c)
                    if payload is not None:
                        yield _sse(payload)
                for payload in finish():
                    yield _sse(payload)
            except Exception as e:  # after the 200 went out: report in-band, OpenAI-style
                err = map_error(e)
                log.error("stream failed: %s", err.message, exc_info=e)
                yield _sse(openai_error_body(err))
            yield _sse("[DONE]")
        finally:
            await stream.aclose()

    def _request_id(request: Request) -> str:
        return request.headers.get("x-request-id") or new_request_id()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        rid = _request_id(request)
        try:
            if body.echo:
                raise InvalidRequestError("echo is not supported")
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise InvalidRequestError("prompt: one prompt per request (got a batch of "
                                              f"{len(prompt)})")
                prompt = prompt[0]
            sampling = body.to_sampling(default_max_tokens=None)
            inp = (GenerateInput(sampling, text=prompt, request_id=rid, model=body.model)
                   if isinstance(prompt, str) else
                   GenerateInput(sampling, token_ids=list(prompt), request_id=rid, model=body.model))
        except ValueError as e:
            return _error_response(e)
        model_id = backend.model_info().model_id
        created = int(time.time())
        cid = f"cmpl-{rid}"

        def envelope(choices: list[dict], **extra) -> dict:
            return {"id": cid, "object": "text_completion", "created": created,
                    "model": model_id, "choices": choices, **extra}

        if not body.stream:
            try:
                out = await _run_until_disconnect(request, _collect(inp))
            except Exception as e:
                return _error_response(e)
            if out is _DISCONNECTED:
                return Response(status_code=_CLIENT_CLOSED)
            return JSONResponse(envelope(
                [{"index": 0, "text": out.text, "logprobs": None,
                  "finish_reason": out.finish_reason}],
                usage=_usage(out.prompt_tokens, out.completion_tokens)),
                headers={"x-request-id": rid})
        try:
            first, stream = await _start_stream(inp)
        except Exception as e:
            return _error_response(e)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        usage: list[dict] = []

        def render(c: GenerationChunk) -> dict | None:
            if c.finished and c.usage is not None:
                usage.append(_usage(c.usage.prompt_tokens, c.usage.completion_tokens))
            if not c.text and not c.finished:
                return None
            return envelope([{"index": 0, "text": c.text, "logprobs": None,
                              "finish_reason": c.finish_reason if c.finished else None}])

        def finish() -> list[dict]:
            return [envelope([], usage=usage[0])] if include_usage and usage else []

        return StreamingResponse(_events(first, stream, render, finish),
                                 media_type="text/event-stream", headers={"x-request-id": rid})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        rid = _request_id(request)
        info = backend.model_info()
        try:
            messages = [m.to_dict() for m in body.messages]
            if not messages:
                raise InvalidRequestError("messages: at least one message is required")
            if body.max_tokens is None and body.max_completion_tokens is not None:
                body.max_tokens = body.max_completion_tokens
            default_max = None
            if body.max_tokens is None:
                # OpenAI's default: generate until the context is full (or a stop).
                num_prompt = len(backend.apply_chat_template(messages))
                default_max = max(1, info.max_model_len - num_prompt)
            sampling = body.to_sampling(default_max_tokens=default_max)
            inp = GenerateInput(sampling, messages=messages, request_id=rid, model=body.model)
        except ValueError as e:
            return _error_response(e)
        created = int(time.time())
        cid = f"chatcmpl-{rid}"

        def envelope(obj: str, choices: list[dict], **extra) -> dict:
            return {"id": cid, "object": obj, "created": created, "model": info.model_id,
                    "choices": choices, **extra}

        if not body.stream:
            try:
                out = await _run_until_disconnect(request, _collect(inp))
            except Exception as e:
                return _error_response(e)
            if out is _DISCONNECTED:
                return Response(status_code=_CLIENT_CLOSED)
            return JSONResponse(envelope(
                "chat.completion",
                [{"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": None, "finish_reason": out.finish_reason}],
                usage=_usage(out.prompt_tokens, out.completion_tokens)),
                headers={"x-request-id": rid})
        try:
            first, stream = await _start_stream(inp)
        except Exception as e:
            return _error_response(e)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        usage: list[dict] = []
        sent_role = [False]

        def render(c: GenerationChunk) -> dict | None:
            if c.finished and c.usage is not None:
                usage.append(_usage(c.usage.prompt_tokens, c.usage.completion_tokens))
            if not c.text and not c.finished:
                return None
            delta: dict[str, str] = {}
            if not sent_role[0]:
                delta["role"] = "assistant"
                sent_role[0] = True
            if c.text or not c.finished:
                delta["content"] = c.text
            return envelope("chat.completion.chunk", [{
                "index": 0, "delta": delta, "logprobs": None,
                "finish_reason": c.finish_reason if c.finished else None}])

        def finish() -> list[dict]:
            return ([envelope("chat.completion.chunk", [], usage=usage[0])]
                    if include_usage and usage else [])

        return StreamingResponse(_events(first, stream, render, finish),
                                 media_type="text/event-stream", headers={"x-request-id": rid})

    @app.get("/v1/models")
    async def models():
        info = backend.model_info()
        return {"object": "list", "data": [{
            "id": info.model_id, "object": "model", "created": 0, "owned_by": "pdcluster",
            "max_model_len": info.max_model_len}]}

    @app.get("/health")
    async def health():
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await metrics.render(), media_type=CONTENT_TYPE)

    return app
