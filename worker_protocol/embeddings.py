"""Embedding requests on a worker (``/v1/embeddings``): prefill-only work. The prompt runs
through the worker's engine like any prompt (batched with others, its full blocks cached for
later prompts) as a ``max_tokens=1`` request with ``SamplingParams.pooling``; its output is
the pooled vector, and nothing else: no KV leaves the worker, no decode worker reserves any,
and no token reaches the router's token stream (``WorkerEmbeddings.take`` removes its outputs
from what the worker publishes). A disaggregated cluster runs them on prefill workers, a
colocated one on its workers."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

from engine.contract import RequestFailedError, RequestOutput, SamplingParams
from engine.lora.request import LoRARequest


@dataclass(frozen=True)
class EmbedRequest:
    """One prompt to embed: ``pooling`` "last" | "mean" | "cls", L2-``normalize``d; under
    ``lora_request``'s adapter (None: the base model). The worker gives up after
    ``timeout_s`` (aborting it there)."""

    request_id: str
    prompt_token_ids: list[int]
    pooling: str = "last"
    normalize: bool = True
    lora_request: LoRARequest | None = None
    timeout_s: float = 60.0


@dataclass(frozen=True)
class EmbedResult:
    request_id: str
    embedding: list[float]
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the prefix cache served (``last`` pooling only)


class WorkerEmbeddings:
    """A worker's embedding requests: ``loop`` (its ``EngineLoop``), ``adapters`` (its
    ``WorkerAdapters``), ``timeout_s`` for calls onto the engine thread."""

    def __init__(self, loop, adapters, timeout_s: float) -> None:
        self.loop, self.adapters, self.timeout_s = loop, adapters, timeout_s
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()

    def embed(self, req: EmbedRequest) -> EmbedResult:
        """Run ``req`` to its vector. Raises ValueError (bad input, a refused adapter),
        QueueFullError, RequestFailedError, or TimeoutError (aborted here first)."""
        params = SamplingParams(max_tokens=1, temperature=0, pooling=req.pooling,
                                normalize=req.normalize)
        fut: Future = Future()
        with self._lock:
            if req.request_id in self._futures:
                raise ValueError(f"duplicate request id {req.request_id!r}")
            self._futures[req.request_id] = fut
        try:
            self.adapters.ensure(req.lora_request)  # read here, not on the engine thread
            self.loop.call(lambda e: e.add_request(
                list(req.prompt_token_ids), params, req.request_id,
                lora_request=req.lora_request)).result(self.timeout_s)
            try:
                out: RequestOutput = fut.result(req.timeout_s)
            except TimeoutError:
                self.loop.call(lambda e: e.abort_request(req.request_id))
                raise TimeoutError(f"embedding {req.request_id} was not done within "
                                   f"{req.timeout_s:g} s") from None
        finally:
            with self._lock:
                self._futures.pop(req.request_id, None)
        if out.finish_reason == "error" or out.embedding is None:
            raise RequestFailedError(f"embedding {req.request_id} failed: "
                                     f"{out.error or out.finish_reason}")
        return EmbedResult(req.request_id, out.embedding, len(out.prompt_token_ids),
                           out.metrics.num_cached_tokens)

    def take(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """``outs`` without the embedding requests' (their callers get those): what the
        worker publishes. Called on the engine thread after every step."""
        if not self._futures:
            return outs
        rest = []
        with self._lock:
            for o in outs:
                fut = self._futures.get(o.request_id)
                if fut is None:
                    rest.append(o)
                elif o.finished and not fut.done():
                    fut.set_result(o)
        return rest
