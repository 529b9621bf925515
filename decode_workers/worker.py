"""Decode worker: reserves KV blocks, receives prompt KV, runs the continuous-batching loop.

A plain class; ``router.cluster`` wraps it as a threaded Ray actor (``max_concurrency`` > 1 so
``subscribe`` can stream while ``reserve`` / ``commit`` / ``abort`` run). Ownership:
- the ``EngineLoop`` thread owns the engine (blocks, scheduler, KV pages);
- the KV receiver's threads write arriving layers into pages the engine reserved for exactly
  that request, which no step reads until ``commit`` admits the request;
- the lease thread frees any reservation whose KV did not arrive in time.
Every step's new tokens for all sequences leave as ONE ``TokenBatch`` (one Ray message per step).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator

from decode_workers.messages import (
    CommitResult,
    ReserveRequest,
    ReserveResult,
    SubmitRequest,
    TokenBatch,
    TokenUpdate,
    WorkerConfig,
    WorkerInfo,
    WorkerLoad,
    apply_cpu_affinity,
)
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestOutput, RequestStatus
from kv_transfer import KVHandshakeError, KVLayout, KVTransferError, TorchDistReceiver

log = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 60.0


@dataclasses.dataclass
class _Reservation:
    block_ids: list[int]
    deadline: float
    num_bytes: int


class DecodeWorker:
    """Also serves colocated mode (``role="colocated"``): ``submit`` prefills locally, chunked."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id
        apply_cpu_affinity(config.cpu_affinity)
        args = dataclasses.replace(config.engine_args, detokenize=False)
        self.engine = LLMEngine(args)
        self.layout = KVLayout.from_model_config(self.engine.model_config)
        # NCCL on GPU, gloo on CPU: the transport follows the engine's device.
        self.receiver = (TorchDistReceiver(self.worker_id, self.layout, host=config.kv_host,
                                           device=self.engine.device,
                                           timeout_s=config.transfer_timeout_s)
                         if config.role == "decode" else None)
        self._batches: queue.SimpleQueue[TokenBatch | None] = queue.SimpleQueue()
        self._reservations: dict[str, _Reservation] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.kv_bytes_received = 0
        self.loop = EngineLoop(self.engine, self._on_step, name=f"{self.worker_id}-loop")
        self._lease_thread = threading.Thread(target=self._expire_leases, daemon=True,
                                              name=f"{self.worker_id}-leases")
        self._lease_thread.start()

    # ---- introspection --------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        import ray

        bm = self.engine.block_manager
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        return WorkerInfo(self.worker_id, self.config.role, node, os.getpid(), self.layout,
                          bm.num_blocks, bm.block_size, self.engine.max_model_len,
                          self.receiver.address if self.receiver else None)

    def load(self) -> WorkerLoad:
        bm = self.engine.block_manager
        sched = self.engine.scheduler
        with self._lock:
            reserved = sum(len(r.block_ids) for r in self._reservations.values())
        return WorkerLoad(self.worker_id, self.config.role, bm.num_used_blocks, bm.num_blocks,
                          reserved, sched.num_running, len(sched.waiting) + len(sched.remote),
                          self.kv_bytes_received)

    def ping(self) -> str:
        return self.worker_id

    # ---- disaggregated path ---------------------------------------------------------------
    def reserve(self, req: ReserveRequest) -> ReserveResult:
        """Allocate blocks for the prompt and post receives for its KV, under a lease.

        Refuses (ok=False) when blocks are short. Raises KVHandshakeError when the prefill
        worker's model does not match ours.
        """
        params = req.sampling_params

        def allocate(engine: LLMEngine) -> list[int] | None:
            request = Request(req.request_id, list(req.prompt_token_ids), params,
                              req.arrival_time or engine.clock(), eos_token_ids=engine.eos_token_ids)
            if not engine.scheduler.add_remote_request(request):
                return None
            return list(engine.block_manager.block_ids(req.request_id))

        block_ids = self.loop.call(allocate).result(_CALL_TIMEOUT_S)
        if block_ids is None:
            bm = self.engine.block_manager
            return ReserveResult(False, f"no KV capacity on {self.worker_id}: need "
                                        f"{bm.num_blocks_needed(len(req.prompt_token_ids) + 1)} "
                                        f"blocks, {bm.num_free_blocks} free")
        with self._lock:
            self._reservations[req.request_id] = _Reservation(
                block_ids, time.monotonic() + self.config.lease_s, req.transfer.layer_nbytes
                * req.transfer.layout.num_layers)
        runner = self.engine.runner
        try:
            self.receiver.expect(req.transfer, req.source_worker_id,
                                 lambda layer, kv: runner.write_layer_kv(layer, block_ids, kv))
        except KVHandshakeError:
            self._release(req.request_id)
            raise
        except Exception as e:
            self._release(req.request_id)
            return ReserveResult(False, f"cannot receive KV: {e}")
        return ReserveResult(True, num_blocks=len(block_ids))

    def commit(self, request_id: str, first_token_id: int, timeout_s: float | None = None
               ) -> CommitResult:
        """Wait for the KV to have fully arrived, then admit the request with its first token.

        Raises KVTransferError (reservation already released) when the transfer failed or
        timed out.
        """
        try:
            self.receiver.wait(request_id, timeout_s or self.config.transfer_timeout_s)
        except KVTransferError:
            self._release(request_id)
            raise
        with self._lock:
            res = self._reservations.pop(request_id, None)
        if res is None:  # lease expired or aborted while we waited
            raise KVTransferError(f"reservation for {request_id} was released before commit")
        self.kv_bytes_received += res.num_bytes
        try:
            update = self.loop.call(lambda e: e.scheduler.finish_remote_kv(
                request_id, first_token_id)).result(_CALL_TIMEOUT_S)
        except KeyError:  # aborted between the wait and the admission
            raise KVTransferError(f"{request_id} was aborted before commit") from None
        req = update.request
        return CommitResult(req.is_finished, req.status.finish_reason)

    # ---- colocated path -------------------------------------------------------------------
    def submit(self, req: SubmitRequest) -> None:
        """Queue a whole request (prefill + decode here). Raises QueueFullError when full."""

        def add(engine: LLMEngine) -> None:
            engine.enqueue(Request(req.request_id, list(req.prompt_token_ids), req.sampling_params,
                                   req.arrival_time or engine.clock(),
                                   eos_token_ids=engine.eos_token_ids))

        self.loop.call(add).result(_CALL_TIMEOUT_S)

    # ---- both -----------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Free everything the request holds here (reservation, pages, slot). Idempotent."""
        had_reservation = self._release(request_id)
        aborted = self.loop.call(lambda e: e.scheduler.abort_request(request_id)).result(_CALL_TIMEOUT_S)
        return had_reservation or bool(aborted)

    def subscribe(self) -> Iterator[TokenBatch]:
        """Ray streaming generator: one TokenBatch per engine step that produced tokens."""
        while not self._stopped.is_set():
            try:
                batch = self._batches.get(timeout=0.5)
            except queue.Empty:
                continue
            if batch is None:
                return
            yield batch

    def shutdown(self) -> None:
        self._stopped.set()
        self._batches.put(None)
        self.loop.stop()
        if self.receiver is not None:
            self.receiver.close()

    # ---- internals ------------------------------------------------------------------------
    def _on_step(self, outs: list[RequestOutput]) -> None:
        updates = [TokenUpdate(o.request_id, o.new_token_ids, o.finish_reason if o.finished else None)
                   for o in outs]
        self._batches.put(TokenBatch(self.worker_id, updates, time.time()))

    def _release(self, request_id: str) -> bool:
        """Drop a reservation: stop receiving and free its blocks (if still waiting for KV)."""
        with self._lock:
            res = self._reservations.pop(request_id, None)
        if res is None:
            return False
        if self.receiver is not None:
            self.receiver.abort(request_id)

        def free(engine: LLMEngine) -> None:
            req = engine.scheduler.remote.get(request_id)
            if req is not None:
                engine.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)

        self.loop.call(free).result(_CALL_TIMEOUT_S)
        return True

    def _expire_leases(self) -> None:
        while not self._stopped.wait(0.2):
            now = time.monotonic()
            with self._lock:
                expired = [rid for rid, r in self._reservations.items() if r.deadline < now]
            for rid in expired:
                log.warning("%s: lease for %s expired; releasing its blocks", self.worker_id, rid)
                self._release(rid)
