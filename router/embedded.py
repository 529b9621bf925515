"""One in-process engine behind the backend contract: ``pdcluster generate --local``, the
embedded use, and the front doors' own tests (no Ray, no workers)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator

from engine.contract import SamplingParams, check_priority
from engine.core.step_times import merge_rows
from engine.lora.request import LoRARequest
from router.contract import (
    AdapterInUseError,
    BackendStats,
    DrainStatus,
    EmbedInput,
    EmbedOutput,
    GenerateInput,
    GenerationChunk,
    InvalidRequestError,
    ModelInfo,
    ModelNotFoundError,
    QueueFullError,
    ServedModel,
    Usage,
    WorkerLoad,
    WorkerNotFoundError,
    WorkerStatus,
    as_invalid_request,
    new_request_id,
)
from worker_protocol.adapters import lora_load_fields
from worker_protocol.messages import offload_load
from worker_protocol.tracing import (
    TracingConfig,
    close_request_span,
    end,
    open_request_span,
    start_tracing,
    wall_ns,
)

__all__ = ["EngineBackend"]


class EngineBackend:
    """One in-process engine behind the backend contract (embedded mode, front-door tests)."""

    def __init__(self, engine_args=None, tracing: TracingConfig | None = None,
                 pooling: str = "last", normalize_embeddings: bool = True) -> None:
        """``tracing``: export each request's trace (worker_protocol.tracing); None: off.
        ``pooling`` / ``normalize_embeddings``: how ``embed`` pools (engine.executor.pooling)."""
        self.pooling, self.normalize_embeddings = pooling, normalize_embeddings
        from engine.args import EngineArgs
        from engine.runtime.async_engine import AsyncEngine
        from router.state.memory import InMemoryStore
        from router.state.stream_log import StreamLogger

        self._async = AsyncEngine(engine_args or EngineArgs())
        eng = self._async.engine
        self._info = ModelInfo(eng.model_config.model_id, eng.max_model_len,
                               eng.model_config.vocab_size, eng.eos_token_ids, mode="embedded",
                               tool_call_parser=eng.tokenizer.tool_call_format()
                               if eng.tokenizer is not None else None)
        self.streams = StreamLogger(InMemoryStore(), self._info.model_id, eng.tokenizer)
        self._tracing = start_tracing(tracing, "pdcluster-embedded", is_router=True)
        # Served adapters by name, in load order: what requests carry, what /v1/models lists.
        self._loras: dict[str, tuple[LoRARequest, ServedModel]] = {}
        self._lora_ids = itertools.count(1)
        self._lora_counts: dict[str, list[int]] = {}  # name -> [requests, tokens], cumulative

    @property
    def engine(self):
        return self._async.engine

    def model_info(self) -> ModelInfo:
        return self._info

    def tokenize(self, prompt: str | list[dict], tools: list[dict] | None = None,
                 add_special_tokens: bool | None = None, chat_template_kwargs: dict | None = None
                 ) -> list[int]:
        return as_invalid_request(self._async.engine.inputs.encode, prompt, tools,
                                  add_special_tokens, chat_template_kwargs).token_ids

    def detokenize(self, token_ids: list[int]) -> str:
        return as_invalid_request(self._async.engine.inputs.decode, token_ids)

    def generate(self, inp: GenerateInput) -> AsyncIterator[GenerationChunk]:
        return self.streams.keep(inp, self._generate(inp))

    def resume(self, request_id: str, from_index: int = 0) -> AsyncIterator[GenerationChunk]:
        return self.streams.resume(request_id, from_index)

    async def stream_kind(self, request_id: str) -> str | None:
        return await self.streams.kind(request_id)

    async def embed(self, inp: EmbedInput) -> EmbedOutput:
        """Each input as an embedding request of the one engine, at once (they batch)."""
        if not inp.inputs:
            raise InvalidRequestError("input: at least one item")
        lora = self._lora_of(inp.model)
        params = SamplingParams(max_tokens=1, temperature=0, pooling=self.pooling,
                                normalize=self.normalize_embeddings)
        rid = inp.request_id or new_request_id()

        async def one(i: int, item) -> tuple[list[float], int]:
            outs = []
            try:
                async for o in self._async.generate(item, params, f"{rid}-emb{i}", lora):
                    outs.append(o)
            except ValueError as e:
                where = f"input[{i}]: " if len(inp.inputs) > 1 else "input: "
                raise InvalidRequestError(where + str(e)) from e
            return outs[-1].embedding, len(outs[-1].prompt_token_ids)

        done = await asyncio.gather(*[one(i, x) for i, x in enumerate(inp.inputs)])
        return EmbedOutput([v for v, _ in done], sum(n for _, n in done))

    # ---- LoRA adapters (the engine's own registry; one engine, so no fan-out) ---------------
    def served_models(self) -> list[ServedModel]:
        return [ServedModel(self._info.model_id), *(m for _, m in self._loras.values())]

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        if lora_name in self._loras or lora_name == self._info.model_id:
            raise InvalidRequestError(f"LoRA adapter {lora_name!r} is already served")
        try:
            req = LoRARequest(lora_name, next(self._lora_ids), lora_path)
            # read off the engine thread, held between two steps (worker_protocol.adapters)
            adapter = await asyncio.to_thread(self.engine.read_lora, req)
            await asyncio.wrap_future(self._async.loop.call(lambda e: e.load_lora(req, adapter)))
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        self._loras[lora_name] = (req, ServedModel(lora_name, self._info.model_id, lora_path,
                                                   int(time.time()), req.lora_int_id))

    async def unload_lora_adapter(self, lora_name: str) -> None:
        if lora_name not in self._loras:
            raise ModelNotFoundError(f"LoRA adapter {lora_name!r} is not loaded")

        def drop(e) -> None:
            with contextlib.suppress(KeyError):  # the LRU dropped it already
                e.remove_lora(lora_name)

        try:
            await asyncio.wrap_future(self._async.loop.call(drop))
        except ValueError as e:  # requests run under it: refused
            raise AdapterInUseError(str(e)) from e
        del self._loras[lora_name]

    def _lora_of(self, model: str | None) -> LoRARequest | None:
        if model is None or model == self._info.model_id:
            return None
        served = self._loras.get(model)
        if served is None:
            names = ", ".join(repr(m.id) for m in self.served_models())
            raise ModelNotFoundError(f"model {model!r} is not served here (serving {names})")
        return served[0]

    async def _generate(self, inp: GenerateInput) -> AsyncIterator[GenerationChunk]:
        lora = self._lora_of(inp.model)
        counts = (self._lora_counts.setdefault(lora.lora_name, [0, 0]) if lora is not None
                  else [0, 0])  # [requests, tokens]
        rid = inp.request_id or new_request_id()
        t0 = asyncio.get_running_loop().time()
        ttft = None
        root = (open_request_span(self._tracing, rid, self._info.model_id,
                                  inp.messages is not None, 0, inp.sampling, inp.traceparent,
                                  inp.user)
                if self._tracing is not None else None)
        # the engine's priorities run the other way (higher first)
        priority = -as_invalid_request(check_priority, inp.priority)
        counts[0] += 1  # taken back below if the engine refuses it: admitted requests count
        gen = self._async.generate(inp.prompt, inp.sampling, rid, lora, priority)
        opened = finished = False
        out = error = None
        try:
            async for out in gen:
                if not opened:
                    self.streams.open(rid, out.prompt_token_ids, inp.sampling,
                                      inp.messages is not None)
                    opened = True
                self.streams.append(rid, out.new_token_ids,
                                    out.finish_reason if out.finished else None)
                finished = out.finished
                counts[1] += len(out.new_token_ids)
                if ttft is None and out.token_ids:
                    ttft = asyncio.get_running_loop().time() - t0
                usage = (Usage(len(out.prompt_token_ids), len(out.token_ids))
                         if out.finished else None)
                first = len(out.token_ids) == len(out.new_token_ids)
                yield GenerationChunk(rid, out.new_token_ids, out.delta_text, out.finished,
                                      out.finish_reason, usage, ttft, len(out.prompt_token_ids),
                                      out.new_logprobs, out.prompt_logprobs if first else None)
        except ValueError as e:
            error = InvalidRequestError(str(e))
            raise error from e
        except Exception as e:
            error = e
            raise
        finally:
            if not opened and isinstance(error, (InvalidRequestError, QueueFullError)):
                counts[0] -= 1  # refused at the engine's door (nothing else raises these)
            if opened and not finished:
                self.streams.append(rid, [], "abort")
            await gen.aclose()
            if root is not None:
                self._close_trace(root, out, finished, error)

    def _close_trace(self, root, out, finished: bool, error: BaseException | None) -> None:
        """The engine's phases of the request (from its own timings) under ``root``, then
        the root: queue, prefill (to the first token), decode (to the last)."""
        if out is not None:
            root.set_attribute("gen_ai.usage.input_tokens", len(out.prompt_token_ids))
            m, clock = out.metrics, self._async.engine.clock
            marks = [m.arrival_time, m.first_scheduled_time, m.first_token_time,
                     m.finished_time]
            for name, a, b in zip(("queue", "prefill", "decode"), marks, marks[1:],
                                  strict=False):
                if a is not None and b is not None:
                    span = self._tracing.start(name, root, start_ns=wall_ns(a, clock))
                    if name == "prefill":
                        span.set_attribute("pdcluster.prompt.cached_tokens", m.num_cached_tokens)
                        span.set_attribute("pdcluster.prefill.chunks", m.num_prompt_chunks)
                    end(span, end_ns=wall_ns(b, clock))
        close_request_span(root, len(out.token_ids) if out is not None else 0,
                           out.finish_reason if finished and out is not None else None, error)

    async def abort(self, request_id: str) -> bool:
        return await self._async.abort(request_id)

    async def stats(self) -> BackendStats:
        s = self._async.engine.stats()
        return BackendStats([WorkerLoad("embedded-0", "embedded", s.kv_blocks_used,
                                        s.kv_blocks_total, s.num_running, s.num_waiting,
                                        kv_block_bytes=s.kv_block_bytes, **offload_load(s),
                                        **lora_load_fields(self.engine))],
                            prefix_hit_tokens={"embedded": s.num_prefix_hit_tokens},
                            prefill_computed_tokens=s.num_prefill_tokens_computed,
                            decode_steps=merge_rows([s.decode_steps]),
                            mixed_steps=merge_rows([s.mixed_steps]),
                            lora_adapters={n: tuple(c) for n, c in self._lora_counts.items()})

    async def cluster_status(self) -> list[WorkerStatus]:
        engine = self._async.engine
        s = engine.stats()
        return [WorkerStatus("embedded-0", "embedded", "127.0.0.1", os.getpid(), "ready",
                             s.kv_blocks_used, s.kv_blocks_total, s.num_running, s.num_waiting,
                             threads=s.num_threads, cpu_stolen=s.cpu_stolen,
                             kv_cache_dtype=engine.cache_config.kv_cache_dtype,
                             kv_block_bytes=s.kv_block_bytes)]

    async def drain_worker(self, worker_id: str, migrate_after_s: float | None = None,
                           wait: bool = False) -> DrainStatus:
        """Embedded: the one engine is this process; there is nothing to drain it onto."""
        raise WorkerNotFoundError(f"no worker {worker_id!r} to drain: embedded mode runs one "
                                  "in-process engine (drain workers of `pdcluster serve`)")

    async def shutdown(self) -> None:
        await self.streams.close()
        self._async.shutdown()
        if self._tracing is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._tracing.shutdown)
