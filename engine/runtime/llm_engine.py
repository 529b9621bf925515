"""The single-process engine's step loop: validation, scheduling, model execution, detokenization.

``LLMEngine.step()`` runs one iteration (schedule -> execute -> update -> detokenize) and returns
a ``RequestOutput`` for every request that produced a token or finished. It is the loop body
for the offline ``LLM``, the prefill worker and the decode worker alike; none of them reimplement
it. Not thread-safe: one thread drives an engine. Its parts (model, runner, scheduler, block
manager, tensor-parallel ranks) are built by ``engine.runtime.build``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.args import EngineArgs  # re-exported: its home is engine.args (no torch)
from engine.contract import RequestMetrics, RequestOutput, RequestProgress, SamplingParams
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import StepUpdate
from engine.core.step_times import StepTimes
from engine.executor.kv_tier import TierStats
from engine.executor.pooling import join_parts
from engine.lora.peft_format import LoRAAdapter
from engine.lora.request import LoRARequest
from engine.runtime.build import build_engine
from engine.runtime.kv_connector import StepInfo
from engine.text.input_processor import Prompt
from engine.text.tokenizer import IncrementalDetokenizer, LazyTokenizer


@dataclass(frozen=True)
class EngineStats:
    """What an operator (and a router's load report) reads off one engine."""

    kv_blocks_used: int  # reserved-for-remote-KV blocks included
    kv_blocks_total: int
    block_size: int
    kv_blocks_reserved: int  # held for KV still arriving from another worker
    num_running: int
    num_waiting: int  # queued, or waiting for remote KV
    num_generated_tokens: int
    # Cumulative: prompt (and recomputed) tokens run through the model, and prompt tokens
    # whose KV came from the prefix cache instead (local hits and pinned remote prefixes).
    num_prefill_tokens_computed: int = 0
    num_prefix_hit_tokens: int = 0
    # Cumulative pure-decode steps per batch size: (batch, steps, seconds) (engine.core.step_times).
    decode_steps: tuple = ()
    mixed_steps: tuple = ()  # the same for mixed steps (decode rows beside prefill chunks)
    # The second KV cache tier (engine.executor.kv_tier), None when off; of the prefix hits, the
    # tokens restored from it (cumulative).
    kv_offload: TierStats | None = None
    num_restored_tokens: int = 0
    # Cumulative: requests preempted (their KV dropped, recomputed later), cached prefix
    # blocks evicted from the pool (to the second tier when it is on), and every step's time
    # (engine.core.step_times.StepHistogram.snapshot).
    num_preemptions: int = 0
    num_evicted_blocks: int = 0
    step_seconds: tuple = ()
    # The torch threads the engine steps on now, and the last window's fraction of its busy
    # threads' time other processes took (engine.runtime.cpu_threads; 0 / 0.0 off the CPU).
    num_threads: int = 0
    cpu_stolen: float = 0.0
    # One block of the pool as stored, every layer (``--kv-cache-dtype``: an int8 pool's
    # values and scales): blocks x this = the pool's bytes.
    kv_block_bytes: int = 0
    # Speculative decoding's counters (engine.spec.controller.SpecStats.snapshot), None off.
    spec: dict | None = None


class LLMEngine:
    """Owns one model, its KV cache, a scheduler and the per-request detokenizers. With
    ``tensor_parallel_size`` > 1 it also owns the other ranks' processes: ``close`` ends them
    (so does collecting the engine, or this process's exit)."""

    def __init__(self, args: EngineArgs, clock: Callable[[], float] = time.monotonic) -> None:
        parts = build_engine(args, clock)  # engine.runtime.build
        self.plan, self.device, self.threads = parts.plan, parts.plan.device, parts.threads
        self.model_config, self.model, self.ranks = parts.model_config, parts.model, parts.ranks
        self.tokenizer, self.eos_token_ids = parts.tokenizer, parts.eos_token_ids
        self.max_model_len, self.inputs = parts.max_model_len, parts.inputs
        self.scheduler_config, self.cache_config = parts.scheduler_config, parts.cache_config
        self.runner, self.kv_tier = parts.runner, parts.kv_tier
        self.block_manager, self.scheduler = parts.block_manager, parts.scheduler
        self.kv_connector = parts.kv_connector
        self.clock = clock
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        self._ids = itertools.count()
        self.args = args
        self.num_generated_tokens = 0
        self.num_prefill_tokens_computed = 0
        self.step_times = StepTimes()  # decode, mixed and every step (engine.core.step_times)
        self.last_step_idle = False  # the last step had nothing to schedule
        self._tp_failure: str | None = None
        self.spec = parts.spec  # speculative decoding (engine.spec), None when off
        self.lora = parts.lora  # the LoRA adapters (engine.lora.registry), None when off

    @property
    def idle_warmup(self) -> Callable[[], None] | None:
        """An idle engine loop's one-off work (a lazy tokenizer's load; never raises), or None."""
        lazy = isinstance(self.tokenizer, LazyTokenizer) and not self.tokenizer.loaded
        return self.tokenizer.warm if lazy else None

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks (1: this process alone)."""
        return self.args.tensor_parallel_size

    @property
    def rank_pids(self) -> tuple[int, ...]:
        """The processes of ranks 1.. (empty for one rank)."""
        return tuple(self.ranks.pids) if self.ranks is not None else ()

    # ---- rank agents (engine.parallel.agents) ----------------------------------------------
    def attach_rank_agents(self, factory: str, config: Any, timeout_s: float = 120.0
                           ) -> list[str]:
        """Start a worker's agent (``"module:callable"``, called with a FollowerContext and
        ``config``) on every other tensor-parallel rank, and return what each reported ready
        (rank order; empty at TP 1). From then on the engine's KV moves per rank: exports
        hand the layer hook (and every follower's agent) each rank's own heads
        (``LayerExport.heads``), and a reservation's pages are held on every rank, so KV
        imported with ``heads`` lands on the rank that holds them. Call before the engine
        loop starts (or on its thread)."""
        self.kv_connector.per_rank = True
        if self.ranks is None:
            return []
        self.runner.rank_kv.tell(("agent", factory, config))
        self.runner.rank_kv.flush_ranks()
        return self.ranks.replies.wait("ready", timeout_s)

    def tell_ranks(self, payload: Any, now: bool = False) -> None:
        """Engine thread: send ``payload`` to every follower's agent, ahead of the next
        step (``now``: at once, for a message that must not wait for a step). No-op at TP 1."""
        if self.ranks is None:
            return
        self.runner.rank_kv.tell(("tell", payload))
        if now:
            self.runner.rank_kv.flush_ranks()

    def rank_replies(self, key: str, timeout_s: float) -> list[str]:
        """Any thread: every follower agent's answer to ``key`` (rank order; empty at TP 1).
        Raises TimeoutError, or RuntimeError when a rank has died."""
        return self.ranks.replies.wait(key, timeout_s) if self.ranks is not None else []

    def discard_rank_replies(self, key: str) -> None:
        """Drop the answers to ``key`` nobody will read (the caller gave up on them)."""
        if self.ranks is not None:
            self.ranks.replies.discard(key)

    def close(self) -> None:
        """End the other tensor-parallel ranks (nothing to do for one rank). The engine
        cannot step afterwards."""
        ranks = getattr(self, "ranks", None)
        if ranks is not None:
            ranks.close()
        tier = getattr(self, "kv_tier", None)
        if tier is not None:
            tier.close()  # its disk files go now, not at exit

    # ---- input processing ----------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Prompt -> (token ids, text or None). Raises ValueError for empty or malformed prompts."""
        enc = self.inputs.encode(prompt)
        return enc.token_ids, enc.text

    def validate_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError when the request cannot fit the model's context or KV pool."""
        self.inputs.validate(num_prompt_tokens, params)

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                     arrival_time: float | None = None,
                     lora_request: LoRARequest | None = None) -> Request:
        """Validate and build a Request (does not queue it); ``lora_request``: the adapter it
        runs under, loaded now if it is not held (ValueError: LoRA off, or the adapter
        refused)."""
        enc = self.inputs.process(prompt, params)
        adapter = self.load_lora(lora_request) if lora_request is not None else None
        token_ids, text = enc.token_ids, enc.text
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, token_ids, params, arrival_time if arrival_time is not None else self.clock(),
                      eos_token_ids=self.eos_token_ids)
        if adapter is not None:
            req.lora_request, req.hash_root = lora_request, adapter.key
        self._prompts[rid] = text
        return req

    # ---- LoRA adapters ---------------------------------------------------------------------
    def read_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """``lora_request``'s adapter read and checked, not held (safe from any thread:
        ``load_lora(req, adapter)`` on the engine thread then takes it without the disk).
        Raises ValueError like ``load_lora``."""
        self._lora_on(lora_request)
        return self.lora.read(lora_request)

    def _lora_on(self, lora_request) -> None:
        if self.lora is None:
            raise ValueError("LoRA adapters are off: start the engine with enable_lora=True "
                             "(pdcluster serve --enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")

    def load_lora(self, lora_request: LoRARequest,
                  adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """Hold ``lora_request``'s adapter (``adapter``: ``read_lora``'s answer; else read
        and checked now unless held). Raises ValueError: LoRA is off, or the adapter is
        refused (the message says why)."""
        self._lora_on(lora_request)
        return self.lora.load(lora_request, adapter)

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name``: KeyError if not held, ValueError while requests run
        under it (refused)."""
        if self.lora is None:
            raise ValueError("LoRA adapters are off")
        self.lora.unload(name)

    def list_loras(self) -> list[LoRARequest]:
        """The held adapters' requests, least recently used first."""
        return [a.request for a in self.lora.held()] if self.lora is not None else []

    # ---- lifecycle -----------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None, export_kv: bool = False,
                    priority: int = 0, export_from: int = 0,
                    lora_request: LoRARequest | None = None) -> Request:
        """Validate and queue (ahead of waiting requests of lower ``priority``). With
        ``export_kv`` the prompt's KV from position ``export_from`` on is handed to the
        connector's exporter. Raises ValueError (bad input) or QueueFullError (queue limit)."""
        req = self.make_request(prompt, params, request_id, arrival_time, lora_request)
        if not 0 <= export_from < req.num_prompt_tokens:
            raise ValueError(f"export_from {export_from} outside the prompt "
                             f"({req.num_prompt_tokens} tokens)")
        req.export_kv, req.priority, req.export_from = export_kv, priority, export_from
        self.enqueue(req)
        return req

    def enqueue(self, req: Request) -> None:
        try:
            if req.lora_request is not None:
                # held again if a later load made room by dropping it since make_request
                req.hash_root = self.load_lora(req.lora_request).key
            self.scheduler.add_request(req)
        except Exception:
            self._prompts.pop(req.request_id, None)
            raise
        self._start_detok(req)

    def _start_detok(self, req: Request) -> None:
        if self.tokenizer is not None and self.args.detokenize:
            self._detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, stop=req.sampling_params.stop,
                include_stop_str_in_output=req.sampling_params.include_stop_str_in_output,
                stop_token_ids=req.sampling_params.stop_token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort; returns the final output (finish_reason "abort") or None if unknown/done."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        # A request still waiting for remote KV goes through the connector, which also stops
        # late layers from landing in its freed pages.
        self.kv_connector.release(request_id)
        self.scheduler.abort_request(request_id)
        if self.spec is not None:
            self.spec.forget(request_id)
        return self._output(req, [], "")

    def request_progress(self, request_id: str) -> RequestProgress:
        """Queued, running (for how long) or unknown here (see RequestProgress). Safe from
        any thread: it reads one request's fields, each written whole by the engine thread."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.is_finished:
            return RequestProgress(RequestProgress.UNKNOWN)
        if req.status is RequestStatus.RUNNING and req.running_since is not None:
            return RequestProgress(RequestProgress.RUNNING, self.clock() - req.running_since)
        return RequestProgress(RequestProgress.QUEUED)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> EngineStats:
        """A snapshot of the KV pool and the queues (safe to read from any thread; the
        numbers may be one step stale)."""
        bm = self.block_manager
        sched = self.scheduler
        return EngineStats(bm.num_used_blocks, bm.num_blocks, bm.block_size,
                           self.kv_connector.num_reserved_blocks, sched.num_running,
                           sched.num_waiting, self.num_generated_tokens,
                           self.num_prefill_tokens_computed, bm.num_prefix_hit_tokens,
                           self.step_times.decode.rows(), self.step_times.mixed.rows(),
                           self.kv_tier.stats() if self.kv_tier is not None else None,
                           bm.num_restored_tokens, sched.num_preemptions,
                           bm.num_evicted_blocks, self.step_times.histogram.snapshot(),
                           self.threads.threads if self.threads else 0,
                           self.threads.governor.last_stolen if self.threads else 0.0,
                           self.model_config.kv_cache_bytes_per_token(
                               self.cache_config.kv_cache_dtype) * bm.block_size,
                           self.spec.stats.snapshot() if self.spec is not None else None)

    def record_kv_events(self) -> None:
        """Record the prefix cache's changes from now on, for ``take_kv_events`` (a worker
        whose routers index its cache calls this before serving)."""
        self.block_manager.record_events()

    def take_kv_events(self) -> list:
        """The prefix cache's changes since the last call (``engine.core.kv_events``), oldest
        first. Call on the engine's own thread (the engine loop), e.g. after each step."""
        return self.block_manager.take_events()

    def cached_block_hashes(self) -> list[int]:
        """Snapshot of the prefix cache (engine thread): what the events after the last
        ``take_kv_events`` apply to."""
        return self.block_manager.cached_hashes()

    def cached_block_tiers(self) -> dict[int, str]:
        """``cached_block_hashes`` with each block's cheapest tier (``engine.core.kv_events``)."""
        return self.block_manager.cached_tiers()

    def step(self) -> list[RequestOutput]:
        """One iteration. Returns an output per request that got a token or finished.
        Raises RuntimeError once a tensor-parallel rank has failed (the engine is dead)."""
        if self._tp_failure is not None:
            raise RuntimeError(self._tp_failure)
        t0 = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if self.threads is not None and (sched.is_empty or self.last_step_idle):
            self.threads.idle()  # time without work is not the neighbours' doing
        self.last_step_idle = sched.is_empty
        if sched.is_empty:
            return []
        # Decode rows: running sequences' one-token steps; prefill work: every other chunk.
        prefill = decode_rows = 0
        for c in sched.chunks:
            if c.num_output_tokens > 0 and (c.num_tokens == 1 or c.num_draft):
                decode_rows += c.num_tokens  # a verifying chunk: its token and drafts
            else:
                prefill += c.num_tokens
        self.num_prefill_tokens_computed += prefill
        step = StepInfo(self.scheduler.num_steps, self.clock())
        exports = self.kv_connector.begin_step(sched, step)
        try:
            result = self.runner.execute(
                sched, self.kv_connector.layer_saved if exports else None,
                self.kv_connector.step_reads() if exports else (), self.kv_connector.per_rank)
        except Exception as e:
            if self.ranks is not None:
                # A rank failed or the group broke mid-collective: the others may be stuck
                # in one, so no later step could meet them. The engine is dead as a whole.
                self.ranks.close()
                self._tp_failure = f"a tensor-parallel rank failed: {type(e).__name__}: {e}"
            raise
        updates = self.scheduler.update_from_output(sched, result)
        outs = [self.process_update(u) for u in updates]
        if self.spec is not None:
            self.spec.observe(sched, result, time.perf_counter() - t0)
            for u in updates:
                if u.request.is_finished:
                    self.spec.forget(u.request_id)
        # Timed by kind, so a served time per token splits into the engine's pure decode
        # step, what prefill sharing the step adds (colocated), and the serving path.
        step_s = time.perf_counter() - t0
        self.step_times.record(step_s, decode_rows, prefill, sched.held_decodes)
        if self.threads is not None:  # steps of one kind: the same rows, prompts bucketed
            self.threads.after_step(step_s, (decode_rows, prefill and 1 << (prefill - 1).bit_length()))
        return outs

    def process_update(self, u: StepUpdate) -> RequestOutput:
        """Detokenize a step's new tokens, apply stop strings, build the output."""
        req = u.request
        self.num_generated_tokens += len(u.new_token_ids)
        delta = ""
        new_ids = list(u.new_token_ids)
        detok = self._detok.get(u.request_id)
        if detok is not None:
            upd, used = detok.update_each(new_ids)  # a stop string ends at its token
            delta = upd.delta_text
            if used < len(new_ids):
                self._drop_tail(req, len(new_ids) - used)
                new_ids = new_ids[:used]
            if upd.stopped and (not req.is_finished or len(new_ids) < len(u.new_token_ids)):
                # (a token after the stop string may have ended the request another way)
                req.stop_reason = upd.stop_str
                if req.is_finished:
                    req.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
            if req.is_finished:
                delta += detok.flush()
        return self._output(req, new_ids, delta)

    def _drop_tail(self, req: Request, n: int) -> None:
        """Forget the last ``n`` output tokens (accepted drafts after a stop string)."""
        if n:
            self.num_generated_tokens -= n
            del req.output_token_ids[-n:]
            del req.token_times[-n:]
            if len(req.output_logprobs) > len(req.output_token_ids):
                del req.output_logprobs[len(req.output_token_ids):]

    def _output(self, req: Request, new_ids: list[int], delta: str) -> RequestOutput:
        detok = self._detok.get(req.request_id)
        finished = req.is_finished
        out = RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=detok.text if detok else "",
            finished=finished,
            finish_reason=req.status.finish_reason,
            metrics=RequestMetrics(req.arrival_time, req.first_token_time,
                                   self.clock() if finished else None, list(req.token_times),
                                   req.num_cached_tokens, req.first_scheduled_time,
                                   req.num_prompt_chunks, req.spec_proposed,
                                   req.spec_accepted),
            new_token_ids=list(new_ids),
            delta_text=delta,
            prompt=self._prompts.get(req.request_id),
            error=req.error,
        )
        if req.sampling_params.prompt_logprobs is not None:
            out.prompt_logprobs = req.prompt_logprobs
        if finished and req.sampling_params.pooling is not None and req.pooled:
            out.embedding = join_parts(req.pooled, req.num_prompt_tokens,
                                       req.sampling_params.normalize)
        if req.sampling_params.logprobs is not None:
            out.logprobs = list(req.output_logprobs)
            out.new_logprobs = out.logprobs[max(0, len(out.logprobs) - len(new_ids)):] \
                if new_ids else []
        if finished:
            self._detok.pop(req.request_id, None)
            self._prompts.pop(req.request_id, None)
        return out
