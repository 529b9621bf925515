"""Decode worker: reserves KV blocks, receives prompt KV, runs the continuous-batching loop.

A thin Ray adapter (``router.cluster.ray_cluster`` wraps it as a threaded actor, ``max_concurrency`` > 1
so ``subscribe`` streams while ``reserve`` / ``commit`` / ``abort`` run) over three parts:
- the ``EngineLoop`` thread owns the engine; every engine call is posted to it;
- the KV receiver's threads import arriving layers through the engine's ``KVConnector``
  into pages reserved for exactly that request, which no step reads until ``commit``;
- the lease thread releases any reservation whose KV did not arrive in time.
Every step's new tokens for all sequences leave as ONE ``TokenBatch`` (one Ray message per step).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

from decode_workers.delivery import TokenDelivery
from engine.contract import RequestOutput, RequestProgress
from engine.runtime.compute_thread import ComputeThread
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.kv_connector import Reservation
from engine.runtime.llm_engine import LLMEngine
from kv_transfer import (
    KVHandshakeError,
    KVLayout,
    KVTransferError,
    KVTransferSpec,
)
from worker_protocol import (
    AbortRequest,
    CommitRequest,
    CommitResult,
    RequestTokens,
    ReserveRequest,
    ReserveResult,
    SubmitRequest,
    TokenBatch,
    TokenUpdate,
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
    restore_priority,
)
from worker_protocol.adapters import WorkerAdapters
from worker_protocol.embeddings import WorkerEmbeddings
from worker_protocol.kv_events import KVEventFeed, KVSnapshot
from worker_protocol.kv_publisher import WorkerKVEvents
from worker_protocol.kv_ranks import DecodeRankKV, rank_state
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
from worker_protocol.tracing import Tracing, start_tracing

log = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 60.0
_KEEP_OUTPUTS = 4096  # finished requests' outputs kept beyond the running ones (tokens_of)
# A disaggregated decode worker computes prompts only for streams it must rebuild itself (a
# migrated one, an orphan): this many prompt tokens a step at most (unless its EngineArgs say
# otherwise), so its running streams wait one short step, not the whole rebuild.
DECODE_STEP_PREFILL_TOKENS = 64


def _oldest_finished(outputs: OrderedDict) -> str | None:
    return next((rid for rid, t in outputs.items() if t.finish_reason is not None), None)


@dataclasses.dataclass(frozen=True)
class _Traced:
    """A traced request's parent span and when its generation here began (wall ns)."""

    traceparent: str
    start_ns: int
    prompt_tokens: int


@dataclasses.dataclass(frozen=True)
class _Lease:
    deadline: float  # time.monotonic()
    num_bytes: int  # the transfer's size, counted once it is committed


class DecodeWorker(ServingCalls):
    """Also serves colocated mode (``role="colocated"``): ``submit`` prefills locally, chunked."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id
        self.incarnation = new_incarnation()
        restore_priority()  # first: threads started later inherit it
        apply_cpu_affinity(config.cpu_affinity)
        args = dataclasses.replace(config.engine_args, detokenize=False)
        if (config.role == "decode" and args.max_step_prefill_tokens is None
                and args.enable_chunked_prefill):
            args = dataclasses.replace(args, max_step_prefill_tokens=DECODE_STEP_PREFILL_TOKENS)
        # Built on the thread that will step it (engine.runtime.compute_thread says why).
        compute, self.engine = ComputeThread.building(f"{self.worker_id}-loop",
                                                      lambda: LLMEngine(args))
        self.layout = KVLayout.from_model_config(self.engine.model_config,
                                               self.engine.cache_config.kv_cache_dtype)
        # NCCL into the GPU, or gloo (layers arrive in host memory; importing them into the
        # pages copies them to the cache's device): the launcher chose (WorkerConfig.kv_transport).
        self.kv_transport = config.transport_for(self.engine.device.type)
        kv_device = self.engine.device if self.kv_transport == "nccl" else "cpu"
        self.kv_host = kv_host_for(self.worker_id, config.kv_host, config.kv_interface,
                                   "cuda" if self.kv_transport == "nccl" else "cpu")
        # KV arrives on every tensor-parallel rank, each taking its own heads from the prefill
        # ranks that hold them (worker_protocol.kv_ranks); at TP 1, one receiver as ever.
        self.kv = (DecodeRankKV(self.engine, self.worker_id, self.layout, self.kv_host.address,
                                self.kv_transport, kv_device, config.transfer_timeout_s)
                   if config.role == "decode" else None)
        self.delivery = TokenDelivery(self.worker_id)
        self._leases: dict[str, _Lease] = {}
        # request id -> its stream offset (a migrated request's tokens before it), and the
        # outputs of running and recently finished requests (see tokens_of)
        self._offsets: dict[str, int] = {}
        self._outputs: OrderedDict[str, RequestTokens] = OrderedDict()
        self._lock = threading.Lock()
        # Transfer ids are this worker's to give (see ReserveResult.transfer); next() on an
        # itertools.count is atomic under the GIL, so concurrent reserves never share one.
        self._transfer_ids = itertools.count(1)
        self._stopped = threading.Event()
        self.kv_bytes_received = 0
        self._kv_events = WorkerKVEvents(self.engine, self.worker_id, self.incarnation,
                                         config.kv_events_redis_url, config.kv_events_namespace)
        self.loop = EngineLoop(self.engine, self._on_step, name=f"{self.worker_id}-loop",
                               on_crash=exit_on_engine_crash(self.worker_id),
                               after_work=self._kv_events.after_work, compute=compute)
        self.adapters = WorkerAdapters(self.engine, self.loop, _CALL_TIMEOUT_S)
        self.embeddings = WorkerEmbeddings(self.loop, self.adapters, _CALL_TIMEOUT_S)
        # Serves prefill workers' pulls of prefixes this one holds (worker_protocol.prefix_pull).
        self.source = PrefixSource(self.loop, self.worker_id, self.layout, self.kv_host.address,
                                   kv_device, config.fault_pull_delay_per_layer_s)
        # Pulls a moved stream's prompt from a worker that still holds it, so a rebuild here
        # computes only what no one holds (router.control.orchestrator._migrate).
        self.puller = PrefixPuller(self.loop, self.worker_id, self.layout, self.kv_host.address,
                                   kv_device)
        self.tracing: Tracing | None = start_tracing(
            config.tracing, f"pdcluster-{config.role}",
            attributes={"pdcluster.worker_id": self.worker_id})
        self._traced: dict[str, _Traced] = {}  # request id -> its span's parent (tracing on)
        self._lease_thread = threading.Thread(target=self._expire_leases, daemon=True,
                                              name=f"{self.worker_id}-leases")
        self._lease_thread.start()
        # The router reads its end within milliseconds of this process's death.
        self.lifeline = Lifeline(current_node_ip(), self.worker_id)
        # Last: the model, torch and Ray are loaded; keep full collections off them (their
        # pauses would be inter-token gaps).
        freeze_startup_heap()

    # ---- introspection --------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        stats = self.engine.stats()
        return WorkerInfo(self.worker_id, self.config.role, current_node_id(), os.getpid(),
                          self.layout, stats.kv_blocks_total, stats.block_size,
                          self.engine.max_model_len,
                          self.kv.addresses[0] if self.kv else None,
                          current_node_ip(), self.kv_host.address, self.incarnation,
                          self.kv_transport, self.engine.tp_size, self.engine.rank_pids,
                          lifeline_port=self.lifeline.port)

    def load(self, router_id: str = "") -> WorkerLoad:
        """``router_id``: the router asking (its reports say it is alive: see delivery)."""
        if router_id:
            self.delivery.seen(router_id)
        s = self.engine.stats()
        return WorkerLoad(self.worker_id, self.config.role, s.kv_blocks_used, s.kv_blocks_total,
                          s.num_running, s.num_waiting, s.kv_blocks_reserved,
                          self.kv_bytes_received, incarnation=self.incarnation,
                          prefix_hit_tokens=s.num_prefix_hit_tokens,
                          prefill_tokens_computed=s.num_prefill_tokens_computed,
                          kv_event_seq=self._kv_events.log.seq, decode_steps=s.decode_steps,
                          mixed_steps=s.mixed_steps,
                          rank_kv_transfer_bytes=tuple(self.kv.rank_bytes if self.kv else ()),
                          kv_block_bytes=s.kv_block_bytes, **offload_load(s),
                          **self.adapters.load_fields())

    def ping(self) -> str:
        return self.worker_id

    def worker_config(self) -> WorkerConfig:
        """How this worker was built (a re-attaching router checks it wants the same)."""
        return self.config

    def kv_pairs(self) -> dict[str, int]:
        """Prefill worker id -> generation of the live KV group with it."""
        return self.kv.live_pairs() if self.kv else {}

    def kv_rank_state(self) -> list[dict]:
        """What the other tensor-parallel ranks still hold for KV transfers (tests: all zero
        when idle; empty at TP 1 and for a colocated worker, which moves no KV):
        ``worker_protocol.kv_ranks.rank_state``."""
        return rank_state(self.loop, self.engine) if self.kv is not None else []

    def kv_events(self, after_seq: int, incarnation: str) -> KVEventFeed:
        """The KV event batches after a router's cursor (see worker_protocol.kv_events)."""
        return self._kv_events.since(after_seq, incarnation)

    def kv_snapshot(self) -> KVSnapshot:
        """Every block hash the prefix cache holds, and the batch seq it follows."""
        return self.loop.call(self._kv_events.snapshot).result(_CALL_TIMEOUT_S)

    # ---- disaggregated path ---------------------------------------------------------------
    def reserve(self, req: ReserveRequest) -> ReserveResult:
        """Allocate blocks for the prompt and post receives for its KV, under a lease.

        Refuses (ok=False) when blocks are short. Raises KVHandshakeError when the prefill
        worker's model does not match ours.
        """
        with self.adapters.abortable(req.request_id) as aborted:  # set by abort from now on
            return self._reserve(req, aborted)

    def _reserve(self, req: ReserveRequest, aborted: threading.Event) -> ReserveResult:
        rid = req.request_id
        # read here, not on the engine thread; waits while every held adapter is in use
        self.adapters.ensure(req.lora_request, req.adapter_wait_s, aborted)
        self._offsets[rid] = req.sampling_params.sample_index_offset
        self.delivery.own(rid, req.router_id)
        transfer_id = next(self._transfer_ids)

        def reserve(e: LLMEngine) -> tuple[Reservation, KVTransferSpec | None]:
            lora = req.lora_request  # its key again: held now, the LRU may drop it later
            root = e.load_lora(lora).key if lora is not None else 0
            res = e.kv_connector.reserve(rid, req.prompt_token_ids, req.sampling_params, root,
                                         lora, req.priority)
            if not res.ok:
                return res, None
            # Our prefix cache holds the first num_cached_tokens: only the rest travels.
            cached = res.num_cached_tokens
            spec = KVTransferSpec(rid, transfer_id, len(req.prompt_token_ids) - cached,
                                  req.layout, start_token=cached)
            # The other ranks hold the pages and expect their heads from now on.
            self.kv.announce(e, spec, req.source_worker_id, req.source_tp)
            return res, spec

        res, spec = self.loop.call(reserve).result(_CALL_TIMEOUT_S)
        if not res.ok:
            return ReserveResult(False, f"no KV capacity on {self.worker_id}: {res.reason}")
        with self._lock:
            self._leases[rid] = _Lease(time.monotonic() + self.config.lease_s,
                                       spec.layer_nbytes * spec.layout.num_layers)
        if aborted.is_set():  # abort set it before it drops leases: none lasts to lease_s
            self._release(rid)
            return ReserveResult(False, f"{rid} was aborted during its reservation")
        connector = self.engine.kv_connector
        try:
            self.kv.expect(spec, req.source_worker_id, req.source_tp,
                           lambda layer, kv, heads: connector.import_layer(rid, layer, kv, heads))
        except KVHandshakeError:
            self._release(rid)
            raise
        except Exception as e:
            self._release(rid)
            return ReserveResult(False, f"cannot receive KV: {e}")
        return ReserveResult(True, num_blocks=res.num_blocks, kv_address=self.kv.addresses[0],
                             incarnation=self.incarnation, transfer=spec,
                             kv_rank_addresses=self.kv.addresses[1:])

    def commit(self, req: CommitRequest) -> CommitResult:
        """Wait for the KV to have fully arrived, then admit the request with its first token.

        Raises KVTransferError (reservation already released) when the transfer failed or
        timed out.
        """
        rid = req.request_id
        t0 = time.time_ns()
        try:
            self.kv.wait(rid, req.timeout_s or self.config.transfer_timeout_s)
        except KVTransferError as e:
            self._release(rid)
            self._trace_span("decode.kv_wait", req.traceparent, t0, error=repr(e))
            raise
        with self._lock:
            lease = self._leases.pop(rid, None)
        if lease is None:  # lease expired or aborted while we waited
            raise KVTransferError(f"reservation for {rid} was released before commit")
        self.kv_bytes_received += lease.num_bytes
        self._trace_span("decode.kv_wait", req.traceparent, t0,
                         {"pdcluster.kv.bytes": lease.num_bytes})
        if self.tracing is not None and req.traceparent:
            with self._lock:  # before admission: its first step may finish it
                self._traced[rid] = _Traced(req.traceparent, time.time_ns(), -1)
        try:
            admitted = self.loop.call(lambda e: e.kv_connector.admit(
                rid, req.first_token_id, req.first_logprob)).result(_CALL_TIMEOUT_S)
        except KeyError:  # aborted between the wait and the admission
            self._untrace(rid)
            raise KVTransferError(f"{rid} was aborted before commit") from None
        if admitted.finished:  # its only token was the prefill's: no step will report it
            self._trace_end(rid, 1, admitted.finish_reason)
        return CommitResult(admitted.finished, admitted.finish_reason)

    # ---- colocated path -------------------------------------------------------------------
    def submit(self, req: SubmitRequest) -> str:
        """Queue a whole request (prefill + decode here); returns this process's incarnation
        (the one the sequence lives on). Raises QueueFullError when full."""
        self.adapters.ensure(req.lora_request)  # read here, not on the engine thread
        self._offsets[req.request_id] = req.sampling_params.sample_index_offset
        self.delivery.own(req.request_id, req.router_id)
        if self.tracing is not None and req.traceparent:
            with self._lock:
                self._traced[req.request_id] = _Traced(req.traceparent, time.time_ns(),
                                                       len(req.prompt_token_ids))
        self.loop.call(lambda e: e.add_request(
            list(req.prompt_token_ids), req.sampling_params, req.request_id,
            priority=req.priority, lora_request=req.lora_request)).result(_CALL_TIMEOUT_S)
        return self.incarnation

    # ---- both -----------------------------------------------------------------------------
    def abort(self, req: AbortRequest) -> bool:
        """Free everything the request holds here (reservation, pages, slot). Idempotent."""
        self.adapters.cancel(req.request_id)  # a reserve waiting for an adapter gives up
        had_reservation = self._release(req.request_id)
        out = self.loop.call(lambda e: e.abort_request(req.request_id)).result(_CALL_TIMEOUT_S)
        self._trace_end(req.request_id, -1, "abort")
        return had_reservation or out is not None

    def tokens_of(self, request_id: str) -> RequestTokens | None:
        """Everything generated here for a running or recently finished request (None once
        forgotten): a router that adopts a request whose own router died repairs its stream
        log from this."""
        with self._lock:
            return self._outputs.get(request_id)

    def holds(self, request_id: str) -> bool:
        """Whether the request is reserved, queued or running here (not ended): a router
        deciding that a request's router and decode worker both died asks every live
        decode worker this first."""
        with self._lock:
            rec = self._outputs.get(request_id)
            if request_id in self._leases or (rec is not None and rec.finish_reason is None):
                return True
        return rec is None and request_id in self._offsets  # admitted, no step yet

    def progress(self, request_id: str) -> RequestProgress:
        """Where the request stands here: queued (reserved, waiting for a slot, preempted),
        running (for how long) or unknown, and how long the engine has been in its current
        step. A router whose stream got no token for its token timeout asks this before
        taking a busy worker's queue for a lost stream. Never waits for the engine (a
        liveness call: worker_protocol.LIVENESS_GROUP)."""
        stalled = time.monotonic() - self.loop.turned_at
        with self._lock:
            if request_id in self._leases:  # its prompt's KV has not arrived yet
                return RequestProgress(RequestProgress.QUEUED, stalled_s=stalled)
        return dataclasses.replace(self.engine.request_progress(request_id), stalled_s=stalled)

    def subscribe(self, router_id: str = "") -> Iterator[TokenBatch]:
        """Ray streaming generator: one TokenBatch per engine step for the requests
        ``router_id`` owns (several routers may subscribe at once). A newer call from the
        same router (re-subscribing after its connection broke) takes over and the older
        generator ends; a batch is taken off the queue only by the current one."""
        yield from self.delivery.subscribe(router_id)

    def pull_prefix(self, req: PullRequest) -> PullResult:
        """Pull a prefix another worker holds into this one's prefix cache, before the router
        submits a stream rebuilt here; a failed pull holds nothing: the rebuild computes it."""
        return self.puller.pull(req)

    def send_prefix(self, req: SendPrefixRequest) -> int:
        """Serve another worker's pull from this one's prefix cache (the router's
        cluster-wide reuse); returns bytes sent."""
        return self.source.send(req)

    def shutdown(self) -> None:
        if self.tracing is not None:
            self.tracing.shutdown()
        self.puller.close()
        self.source.close()
        self._stopped.set()
        self.delivery.stop()
        self.loop.stop()
        if self.kv is not None:
            self.kv.close()
        self._kv_events.close()
        self.engine.close()  # after the loop: its tier's files and its TP ranks go now
        self.lifeline.close()  # last: routers read that this worker is gone

    # ---- internals ------------------------------------------------------------------------
    def _on_step(self, outs: list[RequestOutput]) -> None:
        outs = self.embeddings.take(outs)  # their callers have them
        updates, forgotten = [], []
        with self._lock:
            for o in outs:
                offset = self._offsets.get(o.request_id, 0)
                reason = o.finish_reason if o.finished else None
                first = len(o.token_ids) == len(o.new_token_ids)
                updates.append(TokenUpdate(o.request_id, o.new_token_ids, reason, o.error,
                                           offset + len(o.token_ids) - len(o.new_token_ids),
                                           o.new_logprobs, o.prompt_logprobs if first else None))
                # o.token_ids is this output's own copy already: kept as is, not copied
                # again (this runs every step for every sequence).
                self._outputs[o.request_id] = RequestTokens(o.request_id, offset,
                                                            o.token_ids, reason)
                self._outputs.move_to_end(o.request_id)
                if o.finished:
                    self._offsets.pop(o.request_id, None)
                    if self._traced:
                        self._trace_end(o.request_id, len(o.token_ids), reason, locked=True,
                                        spec=(o.metrics.num_draft_tokens,
                                              o.metrics.num_accepted_draft_tokens))
            while len(self._outputs) > _KEEP_OUTPUTS and _oldest_finished(self._outputs):
                forgotten.append(_oldest_finished(self._outputs))
                self._outputs.pop(forgotten[-1])
        self.delivery.publish(updates, time.time())
        for rid in forgotten:
            self.delivery.forget(rid)
        if self.config.fault_delay_per_step_s:  # fault injection: a slow decode step
            time.sleep(self.config.fault_delay_per_step_s)

    def _release(self, request_id: str) -> bool:
        """Drop a reservation: stop receiving and free its blocks (if still waiting for KV)."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        # It never produced a token here: nothing else would drop these.
        self._offsets.pop(request_id, None)
        self._untrace(request_id)
        self.delivery.forget(request_id)
        if self.kv is not None:
            self.kv.abort(request_id)
        self.loop.call(lambda e: e.kv_connector.release(request_id)).result(_CALL_TIMEOUT_S)
        return True

    def _expire_leases(self) -> None:
        """Also hands requests of routers that stopped reporting to a live one (delivery)."""
        while not self._stopped.wait(0.2):
            moved = self.delivery.reassign_orphans(self.tokens_of)
            if moved:
                log.warning("%s: %d requests of a silent router handed to a live one",
                            self.worker_id, len(moved))
            now = time.monotonic()
            with self._lock:
                expired = [rid for rid, lease in self._leases.items() if lease.deadline < now]
            for rid in expired:
                log.warning("%s: lease for %s expired; releasing its blocks", self.worker_id, rid)
                self._release(rid)

    # ---- traces (worker_protocol.tracing) -----------------------------------------------------
    def _trace_span(self, name: str, traceparent: str, start_ns: int,
                    attributes: dict | None = None, error: str | None = None) -> None:
        if self.tracing is not None and traceparent:
            self.tracing.record(name, traceparent, start_ns, time.time_ns(),
                                {"pdcluster.worker_id": self.worker_id, **(attributes or {})},
                                error)

    def _trace_end(self, request_id: str, num_tokens: int, reason: str | None,
                   locked: bool = False, spec: tuple[int, int] = (0, 0)) -> None:
        """The request's generation span here, from admission (or submission) to now;
        ``spec``: its drafts verified and accepted here (speculative decoding)."""
        if self.tracing is None:
            return
        if locked:
            traced = self._traced.pop(request_id, None)
        else:
            with self._lock:
                traced = self._traced.pop(request_id, None)
        if traced is None:
            return
        attrs = {"pdcluster.worker_id": self.worker_id,
                 "gen_ai.response.finish_reasons": (reason or "",)}
        if num_tokens >= 0:
            attrs["gen_ai.usage.output_tokens"] = num_tokens
        if traced.prompt_tokens >= 0:  # colocated: the prompt was computed here too
            attrs["gen_ai.usage.input_tokens"] = traced.prompt_tokens
        if spec[0]:
            attrs["pdcluster.spec.draft_tokens"], attrs["pdcluster.spec.accepted_tokens"] = spec
        self.tracing.record("decode.generate", traced.traceparent, traced.start_ns,
                            time.time_ns(), attrs, "aborted" if reason == "abort" else None)

    def _untrace(self, request_id: str) -> None:
        if self.tracing is None:
            return
        with self._lock:
            self._traced.pop(request_id, None)
