"""Prefill worker: batched, chunked prefill that streams each layer's KV to a decode worker.

A thin Ray adapter (``router.cluster.ray_cluster`` wraps it as a threaded actor so many ``prefill`` calls
wait concurrently while one ``EngineLoop`` thread batches their prompts by token budget).
Each prompt is a ``max_tokens=1`` request with ``export_kv``: in the step that computes its
last chunk, the engine's ``KVConnector`` hands this worker each layer's K/V for the whole
prompt (token-contiguous) as soon as the layer is written, and the worker posts an async send
right away, so layer L travels while layer L+1 computes. The pages are freed when the request
finishes (the sends hold their own copies); full blocks stay in the prefix cache.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.contract import RequestFailedError, RequestOutput
from engine.runtime.compute_thread import ComputeThread
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.kv_connector import LayerExport
from engine.runtime.llm_engine import LLMEngine
from kv_transfer import KVLayout, KVTransferAborted
from worker_protocol import (
    AbortRequest,
    PrefillRequest,
    PrefillResult,
    PrefillTimeoutError,
    WorkerConfig,
    WorkerInfo,
    WorkerLoad,
    apply_cpu_affinity,
    current_node_id,
    current_node_ip,
    exit_on_engine_crash,
    freeze_startup_heap,
    kv_host_for,
    new_incarnation,
    restarted_by_ray,
    restore_priority,
)
from worker_protocol.adapters import WorkerAdapters
from worker_protocol.embeddings import WorkerEmbeddings
from worker_protocol.kv_events import KVEventFeed, KVSnapshot
from worker_protocol.kv_publisher import WorkerKVEvents
from worker_protocol.kv_ranks import PrefillRankKV, rank_state
from worker_protocol.lifeline import Lifeline
from worker_protocol.messages import offload_load
from worker_protocol.prefix_pull import (
    PrefixPuller,
    PrefixSource,
    PullRequest,
    PullResult,
    SendPrefixRequest,
)
from worker_protocol.serving_calls import ServingCalls
from worker_protocol.tracing import Tracing, start_tracing, wall_ns

log = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 60.0
_PREFILL_TIMEOUT_S = 300.0  # a PrefillRequest without its own deadline
_MAX_ABORTED = 65536  # aborts remembered for prefill calls not arrived yet


@dataclasses.dataclass
class _Pending:
    req: PrefillRequest
    future: Future
    arrival: float  # engine clock
    layers_sent: int = 0
    kv_bytes: int = 0
    first_layer_at: float | None = None  # engine clock: its first layer's send was posted
    chunks: int = 0  # steps that computed part of the prompt (traces)
    # set by ``abort`` under the worker's lock: ends an adapter wait, and ``add`` skips it
    aborted: threading.Event = dataclasses.field(default_factory=threading.Event)
    # non-streaming mode: each layer's (kv, heads) until the prompt is done
    held: list[tuple[torch.Tensor, tuple[int, int] | None]] = dataclasses.field(
        default_factory=list)


class PrefillWorker(ServingCalls):
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id
        self.incarnation = new_incarnation()
        # Fault injection is for the first incarnation only: restarted, the worker serves.
        self._fault_exit_after = None if restarted_by_ray() else config.fault_exit_after_layers
        restore_priority()  # first: threads started later inherit it
        apply_cpu_affinity(config.cpu_affinity)
        args = dataclasses.replace(config.engine_args, detokenize=False)
        # Built on the thread that will step it (engine.runtime.compute_thread says why).
        compute, self.engine = ComputeThread.building(f"{self.worker_id}-loop",
                                                      lambda: LLMEngine(args))
        self.layout = KVLayout.from_model_config(self.engine.model_config,
                                               self.engine.cache_config.kv_cache_dtype)
        # NCCL from the GPU, or gloo (a GPU engine's layers staged through host memory):
        # the launcher chose (WorkerConfig.kv_transport).
        self.kv_transport = config.transport_for(self.engine.device.type)
        kv_device = self.engine.device if self.kv_transport == "nccl" else "cpu"
        self.kv_host = kv_host_for(self.worker_id, config.kv_host, config.kv_interface,
                                   "cuda" if self.kv_transport == "nccl" else "cpu")
        # Every tensor-parallel rank sends the KV heads it holds to the decode ranks that take
        # them (worker_protocol.kv_ranks); at TP 1, one sender as ever.
        self.kv = PrefillRankKV(self.engine, self.worker_id, self.layout, self.kv_host.address,
                                self.kv_transport, kv_device, config.transfer_timeout_s,
                                config.stream_layers)
        self._pending: dict[str, _Pending] = {}
        # Aborts that found no prefill here (request id -> monotonic time): the call may still
        # wait in Ray's queue behind busy request threads, and must not run once it arrives.
        self._aborted: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._finisher = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"{self.worker_id}-send")
        self._layers_sent_total = 0
        self.kv_bytes_sent = 0
        self.engine.kv_connector.exporter = self._export_layer
        self._kv_events = WorkerKVEvents(self.engine, self.worker_id, self.incarnation,
                                         config.kv_events_redis_url, config.kv_events_namespace)
        self.loop = EngineLoop(self.engine, self._on_step, name=f"{self.worker_id}-loop",
                               on_crash=exit_on_engine_crash(self.worker_id),
                               after_work=self._kv_events.after_work, compute=compute)
        self.adapters = WorkerAdapters(self.engine, self.loop, _CALL_TIMEOUT_S)
        self.embeddings = WorkerEmbeddings(self.loop, self.adapters, _CALL_TIMEOUT_S)
        # Cluster-wide prefix reuse (worker_protocol.prefix_pull): this worker pulls prefixes
        # other workers hold, and serves its own; endpoints open on first use.
        self.puller = PrefixPuller(self.loop, self.worker_id, self.layout,
                                   self.kv_host.address, kv_device)
        self.source = PrefixSource(self.loop, self.worker_id, self.layout, self.kv_host.address,
                                   kv_device, config.fault_pull_delay_per_layer_s)
        self.tracing: Tracing | None = start_tracing(
            config.tracing, "pdcluster-prefill", attributes={"pdcluster.worker_id": self.worker_id})
        # The router reads its end within milliseconds of this process's death.
        self.lifeline = Lifeline(current_node_ip(), self.worker_id)
        # Last: the model, torch and Ray are loaded; keep full collections off them (their
        # pauses would delay every prefill and layer send running then).
        freeze_startup_heap()

    def info(self) -> WorkerInfo:
        stats = self.engine.stats()
        return WorkerInfo(self.worker_id, "prefill", current_node_id(), os.getpid(), self.layout,
                          stats.kv_blocks_total, stats.block_size, self.engine.max_model_len,
                          None, current_node_ip(), self.kv_host.address, self.incarnation,
                          self.kv_transport, self.engine.tp_size, self.engine.rank_pids,
                          lifeline_port=self.lifeline.port)

    def load(self, router_id: str = "") -> WorkerLoad:
        s = self.engine.stats()
        return WorkerLoad(self.worker_id, "prefill", s.kv_blocks_used, s.kv_blocks_total,
                          s.num_running, s.num_waiting, kv_transfer_bytes=self.kv_bytes_sent,
                          incarnation=self.incarnation,
                          prefix_hit_tokens=s.num_prefix_hit_tokens,
                          prefill_tokens_computed=s.num_prefill_tokens_computed,
                          kv_event_seq=self._kv_events.log.seq,
                          rank_kv_transfer_bytes=tuple(self.kv.rank_bytes),
                          kv_block_bytes=s.kv_block_bytes, **offload_load(s),
                          **self.adapters.load_fields())

    def layers_sent(self, request_id: str) -> int:
        """How many layers of an in-flight request's KV have been posted (tests, debugging)."""
        pending = self._pending.get(request_id)
        return pending.layers_sent if pending else -1

    def ping(self) -> str:
        return self.worker_id

    def worker_config(self) -> WorkerConfig:
        """How this worker was built (a re-attaching router checks it wants the same)."""
        return self.config

    def kv_pairs(self) -> dict[str, int]:
        """Decode worker id -> generation of the live KV group with it."""
        return self.kv.live_pairs()

    def kv_rank_state(self) -> list[dict]:
        """What the other tensor-parallel ranks still hold for KV transfers (tests: all zero
        when idle; empty at TP 1): ``worker_protocol.kv_ranks.rank_state``."""
        return rank_state(self.loop, self.engine)

    def kv_events(self, after_seq: int, incarnation: str) -> KVEventFeed:
        """The KV event batches after a router's cursor (see worker_protocol.kv_events)."""
        return self._kv_events.since(after_seq, incarnation)

    def kv_snapshot(self) -> KVSnapshot:
        """Every block hash the prefix cache holds, and the batch seq it follows."""
        return self.loop.call(self._kv_events.snapshot).result(_CALL_TIMEOUT_S)

    def prefill(self, req: PrefillRequest) -> PrefillResult:
        """Compute the prompt, stream its KV to ``req.destination``, return the first token.

        Blocks until every layer was sent, at most ``req.timeout_s``. Raises KVTransferError
        on a failed/timed-out transfer, KVTransferAborted if ``abort`` was called,
        PrefillTimeoutError past the deadline (the prompt is aborted here first), ValueError
        for bad input.
        """
        sp = req.sampling_params
        if req.transfer.prompt_len != len(req.prompt_token_ids):
            raise ValueError(f"transfer of {req.request_id} covers {req.transfer.prompt_len} "
                             f"tokens, the prompt has {len(req.prompt_token_ids)}")
        # One token here; stop strings and the rest of the budget are the decode side's.
        params = dataclasses.replace(sp, max_tokens=1, min_tokens=min(sp.min_tokens, 1), stop=[])
        pending = _Pending(req, Future(), self.engine.clock())
        # One deadline for the adapter wait and the prefill together: the router waits
        # prefill_timeout_s (and one call timeout), not twice that.
        timeout_s = req.timeout_s or _PREFILL_TIMEOUT_S
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._aborted.pop(req.request_id, None) is not None:
                raise KVTransferAborted(f"{req.request_id} aborted before its prefill started")
            if req.request_id in self._pending:
                raise ValueError(f"duplicate request id {req.request_id!r}")
            self._pending[req.request_id] = pending
        destinations = [req.destination, *req.destination_ranks]

        def add(e: LLMEngine) -> None:
            # Aborted before this ran (while it waited for an adapter, say): compute nothing.
            # ``abort`` sets the flag before it queues its engine abort, so a prompt added
            # here is always aborted after.
            if pending.aborted.is_set():
                return
            # The ranks learn where their heads go before the step that exports them.
            self.kv.announce(e, req.transfer, destinations)
            e.add_request(list(req.prompt_token_ids), params, req.request_id, export_kv=True,
                          priority=req.priority, export_from=req.transfer.start_token,
                          lora_request=req.lora_request)

        try:
            try:
                # read here, not on the engine thread; waits while every held one is in use
                self.adapters.ensure(req.lora_request, deadline - time.monotonic(),
                                     pending.aborted)
                self.loop.call(add).result(_CALL_TIMEOUT_S)
            except BaseException:
                self._abort_kv(req.request_id)
                raise
            try:
                result = pending.future.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError:  # concurrent.futures' is the builtin since 3.11
                self.abort(AbortRequest(req.request_id))  # stop computing and sending it
                error = PrefillTimeoutError(
                    f"prefill of {req.request_id} ({len(req.prompt_token_ids)} tokens) was not "
                    f"done within {timeout_s:g} s on {self.worker_id}")
                self._trace_failure(pending, error)
                raise error from None
            except BaseException as e:
                self._trace_failure(pending, e)
                raise
            if self.tracing is not None and req.traceparent:
                self._trace(pending, result)
            return result
        finally:
            with self._lock:
                self._pending.pop(req.request_id, None)

    def abort(self, req: AbortRequest) -> bool:
        """Stop computing and sending ``req.request_id``; its ``prefill`` call raises
        KVTransferAborted, also when it arrives after this (it waited in Ray's queue). False
        when it is not (or no longer) here."""
        rid = req.request_id
        with self._lock:
            pending = self._pending.get(rid)
            if pending is None:  # not here yet, or done: a call arriving later is refused
                self._remember_abort(rid)
            else:  # a prefill waiting for an adapter gives up; one not yet added never is
                pending.aborted.set()
        if pending is None:
            return False
        self._abort_kv(rid)
        if not pending.future.done():
            pending.future.set_exception(KVTransferAborted(f"{rid} aborted during prefill"))
        return True

    def _remember_abort(self, request_id: str) -> None:
        """(Under the lock.) Kept as long as a router may still wait for that call (its
        prefill deadline and one call timeout), at most _MAX_ABORTED ids."""
        now = time.monotonic()
        self._aborted[request_id] = now
        self._aborted.move_to_end(request_id)
        while self._aborted and (len(self._aborted) > _MAX_ABORTED or next(
                iter(self._aborted.values())) < now - _PREFILL_TIMEOUT_S - _CALL_TIMEOUT_S):
            self._aborted.popitem(last=False)

    def pull_prefix(self, req: PullRequest) -> PullResult:
        """Pull a prefix another worker holds into this one's prefix cache (the router's
        cluster-wide reuse); a failed pull holds nothing: the request computes it."""
        return self.puller.pull(req)

    def send_prefix(self, req: SendPrefixRequest) -> int:
        """Serve another worker's pull from this one's prefix cache; returns bytes sent."""
        return self.source.send(req)

    def shutdown(self) -> None:
        if self.tracing is not None:
            self.tracing.shutdown()
        self.puller.close()
        self.source.close()
        self.loop.stop()
        self._finisher.shutdown(wait=False, cancel_futures=True)
        self.kv.close()
        self._kv_events.close()
        self.engine.close()  # after the loop: its tier's files and its TP ranks go now
        self.lifeline.close()  # last: routers read that this worker is gone

    def _abort_kv(self, request_id: str) -> None:
        """Stop computing and sending the request on every rank (rank 0's sends at once,
        the others' with the engine's next message to them)."""
        def abort(e: LLMEngine) -> None:
            e.abort_request(request_id)
            self.kv.abort_ranks(e, request_id)
        self.loop.call(abort)
        self.kv.abort(request_id)

    # ---- engine-loop thread -----------------------------------------------------------------
    def _export_layer(self, export: LayerExport) -> None:
        pending = self._pending.get(export.request_id)
        if pending is None:
            return
        # The whole layer's bytes (every rank's heads), as at TP 1.
        pending.kv_bytes += pending.req.transfer.layer_nbytes
        if pending.first_layer_at is None:
            pending.first_layer_at = self.engine.clock()
        if self.config.stream_layers:
            self._send(pending, export.layer, export.kv, export.heads)
        else:
            pending.held.append((export.kv, export.heads))

    def _send(self, pending: _Pending, layer: int, kv: torch.Tensor,
              heads: tuple[int, int]) -> None:
        self.kv.send_layer(pending.req.request_id, layer, kv, heads)
        self._layers_sent_total += 1
        pending.layers_sent += 1
        limit = self._fault_exit_after
        if limit is not None and self._layers_sent_total >= limit:
            log.error("%s: fault injection: exiting after %d layers", self.worker_id, limit)
            os._exit(1)
        if self.config.fault_delay_per_layer_s:
            time.sleep(self.config.fault_delay_per_layer_s)

    def _on_step(self, outs: list[RequestOutput]) -> None:
        outs = self.embeddings.take(outs)  # their callers have them
        step_end = self.engine.clock()
        for out in outs:
            pending = self._pending.get(out.request_id)
            if pending is None or not out.finished:
                continue
            if out.finish_reason == "error":  # this prompt alone failed: its caller hears why
                self.kv.abort(out.request_id)
                self.kv.abort_ranks(self.engine, out.request_id)
                if not pending.future.done():
                    pending.future.set_exception(RequestFailedError(
                        f"prefill of {out.request_id} failed: {out.error}"))
                continue
            if out.finish_reason == "abort" or not out.token_ids:
                continue
            for layer, (kv, heads) in enumerate(pending.held):  # send-at-the-end mode
                self._send(pending, layer, kv, heads)
            pending.held.clear()
            self._finisher.submit(self._finish, pending, out, step_end)

    def _finish(self, pending: _Pending, out: RequestOutput, step_end: float) -> None:
        req = pending.req
        try:
            self.kv.finish(req.request_id, self.config.transfer_timeout_s)
        except BaseException as e:
            self.kv.abort(req.request_id)
            if not pending.future.done():
                pending.future.set_exception(e)
            return
        done = self.engine.clock()
        self.kv_bytes_sent += pending.kv_bytes
        scheduled = out.metrics.first_scheduled_time or pending.arrival
        pending.chunks = out.metrics.num_prompt_chunks
        first_sent = pending.first_layer_at if pending.first_layer_at is not None else step_end
        result = PrefillResult(req.request_id, out.token_ids[0], len(req.prompt_token_ids),
                               out.metrics.num_cached_tokens, max(0.0, scheduled - pending.arrival),
                               step_end - scheduled, done - step_end, pending.kv_bytes,
                               out.logprobs[0] if out.logprobs else None, out.prompt_logprobs,
                               max(0.0, done - first_sent))
        if not pending.future.done():
            pending.future.set_result(result)

    # ---- traces (worker_protocol.tracing) -----------------------------------------------------
    def _trace(self, pending: _Pending, result: PrefillResult) -> None:
        """This prefill's spans under the router's: queue, compute, and the KV transfer (which
        overlaps compute when layers stream; its exposed tail is what follows the compute)."""
        req, clock = pending.req, self.engine.clock
        arrived = wall_ns(pending.arrival, clock)
        scheduled = arrived + int(result.queue_s * 1e9)
        computed = scheduled + int(result.compute_s * 1e9)
        done = computed + int(result.transfer_tail_s * 1e9)
        tp = req.traceparent
        self.tracing.record("prefill.queue", tp, arrived, scheduled,
                            {"pdcluster.worker_id": self.worker_id})
        self.tracing.record("prefill.compute", tp, scheduled, computed, {
            "pdcluster.worker_id": self.worker_id,
            "gen_ai.usage.input_tokens": result.num_prompt_tokens,
            "pdcluster.prompt.cached_tokens": result.num_cached_tokens,
            "pdcluster.prompt.computed_tokens": result.num_prompt_tokens
            - result.num_cached_tokens,
            "pdcluster.prefill.chunks": pending.chunks})
        # The whole transfer: its first layer posted (PrefillResult.transfer_s) to done.
        self.tracing.record("kv_transfer", tp, done - int(result.transfer_s * 1e9), done, {
            "pdcluster.kv.bytes": result.kv_bytes,
            "pdcluster.kv.layers": pending.layers_sent,
            "pdcluster.kv.pair": f"{self.worker_id}->{req.destination.worker_id}",
            "pdcluster.kv.transport": self.kv_transport,
            "pdcluster.kv.exposed_tail_s": result.transfer_tail_s})

    def _trace_failure(self, pending: _Pending, error: BaseException) -> None:
        if self.tracing is not None and pending.req.traceparent:
            self.tracing.record("prefill.compute", pending.req.traceparent,
                                wall_ns(pending.arrival, self.engine.clock), time.time_ns(),
                                {"pdcluster.worker_id": self.worker_id}, error=repr(error))
