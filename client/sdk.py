"""The gRPC client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    with Client("127.0.0.1:50051") as c:
        print(c.generate("Hello", max_tokens=8, temperature=0).text)
        with c.stream(messages=[{"role": "user", "content": "Hi"}]) as s:
            for chunk in s:
                print(chunk.text, end="")

Every call takes ``timeout=`` (seconds, a deadline for the whole call, retries included).
Errors are ``PdclusterError`` subclasses (``InvalidArgument``, ``NotFound``,
``ResourceExhausted``, ``Unavailable``, ...). UNAVAILABLE is retried with exponential backoff,
but only before any token arrived. Closing a stream early (``close()``, leaving the ``with``
block, ``break`` then garbage collection, or cancelling the task) cancels the call, and the
server aborts the request and frees its KV.

Resumable streams: ``stream(..., resume=True)`` asks the server to keep the request running
if the call breaks, and resumes it by itself (``Resume`` RPC, on whichever router answers)
from the last token received; ``resume(request_id, from_index)`` does the same by hand, e.g.
from another process. The tokens equal an unbroken stream's.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import grpc

from client.channel import Deadline, KeyedStub, credentials
from client.types import (
    REQUEST_ID_METADATA_KEY,
    GenerateResult,
    ModelInfo,
    RetryPolicy,
    ServedModel,
    StreamChunk,
    build_request,
    chunk_from_response,
    embed_request,
    embeddings_from_proto,
    error_from_rpc,
    model_info_from_proto,
    retry_after_of,
    served_models_from_proto,
)
from proto.pdcluster.v1 import generation_pb2 as pb
from proto.pdcluster.v1 import generation_pb2_grpc as pb_grpc

__all__ = ["AsyncClient", "AsyncGenerateStream", "Client", "GenerateStream"]


def _request_id_from(metadata) -> str | None:
    return dict(metadata or ()).get(REQUEST_ID_METADATA_KEY)


# ---- blocking --------------------------------------------------------------------------------
class _StreamCall:
    """What both stream kinds keep about one request's call: retries before the first token,
    and resumption (a new ``Resume`` call from the last token received) after it."""

    def __init__(self, stub: pb_grpc.GenerationStub, request: pb.GenerateRequest | None,
                 timeout: float | None, retry: RetryPolicy, *, resume: bool = False,
                 request_id: str | None = None, from_index: int = 0) -> None:
        """``request`` None: follow ``request_id``'s stream from ``from_index`` (Resume)."""
        self._stub = stub
        self._request = request
        self._deadline = Deadline(timeout)
        self._retry = retry
        self._call = None
        self._attempt = 0
        self._got_tokens = False
        self._done = False
        self._resume = resume or request is None
        self._resuming = request is None  # the next call is Resume
        self._resumes = 0
        self._received = from_index  # tokens the caller has: where a resume starts
        self.request_id: str | None = (request_id or (request.request_id if request else None)
                                       or None)
        # Per choice (GenerateResponse.index): one unless the request asked for n.
        self.results: dict[int, GenerateResult] = {0: GenerateResult(self.request_id or "")}

    @property
    def result(self) -> GenerateResult:
        """Everything the stream carried, joined (choice 0's, for a request with ``n``)."""
        return self.results[0]

    def _new_call(self):
        timeout = self._deadline.remaining()
        if self._resuming:
            return self._stub.Resume(pb.ResumeRequest(request_id=self.request_id,
                                                      from_index=self._received), timeout=timeout)
        return self._stub.Generate(self._request, timeout=timeout)

    def _resume_delay(self, code: grpc.StatusCode) -> float | None:
        """Seconds to wait before resuming a broken stream, or None: do not resume."""
        if not (self._resume and self.request_id and (self._got_tokens or self._resuming)):
            return None
        if not self._retry.should_resume(code, self._resumes):
            return None
        self._resuming = True
        self._resumes += 1
        return self._deadline.clip(self._retry.resume_backoff_s(self._resumes - 1))

    def _ensure_call(self):
        if self._call is None:
            self._call = self._new_call()
        return self._call

    def _accept(self, resp) -> StreamChunk:
        chunk = chunk_from_response(resp)
        self.request_id = chunk.request_id or self.request_id
        self._got_tokens = self._got_tokens or bool(chunk.token_ids)
        self._received += len(chunk.token_ids)
        self.results.setdefault(chunk.index, GenerateResult(chunk.request_id)).add(chunk)
        return chunk


class GenerateStream(_StreamCall):
    """Iterator of ``StreamChunk`` for one request; the call starts on the first ``next``.

    ``request_id`` is known after the first chunk (or call ``wait_request_id()``). ``result``
    holds everything joined once the stream is exhausted. ``close()`` cancels the call.
    """

    def _handle(self, e: grpc.RpcError) -> None:
        """Retry or resume (return), or raise the mapped error."""
        self._call = None
        delay = self._resume_delay(e.code())
        if delay is not None:
            time.sleep(delay)
            return
        after = retry_after_of(e)
        if self._retry.should_retry(e.code(), self._attempt, self._got_tokens, after):
            time.sleep(self._deadline.clip(self._retry.backoff_s(self._attempt, after)))
            self._attempt += 1
            return
        self._done = True
        raise error_from_rpc(e) from None

    def wait_request_id(self) -> str:
        """Start the call if needed and block until the server accepted it; returns its id."""
        while self.request_id is None:
            try:
                rid = _request_id_from(self._ensure_call().initial_metadata())
            except grpc.RpcError as e:
                self._handle(e)
                continue
            if rid is None:  # only a server without the metadata; the first chunk has it
                break
            self.request_id = rid
        return self.request_id or ""

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        while not self._done:
            try:
                resp = next(self._ensure_call())
            except StopIteration:
                self._done = True
                break
            except grpc.RpcError as e:
                self._handle(e)
                continue
            return self._accept(resp)
        raise StopIteration

    def close(self) -> None:
        """Cancel the call (the server aborts the request). Idempotent."""
        self._done = True
        if self._call is not None:
            self._call.cancel()
            self._call = None

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        call = getattr(self, "_call", None)
        if call is not None:
            call.cancel()


class Client:
    """Blocking client for one server address (``"host:port"``).

    ``timeout`` is the default per-call deadline in seconds (None: none); ``retry`` governs
    UNAVAILABLE retries. ``api_key`` (default ``$PDCLUSTER_API_KEY``) goes with every call.
    ``tls=True`` (or a ``ca_file``) connects over TLS, verifying the server against
    ``ca_file`` (default: the system's roots); ``client_cert`` + ``client_key`` (PEM files)
    answer a server that requires client certificates. Safe to share between threads.
    """

    def __init__(self, address: str = "127.0.0.1:50051", *, timeout: float | None = None,
                 retry: RetryPolicy | None = None, channel_options: list | None = None,
                 api_key: str | None = None, tls: bool = False, ca_file: str | None = None,
                 client_cert: str | None = None, client_key: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        creds = credentials(tls, ca_file, client_cert, client_key)
        options = channel_options or []
        self._channel = (grpc.secure_channel(address, creds, options=options) if creds
                         else grpc.insecure_channel(address, options=options))
        self._stub = KeyedStub(self._channel, api_key or os.environ.get("PDCLUSTER_API_KEY"))

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def stream(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
               messages: list[dict] | None = None, model: str | None = None,
               request_id: str | None = None, timeout: float | None = None,
               resume: bool = False, n: int | None = None, tools: list[dict] | None = None,
               tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
               priority: int | None = None, **sampling) -> GenerateStream:
        """Stream one request. Exactly one of ``prompt`` / ``prompt_token_ids`` / ``messages``;
        ``sampling``: max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids,
        ignore_eos, min_tokens, include_stop_str_in_output, presence_penalty,
        frequency_penalty, repetition_penalty, min_p, logit_bias ({token id: bias}),
        logprobs (0-20: each chunk's ``logprobs`` then gives every token's log-probability and
        that many alternatives; not with ``resume``), structured (the output matches one of
        ``{"json": schema}``, ``{"json_object": True}``, ``{"regex": str}``,
        ``{"choice": [str, ...]}``, ``{"grammar": lark_or_gbnf}``) (unset: server defaults).
        ``resume``: the request survives a broken call (router restarted, connection cut)
        and this stream resumes it by itself from the last token received (UNAVAILABLE is
        retried up to ``RetryPolicy.max_resumes`` times); without it, a broken call after
        the first token raises and the server aborts the request.
        ``n``: that many choices (1-64; a seeded choice j samples with seed + j), their chunks
        merged, each naming its ``index``; ``results`` holds each joined (see ``choices``).
        ``tools`` (OpenAI's tool list; with ``messages``), ``tool_choice`` ("none" | "auto" |
        "required" | ``{"type": "function", "function": {"name": ...}}``) and
        ``parallel_tool_calls``: the last chunk (and the result) carries ``tool_calls`` and
        ``content`` parsed from the output; required and named calls are enforced by a grammar.
        ``priority`` (vLLM's: lower runs first, -1000..1000; unset: 0).
        Raises ValueError / TypeError for a malformed call; server errors surface while
        iterating."""
        req = build_request(prompt, prompt_token_ids, messages, model, request_id, sampling,
                            resumable=resume, n=n, tools=tools, tool_choice=tool_choice,
                            parallel_tool_calls=parallel_tool_calls, priority=priority)
        return GenerateStream(self._stub, req, self._timeout(timeout), self.retry, resume=resume)

    def resume(self, request_id: str, from_index: int = 0,
               timeout: float | None = None) -> GenerateStream:
        """Follow ``request_id``'s stream (on any router of its deployment) from token
        ``from_index`` on, until the request ends. NotFound for an unknown or expired id."""
        return GenerateStream(self._stub, None, self._timeout(timeout), self.retry,
                              request_id=request_id, from_index=from_index)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerateResult:
        """Run one request to completion; same arguments as ``stream``."""
        with self.stream(prompt, **kwargs) as s:
            for _ in s:
                pass
            return s.result

    def chat(self, messages: list[dict], **kwargs) -> GenerateResult:
        """Generate the assistant's reply to ``messages`` (the model's chat template)."""
        return self.generate(messages=messages, **kwargs)

    def choices(self, prompt: str | None = None, *, n: int, **kwargs) -> list[GenerateResult]:
        """``n`` generations of one prompt to completion, by choice index; the arguments are
        ``stream``'s."""
        with self.stream(prompt, n=n, **kwargs) as s:
            for _ in s:
                pass
            return [s.results[i] for i in sorted(s.results)]

    def _unary(self, method, request, timeout: float | None):
        deadline = Deadline(self._timeout(timeout))
        attempt = 0
        while True:
            try:
                return method(request, timeout=deadline.remaining())
            except grpc.RpcError as e:
                after = retry_after_of(e)
                if not self.retry.should_retry(e.code(), attempt, False, after):
                    raise error_from_rpc(e) from None
                time.sleep(deadline.clip(self.retry.backoff_s(attempt, after)))
                attempt += 1

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return model_info_from_proto(
            self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    def abort(self, request_id: str, timeout: float | None = None) -> bool:
        """Abort a running request; False if it is unknown or already finished."""
        resp = self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout)
        return resp.found

    def embed(self, inputs: str | list[int] | list[str | list[int]], model: str | None = None,
              timeout: float | None = None) -> list[list[float]]:
        """One embedding per input (a text or token ids; one input or a list), pooled as the
        server is configured; ``model``: the base model (None) or a LoRA adapter."""
        return embeddings_from_proto(self._unary(self._stub.Embed,
                                                 embed_request(inputs, model), timeout))

    def list_models(self, timeout: float | None = None) -> list[ServedModel]:
        """The base model, then every LoRA adapter served (names ``model`` may take)."""
        return served_models_from_proto(
            self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout))

    def load_lora_adapter(self, lora_name: str, lora_path: str,
                          timeout: float | None = None) -> None:
        """Serve the PEFT adapter folder ``lora_path`` (as the workers see it) as model
        ``lora_name``; an operator's call. Raises InvalidArgument when refused."""
        self._unary(self._stub.LoadLoRAAdapter, pb.LoadLoRAAdapterRequest(
            lora_name=lora_name, lora_path=lora_path), timeout)

    def unload_lora_adapter(self, lora_name: str, timeout: float | None = None) -> None:
        """Stop serving adapter ``lora_name`` (refused while requests run under it)."""
        self._unary(self._stub.UnloadLoRAAdapter,
                    pb.UnloadLoRAAdapterRequest(lora_name=lora_name), timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- asyncio ---------------------------------------------------------------------------------
class AsyncGenerateStream(_StreamCall):
    """Async iterator of ``StreamChunk``; ``aclose()`` (or ``async with``, or cancelling the
    task that iterates) cancels the call and the server aborts the request."""

    async def _handle(self, e: grpc.aio.AioRpcError) -> None:
        self._call = None
        delay = self._resume_delay(e.code())
        if delay is not None:
            await asyncio.sleep(delay)
            return
        after = retry_after_of(e)
        if self._retry.should_retry(e.code(), self._attempt, self._got_tokens, after):
            await asyncio.sleep(self._deadline.clip(self._retry.backoff_s(self._attempt, after)))
            self._attempt += 1
            return
        self._done = True
        raise error_from_rpc(e) from None

    async def wait_request_id(self) -> str:
        """Start the call if needed and wait until the server accepted it; returns its id."""
        while self.request_id is None:
            try:
                rid = _request_id_from(await self._ensure_call().initial_metadata())
            except grpc.aio.AioRpcError as e:
                await self._handle(e)
                continue
            if rid is None:
                break
            self.request_id = rid
        return self.request_id or ""

    def __aiter__(self) -> AsyncGenerateStream:
        return self

    async def __anext__(self) -> StreamChunk:
        while not self._done:
            call = self._ensure_call()
            try:
                resp = await call.read()
            except grpc.aio.AioRpcError as e:
                await self._handle(e)
                continue
            except asyncio.CancelledError:
                await self.aclose()
                raise
            if resp is grpc.aio.EOF:
                self._done = True
                break
            return self._accept(resp)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Cancel the call (the server aborts the request). Idempotent."""
        self._done = True
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncClient:
    """asyncio client; same API as ``Client`` with ``await`` (``stream`` returns an async
    iterator). Create and use it inside one event loop."""

    def __init__(self, address: str = "127.0.0.1:50051", *, timeout: float | None = None,
                 retry: RetryPolicy | None = None, channel_options: list | None = None,
                 api_key: str | None = None, tls: bool = False, ca_file: str | None = None,
                 client_cert: str | None = None, client_key: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        creds = credentials(tls, ca_file, client_cert, client_key)
        options = channel_options or []
        self._channel = (grpc.aio.secure_channel(address, creds, options=options) if creds
                         else grpc.aio.insecure_channel(address, options=options))
        self._stub = KeyedStub(self._channel, api_key or os.environ.get("PDCLUSTER_API_KEY"))

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def stream(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
               messages: list[dict] | None = None, model: str | None = None,
               request_id: str | None = None, timeout: float | None = None,
               resume: bool = False, n: int | None = None, tools: list[dict] | None = None,
               tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
               priority: int | None = None, **sampling) -> AsyncGenerateStream:
        """See ``Client.stream``."""
        req = build_request(prompt, prompt_token_ids, messages, model, request_id, sampling,
                            resumable=resume, n=n, tools=tools, tool_choice=tool_choice,
                            parallel_tool_calls=parallel_tool_calls, priority=priority)
        return AsyncGenerateStream(self._stub, req, self._timeout(timeout), self.retry,
                                   resume=resume)

    def resume(self, request_id: str, from_index: int = 0,
               timeout: float | None = None) -> AsyncGenerateStream:
        """See ``Client.resume``."""
        return AsyncGenerateStream(self._stub, None, self._timeout(timeout), self.retry,
                                   request_id=request_id, from_index=from_index)

    async def generate(self, prompt: str | None = None, **kwargs) -> GenerateResult:
        async with self.stream(prompt, **kwargs) as s:
            async for _ in s:
                pass
            return s.result

    async def chat(self, messages: list[dict], **kwargs) -> GenerateResult:
        return await self.generate(messages=messages, **kwargs)

    async def choices(self, prompt: str | None = None, *, n: int,
                      **kwargs) -> list[GenerateResult]:
        """See ``Client.choices``."""
        async with self.stream(prompt, n=n, **kwargs) as s:
            async for _ in s:
                pass
            return [s.results[i] for i in sorted(s.results)]

    async def _unary(self, method, request, timeout: float | None):
        deadline = Deadline(self._timeout(timeout))
        attempt = 0
        while True:
            try:
                return await method(request, timeout=deadline.remaining())
            except grpc.aio.AioRpcError as e:
                after = retry_after_of(e)
                if not self.retry.should_retry(e.code(), attempt, False, after):
                    raise error_from_rpc(e) from None
                await asyncio.sleep(deadline.clip(self.retry.backoff_s(attempt, after)))
                attempt += 1

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        return model_info_from_proto(
            await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        resp = await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id),
                                 timeout)
        return resp.found

    async def embed(self, inputs: str | list[int] | list[str | list[int]],
                    model: str | None = None, timeout: float | None = None) -> list[list[float]]:
        return embeddings_from_proto(await self._unary(self._stub.Embed,
                                                       embed_request(inputs, model), timeout))

    async def list_models(self, timeout: float | None = None) -> list[ServedModel]:
        return served_models_from_proto(
            await self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout))

    async def load_lora_adapter(self, lora_name: str, lora_path: str,
                                timeout: float | None = None) -> None:
        await self._unary(self._stub.LoadLoRAAdapter, pb.LoadLoRAAdapterRequest(
            lora_name=lora_name, lora_path=lora_path), timeout)

    async def unload_lora_adapter(self, lora_name: str, timeout: float | None = None) -> None:
        await self._unary(self._stub.UnloadLoRAAdapter,
                          pb.UnloadLoRAAdapterRequest(lora_name=lora_name), timeout)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
