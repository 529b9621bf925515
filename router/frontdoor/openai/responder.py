"""How a request's ``GenerateInput``s (one per choice) become the HTTP response of an OpenAI
endpoint, streamed or not.

``OpenAIResponder`` owns the backend stream's lifecycle: it opens it through ``Metrics.track``
(so both endpoints feed the same metrics) and closes it however the response ends, which aborts
the request in the backend and frees its KV, and ends it once the caller's deadline passes
(``x-request-timeout``: ``DeadlineExceededError``, the same abort). Errors raised before
anything was sent become a status code (``router.frontdoor.errors.map_error``); errors after a
stream's 200 went out are reported in-band, as OpenAI does. What the JSON looks like is the ``Renderer``'s business
(``router.frontdoor.openai.render``), so both endpoints share one non-streamed and one streamed path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router.contract import (
    DeadlineExceededError,
    GenerateInput,
    GenerationBackend,
    GenerationChunk,
    Usage,
)
from router.frontdoor.choices import ChoiceStreams
from router.frontdoor.errors import map_error, openai_error_body
from router.frontdoor.metrics import Metrics
from router.frontdoor.openai.render import Collected, Renderer, usage_json

__all__ = ["OpenAIResponder", "deadline_at", "error_response", "stream_position"]

log = logging.getLogger(__name__)

# Nginx's "client closed request": nobody reads it, but logs show why the request ended.
_CLIENT_CLOSED = 499

_DISCONNECTED = object()


def error_response(exc: BaseException, param: str | None = None) -> JSONResponse:
    """``exc`` as OpenAI's error JSON with its mapped status; server faults are logged."""
    err = map_error(exc)
    if err.http_status >= 500 and not isinstance(exc, DeadlineExceededError):
        log.error("request failed: %s", err.message, exc_info=exc)
    headers = ({"retry-after": str(max(1, math.ceil(err.retry_after_s)))}
               if err.retry_after_s is not None else None)
    return JSONResponse(openai_error_body(err, param), status_code=err.http_status,
                        headers=headers)


class _PrimedStream:
    """A backend stream whose first chunk was already awaited (``first`` is None when the
    stream ended without any): iterating yields that chunk first, then the rest."""

    def __init__(self, first: GenerationChunk | None,
                 rest: AsyncIterator[GenerationChunk]) -> None:
        self._first = first
        self._rest = rest

    def __aiter__(self) -> _PrimedStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._rest)

    async def aclose(self) -> None:
        await self._rest.aclose()


class _Deadlined:
    """A backend stream that ends with ``DeadlineExceededError`` once the loop's clock
    reaches ``at``: the stream is closed first (its pending read cancelled), which aborts the
    request on every worker and frees its KV. ``seconds``: the caller's deadline, for the
    message."""

    def __init__(self, stream: AsyncIterator[GenerationChunk], at: float,
                 seconds: float) -> None:
        self._stream, self._at, self._seconds = stream, at, seconds

    def __aiter__(self) -> _Deadlined:
        return self

    async def __anext__(self) -> GenerationChunk:
        # asyncio.timeout_at, not wait_for: no Task and timer per streamed chunk, and an
        # outer cancellation (the client gone) is never mistaken for the deadline
        deadline = asyncio.timeout_at(self._at)
        try:
            async with deadline:
                return await anext(self._stream)
        except TimeoutError:
            if not deadline.expired():
                raise  # the backend's own (a worker that did not answer)
            await self._stream.aclose()
            raise DeadlineExceededError(
                f"x-request-timeout: the request's {self._seconds:g} s passed before it "
                "finished; it was aborted") from None

    async def aclose(self) -> None:
        await self._stream.aclose()


class OpenAIResponder:
    """Runs generations for the OpenAI endpoints over one backend, recording metrics."""

    def __init__(self, backend: GenerationBackend, metrics: Metrics) -> None:
        self.backend = backend
        self.metrics = metrics

    async def respond(self, request: Request, inputs: list[GenerateInput], renderer: Renderer,
                      *, n: int = 1, stream: bool, include_usage: bool,
                      continuous_usage: bool = False, keep: int | None = None,
                      deadline: tuple[float, float] | None = None) -> Response:
        """The whole response for a request's choices (``inputs``, ``n`` per prompt, in
        OpenAI's order): JSON, or SSE when ``stream`` (ending with a usage chunk when
        ``include_usage``; every chunk with the usage so far when ``continuous_usage``). Both
        carry ``x-request-id`` (choice 0's id). One choice streams with resumable event ids;
        several stream merged, without ids. ``keep`` (``best_of``, whole responses only):
        of each prompt's ``n`` generations (run with logprobs), the ``keep`` with the highest
        mean token logprob are the choices; usage counts every generation. ``deadline``
        (``deadline_at``'s): when the caller stops waiting; then every choice is aborted and
        the answer is a 504, or in a stream an error event (code ``deadline_exceeded``)."""
        if len(inputs) > 1:
            choices = ChoiceStreams(lambda inp: self._open(inp, deadline), inputs, n)
            if stream:
                return await self._respond_choices_stream(inputs, choices, renderer,
                                                          include_usage, continuous_usage)
            return await self._respond_choices_whole(request, inputs[0], choices, renderer,
                                                     n, keep)
        inp = inputs[0]
        if stream:
            return await self._respond_stream(inp, renderer, include_usage, continuous_usage,
                                              deadline)
        return await self._respond_whole(request, inp, renderer, deadline)

    async def _respond_whole(self, request: Request, inp: GenerateInput,
                             renderer: Renderer, deadline=None) -> Response:
        try:
            out = await _run_until_disconnect(request, self._collect(inp, deadline))
        except Exception as e:
            return error_response(e)
        if out is _DISCONNECTED:
            return Response(status_code=_CLIENT_CLOSED)
        return JSONResponse(renderer.whole([out], Usage(out.prompt_tokens, out.completion_tokens)),
                            headers=_request_id_header(inp))

    async def _respond_choices_whole(self, request: Request, first: GenerateInput,
                                     choices: ChoiceStreams, renderer: Renderer, n: int,
                                     keep: int | None) -> Response:
        try:
            outs = await _run_until_disconnect(request, _collect_choices(first, choices))
        except Exception as e:
            return error_response(e)
        if outs is _DISCONNECTED:
            return Response(status_code=_CLIENT_CLOSED)
        if keep is not None and keep < n:
            outs = best_of(outs, n, keep)
        return JSONResponse(renderer.whole(outs, choices.usage()),
                            headers=_request_id_header(first))

    async def _respond_choices_stream(self, inputs: list[GenerateInput], choices: ChoiceStreams,
                                      renderer: Renderer, include_usage: bool,
                                      continuous_usage: bool) -> Response:
        choices.start()
        try:
            await choices.prime()
        except BaseException as e:
            await choices.aclose()
            if isinstance(e, Exception):
                return error_response(e)
            raise
        # Choices that start later than this response (a prompt's followers) hold their
        # permits from now until the stream ends, not from their own start.
        permits = [inp.permit.adopt() for inp in inputs if inp.permit is not None]
        return StreamingResponse(_sse_choice_events(choices, renderer, include_usage,
                                                    continuous_usage, permits),
                                 media_type="text/event-stream",
                                 headers=_request_id_header(inputs[0]))

    async def _respond_stream(self, inp: GenerateInput, renderer: Renderer,
                              include_usage: bool, continuous_usage: bool,
                              deadline=None) -> Response:
        try:
            stream = await self._start_stream(inp, deadline)
        except Exception as e:
            return error_response(e)
        return StreamingResponse(_sse_events(stream, renderer, include_usage, _public_id(inp),
                                             continuous_usage=continuous_usage),
                                 media_type="text/event-stream",
                                 headers=_request_id_header(inp))

    async def respond_resumed(self, backend_id: str, request_id: str, from_index: int,
                              renderer: Renderer) -> Response:
        """SSE of a request's stream from token ``from_index`` on, in the format of its
        original endpoint (404 when unknown or expired). ``backend_id``: the id the backend
        knows it by (the tenant's scope + ``request_id``). Not metered: counted once."""
        stream = self.backend.resume(backend_id, from_index)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            first = None
        except Exception as e:
            await stream.aclose()
            return error_response(e)
        return StreamingResponse(_sse_events(_PrimedStream(first, stream), renderer, False,
                                             request_id, from_index),
                                 media_type="text/event-stream",
                                 headers={"x-request-id": request_id})

    def _open(self, inp: GenerateInput, deadline: tuple[float, float] | None = None
              ) -> AsyncIterator[GenerationChunk]:
        stream = self.metrics.track(self.backend.generate(inp), api="http", user=inp.user)
        return stream if deadline is None else _Deadlined(stream, *deadline)

    async def collect(self, inp: GenerateInput,
                      deadline: tuple[float, float] | None = None) -> Collected:
        """Run ``inp`` to its end (metered); raises what the backend raises, and
        DeadlineExceededError once ``deadline`` (``deadline_at``'s) passed (aborted)."""
        return await self._collect(inp, deadline)

    async def start_stream(self, inp: GenerateInput, deadline: tuple[float, float] | None = None
                           ) -> AsyncIterator[GenerationChunk]:
        """``inp``'s chunks (metered) once its first came: an error before it raises here
        (a status code), not inside a stream. Close it to abort the request. ``deadline``:
        as ``collect``'s (a stream then ends raising DeadlineExceededError)."""
        return await self._start_stream(inp, deadline)

    async def _collect(self, inp: GenerateInput, deadline=None) -> Collected:
        out = Collected(_public_id(inp))
        stream = self._open(inp, deadline)
        try:
            async for c in stream:
                out.add(c)
        finally:
            await stream.aclose()
        return out

    async def _start_stream(self, inp: GenerateInput, deadline=None) -> _PrimedStream:
        """Wait for the first chunk so errors become a status code, not a broken stream."""
        stream = self._open(inp, deadline)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return _PrimedStream(None, stream)
        except BaseException:
            await stream.aclose()
            raise
        return _PrimedStream(first, stream)


def deadline_at(seconds: float | None) -> tuple[float, float] | None:
    """The caller's deadline of ``seconds`` from now as (the loop's clock then, seconds), for
    ``respond`` / ``collect`` / ``start_stream``; None: none."""
    if seconds is None:
        return None
    return asyncio.get_running_loop().time() + seconds, seconds


def _public_id(inp: GenerateInput) -> str:
    """The id the client knows the request by (without its tenant's scope)."""
    return inp.public_id or inp.request_id or ""


def _request_id_header(inp: GenerateInput) -> dict[str, str]:
    return {"x-request-id": _public_id(inp)}


def _sse(payload: dict | str, event_id: str | None = None) -> str:
    data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
    return f"id: {event_id}\n{data}" if event_id else data


def stream_position(last_event_id: str | None, request_id: str) -> int:
    """The token index a client resumes from, out of the SSE ``Last-Event-ID`` it last saw
    (``<request_id>:<tokens so far>``); 0 without one. Raises ValueError for another
    request's id or a malformed one."""
    if not last_event_id:
        return 0
    rid, _, index = last_event_id.rpartition(":")
    if rid != request_id or not index.isdigit():
        raise ValueError(f"Last-Event-ID {last_event_id!r} is not an event of {request_id!r} "
                         f"(expected {request_id}:<tokens received>)")
    return int(index)


async def _sse_events(stream: _PrimedStream, renderer: Renderer, include_usage: bool,
                      request_id: str, index: int = 0, continuous_usage: bool = False
                      ) -> AsyncIterator[str]:
    """SSE body: one event per chunk the renderer shows, each with the id
    ``<request_id>:<tokens so far>`` (what a client resumes from) and, when
    ``continuous_usage``, the usage so far; the usage chunk if asked, then ``[DONE]``; the
    stream is closed (aborting the request unless it is resumable) however this ends."""

    async def events() -> AsyncIterator[str]:
        nonlocal index
        usage = None  # the finished chunk's; its usage chunk trails the last choice
        async for c in stream:
            if usage is None and c.finished:
                usage = c.usage
            index += len(c.token_ids)
            payload = renderer.chunk(c)
            if payload is not None:
                if continuous_usage:
                    payload["usage"] = usage_json(c.prompt_tokens, index)
                yield _sse(payload, f"{request_id}:{index}")
        if include_usage and usage is not None:
            yield _sse(renderer.usage_chunk(usage))

    try:
        async for event in _ending_with_done(events()):
            yield event
    finally:
        await stream.aclose()


async def _ending_with_done(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """``events``, then ``[DONE]``; an error raised once the 200 went out is reported
    in-band, OpenAI-style, before it."""
    try:
        async for event in events:
            yield event
    except Exception as e:
        err = map_error(e)
        if isinstance(e, DeadlineExceededError):  # the caller's choice, not a fault
            log.info("stream ended: %s", err.message)
        else:
            log.error("stream failed: %s", err.message, exc_info=e)
        yield _sse(openai_error_body(err))
    finally:
        await events.aclose()
    yield _sse("[DONE]")


async def _collect_choices(first: GenerateInput, choices: ChoiceStreams) -> list[Collected]:
    outs: dict[int, Collected] = {}
    choices.start()
    try:
        async for item in choices.events():
            outs.setdefault(item.index, Collected(_public_id(first), item.index)).add(item.chunk)
    finally:
        await choices.aclose()
    return list(outs.values())


async def _sse_choice_events(choices: ChoiceStreams, renderer: Renderer, include_usage: bool,
                             continuous_usage: bool, permits: list) -> AsyncIterator[str]:
    """SSE body of several choices: their chunks as they come, each naming its choice's
    index, then the usage chunk if asked (every prompt once, every choice's completion), then
    ``[DONE]``. No event ids: a merged stream is not resumable."""

    async def events() -> AsyncIterator[str]:
        counts: dict[int, int] = {}
        async for item in choices.events():
            c = item.chunk
            counts[item.index] = counts.get(item.index, 0) + len(c.token_ids)
            payload = renderer.chunk(c, item.index)
            if payload is not None:
                if continuous_usage:
                    payload["usage"] = usage_json(c.prompt_tokens, counts[item.index])
                yield _sse(payload)
        if include_usage:
            yield _sse(renderer.usage_chunk(choices.usage()))

    try:
        async for event in _ending_with_done(events()):
            yield event
    finally:
        await choices.aclose()
        for p in permits:  # idempotent: a choice that ended released its own already
            p.release()


def best_of(outs: list[Collected], per_prompt: int, keep: int) -> list[Collected]:
    """Of each prompt's ``per_prompt`` generations (choice index // per_prompt = the prompt),
    the ``keep`` with the highest mean token logprob (OpenAI's "log probability per token"),
    best first, re-indexed as choices ``prompt * keep + rank``."""
    def score(o: Collected) -> float:
        lps = o.logprobs or []
        return sum(lp.logprob for lp in lps) / len(lps) if lps else float("-inf")

    groups: dict[int, list[Collected]] = {}
    for o in outs:
        groups.setdefault(o.index // per_prompt, []).append(o)
    kept = []
    for p, group in sorted(groups.items()):
        for rank, o in enumerate(sorted(group, key=score, reverse=True)[:keep]):
            kept.append(dataclasses.replace(o, index=p * keep + rank))
    return kept


async def _run_until_disconnect(request: Request, coro: Coroutine[Any, Any, Collected]) -> Any:
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
