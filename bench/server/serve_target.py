"""Where `pdcluster bench serve` sends its load, and what that server says about itself.

``target_from_args`` turns ``--target`` / ``--address`` / ``--api`` into a ``Target`` (our gRPC
front door, or any OpenAI-compatible HTTP server by base URL); ``server_facts`` asks it for its
model id and context length, listing what it does not report as warnings for the JSON.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Target:
    api: str
    address: str  # gRPC host:port, or the HTTP base URL without /v1
    label: str  # names the server in `bench compare`
    api_key: str | None = None
    served_model: str | None = None


def base_url(text: str) -> str:
    """An OpenAI-compatible server's base URL without ``/v1``: ``http://h:p/v1/`` ->
    ``http://h:p`` (requests then go to ``/v1/...``); a bare ``h:p`` gets ``http://``.
    Raises ValueError for another scheme or no host."""
    url = text.strip()
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s)://host:port URL, got {text!r}")
    path = parts.path.rstrip("/")
    path = path[:-3] if path.endswith("/v1") else path
    return f"{parts.scheme}://{parts.netloc}{path}"


def target_from_args(args: argparse.Namespace) -> Target:
    if args.target and args.address:
        raise ValueError("give --target URL or --address, not both")
    if args.target and args.api == "grpc":
        raise ValueError("--target is an OpenAI-compatible HTTP server; drop --api grpc")
    if not args.target and (args.api or "grpc") == "grpc":
        addr = args.address or "127.0.0.1:50051"
        if "://" in addr:
            raise ValueError(f"--address for gRPC is host:port, got {addr!r}")
        return Target("grpc", addr, args.label or addr, args.api_key, args.served_model)
    url = base_url(args.target or args.address or "127.0.0.1:8000")
    return Target("http", url, args.label or urlsplit(url).netloc,
                   args.api_key or os.environ.get("OPENAI_API_KEY") or None, args.served_model)


@dataclass
class ServerFacts:
    """What the server says about itself; ``None`` where it does not say (other servers'
    ``/v1/models`` may lack ``max_model_len``). ``warnings`` go to the result JSON."""

    model_id: str
    max_model_len: int | None
    vocab_size: int | None
    warnings: list[str] = field(default_factory=list)


async def server_facts(t: Target) -> ServerFacts:
    """Model id, context length and (gRPC) vocab size, asked of the server itself. Over
    HTTP, raises ValueError when the server cannot be reached, refuses, or lists no model."""
    if t.api == "grpc":
        from client.sdk import AsyncClient

        async with AsyncClient(t.address, timeout=30, api_key=t.api_key) as c:
            info = await c.model_info()
        return ServerFacts(info.model_id, info.max_model_len, info.vocab_size)
    import httpx

    where = f"{t.address}/v1/models"
    async with httpx.AsyncClient(base_url=t.address, timeout=30, headers=headers(t)) as c:
        try:
            resp = await c.get("/v1/models")
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach {where}: {type(e).__name__}: {e}") from None
    if resp.status_code in (401, 403):
        raise ValueError(f"{where}: HTTP {resp.status_code}: the server wants an API key "
                         "(--api-key or $OPENAI_API_KEY)")
    try:
        listing = resp.json() if resp.status_code == 200 else None
    except ValueError:  # not JSON
        listing = None
    if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
        if t.served_model is None:
            raise ValueError(f"{where}: HTTP {resp.status_code}, no model list; name the model "
                             "with --served-model")
        return ServerFacts(t.served_model, None, None, [
            f"{where} answered HTTP {resp.status_code}: max_model_len unknown, "
            "--input-len/--output-len used as given"])
    models = [m for m in listing["data"] if isinstance(m, dict)]
    ids = [m.get("id") for m in models]
    if t.served_model is None and not ids:
        raise ValueError(f"{where} lists no model")
    model_id = t.served_model or ids[0]
    entry = next((m for m in models if m.get("id") == model_id), {})
    warnings = [] if entry else [f"{model_id!r} is not among {where}'s ids {ids}"]
    max_len = entry.get("max_model_len")
    if not isinstance(max_len, int):
        max_len = None
        warnings.append(f"{where} reports no max_model_len: --input-len/--output-len used as given")
    return ServerFacts(model_id, max_len, None, warnings)


def headers(t: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {t.api_key}"} if t.api_key else {}


def http_client(t: Target) -> Any:
    """An ``httpx.AsyncClient`` on ``t``'s base URL, with its API key, a 600 s timeout and no
    connection cap (every request of a load gets its own stream, as in `vllm bench serve`)."""
    import httpx

    return httpx.AsyncClient(base_url=t.address, timeout=httpx.Timeout(600.0), headers=headers(t),
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=None))
