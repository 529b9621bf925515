"""Overload is not death: the cluster `pdcluster serve` builds, its decode worker slowed on
purpose, flooded past its token timeout. Every request waits its turn on the live worker and
completes (200), none is migrated or failed for the time it spent queued, and nothing stays
held afterwards.

Overrides, each needed to reach the regime in seconds: ``max_num_seqs=2`` (so eight requests
queue behind two slots), ``token_timeout_s=1`` (the default 120 s would take minutes to
pass), and a 50 ms delay per decode step (the fault-injection knob), so the queue outlasts
the timeout several times over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest

from router.cli.serve_config import ServeConfig
from router.frontdoor.lifecycle import serve_frontdoor
from tests.helpers.async_util import assert_no_blocks_held

pytestmark = pytest.mark.slow

TOKEN_TIMEOUT_S = 1.0
STREAMS = 8
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


async def _stream(client: httpx.AsyncClient, i: int) -> tuple[int, str, float, int, str]:
    """One streamed completion: (status, finish reason, longest wait for a chunk, tokens,
    body of an error)."""
    body = {"prompt": f"Count from {i} onwards:", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    # From the request's start: the door may answer its headers with the first chunk.
    reason, gap, tokens, last = "", 0.0, 0, time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, "", 0.0, 0, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                reason = choice.get("finish_reason") or reason
        return 200, reason, gap, tokens, ""


async def _flood(config, request, count: int, settle_s: float) -> tuple[list, dict]:
    """Start the cluster ``config`` describes behind its front doors, send ``count`` requests
    at once (``request(client, i)``), wait (at most ``settle_s``) until no KV block is held,
    shut it all down: (their answers in order, the router's migrations by reason)."""
    from router.cluster.ray_cluster import Cluster

    cluster = await Cluster.start(config)
    fd = await serve_frontdoor(cluster, grpc_port=0, http_port=0, drain_grace_s=1)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{fd.http_port}",
                                     timeout=120) as client:
            got = await asyncio.gather(*[request(client, i) for i in range(count)])
        await assert_no_blocks_held(cluster, timeout_s=settle_s)
        return got, dict(cluster.orchestrator.migrations)
    finally:
        await fd.stop(1)
        await cluster.shutdown()


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_queue_past_the_token_timeout_completes_with_no_migration(loop, mode):
    """Eight streams on a slowed two-slot decode worker: some wait several token timeouts
    between two chunks, all answer 200 with every token, and the router migrated none."""
    serve = ServeConfig(mode=mode, max_num_seqs=2,
                        worker_overrides={"decode-0": {"fault_delay_per_step_s": 0.05}})
    config = dataclasses.replace(serve.cluster_config(), token_timeout_s=TOKEN_TIMEOUT_S)

    got, migrations = loop.run(_flood(config, _stream, STREAMS, config.call_timeout_s),
                               timeout_s=300)
    assert [(s, r, n, e) for s, r, _, n, e in got] == [(200, "length", MAX_TOKENS, "")] * STREAMS
    assert migrations == {}
    # The regime was reached: a queued stream went longer than the token timeout without a
    # chunk (and was neither migrated nor failed for it).
    assert max(gap for _, _, gap, _, _ in got) > TOKEN_TIMEOUT_S


def test_streams_lost_on_their_only_worker_move_back_onto_it_and_end_unavailable(loop):
    """Streams truly lost on a live worker (every step slower than the token timeout, so
    each is in the batch a whole timeout without a token) migrate; the only worker is their
    old one, so they move back there once the abort of each old copy has landed. Twelve at
    once keep the worker's control threads busy, so an abort can trail its resubmission: the
    same request id twice was a duplicate there, answered 400 with a Ray traceback. Past the
    migration limit each ends 503, and nothing stays held."""
    serve = ServeConfig(mode="colocated",
                        worker_overrides={"decode-0": {"fault_delay_per_step_s": 1.5}})
    config = dataclasses.replace(serve.cluster_config(), token_timeout_s=TOKEN_TIMEOUT_S)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, dict]:
        r = await client.post("/v1/completions", json={
            "prompt": f"Hello {i}", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        return r.status_code, r.json()

    # An abort lands between two 1.5 s steps: the last ones may take two steps to land.
    got, migrations = loop.run(_flood(config, one, 12, config.call_timeout_s + 2 * 1.5),
                               timeout_s=300)
    assert [(status, answer["error"]["code"]) for status, answer in got] == \
        [(503, "no_worker")] * 12, got
    assert all("sent no token" in answer["error"]["message"] for _, answer in got)
    assert migrations == {"token_timeout": 12 * config.migration_limit}
