"""The gRPC front door: ``pdcluster.v1.Generation`` over a ``GenerationBackend``, plus the
standard ``grpc.health.v1`` health service and server reflection, on one ``grpc.aio`` server.

Protobuf types stay in the front door: requests become ``GenerateInput`` and backend chunks
become ``GenerateResponse`` in ``router.frontdoor.grpc_messages``. Errors are mapped once (``router.frontdoor.errors.map_error``). A cancelled
call (client went away, deadline) cancels the handler, which closes the backend stream and so
aborts the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.pdcluster.v1 import generation_pb2 as pb
from proto.pdcluster.v1 import generation_pb2_grpc as pb_grpc
from router.contract import EmbedInput, GenerationBackend, new_request_id
from router.frontdoor.choices import ChoiceChunk, ChoiceStreams
from router.frontdoor.errors import map_error
from router.frontdoor.grpc_messages import (
    ReasoningSplitter,
    ToolCallCollector,
    chunk_to_responses,
    request_to_generation,
)
from router.frontdoor.metrics import Metrics
from router.frontdoor.security import Gate, RateLimitedError, Tenant, UnauthenticatedError

__all__ = ["SERVICE_NAME", "CallGate", "GenerationService", "GrpcServer", "start_grpc_server"]

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "pdcluster.v1.Generation"
REQUEST_ID_METADATA_KEY = "x-request-id"

class GenerationService(pb_grpc.GenerationServicer):
    """The Generation RPCs over one backend; metrics are shared with the HTTP server. Every
    RPC of this service needs an API key when the gate has keys (health and reflection are
    other services and stay open); request ids are the caller's tenant's own.
    ``tool_call_parser`` overrides the tool-call format read off the model's chat template;
    ``reasoning_parser`` splits chat output into reasoning and content (None: off), as the
    HTTP door's chat does."""

    def __init__(self, backend: GenerationBackend, metrics: Metrics,
                 gate: Gate | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.backend = backend
        self.metrics = metrics
        self.gate = gate or Gate()
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    async def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        try:
            return self.gate.authenticate(dict(context.invocation_metadata()).get("authorization"))
        except UnauthenticatedError as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        tenant = await self._tenant(context)
        rid = request.request_id if request.HasField("request_id") and request.request_id \
            else new_request_id()
        permits = []
        try:
            gen = request_to_generation(
                request, self.gate.scoped(tenant, rid), self.backend.tokenize,
                self.tool_call_parser or self.backend.model_info().tool_call_parser)
            inputs = gen.inputs
            for _ in inputs:  # each choice is a generation: the tenant's limits count each
                permits.append(self.gate.admit(tenant))
        except (ValueError, RateLimitedError) as e:
            for p in permits:
                p.release()
            err = map_error(e)
            await context.abort(err.grpc_code, err.message, _retry_after(err))
        traceparent = dict(context.invocation_metadata()).get("traceparent")
        # the call's deadline, else its tenant's default: the admission's bound
        deadline = self.gate.deadline_for(tenant, context.time_remaining())
        inputs = [dataclasses.replace(inp, public_id=rid if k == 0 else f"{rid}-{k}", permit=p,
                                      traceparent=traceparent, deadline_s=deadline)
                  for k, (inp, p) in enumerate(zip(inputs, permits, strict=True))]
        calls = ToolCallCollector(gen.tools) if gen.tools is not None else None
        split = (ReasoningSplitter(self.reasoning_parser)
                 if self.reasoning_parser is not None and gen.chat else None)
        try:
            # Before the first token, so a client can Abort a request still in prefill.
            await context.send_initial_metadata(((REQUEST_ID_METADATA_KEY, rid),))
            if len(inputs) == 1:
                chunks = self.metrics.track(self.backend.generate(inputs[0]), api="grpc")
                async for resp in self._stream(rid, chunks, context, calls=calls,
                                               split=split):
                    yield resp
            else:  # the choices merged, each response naming its own
                choices = ChoiceStreams(
                    lambda inp: self.metrics.track(self.backend.generate(inp), api="grpc"),
                    inputs, len(inputs))
                choices.start()
                async for resp in self._stream(rid, choices.events(), context, choices.aclose,
                                               calls, split):
                    yield resp
        finally:
            for p in permits:  # a generation that never started: nobody else frees it
                if not p.adopted:
                    p.release()

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.GenerateResponse]:
        tenant = await self._tenant(context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        rid = request.request_id
        await context.send_initial_metadata(((REQUEST_ID_METADATA_KEY, rid),))
        # Not metered: these tokens were counted when they were generated.
        chunks = self.backend.resume(self.gate.scoped(tenant, rid), request.from_index)
        async for resp in self._stream(rid, chunks, context):
            yield resp

    async def _stream(self, rid: str, chunks, context: grpc.aio.ServicerContext,
                      close=None, calls: ToolCallCollector | None = None,
                      split: ReasoningSplitter | None = None
                      ) -> AsyncIterator[pb.GenerateResponse]:
        """One backend stream (GenerationChunks, or the ChoiceChunks of several choices) as
        GenerateResponses; errors mapped once, here. Closing it (``close``, default the
        stream's ``aclose``) aborts a generation (unless resumable) and stops following a
        resumed log. ``calls``: adds each choice's parsed tool calls to its complete;
        ``split``: fills in each choice's reasoning and content (before the calls: they are
        parsed from the content)."""
        stream = chunks
        sent_tokens = False
        try:
            try:
                async for item in stream:
                    index, chunk = ((item.index, item.chunk) if isinstance(item, ChoiceChunk)
                                    else (0, item))
                    responses = chunk_to_responses(chunk, rid)
                    for resp in responses:
                        resp.index = index
                    if split is not None:
                        responses = split.split(index, responses)
                    for resp in responses:
                        if calls is not None:
                            calls.add(index, resp)
                        sent_tokens = sent_tokens or resp.HasField("chunk")
                        yield resp
            except Exception as e:  # mapped once, here; CancelledError passes through
                err = map_error(e)
                if err.grpc_code == grpc.StatusCode.INTERNAL:
                    log.exception("request %s failed", rid)
                if sent_tokens:
                    # Keep the tokens already streamed meaningful: say why the stream stops.
                    yield pb.GenerateResponse(request_id=rid, error=pb.GenerateError(
                        code=err.grpc_code.name, message=err.message))
                await context.abort(err.grpc_code, err.message, _retry_after(err))
        finally:
            # Runs on completion, error and cancellation alike.
            await (close() if close is not None else stream.aclose())

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> pb.AbortResponse:
        tenant = await self._tenant(context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        try:
            found = await self.backend.abort(self.gate.scoped(tenant, request.request_id))
        except Exception as e:
            err = map_error(e)
            await context.abort(err.grpc_code, err.message, _retry_after(err))
        return pb.AbortResponse(found=bool(found))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._tenant(context)
        info = self.backend.model_info()
        return pb.ModelInfo(model_id=info.model_id, max_model_len=info.max_model_len,
                            vocab_size=info.vocab_size, eos_token_ids=list(info.eos_token_ids),
                            mode=info.mode)

    async def Embed(self, request: pb.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        tenant = await self._tenant(context)
        inputs = [x.text if x.WhichOneof("input") == "text" else list(x.token_ids.ids)
                  for x in request.inputs]
        if any(x == "" or x == [] for x in inputs) or not inputs:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "inputs: each a non-empty text or token ids, at least one")
        rid = request.request_id if request.HasField("request_id") and request.request_id \
            else new_request_id()
        permits = []
        try:
            for _ in inputs:
                permits.append(self.gate.admit(tenant))
            out = await self.backend.embed(EmbedInput(
                inputs, request.model if request.HasField("model") else None,
                self.gate.scoped(tenant, rid)))
        except Exception as e:
            err = map_error(e)
            await context.abort(err.grpc_code, err.message, _retry_after(err))
        finally:
            for p in permits:
                p.release()
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=v) for v in out.embeddings],
                                prompt_tokens=out.prompt_tokens)

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        await self._tenant(context)
        return pb.ListModelsResponse(models=[
            pb.ServedModel(id=m.id, parent=m.parent or "", root=m.root or "",
                           lora_int_id=m.int_id or 0) for m in self.backend.served_models()])

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext) -> pb.LoRAAdapterResponse:
        await self._operator(context, lambda: self.backend.load_lora_adapter(
            request.lora_name, request.lora_path))
        return pb.LoRAAdapterResponse(message=f"LoRA adapter {request.lora_name!r} loaded")

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext) -> pb.LoRAAdapterResponse:
        await self._operator(context, lambda: self.backend.unload_lora_adapter(
            request.lora_name))
        return pb.LoRAAdapterResponse(message=f"LoRA adapter {request.lora_name!r} unloaded")

    async def _operator(self, context: grpc.aio.ServicerContext, call) -> None:
        """Await ``call()`` for an operator (``Gate.authorize_admin``), its errors mapped to
        status codes."""
        tenant = await self._tenant(context)
        try:
            self.gate.authorize_admin(tenant)
            await call()
        except Exception as e:
            err = map_error(e)
            await context.abort(err.grpc_code, err.message, _retry_after(err))


def _retry_after(err) -> tuple:
    """A refusal's ``retry-after`` trailing metadata (seconds, as HTTP's Retry-After): when
    to try again (a rate limit, a deadline the queue cannot meet; the SDK waits that long)."""
    if err.retry_after_s is None:
        return ()
    return (("retry-after", str(max(1, math.ceil(err.retry_after_s)))),)


@dataclass(frozen=True)
class _Undecodable:
    """A request whose bytes are not a valid message of its type."""

    message: str


def _lenient(message_type):
    """A deserializer that hands bad bytes to the handler (as _Undecodable) instead of
    failing the call with INTERNAL, grpc's answer to a deserializer that raises."""
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return _Undecodable(f"request is not a valid {message_type.DESCRIPTOR.full_name}: "
                                f"{e}")
    return parse


class CallGate:
    """Counts the Generation calls being served and, once ``close`` is called, refuses new
    ones with UNAVAILABLE at once.

    Why not leave refusal to ``grpc.aio.Server.stop``: a call racing the core's shutdown
    (GOAWAY, the listener going away) can hang until its deadline instead of failing fast.
    Refusing here, on the still-open connection, answers every new call in milliseconds
    for the whole drain; the core shutdown starts only once the calls in flight are done.
    Calls about work already in flight (``Resume``, ``Abort``) stay open during a drain."""

    def __init__(self) -> None:
        self.closed = False
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        self.closed = True

    async def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until no admitted call runs; False when ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def enter(self, context: grpc.aio.ServicerContext, refusable: bool) -> None:
        if self.closed and refusable:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the server is draining: send new requests to another replica")
        self._running += 1
        self._idle.clear()

    def leave(self) -> None:
        self._running -= 1
        if self._running == 0:
            self._idle.set()


def _checked_stream(method, calls: CallGate, refusable: bool):
    async def handler(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        await calls.enter(context, refusable)
        try:
            async for resp in method(request, context):
                yield resp
        finally:
            calls.leave()
    return handler


def _checked_unary(method, calls: CallGate, refusable: bool):
    async def handler(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        await calls.enter(context, refusable)
        try:
            return await method(request, context)
        finally:
            calls.leave()
    return handler


def _add_generation_service(service: GenerationService, server: grpc.aio.Server,
                            calls: CallGate) -> None:
    """As the generated ``add_GenerationServicer_to_server``, except that undecodable
    request bytes get INVALID_ARGUMENT naming the message type, not INTERNAL, and every
    call passes ``calls`` (new work refused while draining)."""
    def stream(method, req, resp, refusable=True):
        return grpc.unary_stream_rpc_method_handler(
            _checked_stream(method, calls, refusable), request_deserializer=_lenient(req),
            response_serializer=resp.SerializeToString)

    def unary(method, req, resp, refusable=True):
        return grpc.unary_unary_rpc_method_handler(
            _checked_unary(method, calls, refusable), request_deserializer=_lenient(req),
            response_serializer=resp.SerializeToString)

    handlers = {
        "Generate": stream(service.Generate, pb.GenerateRequest, pb.GenerateResponse),
        "Resume": stream(service.Resume, pb.ResumeRequest, pb.GenerateResponse,
                         refusable=False),
        "Abort": unary(service.Abort, pb.AbortRequest, pb.AbortResponse, refusable=False),
        "GetModelInfo": unary(service.GetModelInfo, pb.GetModelInfoRequest, pb.ModelInfo),
        "ListModels": unary(service.ListModels, pb.ListModelsRequest, pb.ListModelsResponse),
        "Embed": unary(service.Embed, pb.EmbedRequest, pb.EmbedResponse),
        "LoadLoRAAdapter": unary(service.LoadLoRAAdapter, pb.LoadLoRAAdapterRequest,
                                 pb.LoRAAdapterResponse),
        "UnloadLoRAAdapter": unary(service.UnloadLoRAAdapter, pb.UnloadLoRAAdapterRequest,
                                   pb.LoRAAdapterResponse),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                          handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class GrpcServer:
    """A started grpc.aio server with health and reflection; ``port`` is the bound port."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                 port: int, calls: CallGate) -> None:
        self.server = server
        self.health = health_servicer
        self.port = port
        self.calls = calls

    async def stop(self, grace_s: float | None) -> None:
        """Report NOT_SERVING, refuse new calls (UNAVAILABLE), let running calls finish for
        ``grace_s`` seconds (None: forever), then cancel the rest (which aborts their
        requests) and close the server."""
        start = time.monotonic()
        self.calls.close()
        await self.health.enter_graceful_shutdown()
        if grace_s is None or grace_s > 0:
            await self.calls.wait_idle(grace_s)
        left = None if grace_s is None else max(0.0, grace_s - (time.monotonic() - start))
        await self.server.stop(left)

    async def wait_closed(self) -> None:
        await self.server.wait_for_termination()


async def start_grpc_server(backend: GenerationBackend, metrics: Metrics,
                            host: str = "127.0.0.1", port: int = 50051,
                            gate: Gate | None = None,
                            tool_call_parser: str | None = None,
                            reasoning_parser: str | None = None) -> GrpcServer:
    """Bind ``host:port`` (port 0: a free one) and start serving, over TLS when the gate's
    config has it (mTLS with a client CA). Messages above ``max_request_bytes`` are refused
    with RESOURCE_EXHAUSTED. Raises RuntimeError when the address cannot be bound, and
    ValueError naming a TLS file that cannot be read."""
    gate = gate or Gate()
    tls = gate.config.tls
    creds = None
    if tls is not None:
        cert, key, client_ca = tls.read()
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                            require_client_auth=client_ca is not None)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", gate.config.max_request_bytes)])
    calls = CallGate()
    _add_generation_service(GenerationService(backend, metrics, gate, tool_call_parser,
                                              reasoning_parser), server, calls)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = (server.add_secure_port(address, creds) if creds is not None
             else server.add_insecure_port(address))
    if bound == 0:
        raise RuntimeError(f"could not bind the gRPC server to {address}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return GrpcServer(server, health_servicer, bound, calls)
