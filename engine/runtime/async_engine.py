"""asyncio face of one in-process engine: ``async for out in engine.generate(...)``.

The engine runs on its own ``EngineLoop`` thread; each request gets an asyncio queue that the
loop feeds (thread-safely) once per step. Leaving the ``async for`` early (client went away,
cancellation) aborts the request, so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from engine.contract import RequestFailedError, RequestMetrics, RequestOutput, SamplingParams
from engine.lora.request import LoRARequest
from engine.runtime.compute_thread import ComputeThread
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.llm_engine import EngineArgs, LLMEngine, Prompt


class AsyncEngine:
    """Owns an LLMEngine and its loop thread; ``shutdown()`` stops the thread."""

    def __init__(self, args: EngineArgs | None = None, engine: LLMEngine | None = None) -> None:
        # Built on the thread that will step it (engine.runtime.compute_thread says why).
        compute, self.engine = ComputeThread.building(
            "async-engine", lambda: engine or LLMEngine(args or EngineArgs()))
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self.loop = EngineLoop(self.engine, self._on_step, name="async-engine",
                               on_crash=self._on_crash, compute=compute)

    def _on_step(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            entry = self._queues.get(out.request_id)
            if entry is not None:
                aloop, q = entry
                aloop.call_soon_threadsafe(q.put_nowait, out)

    def _on_crash(self, error: BaseException) -> None:
        """Every open request ends with the error (none would ever get another token)."""
        for rid, (aloop, q) in list(self._queues.items()):
            failed = RequestOutput(rid, [], [], "", True, "error", RequestMetrics(0.0, None, None, []),
                                   error=f"engine loop crashed: {error!r}")
            aloop.call_soon_threadsafe(q.put_nowait, failed)

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield updates until the request finishes (under ``lora_request``'s adapter: None,
        the base model; ``priority``: the engine's, higher first). Raises ValueError /
        QueueFullError at once for bad input or a full queue (nothing is left queued)."""
        rid = request_id or f"async-{next(self._ids)}"
        if rid in self._queues:
            raise ValueError(f"duplicate request id {rid!r}")
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            await asyncio.wrap_future(self.loop.call(lambda e: e.add_request(
                prompt, params, rid, lora_request=lora_request, priority=priority)))
            while True:
                out = await q.get()
                finished = out.finished
                if out.finish_reason == "error":
                    raise RequestFailedError(f"request {rid} failed: {out.error}")
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.loop.call(lambda e: e.abort_request(rid))

    async def abort(self, request_id: str) -> bool:
        """Abort a running request; its generator then ends with finish_reason "abort"."""
        out = await asyncio.wrap_future(self.loop.call_and_emit(lambda e: e.abort_request(request_id)))
        return out is not None

    def shutdown(self) -> None:
        self.loop.stop()
        self.engine.close()
