"""The two clients `pdcluster bench serve` loads a server with, one request each: gRPC (the
SDK's ``AsyncClient``) and HTTP (streamed ``/v1/completions`` over ``httpx``), timing TTFT,
inter-token gaps and E2E on the client side. ``completion_body`` / ``completion_events`` are
also what ``bench disagg --target`` sends."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestResult", "StreamError", "completion_body", "completion_events",
           "grpc_request", "http_request"]


@dataclass
class RequestResult:
    """One request, client-side (seconds)."""

    ok: bool
    prompt_len: int
    start: float = 0.0  # perf_counter when sent
    output_tokens: int = 0
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    itls_s: list[float] = field(default_factory=list)
    error: str | None = None
    usage_reported: bool = True  # HTTP: False when the stream carried no usage chunk

    @property
    def tpot_s(self) -> float:
        if not self.ok or self.output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def grpc_request(client: Any, prompt: list[int], output_len: int,
                        structured: dict[str, Any] | None = None) -> RequestResult:
    r = RequestResult(False, len(prompt), time.perf_counter())
    last = r.start
    extra = {"structured": structured} if structured is not None else {}
    try:
        async with client.stream(prompt_token_ids=prompt, max_tokens=output_len,
                                 ignore_eos=True, temperature=0, **extra) as s:
            async for chunk in s:
                if not chunk.token_ids:
                    continue
                now = time.perf_counter()
                if r.output_tokens == 0:
                    r.ttft_s = now - r.start
                else:
                    r.itls_s.append(now - last)
                last = now
                r.output_tokens += len(chunk.token_ids)
    except Exception as e:  # a failed request is a data point, not the end of the run
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.e2e_s = last - r.start
    r.ok = r.output_tokens > 0
    return r


class StreamError(Exception):
    """The server refused a streamed completion (non-200) or sent an error event."""


def completion_body(prompt: list[int], output_len: int, model: str | None,
                    structured: dict[str, Any] | None = None) -> dict[str, Any]:
    """A streamed, greedy ``/v1/completions`` request for exactly ``output_len`` tokens
    (``structured``: vLLM's ``structured_outputs``)."""
    # ignore_eos is a vLLM / llama.cpp extension; run() checks the token counts for servers
    # that drop it silently.
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if structured is not None:
        body["structured_outputs"] = structured
    return body


async def completion_events(client: Any, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The parsed SSE messages of one streamed ``/v1/completions`` request (``client``: an
    ``httpx.AsyncClient`` on the server's base URL), up to ``[DONE]``. Raises StreamError for
    a non-200 answer or an ``error`` event; transport errors propagate as httpx raises them."""
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise StreamError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            msg = json.loads(data)
            if "error" in msg:
                raise StreamError(str(msg["error"])[:200])
            yield msg


async def http_request(client: Any, prompt: list[int], output_len: int,
                        structured: dict[str, Any] | None = None,
                        model: str | None = None) -> RequestResult:
    r = RequestResult(False, len(prompt), time.perf_counter())
    last = r.start
    events = 0
    usage_tokens = None
    body = completion_body(prompt, output_len, model, structured)
    try:
        async for msg in completion_events(client, body):
            if msg.get("usage"):
                usage_tokens = msg["usage"]["completion_tokens"]
            if not msg.get("choices"):
                continue
            now = time.perf_counter()
            if events == 0:
                r.ttft_s = now - r.start
            else:
                r.itls_s.append(now - last)
            last = now
            events += 1
    except StreamError as e:
        r.error = str(e)
        return r
    except Exception as e:  # a failed request is a data point, not the end of the run
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.e2e_s = last - r.start
    r.output_tokens = usage_tokens if usage_tokens is not None else events
    r.usage_reported = usage_tokens is not None
    r.ok = events > 0
    return r
