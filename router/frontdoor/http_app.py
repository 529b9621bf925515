"""The OpenAI-compatible HTTP front door (FastAPI): ``/v1/completions``, ``/v1/chat/completions``
(both with SSE streaming), ``/v1/responses`` (and ``GET /v1/responses/{id}``),
``/v1/embeddings``, ``/v1/models`` (LoRA adapters too, loaded and
unloaded by ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``), ``/v1/cluster``
(every worker and its state),
``POST /v1/cluster/workers/{id}/drain`` (an operator takes a worker out of service),
``/health`` and ``/metrics``.

Accepts vLLM's extension fields (``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``) and OpenAI's ``user`` (recorded on the request's trace as
``enduser.id`` and in ``slowest_recent``); the OpenAI fields refused on purpose are
``router.frontdoor.openai.refused``'s, each 400 saying why. Every error, malformed JSON
included, is answered in OpenAI's error shape with 400 / 404 / 429 / 500
(``router.frontdoor.errors.map_error``), never FastAPI's 422.
A client that disconnects (streaming or not) aborts its request, which frees its KV.

This module owns the routes only: request bodies live in ``router.frontdoor.openai.schema``, response
JSON in ``router.frontdoor.openai.render``, and running a generation into a (streamed) response in
``router.frontdoor.openai.responder``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.contract import (
    GenerationBackend,
    InvalidRequestError,
    ModelNotFoundError,
    StreamNotFoundError,
    new_request_id,
)
from router.frontdoor.http_guard import GuardMiddleware
from router.frontdoor.metrics import CONTENT_TYPE, Metrics
from router.frontdoor.openai.adapters import add_adapter_routes
from router.frontdoor.openai.embeddings import add_embedding_routes
from router.frontdoor.openai.logprobs import TokenNames
from router.frontdoor.openai.refused import refusal
from router.frontdoor.openai.render import ChatRenderer, CompletionRenderer
from router.frontdoor.openai.responder import (
    OpenAIResponder,
    deadline_at,
    error_response,
    stream_position,
)
from router.frontdoor.openai.response_store import LocalResponseStore
from router.frontdoor.openai.responses import add_responses_routes
from router.frontdoor.openai.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DrainRequest,
    TokenizeRequest,
)
from router.frontdoor.openapi import publish_openapi
from router.frontdoor.security import Gate, RateLimitedError

__all__ = ["create_app"]


def create_app(backend: GenerationBackend, metrics: Metrics, gate: Gate | None = None,
               tool_call_parser: str | None = None,
               reasoning_parser: str | None = None, response_store=None) -> FastAPI:
    """The FastAPI app over ``backend``, behind ``gate`` (API keys, tenants, limits; default:
    open); set ``app.state.draining = True`` to fail /health. ``tool_call_parser`` overrides
    the format read off the model's chat template (``ModelInfo.tool_call_parser``);
    ``reasoning_parser`` splits chat output into reasoning and content (None: off);
    ``response_store`` keeps stored Responses-API responses (a ClusterStore; None: this
    process only)."""
    gate = gate or Gate()
    app = FastAPI(title="pdcluster", docs_url=None, redoc_url=None)
    app.state.draining = False
    app.add_exception_handler(RequestValidationError, _bad_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(GuardMiddleware, gate=gate)
    responder = OpenAIResponder(backend, metrics)
    _add_generation_routes(app, backend, responder, gate, tool_call_parser, reasoning_parser)
    add_responses_routes(app, backend, responder, gate,
                         response_store if response_store is not None else LocalResponseStore(),
                         _request_id, tool_call_parser, reasoning_parser, request_deadline)
    _add_info_routes(app, backend, metrics, gate)
    _add_token_routes(app, backend)
    add_adapter_routes(app, backend, gate)
    add_embedding_routes(app, backend, gate, _request_id)
    publish_openapi(app, CONTENT_TYPE)
    return app


def _add_generation_routes(app: FastAPI, backend: GenerationBackend,
                           responder: OpenAIResponder, gate: Gate,
                           tool_call_parser: str | None,
                           reasoning_parser: str | None = None) -> None:
    # Handlers carry no docstrings: FastAPI would publish them in /openapi.json.
    async def respond(request: Request, body, make_inputs, renderer) -> Response:
        """Admit the caller's generations, one per choice (its tenant's limits count each),
        run them, and free the permits of those that never started (a started generation
        frees its own)."""
        tenant, rid = request.state.tenant, _request_id(request)
        permits = []
        try:
            caller_s = request_deadline(request)
            # the caller's own deadline ends the request once it passes (its tenant's default
            # only judges admission: it names how long a first token may take)
            abort_at = deadline_at(caller_s)
            deadline = gate.deadline_for(tenant, caller_s)
            inputs = make_inputs(gate.scoped(tenant, rid))
            for _ in inputs:
                permits.append(gate.admit(tenant))
        except (ValueError, RateLimitedError) as e:
            for p in permits:
                p.release()
            return error_response(e)
        # The id a client knows each choice by: the request's, suffixed like the backend's.
        traceparent = request.headers.get("traceparent")
        inputs = [dataclasses.replace(inp, public_id=rid if k == 0 else f"{rid}-{k}", permit=p,
                                      traceparent=traceparent, deadline_s=deadline)
                  for k, (inp, p) in enumerate(zip(inputs, permits, strict=True))]
        try:
            return await responder.respond(request, inputs, renderer(rid),
                                           n=body.generations_per_prompt,
                                           stream=body.stream, include_usage=body.include_usage,
                                           continuous_usage=body.continuous_usage,
                                           keep=body.n, deadline=abort_at)
        finally:
            for p in permits:
                if not p.adopted:
                    p.release()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        model_id = backend.model_info().model_id
        echo: dict[int, str] = {}

        def make_inputs(scoped_id: str) -> list:
            inputs = body.to_inputs(scoped_id)
            if body.echo:  # keyed by returned choice; a token-id prompt echoes as its text
                texts = [inp.text if inp.text is not None else echo_text(inp.token_ids)
                         for inp in inputs[::body.generations_per_prompt]]
                echo.update({i: texts[i // body.n] for i in range(len(texts) * body.n)})
            return inputs

        def echo_text(ids: list[int]) -> str:
            """A token-id prompt's text. An id outside the vocabulary is the prompt's fault:
            refused naming ``prompt``, as its generation would be, not /detokenize's
            ``tokens`` (the echo is decoded before the prompt is checked)."""
            vocab = backend.model_info().vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt: token id {bad[0]} is outside the "
                                          f"vocabulary [0, {vocab})")
            return backend.detokenize(ids)

        return await respond(request, body, make_inputs,
                             lambda rid: CompletionRenderer(f"cmpl-{rid}", int(time.time()),
                                                            body.model or model_id,
                                                            _names(body), echo=echo))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        info = backend.model_info()
        plan: list = [None]

        def make_inputs(scoped_id: str) -> list:
            plan[0] = body.tool_plan(tool_call_parser or info.tool_call_parser)
            if plan[0] is not None and body.logprobs:
                raise InvalidRequestError("logprobs: not with tool calls")
            return body.to_inputs(scoped_id, info.max_model_len, backend.tokenize, plan[0])

        return await respond(
            request, body, make_inputs,
            lambda rid: ChatRenderer(f"chatcmpl-{rid}", int(time.time()),
                                     body.model or info.model_id, _names(body), tools=plan[0],
                                     reasoning=reasoning_parser))

    def _names(body) -> TokenNames | None:
        """How the response's logprobs name tokens (None: it asked for none)."""
        if body.top_logprobs_k() is None:
            return None
        return TokenNames(backend.detokenize, body.return_tokens_as_token_ids)


    @app.get("/v1/streams/{request_id}")
    async def resume_stream(request_id: str, request: Request):
        try:
            from_index = stream_position(request.headers.get("last-event-id"), request_id)
        except ValueError as e:
            return error_response(e)
        backend_id = gate.scoped(request.state.tenant, request_id)
        kind = await backend.stream_kind(backend_id)
        if kind is None:
            return error_response(StreamNotFoundError(f"no stream {request_id!r} here "
                                                      f"(unknown, or expired)"))
        make = ChatRenderer if kind == "chat" else CompletionRenderer
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        renderer = make(f"{prefix}-{request_id}", int(time.time()), backend.model_info().model_id)
        return await responder.respond_resumed(backend_id, request_id, from_index, renderer)


def _add_info_routes(app: FastAPI, backend: GenerationBackend, metrics: Metrics,
                     gate: Gate) -> None:
    @app.get("/v1/models")
    async def models():
        info = backend.model_info()
        # vLLM's shape: an adapter names its base model as parent, its folder as root.
        return {"object": "list", "data": [{
            "id": m.id, "object": "model", "created": m.created, "owned_by": "pdcluster",
            "root": m.root or m.id, "parent": m.parent, "max_model_len": info.max_model_len}
            for m in backend.served_models()]}

    @app.get("/health")
    async def health():
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/cluster/workers/{worker_id}/drain")
    async def drain(worker_id: str, request: Request, body: DrainRequest | None = None):
        """Take a worker out of service losing nothing (router.control.drain): 202 with its
        status while it drains, 200 once drained (``wait``). Operators only."""
        body = body or DrainRequest()
        try:
            gate.authorize_admin(request.state.tenant)
            st = await backend.drain_worker(worker_id, body.migrate_after_s, body.wait)
        except (ValueError, LookupError, PermissionError) as e:
            return error_response(e)
        return JSONResponse(asdict(st), status_code=200 if st.state == "drained" else 202)

    @app.get("/v1/cluster")
    async def cluster(request: Request):
        draining = app.state.draining
        out = {"workers": [
            {**asdict(w), "state": "draining" if draining and w.state == "ready" else w.state}
            for w in await backend.cluster_status()]}
        # The front door's slowest requests of the last 5 minutes (pdcluster top): every
        # tenant's, so operators only.
        try:
            gate.authorize_admin(request.state.tenant)
            out["slowest_recent"] = metrics.recent.slowest(10)
        except PermissionError:
            pass
        return out


def _add_token_routes(app: FastAPI, backend: GenerationBackend) -> None:
    """vLLM's /tokenize and /detokenize: the ids a generation of a prompt runs on (chat
    messages through the chat template), and back."""

    def check_model(model: str | None) -> None:
        served = [m.id for m in backend.served_models()]  # adapters share the tokenizer
        if model is not None and model not in served:
            raise ModelNotFoundError(f"model {model!r} is not served here (serving "
                                     f"{', '.join(repr(m) for m in served)})")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        try:
            check_model(body.model)
            ids = backend.tokenize(body.to_prompt(), add_special_tokens=body.add_special_tokens)
        except (ValueError, LookupError) as e:
            return error_response(e)
        return {"count": len(ids), "max_model_len": backend.model_info().max_model_len,
                "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        try:
            check_model(body.model)
            return {"prompt": backend.detokenize(body.tokens)}
        except (ValueError, LookupError) as e:
            return error_response(e)


def request_deadline(request: Request) -> float | None:
    """The ``x-request-timeout`` header: seconds the caller will wait (router.control.admission:
    a first token predicted later is refused at once). ValueError for a bad value."""
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise InvalidRequestError(f"x-request-timeout: not a number of seconds: {raw!r}") from None
    if not 0 < value < float("inf"):
        raise InvalidRequestError(f"x-request-timeout: must be > 0 seconds, got {raw!r}")
    return value


def _request_id(request: Request) -> str:
    return request.headers.get("x-request-id") or new_request_id()


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path, a wrong method, a body FastAPI could not
    even parse, e.g. JSON nested too deep) in OpenAI's error shape too."""
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None,
                                   "code": None}},
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Pydantic's validation errors (malformed JSON included) as OpenAI's 400, not FastAPI's
    422: the first error names the field (``param``) and says what is wrong with it (for a
    field refused on purpose, why: ``router.frontdoor.openai.refused``)."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        msg = f"malformed JSON body: {first.get('ctx', {}).get('error', msg)}"
    elif first.get("type") == "extra_forbidden":
        why = refusal(request.url.path, loc or "")
        msg = (f"{loc}: refused, not ignored: {why}" if why is not None
               else f"{loc}: this server does not support this field (refused, not ignored)")
    elif loc:
        msg = f"{loc}: {msg}"
    return error_response(InvalidRequestError(msg), param=loc)
