"""The request lifecycle: reserve -> prefill -> transfer -> commit -> decode -> stream (see
"The request lifecycle" in docs/architecture.md). Runs on the router's asyncio loop. Owns, per request, the global request id, the stream of
token updates from its decode worker, the incremental detokenizer (stop strings are decided
here), and the duty to free the request's KV on every path: finish, client cancel, error,
worker death. Failed reserve / prefill / transfer steps are retried on other workers; a
request either completes or ends with an error the client sees, never silently.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from engine.config import cdiv, kv_hash_seed
from engine.contract import QueueFullError, RequestFailedError, SamplingParams, check_priority
from engine.text.input_processor import InputProcessor
from engine.text.tokenizer import IncrementalDetokenizer, Tokenizer
from kv_transfer import KVLayout
from router.contract import (
    GenerateInput,
    GenerationChunk,
    InvalidRequestError,
    Usage,
    WorkerUnavailableError,
    as_invalid_request,
    new_request_id,
)
from router.control.adapters import AdapterCatalog
from router.control.admission import Outcomes, admit
from router.control.chooser import WorkerChooser
from router.control.config import MIGRATED_PRIORITY, OrchestratorConfig
from router.control.drain import WorkerDrains
from router.control.fair_share import TenantShares
from router.control.fanout import TokenFanout
from router.control.heartbeat import Heartbeats
from router.control.membership import rejoin
from router.control.orphans import OrphanRescue
from router.control.phase_times import PhaseTimes
from router.control.prefix_pull import PrefixPulls
from router.control.request_state import (
    Aborted,
    FirstToken,
    RequestTiming,
    RetryElsewhere,
    StreamState,
    WorkerLost,
    WorkerSlot,
    cause_of,
    first_update,
    rest_of,
)
from router.control.request_trace import RequestTrace, decode_call, phase
from router.control.token_wait import next_update
from router.control.usage import UsageCounters
from router.control.worker_calls import WorkerCalls
from router.control.worker_health import WorkerHealth
from router.routing.kv_index import KVIndex
from router.routing.kv_sync import KVEventSync
from router.routing.policy import Routing, WorkerView
from router.state.memory import InMemoryStore
from router.state.store import JournalEvent
from router.state.stream_log import StreamLogger
from worker_protocol import (
    AbortRequest,
    CommitRequest,
    PrefillRequest,
    PrefillResult,
    ReserveRequest,
    SubmitRequest,
    TokenUpdate,
    WorkerInfo,
    control,
)
from worker_protocol.tracing import start_tracing

log = logging.getLogger(__name__)

class Orchestrator:
    def __init__(self, config: OrchestratorConfig, tokenizer: Tokenizer | None,
                 inputs: InputProcessor, layout: KVLayout, store=None,
                 kv_event_source=None) -> None:
        """``kv_event_source``: where workers' KV events are read (Redis Streams), or None:
        pulled from the workers (see router.routing.kv_sync)."""
        self.config = config
        self.tokenizer = tokenizer
        self.inputs = inputs
        self.layout = layout
        self.store = store
        # This router's name towards the workers (they send it the tokens of the requests it
        # reserved or submitted, and hand it those of routers that stopped reporting) and
        # in the store (the owner of its requests' stream logs).
        self.router_id = f"router-{uuid.uuid4().hex[:12]}"
        self.streams = StreamLogger(store if store is not None else InMemoryStore(),
                                    config.model_id, tokenizer,
                                    orphan_after_s=config.orphan_after_s, owner=self.router_id)
        # Which worker caches which blocks, from the workers' own KV events (kv_sync feeds it).
        # Keyed like the workers' blocks: the seed folds in their KV dtype (kv_hash_seed).
        self.kv_index = KVIndex(kv_hash_seed(config.prefix_hash_seed, layout.kv_cache_dtype))
        self.kv_sync = KVEventSync(self.kv_index, config.call_timeout_s, kv_event_source)
        self.adapters = AdapterCatalog(config.model_id, config.enable_lora, lambda: [
            *self.prefill.values(), *self.decode.values()], config.call_timeout_s)
        self.usage = UsageCounters()
        self._streams: dict[str, StreamState] = {}
        self.fanout = TokenFanout(self._streams, self.streams, config.call_timeout_s,
                                  self.router_id)
        self.health = WorkerHealth(store, config.kv_unreachable_quarantine_s,
                                   config.worker_silent_s, self.fanout.fail_committed_streams)
        self.fanout.health = self.health
        self.calls = WorkerCalls(self.health, config.call_timeout_s)
        # Cluster-wide reuse: pull a prefix another worker holds instead of computing it.
        self.pulls = PrefixPulls(self.kv_index, layout, config.routing.prefix_pull,
                                 config.transfer_timeout_s, health=self.health)
        self.choose = WorkerChooser(Routing(config.routing), self.kv_index,
                                    config.capacity_wait_s, self.adapters, self.pulls.prefill_rate,
                                    TenantShares(config.tenant_weights))
        self.orphans = OrphanRescue(self)
        self.fanout.on_lost = self.orphans.lost
        self.streams.on_stall = self.orphans.stalled
        self.prefill: dict[str, WorkerSlot] = {}
        self.decode: dict[str, WorkerSlot] = {}
        # Failure detection in about a second (router/control/heartbeat.py).
        self.heartbeats = Heartbeats(
            lambda: [*self.prefill.values(), *self.decode.values()],
            lambda wid: any(s.committed for s in self.streams_on(wid)), self.fanout.last_tokens,
            self.health.silent, self.health.gone, config.heartbeat_interval_s,
            config.suspect_after_s)
        self.kv_transfer_bytes_total, self.outcomes = 0, Outcomes()  # outcomes: admission's
        self.migrations: dict[str, int] = {}  # reason -> streams moved off a lost worker
        self.phases = PhaseTimes()  # where first tokens' time went (/metrics), last timings
        self.pulls.on_transfer = self.phases.transfer
        self.tracing = start_tracing(config.tracing, "pdcluster-router", is_router=True,
                                     attributes={"pdcluster.router_id": self.router_id})
        # Operators' drains (scale-down): the cluster sets ``drains.retire`` (it owns processes).
        self.drains = WorkerDrains(lambda: [*self.prefill.values(), *self.decode.values()],
                                   self.fanout, call_timeout_s=config.call_timeout_s)

    # ---- membership -----------------------------------------------------------------------
    def add_worker(self, info: WorkerInfo, handle) -> None:
        view = WorkerView(info.worker_id, info.role, info.num_kv_blocks, info.block_size)
        slot = WorkerSlot(info, handle, view)
        self.kv_sync.track(info.worker_id, info.block_size)
        if info.role == "prefill":
            self.prefill[info.worker_id] = slot
        else:
            self.decode[info.worker_id] = slot
            self.fanout.start(slot)
        self.heartbeats.watch(slot)

    def rejoin(self, slot: WorkerSlot, info: WorkerInfo) -> None:
        """``slot``'s worker was restarted by Ray: see ``router.control.membership.rejoin``."""
        rejoin(self, slot, info)

    async def close(self) -> None:
        await self.drains.close()
        await self.heartbeats.close()
        await self.kv_sync.close()
        await self.orphans.close()
        await self.streams.close()
        await self.fanout.close()
        if self.tracing is not None:  # its queued spans, within its export timeout
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)

    # ---- the lifecycle --------------------------------------------------------------------
    async def generate(self, inp: GenerateInput) -> AsyncIterator[GenerationChunk]:
        lora = self.adapters.resolve(inp.model)  # ModelNotFoundError for a name not served
        try:
            enc = self.inputs.process(inp.prompt, inp.sampling)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        if len(self._streams) >= self.config.max_inflight_requests:
            raise QueueFullError(f"too many requests in flight ({self.config.max_inflight_requests})")
        rid = inp.request_id or new_request_id()
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in flight")
        prompt_ids, params = enc.token_ids, inp.sampling
        # the engines' priorities run the other way (higher first): router/control/config.py
        priority = -as_invalid_request(check_priority, inp.priority)
        predicted = admit(self, prompt_ids, params.max_tokens, lora, inp.deadline_s, priority)
        stream = StreamState(rid, lora=lora, priority=priority, predicted=predicted)
        t0 = time.monotonic()
        finished = False
        stream.trace = RequestTrace.open(self.tracing, rid, self.config.model_id,
                                         inp.messages is not None, len(prompt_ids), params,
                                         inp.traceparent, inp.user)
        last = error = None  # the last chunk streamed, what ended the request (traces)
        # From here every path ends in the finally below, which drops the stream's entry:
        # a leaked entry would count against max_inflight_requests forever.
        self.add_stream(stream)
        try:
            self._journal(rid, "received", None, f"{len(prompt_ids)} prompt tokens")
            self.streams.open(rid, prompt_ids, params, inp.messages is not None,
                              lora.name if lora is not None else None)
            first: FirstToken | None = None
            try:
                if self.config.mode == "colocated":
                    await self._submit_colocated(stream, prompt_ids, params)
                else:
                    first = await self._prefill(stream, prompt_ids, params)
            except Aborted:  # aborted by id: the queue already holds the final "abort" update
                first = None
            pending: list[TokenUpdate | WorkerLost] = []
            if first is not None:
                pending.append(first_update(rid, first))
            async for chunk in self.follow(stream, prompt_ids, params, [], pending, t0):
                finished, last = chunk.finished, chunk
                self.outcomes.note(stream, chunk)  # adapters' tokens, prediction errors
                yield chunk
        except BaseException as e:
            error = e
            raise
        finally:
            if stream.trace is not None:
                stream.trace.close(last, finished, stream.migrations, error)
            await self.end_stream(stream, finished)

    # ---- what the orphan rescue needs (router/control/orphans.py: RescueHost) -------------
    @property
    def call_timeout_s(self) -> float:
        return self.config.call_timeout_s

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    def live_decode_slots(self) -> list[WorkerSlot]:
        return [s for s in self.decode.values() if s.view.alive and not s.view.draining]

    def streams_on(self, worker_id: str) -> list[StreamState]:
        return self.fanout.streams_on(worker_id)

    def add_stream(self, stream: StreamState) -> None:
        self._streams[stream.request_id] = stream

    async def end_stream(self, stream: StreamState, finished: bool) -> None:
        """Drop the stream's entry; unfinished, end its log and journal with "abort" and free
        whatever its workers hold."""
        self._streams.pop(stream.request_id, None)
        self.kv_index.forget(stream.request_id)
        self.choose.shares.ended(stream.request_id)
        if not finished:
            self.streams.append(stream.request_id, [], "abort")
            self._journal(stream.request_id, "aborted", stream.decode_id, "")
            await asyncio.shield(self._abort_on_workers(stream))

    async def follow(self, stream: StreamState, prompt_ids: list[int], params: SamplingParams,
                     generated: list[int], pending: list, t0: float
                     ) -> AsyncIterator[GenerationChunk]:
        """The stream's chunks from its worker's token updates (``pending`` first), after the
        tokens ``generated`` already (a continued request's log holds them): each logged before
        it is yielded; a lost worker migrates the stream (up to ``migration_limit`` times); a
        stop string ends it. Ends after the finished chunk."""
        rid = stream.request_id
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, stop=params.stop, stop_token_ids=params.stop_token_ids,
                include_stop_str_in_output=params.include_stop_str_in_output)
            if generated:
                detok.update(generated)  # the text so far, so stop strings span the seam
        generated, ttft = list(generated), None  # generated: every token streamed, in order
        while True:
            upd = (pending.pop(0) if pending else await next_update(
                stream, self.decode.get(stream.decode_id), self.config.token_timeout_s))
            # A drain's move is the operator's, not a sign of a request that kills workers:
            # it does not count against migration_limit.
            drained = isinstance(upd, WorkerLost) and upd.reason == "drained"
            if isinstance(upd, WorkerLost) and (
                    drained or stream.migrations < self.config.migration_limit):
                self.migrations[upd.reason] = self.migrations.get(upd.reason, 0) + 1
                resumed = await self._migrate(stream, prompt_ids, params, generated, str(upd),
                                              counted=not drained)
                if resumed is not None:
                    pending.append(resumed)
                continue
            if isinstance(upd, BaseException):
                raise upd
            if upd.finish_reason == "error":  # the worker failed this request alone
                raise RequestFailedError(f"request {rid} failed: {upd.error}")
            new_ids, logprobs, reason, text = list(upd.new_token_ids), upd.logprobs, upd.finish_reason, ""
            if detok is not None:  # accepted drafts come several at once: a stop string ends
                d, used = detok.update_each(new_ids)  # at its token, the rest dropped
                if used < len(new_ids):
                    new_ids, reason, logprobs = new_ids[:used], None, logprobs and logprobs[:used]
                text = d.delta_text
                if d.stopped and reason is None:
                    reason = "stop"
                    await self._abort_on_workers(stream)
                if reason is not None:
                    text += detok.flush()
            generated += new_ids
            if ttft is None and new_ids:
                ttft = time.monotonic() - t0
            finished = reason is not None
            # Logged before the client sees it: a client resuming after token n finds it.
            self.streams.append(rid, new_ids, reason)
            yield GenerationChunk(rid, new_ids, text, finished, reason,
                                  Usage(len(prompt_ids), len(generated)) if finished else None,
                                  ttft, len(prompt_ids), logprobs, upd.prompt_logprobs)
            if finished:
                self._journal(rid, "finished", stream.decode_id, reason)
                return

    async def _migrate(self, stream: StreamState, prompt_ids: list[int], params: SamplingParams,
                       generated: list[int], why: str, counted: bool = True
                       ) -> TokenUpdate | None:
        """Continue a stream whose decode worker was lost: prompt + every token streamed,
        computed again (what another worker holds of it pulled) on another decode worker or
        pair. Returns the next token's update or None (it streams): the client sees one stream,
        no token missing or repeated, equal to an undisturbed run (greedy or seeded)."""
        old = stream.decode_id
        if stream.trace is not None:
            stream.trace.end_decode(f"migrated: {why}")
        stream.migrations += counted
        stream.priority = MIGRATED_PRIORITY
        self._journal(stream.request_id, "migrated", old,
                      f"after {len(generated)} tokens: {why}"[:200])
        log.warning("migrating %s off %s after %d tokens (%s)", stream.request_id,
                    old or "its lost worker", len(generated), why)
        if old in self.decode:  # best effort: a silent worker that comes back frees the KV
            stream.moved_off[old] = asyncio.ensure_future(
                self.calls.safe_abort(self.decode[old], stream.request_id))
        if len(generated) >= params.max_tokens:  # every token arrived; only the end was lost
            return TokenUpdate(stream.request_id, [], "length")
        rest = rest_of(params, len(generated))
        if self.config.mode == "colocated" or self.choose.reprefill_on_decode(
                self.prefill, self.config.migration_prefill):  # it prefills, then streams
            await self._submit_colocated(stream, prompt_ids + generated, rest, {old}, pull=True)
            return None
        first = await self._prefill(stream, prompt_ids + generated, rest, avoid_decode={old})
        return first_update(stream.request_id, first)

    async def abort(self, request_id: str) -> bool:
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        stream.aborted = True
        await self._abort_on_workers(stream)
        stream.queue.put_nowait(TokenUpdate(request_id, [], "abort"))
        return True

    async def _abort_on_workers(self, stream: StreamState) -> None:
        await stream.settle(self.config.call_timeout_s)  # an abort must not overtake a reserve
        calls = []
        msg = AbortRequest(stream.request_id)
        if stream.prefill_id and stream.prefill_id in self.prefill:
            calls.append(control(self.prefill[stream.prefill_id].handle.abort).remote(msg))
        if stream.decode_id and stream.decode_id in self.decode:
            calls.append(control(self.decode[stream.decode_id].handle.abort).remote(msg))
        for c in calls:
            try:
                await asyncio.wait_for(c, self.config.call_timeout_s)
            except Exception as e:  # a dead worker holds nothing; an unreachable one, a lease
                log.info("abort of %s: %r", stream.request_id, e)

    async def _submit_colocated(self, stream: StreamState, prompt_ids: list[int], params,
                                avoid: set[str] = frozenset(), pull: bool = False) -> None:
        """Route to a decode (colocated) worker that prefills and streams; ``pull``: first
        pull there what another worker holds of the prompt, when cheaper than computing it."""
        num_tokens = len(prompt_ids) + params.max_tokens
        with phase(stream.trace, "route"):
            slot = await self.choose.decode(self.decode, num_tokens, set(avoid), prompt_ids,
                                            lambda: stream.aborted, stream.lora,
                                            stream.priority, stream.request_id)
        # A moved stream's prompt is often still cached where it was prefilled; no pulls under
        # an adapter: they move base-model prefixes (KV of other weights).
        if pull and stream.lora is None:
            await self.pulls.before_prefill(stream.request_id, prompt_ids, slot, [
                *self.prefill.values(), *self.decode.values()], self._journal, stream.trace)
            if stream.aborted:
                raise Aborted
        await stream.rejoin(slot.info.worker_id, self.config.call_timeout_s)
        stream.decode_id, stream.committed = slot.info.worker_id, True
        self.kv_index.forget(stream.request_id)  # a migrated stream's earlier worker
        self.kv_index.expect(stream.request_id, slot.info.worker_id, prompt_ids, stream.root)
        slot.view.inflight_requests += 1
        try:
            stream.decode_incarnation = await decode_call(
                stream.trace, slot.info.worker_id, lambda tp: stream.open_call(
                    slot.handle.submit.remote(SubmitRequest(
                        stream.request_id, prompt_ids, params, stream.priority, self.router_id,
                        tp, stream.lora_request))))
        finally:
            slot.view.inflight_requests -= 1

    async def _prefill(self, stream: StreamState, prompt_ids: list[int], params,
                       avoid_decode: set[str] = frozenset()) -> FirstToken:
        """Reserve, prefill, transfer, commit; a failed attempt retried on other workers."""
        rid = stream.request_id
        excluded: dict[str, set[str]] = {"prefill": set(), "decode": set(avoid_decode)}
        last_error: BaseException | None = None
        for attempt in range(self.config.max_attempts):
            if stream.aborted:
                raise Aborted
            # Only to a worker whose free blocks cover prompt AND whole output now: preemption
            # gets rare, not impossible (the reservation holds prompt + 1; outputs of requests
            # routed meanwhile share the free blocks; a preempted one is recomputed there).
            with phase(stream.trace, "route", {"pdcluster.attempt": attempt + 1}):
                decode = await self.choose.decode(
                    self.decode, len(prompt_ids) + params.max_tokens, excluded["decode"],
                    prompt_ids, lambda: stream.aborted, stream.lora, stream.priority, rid)
                pslot, work = self.choose.prefill(self.prefill, prompt_ids, excluded["prefill"],
                                                  stream.lora)
            try:
                return await self._attempt(stream, pslot, decode, prompt_ids, params, attempt,
                                           work)
            except RetryElsewhere as retry:
                for slot in retry.exclude:
                    excluded["prefill" if slot.info.role == "prefill" else "decode"].add(
                        slot.info.worker_id)
                last_error = retry.error
                self._journal(rid, "retried", retry.worker_id, repr(retry.error)[:200])
        raise WorkerUnavailableError(f"request {rid} failed after {self.config.max_attempts} "
                                     f"attempts; last error: {cause_of(last_error)!r}")

    async def _attempt(self, stream: StreamState, pslot: WorkerSlot, decode: WorkerSlot,
                       prompt_ids: list[int], params, attempt: int, work: int) -> FirstToken:
        """One try on one (prefill, decode) pair; ``work``: the prompt tokens it will cost
        the prefill worker (counted as queued there meanwhile). Raises RetryElsewhere with
        the reservation already released, Aborted, or ClusterMisconfiguredError."""
        rid = stream.request_id
        cfg = self.config
        await stream.rejoin(decode.info.worker_id, cfg.call_timeout_s)  # before any count
        # In-flight affinity: both workers will hold the prompt's blocks once this attempt is
        # through; until their events say so the index counts them (not a failed attempt's).
        self.kv_index.forget(rid)
        for slot in (pslot, decode):
            self.kv_index.expect(rid, slot.info.worker_id, prompt_ids, stream.root)
        need = cdiv(len(prompt_ids) + 1, decode.view.block_size)
        decode.view.inflight_blocks += need
        # Counted from the pick, not from the reserve's answer: requests routed in one burst
        # must see each other's prompts, or they all pick the same prefill worker.
        pslot.view.inflight_prefill_tokens += work
        prefill_counted = True
        stream.decode_id, stream.committed = decode.info.worker_id, False
        trace = stream.trace
        try:
            with phase(trace, "reserve", {"pdcluster.worker_id": decode.info.worker_id}):
                res = await self.calls.call(stream, decode, stream.open_call(
                    decode.handle.reserve.remote(ReserveRequest(
                        rid, prompt_ids, params, self.layout, pslot.info.worker_id,
                        self.router_id, pslot.info.tp_size, stream.lora_request,
                        stream.priority, cfg.capacity_wait_s))),
                    cfg.call_timeout_s + (cfg.capacity_wait_s if stream.lora else 0.0))
            if not res.ok:
                raise RetryElsewhere(QueueFullError(res.reason), [decode], decode.info.worker_id)
            cached = res.transfer.start_token if res.transfer is not None else 0
            self._journal(rid, "reserved", decode.info.worker_id,
                          f"{res.num_blocks} blocks for KV from {pslot.info.worker_id}"
                          + (f"; {cached} prompt tokens cached here" if cached else ""))
            try:
                with phase(trace, "prefill", {"pdcluster.worker_id": pslot.info.worker_id}
                           ) as span:
                    if stream.lora is None:  # pulls move base-model prefixes only
                        await self.pulls.before_prefill(rid, prompt_ids, pslot, [
                            *self.prefill.values(), *self.decode.values()], self._journal)
                    stream.prefill_id = pslot.info.worker_id
                    # The reserving process's address: a just-restarted worker has a new port.
                    destination = res.kv_address or decode.info.kv_address
                    result: PrefillResult = await self.calls.call(
                        stream, pslot, pslot.handle.prefill.remote(PrefillRequest(
                            rid, prompt_ids, params, res.transfer, destination,
                            cfg.prefill_timeout_s, stream.priority, res.kv_rank_addresses,
                            trace.header(span) if trace is not None else "",
                            stream.lora_request)),
                        cfg.prefill_timeout_s + cfg.call_timeout_s, release=decode, peer=decode)
            finally:
                # On cancellation prefill_id stays set, so the caller aborts the prefill too.
                pslot.view.inflight_prefill_tokens -= work
                prefill_counted = False
            stream.prefill_id = None
            self._journal(rid, "prefilled", pslot.info.worker_id, "")
            prefilled_at = time.monotonic()
            # The decode phase runs from here to the last token (or a migration).
            commit = await decode_call(trace, decode.info.worker_id, lambda tp: self.calls.call(
                stream, decode, decode.handle.commit.remote(CommitRequest(
                    rid, result.first_token_id, cfg.transfer_timeout_s, result.first_logprob, tp)),
                cfg.transfer_timeout_s + cfg.call_timeout_s, release=decode))
        finally:
            decode.view.inflight_blocks -= need
            if prefill_counted:  # the reserve failed: no prefill was sent
                pslot.view.inflight_prefill_tokens -= work
        stream.committed, stream.decode_incarnation = True, res.incarnation
        self.kv_transfer_bytes_total += result.kv_bytes
        self.pulls.note_prefill(pslot.info.worker_id,
                                result.num_prompt_tokens - result.num_cached_tokens,
                                result.compute_s)
        self.phases.record(rid, RequestTiming(result.queue_s, result.compute_s,
                                              result.transfer_tail_s, attempt + 1),
                           time.monotonic() - prefilled_at)
        if result.kv_bytes:
            self.phases.transfer(f"{pslot.info.role}->{decode.info.role}", result.transfer_s)
        self._journal(rid, "committed", decode.info.worker_id, "")
        return FirstToken(result.first_token_id, commit.finished, commit.finish_reason,
                          result.first_logprob, result.prompt_logprobs)

    def _journal(self, rid: str, kind: str, worker_id: str | None, detail: str | None) -> None:
        if self.store is not None:
            self.store.journal_append(rid, JournalEvent(time.time(), kind, worker_id, detail or ""))
