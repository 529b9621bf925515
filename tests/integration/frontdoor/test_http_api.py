"""The OpenAI-compatible HTTP front door end to end: the real ``openai`` client against our
server, raw httpx for SSE framing, error shapes and disconnects, and /metrics."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from client import Client, RetryPolicy
from router.embedded import EngineBackend
from tests.helpers.http_asserts import assert_openai_error

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
# Test clients retry nothing: a retried UNAVAILABLE would hide the refusal under test.
NO_RETRY = RetryPolicy(max_retries=0)

METRIC_NAMES = [
    "pdcluster_time_to_first_token_seconds", "pdcluster_inter_token_latency_seconds",
    "pdcluster_e2e_request_latency_seconds", "pdcluster_requests_running",
    "pdcluster_requests_waiting", "pdcluster_kv_blocks_used", "pdcluster_kv_blocks_total",
    "pdcluster_kv_transfer_bytes_total", "pdcluster_generation_tokens_total",
    "pdcluster_prompt_tokens_total", "pdcluster_migrations_total", "pdcluster_kv_usage_ratio",
    "pdcluster_preemptions_total", "pdcluster_prefix_cache_evictions_total",
    "pdcluster_engine_step_seconds", "pdcluster_time_per_output_token_seconds",
]


def _sse_payloads(lines) -> list:
    """Parse an SSE body: every line is ``data: ...`` or, before a token chunk's data, its
    ``id: <request id>:<tokens so far>``; the last event is ``[DONE]``."""
    events = [line for line in lines if line]
    assert events, "empty SSE stream"
    assert all(e.startswith(("data: ", "id: ")) for e in events), events
    ids = [e[len("id: "):] for e in events if e.startswith("id: ")]
    rids = {i.rpartition(":")[0] for i in ids}
    counts = [int(i.rpartition(":")[2]) for i in ids]
    assert len(rids) <= 1 and counts == sorted(counts), ids  # one request, counting up
    data = [e for e in events if e.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in data[:-1]]


def test_models_lists_the_served_model(oai, model_id):
    assert [m.id for m in oai.models.list().data] == [model_id]


def test_chat_answers_and_streaming_matches(oai, model_id):
    resp = oai.chat.completions.create(model=model_id, messages=PARIS, max_tokens=12,
                                       temperature=0)
    text = resp.choices[0].message.content
    assert "Paris" in text
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 0
    stream = oai.chat.completions.create(model=model_id, messages=PARIS, max_tokens=12,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == resp.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_chat_without_max_tokens_stops_at_eos(oai, model_id):
    resp = oai.chat.completions.create(model=model_id, messages=PARIS, temperature=0)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"


def test_completions_streaming_matches_non_streaming(oai, model_id):
    kw = {"model": model_id, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
          "extra_body": {"ignore_eos": True, "top_k": 5, "min_tokens": 8}}
    resp = oai.completions.create(**kw)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    chunks = list(oai.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == resp.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_accepts_token_ids(oai, model_id):
    resp = oai.completions.create(model=model_id, prompt=[1, 504, 3458, 282], max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == 4
    assert resp.usage.completion_tokens == 3


def test_sse_framing_and_usage_chunk(http):
    with http.stream("POST", "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        payloads = _sse_payloads(list(r.iter_lines()))
    assert payloads[-1]["choices"] == []
    assert payloads[-1]["usage"]["completion_tokens"] == 4
    assert all(p["object"] == "text_completion" for p in payloads)


@pytest.mark.parametrize("body", [
    {"prompt": ""},
    {"prompt": PROMPT, "top_p": 2},
    {"prompt": PROMPT, "temperature": -1},
    {"prompt": PROMPT, "max_tokens": 0},
    {"prompt": PROMPT, "max_tokens": 10_000_000},
    {"prompt": PROMPT, "n": 65},
    {"prompt": PROMPT, "max_tokens": "many"},
    {"max_tokens": 4},  # no prompt at all
    # Poison values that once raised inside a worker's engine step (killing its loop):
    {"prompt": PROMPT, "seed": 2**62, "temperature": 0.7},
    {"prompt": PROMPT, "stop_token_ids": [1_000_000], "min_tokens": 1},
    {"prompt": PROMPT, "stop": ["x"] * 100},
], ids=["empty-prompt", "top_p-2", "temperature-neg", "max_tokens-0", "max_tokens-huge", "n-65",
        "max_tokens-str", "no-prompt", "seed-huge", "stop_token_id-outside-vocab", "stop-many"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_bad_input_is_400_and_server_keeps_serving(http, body, stream):
    err = assert_openai_error(http.post("/v1/completions", json={**body, "stream": stream}), 400)
    assert err["type"] == "invalid_request_error"
    ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body,field", [
    ({"seed": 2**62, "temperature": 0.7}, "seed"),
    ({"stop_token_ids": [1_000_000], "min_tokens": 1}, "stop_token_ids"),
    ({"stop": ["y" * 1000]}, "stop"),
], ids=["seed", "stop_token_ids", "stop"])
def test_poison_values_are_named_in_the_400(http, body, field):
    err = assert_openai_error(http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 2, **body}), 400)
    assert err["message"].startswith(field), err["message"]


def test_bad_chat_input_is_400(http):
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": []}), 400)
    assert_openai_error(http.post("/v1/chat/completions", json={
        "messages": [{"role": "wizard", "content": "hi"}]}), 400)
    assert_openai_error(http.post("/v1/chat/completions", json={
        "messages": PARIS, "temperature": -1, "stream": True}), 400)


def test_malformed_json_is_400_not_422(http):
    r = http.post("/v1/chat/completions", content=b'{"messages": [', headers={
        "content-type": "application/json"})
    err = assert_openai_error(r, 400)
    assert "JSON" in err["message"]


def test_unknown_model_is_404(http, oai):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": PARIS})):
        for stream in (False, True):
            err = assert_openai_error(http.post(path, json={
                **body, "model": "no-such-model", "max_tokens": 2, "stream": stream}), 404)
            assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=PARIS, max_tokens=2)


def test_flooding_the_queue_is_429(base_url, kv_probe):
    async def main():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}) for _ in range(16)))

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert 429 in codes, codes
    assert set(codes) <= {200, 429}, codes
    for r in responses:
        if r.status_code == 429:
            assert assert_openai_error(r, 429)["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 24
    kv_probe.wait_until_free()


def test_client_disconnect_during_stream_frees_kv(base_url, kv_probe):
    with httpx.Client(base_url=base_url, timeout=120) as c, c.stream(
            "POST", "/v1/chat/completions", json={
                "messages": PARIS, "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert kv_probe.blocks_used() > 0
    kv_probe.wait_until_free()


def test_client_disconnect_without_streaming_frees_kv(base_url, kv_probe):
    async def main():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
            task = asyncio.create_task(c.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}))
            await asyncio.to_thread(kv_probe.wait_until_used)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    kv_probe.wait_until_free()


def test_health(http):
    assert http.get("/health").status_code == 200


def test_cluster_lists_every_worker_ready(http, backend):
    """GET /v1/cluster: what an operator checks first, one entry per worker."""
    r = http.get("/v1/cluster")
    assert r.status_code == 200
    workers = r.json()["workers"]
    mode = backend.model_info().mode
    roles = sorted(w["role"] for w in workers)
    assert roles == (["embedded"] if mode == "embedded" else ["decode", "prefill"])
    for w in workers:
        assert {"id", "role", "host", "pid", "state", "kv_blocks_used", "kv_blocks_total",
                "running", "waiting", "kv_cache_dtype", "kv_block_bytes"} <= set(w)
        # the default KV cache: fp32 rows, a block's bytes a whole number of tokens' KV
        assert w["kv_cache_dtype"] == "auto" and w["kv_block_bytes"] > 0
        assert w["state"] == "ready" and w["host"] and w["pid"] > 0
        assert 0 <= w["kv_blocks_used"] <= w["kv_blocks_total"] and w["kv_blocks_total"] > 0
    if mode != "embedded":  # every worker is a process of its own
        assert len({w["pid"] for w in workers}) == len(workers)
        decode = [w for w in workers if w["role"] == "decode"]
        assert all(w["kv_address"].startswith("127.0.0.1:") for w in decode)  # one host


def _scrape(http) -> dict[str, float]:
    """Sum every sample of each metric name (across labels) from /metrics."""
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    totals: dict[str, float] = {}
    for line in r.text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        if m:
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(3))
    return totals


def test_metrics_expose_every_name_and_move_with_requests(http, frontdoor, backend):
    # One request first: labelled histograms have no series until a request has been served,
    # and this test must not depend on the tests before it.
    http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    before = _scrape(http)
    before_phases = _scrape_phases(http)
    for name in METRIC_NAMES:
        kind_suffix = "_count" if name.endswith("_seconds") else ""
        assert name + kind_suffix in before, name
    assert before["pdcluster_kv_blocks_total"] > 0
    assert before["pdcluster_kv_block_bytes"] > 0  # every worker reports its block's bytes

    http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
    with Client(f"127.0.0.1:{frontdoor.grpc_port}", timeout=60, retry=NO_RETRY) as c:
        c.generate(PROMPT, max_tokens=4, ignore_eos=True)
    after = _scrape(http)
    assert after["pdcluster_generation_tokens_total"] - before[
        "pdcluster_generation_tokens_total"] == 9
    assert after["pdcluster_prompt_tokens_total"] > before["pdcluster_prompt_tokens_total"]
    assert after["pdcluster_e2e_request_latency_seconds_count"] - before[
        "pdcluster_e2e_request_latency_seconds_count"] == 2
    assert after["pdcluster_time_to_first_token_seconds_count"] - before[
        "pdcluster_time_to_first_token_seconds_count"] == 2
    # Both requests had tokens after their first: one TPOT each.
    assert after["pdcluster_time_per_output_token_seconds_count"] - before[
        "pdcluster_time_per_output_token_seconds_count"] == 2
    # 5 + 4 tokens: 4 + 3 gaps between consecutive tokens.
    assert after["pdcluster_inter_token_latency_seconds_count"] - before[
        "pdcluster_inter_token_latency_seconds_count"] == 7
    # ... and as many pure-decode engine steps (the first token comes from the prefill), each
    # of batch 1: the engine's own step times, by batch size, beside the served ones.
    steps = "pdcluster_engine_decode_steps_total"
    assert after[steps] - before.get(steps, 0.0) == 7
    assert _scrape_labels(http, steps).get("1", 0.0) >= 7
    seconds = "pdcluster_engine_decode_step_seconds_total"
    assert after[seconds] - before.get(seconds, 0.0) > 0
    # One request at a time: no decode row ever shared a step with a prefill.
    mixed = "pdcluster_engine_mixed_steps_total"
    assert f"# TYPE {mixed} counter" in http.get("/metrics").text
    assert after.get(mixed, 0.0) - before.get(mixed, 0.0) == 0
    # Every engine step, whichever worker ran it: per request its prompt's step and its
    # decode steps (5 + 4 tokens: 2 + 7), in embedded and disaggregated mode alike.
    all_steps = "pdcluster_engine_step_seconds_count"
    assert after[all_steps] - before[all_steps] == 9
    assert after["pdcluster_preemptions_total"] == before["pdcluster_preemptions_total"]
    if isinstance(backend, EngineBackend):  # no prefill / decode split to time
        assert "pdcluster_request_phase_seconds_count" not in after
        assert "pdcluster_kv_transfer_seconds_count" not in after
        return
    # Each request's prompt KV crossed once, prefill -> decode.
    moved = "pdcluster_kv_transfer_seconds_count"
    assert after[moved] - before.get(moved, 0.0) == 2
    assert 'pdcluster_kv_transfer_seconds_count{pair="prefill->decode"}' in \
        http.get("/metrics").text
    # Disaggregated: each request's first-token time in phases, one observation per phase
    # each, and together no more than the TTFT the front door measured around them.
    phases = _scrape_phases(http)
    assert {p: n - before_phases.get(p, (0, 0.0))[0] for p, (n, _) in phases.items()} == {
        "prefill_queue": 2, "prefill_compute": 2, "kv_transfer_tail": 2, "decode_commit": 2}
    spent = sum(s - before_phases.get(p, (0, 0.0))[1] for p, (_, s) in phases.items())
    ttft = "pdcluster_time_to_first_token_seconds_sum"
    assert 0 < spent <= after[ttft] - before[ttft]
    assert phases["prefill_compute"][1] > before_phases.get("prefill_compute", (0, 0.0))[1]


def _scrape_phases(http) -> dict[str, tuple[int, float]]:
    """``pdcluster_request_phase_seconds``: (count, sum) by phase."""
    out: dict[str, list] = {}
    for line in http.get("/metrics").text.splitlines():
        m = re.match(r'^pdcluster_request_phase_seconds_(count|sum)\{phase="(\w+)"\} (\S+)$',
                     line)
        if m:
            out.setdefault(m.group(2), [0, 0.0])[m.group(1) == "sum"] = float(m.group(3))
    return {p: (int(n), s) for p, (n, s) in out.items()}


def _scrape_labels(http, name: str) -> dict[str, float]:
    """``name``'s samples by their ``batch`` label."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        m = re.match(rf'^{name}\{{batch="(\d+)"\}} (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_store_gauge_says_the_cluster_store_answers(http, backend):
    """``pdcluster_store_up`` is 1 while the cluster's store answers (its outages:
    test_store_outage.py); the embedded engine has no store, hence no gauge."""
    scraped = _scrape(http)
    if backend.model_info().mode == "embedded":
        assert "pdcluster_store_up" not in scraped
    else:
        assert scraped["pdcluster_store_up"] == 1


def test_gauges_show_a_running_request(base_url, http, kv_probe):
    with httpx.Client(base_url=base_url, timeout=120) as c, c.stream(
            "POST", "/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        next(line for line in lines if line)
        # The gauges are read at scrape time, from a snapshot that may be one engine step
        # old: scrape until the running request shows, while it streams (400 tokens: seconds).
        deadline = time.monotonic() + 10.0
        during = _scrape(http)
        while during["pdcluster_requests_running"] < 1 and time.monotonic() < deadline:
            next(lines)
            during = _scrape(http)
    assert during["pdcluster_requests_running"] >= 1
    assert during["pdcluster_kv_blocks_used"] >= 1
    kv_probe.wait_until_free()
    assert _scrape(http)["pdcluster_kv_blocks_used"] == 0


# Need the float products: the fuzzed requests beside a good greedy one (its text against its
# run alone), tests/integration/frontdoor_fp32/test_frontdoor_float_products.py; a resumed stream against an
# unbroken run, tests/integration/frontdoor_fp32/test_frontdoor_float_resume.py.


def test_resuming_an_unknown_or_foreign_stream_is_refused(http):
    err = assert_openai_error(http.get("/v1/streams/req-none"), 404)
    assert err["code"] == "stream_not_found"
    err = assert_openai_error(http.get("/v1/streams/req-none", headers={
        "Last-Event-ID": "req-other:3"}), 400)
    assert "Last-Event-ID" in err["message"]
