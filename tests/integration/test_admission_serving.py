"""SLO-aware admission over a real local cluster: while a slowed prefill worker has a queue of
prompts, a request whose deadline is shorter than the predicted wait is refused at once
(DeadlineRefusedError: HTTP 429 with Retry-After and code ``deadline_unmet``; gRPC
RESOURCE_EXHAUSTED with ``retry-after`` metadata), nothing of it reaching a worker; one with
room in its deadline, or none, is served; with the queue gone the same short deadline is met."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from client import Client, ResourceExhausted, RetryPolicy
from engine import EngineArgs, SamplingParams
from router.cluster.ray_cluster import ClusterConfig
from router.contract import DeadlineRefusedError, GenerateInput
from tests.helpers.async_util import assert_no_blocks_held, run_cluster, until
from tests.helpers.tiny_models import random_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


def test_a_deadline_the_queue_cannot_meet_is_refused_at_once(loop, tiny_llama_dir):
    # Each layer of a prefill sends 0.2 s late: six 200-token prompts queue 1,200 tokens,
    # over a second at the prior rate (1,000 tokens/s) before any is measured.
    config = ClusterConfig(model=str(tiny_llama_dir), num_prefill_workers=1,
                           num_decode_workers=1,
                           prefill_engine=EngineArgs(block_size=16, num_threads=1),
                           decode_engine=EngineArgs(block_size=16, num_threads=1),
                           worker_num_cpus=1.0,
                           worker_overrides={"prefill-0": {"fault_delay_per_layer_s": 0.2}})
    prompts = random_prompts(seed=61, count=7, max_len=200, min_len=200)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def tokens(c, prompt, deadline=None, rid=None):
        out = []
        async for ch in c.generate(GenerateInput(params, token_ids=prompt, request_id=rid,
                                                 deadline_s=deadline)):
            out += ch.token_ids
        return out

    async def body(c):
        from router.frontdoor.lifecycle import serve_frontdoor

        fd = await serve_frontdoor(c, grpc_port=0, http_port=0, drain_grace_s=1)
        try:
            queue = [asyncio.ensure_future(tokens(c, p, rid=f"q{i}"))
                     for i, p in enumerate(prompts[:6])]
            pslot = c.orchestrator.prefill["prefill-0"]
            await until(lambda: _async(pslot.view.inflight_prefill_tokens >= 1000),
                        "a queue on the prefill worker")
            refused = None
            try:
                await tokens(c, prompts[6], deadline=0.2, rid="hurry")
            except DeadlineRefusedError as e:
                refused = e
            journal = c.store.journal_get("hurry")

            def doors():
                url = f"http://127.0.0.1:{fd.http_port}"
                with httpx.Client(base_url=url, timeout=60) as h:
                    r = h.post("/v1/completions", headers={"x-request-timeout": "0.2"},
                               json={"prompt": prompts[6], "max_tokens": 2})
                    with Client(f"127.0.0.1:{fd.grpc_port}", retry=RetryPolicy(max_retries=0),
                                timeout=0.5) as g:
                        try:
                            g.generate(prompt_token_ids=prompts[6], max_tokens=2)
                            grpc_err = None
                        except ResourceExhausted as e:
                            grpc_err = e
                    metrics = h.get("/metrics").text
                return r, grpc_err, metrics

            http_r, grpc_err, metrics = await asyncio.to_thread(doors)
            patient = await tokens(c, prompts[6], deadline=600.0, rid="patient")
            await asyncio.gather(*queue)
            met = await tokens(c, prompts[6], deadline=5.0, rid="later")
            after = await asyncio.to_thread(
                lambda: httpx.get(f"http://127.0.0.1:{fd.http_port}/metrics", timeout=60).text)
            await assert_no_blocks_held(c)
            return refused, journal, http_r, grpc_err, metrics + after, patient, met
        finally:
            await fd.stop(1)

    refused, journal, http_r, grpc_err, metrics, patient, met = run_cluster(loop, config, body)
    assert refused is not None and refused.retry_after_s > 0.2
    assert "predicted" in str(refused) and "deadline of 0.20 s" in str(refused)
    assert journal == []  # refused before it reached any worker
    assert http_r.status_code == 429, http_r.text
    assert http_r.json()["error"]["code"] == "deadline_unmet"
    assert int(http_r.headers["retry-after"]) >= 1
    assert grpc_err is not None and "predicted" in str(grpc_err)
    assert 'pdcluster_requests_refused_total{api="http",reason="deadline_unmet"} 1.0' in metrics
    assert 'pdcluster_requests_refused_total{api="grpc",reason="deadline_unmet"} 1.0' in metrics
    # the admitted requests' predictions were checked against their first tokens
    assert "pdcluster_ttft_predictions_total" in metrics
    assert "pdcluster_ttft_prediction_abs_error_seconds_total" in metrics
    assert len(patient) == 2 and met == patient


async def _async(v):
    return v


def test_priority_orders_a_cluster_queue_and_a_passed_deadline_frees_everything(
        loop, tiny_llama_dir):
    """One prompt at a time on a slowed prefill worker: of the requests queued behind the
    first, the one with the lowest ``priority`` value (vLLM's: lower first) is prefilled
    next whatever its arrival. A gRPC call whose deadline passes mid-stream (a slowed decode
    worker) ends DEADLINE_EXCEEDED and leaves no block held anywhere; so do HTTP requests
    whose ``x-request-timeout`` passes mid-flight, ended by the server itself while the client
    waits on (a 504 ``deadline_exceeded``; a stream, after its 200: the error event and
    ``[DONE]``), journaled as aborted."""
    # max_num_seqs=1 on the prefill worker: its queue order is the prefill order
    config = ClusterConfig(model=str(tiny_llama_dir), num_prefill_workers=1,
                           num_decode_workers=1,
                           prefill_engine=EngineArgs(block_size=16, num_threads=1,
                                                     max_num_seqs=1),
                           decode_engine=EngineArgs(block_size=16, num_threads=1),
                           worker_num_cpus=1.0,
                           worker_overrides={"prefill-0": {"fault_delay_per_layer_s": 0.1},
                                             "decode-0": {"fault_delay_per_step_s": 0.01}})
    prompts = random_prompts(seed=62, count=4, max_len=40, min_len=20)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first_token: list[str] = []

    async def run(c, name, prompt, priority):
        async for ch in c.generate(GenerateInput(params, token_ids=prompt, request_id=name,
                                                 priority=priority)):
            if ch.token_ids and name not in first_token:
                first_token.append(name)

    async def body(c):
        from router.frontdoor.lifecycle import serve_frontdoor

        head = asyncio.ensure_future(run(c, "head", prompts[0], 0))
        pslot = c.orchestrator.prefill["prefill-0"]
        await until(lambda: _async(pslot.view.inflight_prefill_tokens > 0), "the first prefill")
        rest = []
        for name, prompt, prio in (("low", prompts[1], 5), ("mid", prompts[2], 0),
                                   ("high", prompts[3], -5)):
            rest.append(asyncio.ensure_future(run(c, name, prompt, prio)))
            await asyncio.sleep(0.05)  # arrival order: low, mid, high
        await asyncio.gather(head, *rest)
        fd = await serve_frontdoor(c, grpc_port=0, http_port=0, drain_grace_s=1)
        try:
            def call():
                with Client(f"127.0.0.1:{fd.grpc_port}", retry=RetryPolicy(max_retries=0),
                            timeout=1.5) as g:
                    try:
                        g.generate(prompt_token_ids=prompts[0], max_tokens=400,
                                   ignore_eos=True)
                    except Exception as e:  # the deadline passed mid-stream
                        return type(e).__name__
                return None
            ended = await asyncio.to_thread(call)
            await assert_no_blocks_held(c, timeout_s=30)

            def late(stream: bool):
                # the client would wait a minute: only the server can end these early
                with httpx.Client(base_url=f"http://127.0.0.1:{fd.http_port}", timeout=60) as h:
                    rid = "late-stream" if stream else "late-whole"
                    body = {"prompt": prompts[0], "max_tokens": 400, "ignore_eos": True,
                            "stream": stream}
                    headers = {"x-request-timeout": "1.5", "x-request-id": rid}
                    if not stream:
                        return h.post("/v1/completions", json=body, headers=headers)
                    with h.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                        return r.status_code, [x for x in r.iter_lines() if x.startswith("data")]

            whole = await asyncio.to_thread(late, False)
            held_whole = c.orchestrator.has_stream("late-whole")
            streamed = await asyncio.to_thread(late, True)
            held_stream = c.orchestrator.has_stream("late-stream")
            journals = [[e.kind for e in c.store.journal_get(rid)]
                        for rid in ("late-whole", "late-stream")]
            await assert_no_blocks_held(c, timeout_s=30)
        finally:
            await fd.stop(1)
        return ended, whole, streamed, (held_whole, held_stream), journals

    ended, whole, streamed, held, journals = run_cluster(loop, config, body)
    assert first_token == ["head", "high", "mid", "low"]
    assert ended == "DeadlineExceeded"
    assert whole.status_code == 504, whole.text
    assert whole.json()["error"]["code"] == "deadline_exceeded"
    # a stream's 200 goes out with its first token: it ended mid-flight (the tiny model has
    # no tokenizer, so its token chunks carry no text and are not sent)
    status, events = streamed
    assert status == 200 and len(events) == 2 and events[-1] == "data: [DONE]"
    error = json.loads(events[0].removeprefix("data: "))["error"]
    assert error["code"] == "deadline_exceeded" and "1.5 s" in error["message"]
    assert held == (False, False)  # gone from the router when the answer came
    assert [j[-1] for j in journals] == ["aborted", "aborted"]
