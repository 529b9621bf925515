"""The single-process engine: validation, scheduling, model execution, detokenization.

``LLMEngine.step()`` runs one iteration (schedule -> execute -> update -> detokenize) and returns
a ``RequestOutput`` for every request that produced a token or finished. It is the loop body
for the offline ``LLM``, the prefill worker and the decode worker alike; none of them reimplement
it. Not thread-safe: one thread drives an engine.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.args import EngineArgs  # re-exported: its home is engine.args (no torch)
from engine.config import CacheConfig, ModelConfig, SchedulerConfig, num_blocks_for_budget
from engine.core.block_manager import BlockManager
from engine.core.request import (
    Request,
    RequestMetrics,
    RequestOutput,
    RequestProgress,
    RequestStatus,
    SamplingParams,
)
from engine.core.scheduler import Scheduler, StepUpdate
from engine.core.step_times import StepTimes
from engine.core.structured import Grammars
from engine.executor.device import kv_pool_bytes, plan_device
from engine.executor.kv_tier import KVTier, TierStats, offload_config
from engine.executor.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.parallel.ranks import TPRanks, rank_device, rank_threads
from engine.parallel.sharding import TPShard
from engine.quant.layouts import check_quantization
from engine.runtime.cpu_threads import EngineThreads
from engine.runtime.kv_connector import KVConnector, StepInfo
from engine.text.input_processor import InputProcessor, Prompt
from engine.text.tokenizer import IncrementalDetokenizer, LazyTokenizer, load_tokenizer
from engine.tuning.runner_plans import RunnerPlans, plans_by_threads, tune_runner
from engine.weights.loader import load_model_config, load_weights, resolve_model

log = logging.getLogger(__name__)


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


class LLMEngine:
    """Owns one model, its KV cache, a scheduler and the per-request detokenizers. With
    ``tensor_parallel_size`` > 1 it also owns the other ranks' processes: ``close`` ends them
    (so does collecting the engine, or this process's exit)."""

    def __init__(self, args: EngineArgs, clock: Callable[[], float] = time.monotonic) -> None:
        tp = args.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if tp > 1 and args.cuda_graphs:
            # Asked for explicitly, not just the GPU default: refused rather than dropped.
            raise ValueError("cuda_graphs=True: not with tensor_parallel_size > 1 (the "
                             "collectives are not captured); leave it unset or false")
        if tp > 1 or (args.num_threads and args.device != "cpu"):
            torch.set_num_threads(rank_threads(args.num_threads, tp))
        self.plan = plan_device(rank_device(args.device, 0) if tp > 1 else args.device,
                                args.dtype, args.attention_backend, args.cuda_graphs)
        # On the CPU at TP 1, the thread count follows the CPU this process gets.
        self.threads: EngineThreads | None = (
            EngineThreads(args.num_threads, args.adaptive_threads)
            if self.plan.device.type == "cpu" and tp == 1 else None)
        self.device = self.plan.device
        check_quantization(args.quantization, self.device, tp, self.plan.dtype)
        offload = offload_config(args)
        resolved = resolve_model(args.model, cache_dir=args.cache_dir)
        self.model_config: ModelConfig = load_model_config(
            resolved.model_dir, dtype=self.plan.dtype, model_id=resolved.model_id)
        # A worker's engine (token ids in and out) loads it on first need: ~2 s less to start.
        self.tokenizer = load_tokenizer(resolved.model_dir, lazy=not args.detokenize)
        cfg = self.model_config
        eos = tuple(sorted(set(cfg.eos_token_ids) | set(self.tokenizer.eos_token_ids
                                                          if self.tokenizer else ())))
        self.eos_token_ids = eos
        max_len = min(args.max_model_len or cfg.max_model_len, cfg.max_model_len)
        self.max_model_len = max_len
        rs = cfg.rope_scaling
        if rs is not None and rs.kind == "longrope":
            log.info("LongRoPE: serving up to %d tokens with its %s factors for every sequence "
                     "(--max-model-len <= %d serves the short ones)", max_len,
                     "long" if max_len > rs.original_max_position_embeddings else "short",
                     rs.original_max_position_embeddings)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            policy=args.batching, dynamic_window_s=args.dynamic_window_s,
            enable_chunked_prefill=args.enable_chunked_prefill, max_model_len=max_len,
            max_waiting=args.max_waiting, max_prefill_chunk=args.max_prefill_chunk,
            max_step_prefill_tokens=args.max_step_prefill_tokens,
            first_token_first=args.first_token_first)
        shard = TPShard(0, tp)
        shard.check(cfg)  # before any rank starts: a clear error naming the dimension
        # The other ranks start now and load their slices while this one loads its own.
        self.ranks = TPRanks(args, self.device) if tp > 1 else None
        try:
            model = LlamaForCausalLM(cfg, max_len, self.ranks.comm if self.ranks else None)
            load_weights(model, resolved.model_dir, args.quantization,
                         lambda n: shard.slice_of(n, cfg))
            self.model = model.to(self.device)
            model.place_quantized(self.device)  # model.to leaves quantized weights behind
            # Sized after the weights are on the device: on CUDA the pool takes what they
            # left. Per rank: each holds its KV heads only (model.cfg: this rank's shapes).
            pool_bytes = kv_pool_bytes(args.kv_cache_memory_bytes, self.device,
                                       args.gpu_memory_utilization)
            self.cache_config = CacheConfig(
                block_size=args.block_size, kv_cache_memory_bytes=pool_bytes,
                enable_prefix_caching=args.enable_prefix_caching,
                prefix_hash_seed=args.prefix_hash_seed)
            num_blocks = num_blocks_for_budget(model.cfg, args.block_size, pool_bytes)
            if num_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory_bytes={pool_bytes} holds no block of "
                    f"{args.block_size} tokens ({model.cfg.kv_bytes_per_token} bytes per token)")
            if self.ranks is not None:
                self.ranks.start(max_len, num_blocks)
            self.runner = ModelRunner(model, self.cache_config, num_blocks,
                                      attention_backend=self.plan.attention_backend,
                                      cuda_graphs=self.plan.cuda_graphs,
                                      max_num_seqs=args.max_num_seqs, max_model_len=max_len)
            tune_runner(args, self.plan, model, self.runner)
            if self.threads is not None and self.threads.adaptive:
                plans = plans_by_threads(args, self.plan, model, self.runner,
                                         range(1, self.threads.governor.max_threads + 1))
                self.threads.on_change = lambda n: plans.get(n, RunnerPlans.current(
                    self.runner)).apply(self.runner)
        except BaseException:
            self.close()
            raise
        self.inputs = InputProcessor(self.tokenizer, cfg.vocab_size, max_len,
                                     max_kv_tokens=num_blocks * args.block_size)
        self.kv_tier = KVTier(self.runner.kv_caches, offload) if offload.enabled else None
        self.block_manager = BlockManager(num_blocks, args.block_size,
                                          enable_prefix_caching=args.enable_prefix_caching,
                                          hash_seed=args.prefix_hash_seed, tier=self.kv_tier)
        grammars = Grammars(self.tokenizer, cfg.vocab_size, eos) if self.tokenizer else None
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, clock, grammars)
        self.kv_connector = KVConnector(self.scheduler, self.block_manager, self.runner,
                                        self.eos_token_ids, clock)
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
        self.runner.tell(("agent", factory, config))
        self.runner.flush_ranks()
        return self.ranks.replies.wait("ready", timeout_s)

    def tell_ranks(self, payload: Any, now: bool = False) -> None:
        """Engine thread: send ``payload`` to every follower's agent, ahead of the next
        step (``now``: at once, for a message that must not wait for a step). No-op at TP 1."""
        if self.ranks is None:
            return
        self.runner.tell(("tell", payload))
        if now:
            self.runner.flush_ranks()

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
                     arrival_time: float | None = None) -> Request:
        """Validate and build a Request (does not queue it)."""
        enc = self.inputs.process(prompt, params)
        token_ids, text = enc.token_ids, enc.text
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, token_ids, params, arrival_time if arrival_time is not None else self.clock(),
                      eos_token_ids=self.eos_token_ids)
        self._prompts[rid] = text
        return req

    # ---- lifecycle -----------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None, export_kv: bool = False,
                    priority: int = 0, export_from: int = 0) -> Request:
        """Validate and queue (ahead of waiting requests of lower ``priority``). With
        ``export_kv`` the prompt's KV from position ``export_from`` on is handed to the
        connector's exporter. Raises ValueError (bad input) or QueueFullError (queue limit)."""
        req = self.make_request(prompt, params, request_id, arrival_time)
        if not 0 <= export_from < req.num_prompt_tokens:
            raise ValueError(f"export_from {export_from} outside the prompt "
                             f"({req.num_prompt_tokens} tokens)")
        req.export_kv, req.priority, req.export_from = export_kv, priority, export_from
        self.enqueue(req)
        return req

    def enqueue(self, req: Request) -> None:
        try:
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
                           self.threads.governor.last_stolen if self.threads else 0.0)

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
        sched = self.scheduler.schedule()
        if self.threads is not None and (sched.is_empty or self.last_step_idle):
            self.threads.idle()  # time without work is not the neighbours' doing
        self.last_step_idle = sched.is_empty
        if sched.is_empty:
            return []
        # Decode rows: running sequences' one-token steps; prefill work: every other chunk.
        prefill = decode_rows = 0
        for c in sched.chunks:
            if c.num_output_tokens > 0 and c.num_tokens == 1:
                decode_rows += 1
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
        detok = self._detok.get(u.request_id)
        if detok is not None:
            upd = detok.update(u.new_token_ids)
            delta = upd.delta_text
            if upd.stopped and not req.is_finished:
                req.stop_reason = upd.stop_str
                self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
            if req.is_finished:
                delta += detok.flush()
        return self._output(req, u.new_token_ids, delta)

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
                                   req.num_prompt_chunks),
            new_token_ids=list(new_ids),
            delta_text=delta,
            prompt=self._prompts.get(req.request_id),
            error=req.error,
        )
        if req.sampling_params.prompt_logprobs is not None:
            out.prompt_logprobs = req.prompt_logprobs
        if req.sampling_params.logprobs is not None:
            out.logprobs = list(req.output_logprobs)
            out.new_logprobs = out.logprobs[max(0, len(out.logprobs) - len(new_ids)):] \
                if new_ids else []
        if finished:
            self._detok.pop(req.request_id, None)
            self._prompts.pop(req.request_id, None)
        return out
