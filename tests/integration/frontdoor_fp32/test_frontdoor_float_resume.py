"""The front doors' resumed streams over an fp32 in-process engine and an fp32 disaggregated
cluster, both shared with test_frontdoor_float_products.py (this package's conftest.py): a
request whose client leaves mid-stream runs on, and what a client resumes joins up to exactly
an unbroken run's tokens.
That equality needs the float products: under the default quantization it failed once in a
whole-suite run (a greedy token at 26 of 32 differed, the gRPC resume, embedded), so these run
on fp32 as test_frontdoor_float_products.py's checks do; the rest of the front doors run on the
default quantization (tests/integration/frontdoor/)."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import jsonschema
import pytest

from client import AsyncClient, Client, RetryPolicy
from proto.pdcluster.v1 import generation_pb2 as pb
from proto.pdcluster.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers.schemas import SCIENTIST
from tests.helpers.sse import sse_events_with_ids

PROMPT = "The capital of France is"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
QUESTION = [{"role": "user", "content": "Describe one famous scientist."}]
SCHEMA = SCIENTIST
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "scientist", "schema": SCHEMA, "strict": True}}
# Test clients retry nothing: a retried UNAVAILABLE would hide the refusal under test.
NO_RETRY = RetryPolicy(max_retries=0)


# ---- gRPC ------------------------------------------------------------------------------------
def _greedy_alone(client, n: int) -> list[int]:
    return client.generate(PROMPT, max_tokens=n, temperature=0, ignore_eos=True).token_ids


def test_a_resumable_request_outlives_its_call_and_resumes_exactly(address, client, kv_probe):
    """The call of a resumable request is cancelled after 5 tokens: the request runs on, and
    Resume from token 5 (a new call) returns exactly the remaining tokens; the whole equals
    an unbroken run. KV is freed once it ends."""
    alone = _greedy_alone(client, 32)
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        req = pb.GenerateRequest(text=PROMPT, resumable=True, sampling=pb.SamplingParams(
            max_tokens=32, temperature=0, ignore_eos=True))
        call = stub.Generate(req, timeout=60)
        got, rid = [], None
        for resp in call:
            rid = resp.request_id
            got += list(resp.chunk.token_ids)
            if len(got) >= 5:
                break
        call.cancel()  # the client goes away mid-stream
    resumed = client.resume(rid, from_index=len(got))
    rest = [t for chunk in resumed for t in chunk.token_ids]
    assert got + rest == alone
    assert resumed.result.finish_reason == "length"
    # after its end, from the start: the whole stream again
    assert [t for c in client.resume(rid) for t in c.token_ids] == alone
    kv_probe.wait_until_free()


def test_sdk_resumes_by_itself_when_the_connection_is_cut(address, client, kv_probe):
    """Through a proxy that resets every connection mid-stream (twice): the SDK's
    ``stream(..., resume=True)`` reconnects, resumes from the last token received, and the
    caller sees one stream equal to an unbroken run."""
    from tests.helpers.tcp_proxy import CuttableProxy

    alone = _greedy_alone(client, 40)
    proxy = CuttableProxy(int(address.rsplit(":", 1)[1]))
    try:
        with Client(f"127.0.0.1:{proxy.port}", timeout=120, retry=NO_RETRY) as c, c.stream(
                PROMPT, max_tokens=40, temperature=0, ignore_eos=True, resume=True) as s:
            tokens, cut_at = [], [6, 20]
            for chunk in s:
                tokens += chunk.token_ids
                # A chunk may carry several tokens (a busy host): cut once each mark is passed.
                if cut_at and len(tokens) >= cut_at[0]:
                    cut_at.pop(0)
                    proxy.cut()
            assert tokens == alone and s.result.token_ids == alone
            assert s.result.finish_reason == "length"
            assert s._resumes >= 2  # it really was cut and resumed
    finally:
        proxy.close()
    kv_probe.wait_until_free()


def test_async_sdk_resumes_by_itself_too(address, client, kv_probe):
    """The asyncio client's ``stream(..., resume=True)`` through a proxy cut mid-stream, and
    its ``resume`` by hand after the end: both equal the unbroken run."""
    from tests.helpers.tcp_proxy import CuttableProxy

    alone = _greedy_alone(client, 24)
    proxy = CuttableProxy(int(address.rsplit(":", 1)[1]))

    async def go():
        async with AsyncClient(f"127.0.0.1:{proxy.port}", timeout=120, retry=NO_RETRY) as c:
            s = c.stream(PROMPT, max_tokens=24, temperature=0, ignore_eos=True, resume=True)
            tokens, cut = [], False
            async for chunk in s:
                tokens += chunk.token_ids
                if not cut and len(tokens) >= 8:  # a chunk may carry several tokens
                    cut = True
                    proxy.cut()
            by_hand = [t async for ch in c.resume(s.request_id, from_index=8)
                       for t in ch.token_ids]
            return tokens, s._resumes, by_hand

    try:
        tokens, resumes, by_hand = asyncio.run(go())
    finally:
        proxy.close()
    assert tokens == alone and resumes >= 1
    assert by_hand == alone[8:]
    kv_probe.wait_until_free()


# ---- HTTP (SSE) ------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_resumable_sse_stream_resumes_from_its_last_event_id(base_url, http, kv_probe,
                                                               endpoint):
    """SSE events carry ``id: <request_id>:<tokens so far>``. A resumable request whose
    client disconnects runs on; GET /v1/streams/{id} with Last-Event-ID returns the rest, in
    the original endpoint's format, and the text joins up to an unbroken run's."""
    chat = endpoint.endswith("chat/completions")
    body = ({"messages": PARIS} if chat else {"prompt": PROMPT}) | {
        "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}

    def text_of(data: str) -> str:
        choice = json.loads(data)["choices"][0]
        return choice["delta"].get("content") or "" if chat else choice["text"]

    with httpx.Client(base_url=base_url, timeout=60) as c, c.stream("POST", endpoint,
                                                                     json=body) as r:
        alone = "".join(text_of(d) for _, d in sse_events_with_ids(r.iter_lines())
                        if d != "[DONE]")
    got, last_id = "", None
    with httpx.Client(base_url=base_url, timeout=60) as c, c.stream(
            "POST", endpoint, json=body | {"resumable": True}) as r:
        rid = r.headers["x-request-id"]
        for event_id, data in sse_events_with_ids(r.iter_lines()):
            assert event_id.startswith(f"{rid}:")
            got += text_of(data)
            last_id = event_id
            if int(event_id.rsplit(":", 1)[1]) >= 5:
                break  # the client drops the connection here
    with httpx.Client(base_url=base_url, timeout=60) as c, c.stream(
            "GET", f"/v1/streams/{rid}", headers={"Last-Event-ID": last_id}) as r:
        assert r.status_code == 200
        events = sse_events_with_ids(r.iter_lines())
    assert events[-1] == (None, "[DONE]")
    objects = {json.loads(d)["object"] for _, d in events[:-1]}
    assert objects == {"chat.completion.chunk" if chat else "text_completion"}
    rest = "".join(text_of(d) for _, d in events[:-1])
    assert got + rest == alone
    assert events[-2][0] == f"{rid}:24"  # the last event says how many tokens in all
    kv_probe.wait_until_free()


def test_a_resumed_constrained_stream_is_one_valid_document(base_url, kv_probe):
    """A resumable, schema-constrained chat stream whose client drops mid-document runs on;
    resumed from its Last-Event-ID, the joined text equals an unbroken run's and validates."""
    body = {"messages": QUESTION, "max_tokens": 150, "temperature": 0, "stream": True,
            "response_format": JSON_SCHEMA_FORMAT}

    def text_of(data: str) -> str:
        return json.loads(data)["choices"][0]["delta"].get("content") or ""

    with httpx.Client(base_url=base_url, timeout=60) as c, c.stream(
            "POST", "/v1/chat/completions", json=body) as r:
        alone = "".join(text_of(d) for _, d in sse_events_with_ids(r.iter_lines()) if d != "[DONE]")
    got, last_id = "", None
    with httpx.Client(base_url=base_url, timeout=60) as c, c.stream(
            "POST", "/v1/chat/completions", json=body | {"resumable": True}) as r:
        rid = r.headers["x-request-id"]
        for event_id, data in sse_events_with_ids(r.iter_lines()):
            got += text_of(data)
            last_id = event_id
            if int(event_id.rsplit(":", 1)[1]) >= 5:
                break  # the client drops the connection mid-document
    with httpx.Client(base_url=base_url, timeout=60) as c, c.stream(
            "GET", f"/v1/streams/{rid}", headers={"Last-Event-ID": last_id}) as r:
        assert r.status_code == 200
        rest = "".join(text_of(d) for _, d in sse_events_with_ids(r.iter_lines()) if d != "[DONE]")
    assert got + rest == alone
    jsonschema.validate(json.loads(alone), SCHEMA)
    kv_probe.wait_until_free()
