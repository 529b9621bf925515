"""The gRPC front door end to end: real server on 127.0.0.1, the SDK (sync and async), raw
stubs for health / reflection / malformed requests, KV freed on cancel (graceful drain:
test_grpc_drain.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RetryPolicy,
    Unavailable,
)
from proto.pdcluster.v1 import generation_pb2 as pb
from proto.pdcluster.v1 import generation_pb2_grpc as pb_grpc
from router.frontdoor.lifecycle import serve_frontdoor

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
# The SDK's default retries UNAVAILABLE three times: a test client that did would hide the
# very refusal it should report. The tests of retrying say so, and count the retries.
NO_RETRY = RetryPolicy(max_retries=0)


def test_model_info_describes_the_served_model(client, backend):
    info = client.model_info()
    expected = backend.model_info()
    assert info.model_id == expected.model_id
    assert info.max_model_len == expected.max_model_len
    assert info.vocab_size == expected.vocab_size
    assert info.eos_token_ids == tuple(expected.eos_token_ids)


def test_chat_answers_the_question(client):
    res = client.chat(PARIS, max_tokens=12, temperature=0)
    assert "Paris" in res.text
    assert res.finish_reason in ("stop", "length")
    assert res.usage.completion_tokens == len(res.token_ids) > 0
    assert res.usage.prompt_tokens > 0
    assert res.ttft_s is not None and res.ttft_s > 0


def test_stream_matches_generate_for_greedy(client, kv_probe):
    whole = client.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert whole.finish_reason == "length" and len(whole.token_ids) == 8
    with client.stream(PROMPT, max_tokens=8, temperature=0, ignore_eos=True) as s:
        chunks = list(s)
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    assert s.result.usage == whole.usage
    kv_probe.wait_until_free()


def test_token_id_prompt_generates_exactly_max_tokens(client):
    res = client.generate(prompt_token_ids=[1, 504, 3458, 282, 4649, 314], max_tokens=5,
                          temperature=0, ignore_eos=True)
    assert len(res.token_ids) == 5
    assert res.usage.prompt_tokens == 6


def test_async_client_generate_stream_and_chat(address):
    async def main():
        async with AsyncClient(address, timeout=60, retry=NO_RETRY) as c:
            info = await c.model_info()
            whole = await c.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
            chunks = [ch async for ch in c.stream(PROMPT, max_tokens=6, temperature=0,
                                                  ignore_eos=True)]
            answer = await c.chat(PARIS, max_tokens=12, temperature=0)
            return info, whole, chunks, answer

    info, whole, chunks, answer = asyncio.run(main())
    assert info.model_id
    assert len(whole.token_ids) == 6
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert chunks[-1].finish_reason == "length"
    assert "Paris" in answer.text


def test_closing_a_sync_stream_aborts_and_frees_kv(client, kv_probe):
    with client.stream(PROMPT, max_tokens=400, ignore_eos=True) as s:
        first = next(s)
        assert first.token_ids
        assert kv_probe.blocks_used() > 0
    kv_probe.wait_until_free()


def test_cancelling_an_async_stream_aborts_and_frees_kv(address, kv_probe):
    async def main():
        seen = asyncio.Event()
        async with AsyncClient(address, retry=NO_RETRY) as c:
            async def consume():
                async for chunk in c.stream(PROMPT, max_tokens=400, ignore_eos=True):
                    if chunk.token_ids:
                        seen.set()
            task = asyncio.create_task(consume())
            await asyncio.wait_for(seen.wait(), 60)
            used = await asyncio.to_thread(kv_probe.blocks_used)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return used

    assert asyncio.run(main()) > 0
    kv_probe.wait_until_free()


def test_abort_rpc_ends_the_stream_with_abort(client, kv_probe):
    with client.stream(PROMPT, max_tokens=400, ignore_eos=True) as s:
        rid = s.wait_request_id()
        assert rid
        next(s)
        assert client.abort(rid) is True
        rest = list(s)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert s.result.usage.completion_tokens < 400
    assert client.abort(rid) is False
    kv_probe.wait_until_free()


def test_caller_chosen_request_id_is_used(client):
    res = client.generate(PROMPT, max_tokens=2, request_id="my-id-1")
    assert res.request_id == "my-id-1"


@pytest.mark.parametrize("kwargs", [
    {"prompt": ""},
    {"prompt": PROMPT, "top_p": 2.0},
    {"prompt": PROMPT, "temperature": -1.0},
    {"prompt": PROMPT, "max_tokens": 0},
    {"prompt": PROMPT, "max_tokens": 10_000_000},  # beyond the context
    {"prompt": PROMPT, "min_tokens": 5, "max_tokens": 2},
    {"prompt_token_ids": []},
    {"prompt_token_ids": [10_000_000]},  # outside the vocabulary
    {"messages": []},
], ids=["empty-prompt", "top_p-2", "temperature-neg", "max_tokens-0", "max_tokens-huge",
        "min_gt_max", "empty-token-ids", "token-outside-vocab", "no-messages"])
def test_bad_input_is_invalid_argument_and_server_keeps_serving(client, kwargs):
    with pytest.raises(InvalidArgument) as exc:
        client.generate(**kwargs)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details
    assert len(client.generate(PROMPT, max_tokens=2, ignore_eos=True).token_ids) == 2


def test_request_without_prompt_is_invalid_argument(address):
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(pb.GenerateRequest(), timeout=30))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in exc.value.details()


def test_unknown_model_is_not_found(client):
    with pytest.raises(NotFound) as exc:
        client.generate(PROMPT, model="no-such-model", max_tokens=2)
    assert exc.value.code == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in exc.value.details
    assert client.generate(PROMPT, model=client.model_info().model_id, max_tokens=2).token_ids


def test_flooding_the_queue_is_resource_exhausted(address, kv_probe):
    async def main():
        async with AsyncClient(address, timeout=120, retry=NO_RETRY) as c:
            return await asyncio.gather(
                *(c.generate(PROMPT, max_tokens=24, ignore_eos=True) for _ in range(16)),
                return_exceptions=True)

    results = asyncio.run(main())
    refused = [r for r in results if isinstance(r, ResourceExhausted)]
    served = [r for r in results if not isinstance(r, BaseException)]
    assert refused, results
    assert all(r.code == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    assert len(refused) + len(served) == len(results), results
    assert all(len(r.token_ids) == 24 for r in served)
    kv_probe.wait_until_free()
    with Client(address, retry=NO_RETRY) as c:
        assert len(c.generate(PROMPT, max_tokens=2, ignore_eos=True).token_ids) == 2


def test_deadline_exceeded_aborts_the_request(client, kv_probe):
    with pytest.raises(DeadlineExceeded):
        client.generate(PROMPT, max_tokens=400, ignore_eos=True, timeout=0.5)
    kv_probe.wait_until_free()


def test_health_is_serving_and_reflection_lists_the_service(address):
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "pdcluster.v1.Generation"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = list(refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    names = {s.name for s in responses[0].list_services_response.service}
    assert {"pdcluster.v1.Generation", "grpc.health.v1.Health"} <= names


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class CountedRetry(RetryPolicy):
    """A RetryPolicy that records each retry it grants (the status code it retried), and
    sets ``retried`` at the first: a test that relies on retries asserts that they ran."""

    granted: list = field(default_factory=list)
    retried: threading.Event = field(default_factory=threading.Event)

    def should_retry(self, code: grpc.StatusCode, attempt: int, got_tokens: bool,
                     retry_after_s: float | None = None) -> bool:
        ok = super().should_retry(code, attempt, got_tokens, retry_after_s)
        if ok:
            self.granted.append(code)
            self.retried.set()
        return ok


def test_unreachable_server_is_unavailable_after_retries():
    retry = CountedRetry(max_retries=2, initial_backoff_s=0.01)
    port = _free_port()
    with Client(f"127.0.0.1:{port}", retry=retry) as c:
        with pytest.raises(Unavailable, match=f"127.0.0.1:{port}: .*Connection refused") as exc:
            c.generate(PROMPT, max_tokens=2)
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE
        assert retry.granted == [grpc.StatusCode.UNAVAILABLE] * 2  # both retries, then it gave up
        with pytest.raises(Unavailable, match=f"127.0.0.1:{port}: .*Connection refused"):
            c.model_info()
        assert retry.granted == [grpc.StatusCode.UNAVAILABLE] * 4


def test_retry_reaches_a_server_that_comes_up_late(backend, server_loop):
    port = _free_port()
    retry = CountedRetry(max_retries=60, initial_backoff_s=0.05, max_backoff_s=0.2)

    async def start_once_refused():
        # Up only after the client was refused once: what reaches it is a retry.
        assert await asyncio.to_thread(retry.retried.wait, 60), "the client never retried"
        return await serve_frontdoor(backend, grpc_port=port, http_port=0)

    fut = server_loop.submit(start_once_refused())
    try:
        with Client(f"127.0.0.1:{port}", timeout=60, retry=retry) as c:
            res = c.generate(PROMPT, max_tokens=3, ignore_eos=True)
        assert len(res.token_ids) == 3
        assert retry.granted and set(retry.granted) == {grpc.StatusCode.UNAVAILABLE}
    finally:
        server_loop.run(fut.result(60).stop(1))


# Need the float products: the fuzzed requests beside a good greedy one (its tokens against its
# run alone), tests/integration/frontdoor_fp32/test_frontdoor_float_products.py; a resumed stream against an
# unbroken run, tests/integration/frontdoor_fp32/test_frontdoor_float_resume.py.


def test_a_plain_request_is_aborted_when_its_call_breaks(address, client, kv_probe):
    """Without resumable, cancelling the call aborts the request (KV freed at once); its log
    says so: Resume returns what was streamed and ends with "abort"."""
    with grpc.insecure_channel(address) as ch:
        call = pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            text=PROMPT, sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True)),
            timeout=60)
        first = next(call)
        call.cancel()
    kv_probe.wait_until_free()
    resumed = client.resume(first.request_id)
    chunks = list(resumed)
    assert chunks[-1].finished and resumed.result.finish_reason == "abort"
    assert len(resumed.result.token_ids) < 400


def test_resume_of_an_unknown_request_is_not_found(client):
    with pytest.raises(NotFound, match="no stream"):
        list(client.resume("req-that-never-was"))
