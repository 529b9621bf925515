"""A streamed ``/v1/responses`` whose generation fails (or whose deadline passes) after the 200
went out: the client hears OpenAI's ``error`` event and ``response.failed`` (not a cut
connection), the generation's stream is closed, and nothing is stored to continue from."""

from __future__ import annotations

import asyncio
import json

from router.contract import GenerationChunk, WorkerUnavailableError
from router.frontdoor.openai.response_store import LocalResponseStore
from router.frontdoor.openai.responses import ResponsesRequest, _Response


def _parse(sse: list[str]) -> list[dict]:
    out = []
    for block in sse:
        kind, data = block.strip().split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        doc = json.loads(data[len("data: "):])
        assert doc["type"] == kind[len("event: "):]
        out.append(doc)
    return out


def test_a_failure_mid_stream_ends_with_error_and_response_failed():
    closed: list[bool] = []

    async def generation():
        try:
            yield GenerationChunk("r1", [42], "Hel")
            raise WorkerUnavailableError("decode-0 died and no decode worker can continue it")
        finally:
            closed.append(True)

    body = ResponsesRequest(input="Say hello.", stream=True)
    resp = _Response(body, "resp_1", "m", None, None, [])
    store = LocalResponseStore()

    async def collect() -> list[str]:
        return [e async for e in resp.events(generation(), store, "tenant:")]

    events = _parse(asyncio.run(collect()))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "error",
        "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    error, failed = events[-2], events[-1]["response"]
    assert error["code"] == "no_worker" and "decode-0 died" in error["message"]
    assert failed["id"] == "resp_1" and failed["status"] == "failed"
    # OpenAI's closed list of a failed response's codes: a 503's is server_error
    assert failed["error"] == {"code": "server_error", "message": error["message"]}
    assert closed == [True]
    assert store.response_get("tenant:resp_1") is None  # store defaults on: a failure is not kept


def test_the_failure_events_are_what_the_openai_client_parses():
    """The two events validate as the ``openai`` package's own event types (the client yields
    them rather than failing on a malformed event)."""
    import pydantic
    from openai.types.responses import ResponseErrorEvent, ResponseFailedEvent

    async def generation():
        raise WorkerUnavailableError("no decode worker")
        yield  # an async generator

    resp = _Response(ResponsesRequest(input="hi", stream=True), "resp_2", "m", None, None, [])

    async def collect() -> list[str]:
        return [e async for e in resp.events(generation(), LocalResponseStore(), "")]

    events = _parse(asyncio.run(collect()))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    error = pydantic.TypeAdapter(ResponseErrorEvent).validate_python(events[-2])
    failed = pydantic.TypeAdapter(ResponseFailedEvent).validate_python(events[-1])
    assert error.code == "no_worker" and failed.response.status == "failed"
    assert failed.response.error.message == "no decode worker"


def test_a_deadline_passing_mid_stream_ends_it_and_closes_the_generation():
    """``x-request-timeout`` passing after the first delta (a generation that would never
    end on its own): the generation is closed (the request aborted) and the client hears
    ``deadline_exceeded``, then ``response.failed``."""
    from router.frontdoor.openai.responder import _Deadlined

    closed: list[bool] = []

    async def generation():
        try:
            yield GenerationChunk("r3", [42], "Hel")
            await asyncio.Event().wait()  # nothing more, ever
        finally:
            closed.append(True)

    resp = _Response(ResponsesRequest(input="Say hello.", stream=True), "resp_3", "m", None,
                     None, [])

    async def collect() -> list[str]:
        loop = asyncio.get_running_loop()
        stream = _Deadlined(generation(), loop.time() + 0.05, 0.05)
        return [e async for e in resp.events(stream, LocalResponseStore(), "")]

    events = _parse(asyncio.run(collect()))
    assert [e["type"] for e in events][-3:] == [
        "response.output_text.delta", "error", "response.failed"]
    assert events[-2]["code"] == "deadline_exceeded" and "0.05 s" in events[-2]["message"]
    assert events[-1]["response"]["error"]["code"] == "server_error"
    assert closed == [True]
