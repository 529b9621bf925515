"""The HTTP front door's ``/openapi.json``, made to say what the server does.

FastAPI's generated document declares a 422 that never comes (validation errors are 400s here,
in OpenAI's error shape), no other error responses, and JSON for every 200. This adds OpenAI's
error object and the statuses each route really answers with, the SSE content type of the
generation routes and the Prometheus text format of ``/metrics``. The request schemas
themselves come from the pydantic models (router/frontdoor/openai/schema.py), whose field
constraints are SamplingParams' ranges.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

__all__ = ["publish_openapi"]

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}}
_WHY = {"400": "a bad or unsupported field (named in the message and param), malformed JSON",
        "401": "a missing or wrong API key (when keys are configured)",
        "403": "the API key's tenant may not make operators' calls (--admin-tenants)",
        "404": "an unknown model, stream, worker, LoRA adapter or path",
        "413": "a body over the size limit",
        "429": "the queue or the caller's rate limit is full (Retry-After says when to retry)",
        "503": "no live worker can take the request, or the server is draining",
        "504": "the caller's x-request-timeout passed before the request finished (aborted)"}
# The error statuses each route answers with, beside 401 (every route but /health).
_ERRORS = {
    "/v1/completions": ("400", "404", "413", "429", "503", "504"),
    "/v1/chat/completions": ("400", "404", "413", "429", "503", "504"),
    "/v1/embeddings": ("400", "404", "413", "429", "503"),
    "/v1/responses": ("400", "404", "413", "429", "503", "504"),
    "/v1/responses/{response_id}": ("404",),
    "/v1/streams/{request_id}": ("400", "404"),
    "/tokenize": ("400", "404", "413"),
    "/detokenize": ("400", "404", "413"),
    "/health": ("503",),
    "/v1/cluster/workers/{worker_id}/drain": ("400", "403", "404", "413"),
    "/v1/load_lora_adapter": ("400", "403", "413"),
    "/v1/unload_lora_adapter": ("400", "403", "404", "413"),
}
# vLLM's adapter routes answer 200 with a line of text.
_TEXT_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_DRAIN_STATUS = {"type": "object", "required": [
    "worker_id", "role", "state", "elapsed_s", "migrate_after_s", "streams_finished",
    "streams_migrated", "remaining"], "properties": {
    "worker_id": {"type": "string"}, "role": {"type": "string"},
    "state": {"type": "string", "enum": ["draining", "drained"]},
    "elapsed_s": {"type": "number"}, "migrate_after_s": {"type": "number"},
    "streams_finished": {"type": "integer"}, "streams_migrated": {"type": "integer"},
    "remaining": {"type": "integer"}}}
_SSE_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/streams/{request_id}",
               "/v1/responses")
# One server-sent event: a JSON chunk (or "[DONE]") in ``data``, and ``id`` = "<request
# id>:<tokens so far>" on the events a one-choice stream resumes from.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "id": {"type": "string"}, "event": {"type": "string"}}}


def publish_openapi(app: FastAPI, metrics_content_type: str) -> None:
    """Replace ``app.openapi`` (what /openapi.json serves) with the corrected document."""

    def document() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            spec.setdefault("components", {}).setdefault("schemas", {})["Error"] = _ERROR
            for path, ops in spec["paths"].items():
                for op in ops.values():
                    _correct(path, op, metrics_content_type)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = document


def _correct(path: str, op: dict, metrics_content_type: str) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    statuses = list(_ERRORS.get(path, ()))
    if path != "/health":
        statuses.append("401")
    for status in sorted(statuses):
        responses[status] = {"description": _WHY[status], "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    ok = responses.setdefault("200", {"description": "OK"})
    if path == "/metrics":
        ok["content"] = {metrics_content_type.split(";")[0]: {"schema": {"type": "string"}}}
    elif path in _TEXT_ROUTES:
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    elif path in _SSE_ROUTES:
        ok.setdefault("content", {})["text/event-stream"] = {"schema": _SSE_EVENT}
    if path == "/health":
        responses["503"]["description"] = "draining"
    if path.endswith("/drain"):
        ok.update(description="drained (with wait)", content={
            "application/json": {"schema": _DRAIN_STATUS}})
        responses["202"] = {"description": "draining: the drain has started (or was running)",
                            "content": {"application/json": {"schema": _DRAIN_STATUS}}}
