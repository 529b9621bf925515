"""The gRPC front door: ``pdcluster.v1.Generation`` over a ``GenerationBackend``, plus the
standard ``grpc.health.v1`` health service and server reflection, on one ``grpc.aio`` server.

Protobuf types stay in this file: requests become ``GenerateInput`` and backend chunks become
``GenerateResponse`` here. Errors are mapped once (``router.frontdoor.errors.map_error``). A cancelled
call (client went away, deadline) cancels the handler, which closes the backend stream and so
aborts the request and frees its KV.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.request import MAX_SEED, SamplingParams
from engine.structured import StructuredOutput
from proto.pdcluster.v1 import generation_pb2 as pb
from proto.pdcluster.v1 import generation_pb2_grpc as pb_grpc
from router.contract import (
    GenerateInput,
    GenerationBackend,
    GenerationChunk,
    InvalidRequestError,
    new_request_id,
)
from router.frontdoor.choices import ChoiceChunk, ChoiceStreams
from router.frontdoor.errors import map_error
from router.frontdoor.metrics import Metrics
from router.frontdoor.security import Gate, RateLimitedError, Tenant, UnauthenticatedError

__all__ = ["SERVICE_NAME", "GenerationService", "GrpcServer", "request_to_input", "start_grpc_server"]

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "pdcluster.v1.Generation"
REQUEST_ID_METADATA_KEY = "x-request-id"

_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos",
                             "min_tokens", "include_stop_str_in_output", "presence_penalty",
                             "frequency_penalty", "repetition_penalty", "min_p", "logprobs")
# float32 on the wire: 0.7 arrives as 0.699999988; these are rounded back to what the caller wrote.
_FLOAT_SAMPLING_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                          "repetition_penalty", "min_p")


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults. Raises ValueError for bad values."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    for name in _FLOAT_SAMPLING_FIELDS:
        if name in kwargs:
            kwargs[name] = round(kwargs[name], 6)
    bias = {int(t): round(v, 6) for t, v in msg.logit_bias.items()}
    if msg.HasField("structured"):
        kwargs["structured"] = StructuredOutput(msg.structured.kind, msg.structured.spec)
    return SamplingParams(**kwargs, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                          logit_bias=bias)


def request_to_input(req: pb.GenerateRequest, request_id: str) -> GenerateInput:
    """Proto request -> backend input. Raises InvalidRequestError / ValueError for bad input."""
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("request has no prompt: set text, token_ids or messages")
    sampling = sampling_from_proto(req.sampling)
    if sampling.logprobs is not None and req.resumable:
        # A resumed stream is replayed from its log, which keeps token ids only.
        raise InvalidRequestError("logprobs: not available on a resumable request")
    model = req.model if req.HasField("model") and req.model else None
    common = dict(request_id=request_id, model=model, resumable=req.resumable)
    if kind == "text":
        return GenerateInput(sampling, text=req.text, **common)
    if kind == "token_ids":
        return GenerateInput(sampling, token_ids=list(req.token_ids.ids), **common)
    messages = [{"role": m.role, "content": m.content} for m in req.messages.messages]
    if not messages:
        raise InvalidRequestError("prompt is empty: messages has no entries")
    return GenerateInput(sampling, messages=messages, **common)


MAX_CHOICES = 64


def request_to_inputs(req: pb.GenerateRequest, request_id: str) -> list[GenerateInput]:
    """Proto request -> one backend input per choice (``n``): choice k's id is
    ``{request_id}-{k}`` (k > 0), a seeded choice j samples with ``seed + j``. Raises
    InvalidRequestError / ValueError for bad input."""
    inp = request_to_input(req, request_id)
    n = req.n if req.HasField("n") else 1
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequestError(f"n must be in [1, {MAX_CHOICES}], got {n}")
    if n > 1 and inp.resumable:
        raise InvalidRequestError("resumable: only for one choice (n = 1)")
    out = [inp]
    for j in range(1, n):
        params = inp.sampling if inp.sampling.seed is None else dataclasses.replace(
            inp.sampling, seed=(inp.sampling.seed + j) % (MAX_SEED + 1))
        out.append(dataclasses.replace(inp, sampling=params, request_id=f"{request_id}-{j}"))
    return out


def chunk_to_responses(chunk: GenerationChunk, request_id: str | None = None
                       ) -> list[pb.GenerateResponse]:
    """One backend chunk -> a token chunk (if it carries tokens or text) and/or the complete,
    under ``request_id`` (the id the client knows; default: the chunk's)."""
    rid = chunk.request_id if request_id is None else request_id
    out = []
    if chunk.token_ids or chunk.text:
        out.append(pb.GenerateResponse(request_id=rid, chunk=pb.GenerateChunk(
            token_ids=chunk.token_ids, text=chunk.text,
            logprobs=[pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                                      top=[pb.TopLogprob(token_id=t, logprob=x)
                                           for t, x in lp.top])
                      for lp in chunk.logprobs or ()])))
    if chunk.finished:
        usage = chunk.usage
        complete = pb.GenerateComplete(finish_reason=chunk.finish_reason or "stop")
        if usage is not None:
            complete.usage.CopyFrom(pb.Usage(prompt_tokens=usage.prompt_tokens,
                                             completion_tokens=usage.completion_tokens,
                                             total_tokens=usage.total_tokens))
        if chunk.ttft_s is not None:
            complete.ttft_s = chunk.ttft_s
        out.append(pb.GenerateResponse(request_id=rid, complete=complete))
    return out


class GenerationService(pb_grpc.GenerationServicer):
    """The Generation RPCs over one backend; metrics are shared with the HTTP server. Every
    RPC of this service needs an API key when the gate has keys (health and reflection are
    other services and stay open); request ids are the caller's tenant's own."""

    def __init__(self, backend: GenerationBackend, metrics: Metrics,
                 gate: Gate | None = None) -> None:
        self.backend = backend
        self.metrics = metrics
        self.gate = gate or Gate()

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
            inputs = request_to_inputs(request, self.gate.scoped(tenant, rid))
            for _ in inputs:  # each choice is a generation: the tenant's limits count each
                permits.append(self.gate.admit(tenant))
        except (ValueError, RateLimitedError) as e:
            for p in permits:
                p.release()
            err = map_error(e)
            await context.abort(err.grpc_code, err.message)
        inputs = [dataclasses.replace(inp, public_id=rid if k == 0 else f"{rid}-{k}", permit=p)
                  for k, (inp, p) in enumerate(zip(inputs, permits, strict=True))]
        try:
            # Before the first token, so a client can Abort a request still in prefill.
            await context.send_initial_metadata(((REQUEST_ID_METADATA_KEY, rid),))
            if len(inputs) == 1:
                chunks = self.metrics.track(self.backend.generate(inputs[0]), api="grpc")
                async for resp in self._stream(rid, chunks, context):
                    yield resp
            else:  # the choices merged, each response naming its own
                choices = ChoiceStreams(
                    lambda inp: self.metrics.track(self.backend.generate(inp), api="grpc"),
                    inputs, len(inputs))
                choices.start()
                async for resp in self._stream(rid, choices.events(), context, choices.aclose):
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
                      close=None) -> AsyncIterator[pb.GenerateResponse]:
        """One backend stream (GenerationChunks, or the ChoiceChunks of several choices) as
        GenerateResponses; errors mapped once, here. Closing it (``close``, default the
        stream's ``aclose``) aborts a generation (unless resumable) and stops following a
        resumed log."""
        stream = chunks
        sent_tokens = False
        try:
            try:
                async for item in stream:
                    index, chunk = ((item.index, item.chunk) if isinstance(item, ChoiceChunk)
                                    else (0, item))
                    for resp in chunk_to_responses(chunk, rid):
                        resp.index = index
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
                await context.abort(err.grpc_code, err.message)
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
            await context.abort(err.grpc_code, err.message)
        return pb.AbortResponse(found=bool(found))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._tenant(context)
        info = self.backend.model_info()
        return pb.ModelInfo(model_id=info.model_id, max_model_len=info.max_model_len,
                            vocab_size=info.vocab_size, eos_token_ids=list(info.eos_token_ids),
                            mode=info.mode)


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


def _checked_stream(method):
    async def handler(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for resp in method(request, context):
            yield resp
    return handler


def _checked_unary(method):
    async def handler(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await method(request, context)
    return handler


def _add_generation_service(service: GenerationService, server: grpc.aio.Server) -> None:
    """As the generated ``add_GenerationServicer_to_server``, except that undecodable
    request bytes get INVALID_ARGUMENT naming the message type, not INTERNAL."""
    def stream(method, req, resp):
        return grpc.unary_stream_rpc_method_handler(
            _checked_stream(method), request_deserializer=_lenient(req),
            response_serializer=resp.SerializeToString)

    def unary(method, req, resp):
        return grpc.unary_unary_rpc_method_handler(
            _checked_unary(method), request_deserializer=_lenient(req),
            response_serializer=resp.SerializeToString)

    handlers = {
        "Generate": stream(service.Generate, pb.GenerateRequest, pb.GenerateResponse),
        "Resume": stream(service.Resume, pb.ResumeRequest, pb.GenerateResponse),
        "Abort": unary(service.Abort, pb.AbortRequest, pb.AbortResponse),
        "GetModelInfo": unary(service.GetModelInfo, pb.GetModelInfoRequest, pb.ModelInfo),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                          handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class GrpcServer:
    """A started grpc.aio server with health and reflection; ``port`` is the bound port."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                 port: int) -> None:
        self.server = server
        self.health = health_servicer
        self.port = port

    async def stop(self, grace_s: float | None) -> None:
        """Report NOT_SERVING, stop accepting calls, let running calls finish for ``grace_s``
        seconds (None: forever), then cancel the rest (which aborts their requests)."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)

    async def wait_closed(self) -> None:
        await self.server.wait_for_termination()


async def start_grpc_server(backend: GenerationBackend, metrics: Metrics,
                            host: str = "127.0.0.1", port: int = 50051,
                            gate: Gate | None = None) -> GrpcServer:
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
    _add_generation_service(GenerationService(backend, metrics, gate), server)
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
    return GrpcServer(server, health_servicer, bound)
