"""Prefill worker: batched, chunked prefill that streams each layer's KV to a decode worker.

A plain class; ``router.cluster`` wraps it as a threaded Ray actor so many ``prefill`` calls
wait concurrently while one ``EngineLoop`` thread batches their prompts by token budget.
Each prompt is a ``max_tokens=1`` request with ``export_kv``: in the step that computes its
last chunk, the layer hook gathers that layer's K/V for the whole prompt (token-contiguous)
and posts an async send right away, so layer L travels while layer L+1 computes. The pages
are freed when the request finishes (the sends hold their own copies); full blocks stay in
the prefix cache for later prompts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from decode_workers.messages import (
    PrefillRequest,
    PrefillResult,
    WorkerConfig,
    WorkerInfo,
    WorkerLoad,
    apply_cpu_affinity,
)
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestOutput
from kv_transfer import KVLayout, KVTransferAborted, TorchDistSender

log = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 60.0


@dataclasses.dataclass
class _Pending:
    req: PrefillRequest
    future: Future
    arrival: float
    scheduled_at: float | None = None
    layers_sent: int = 0
    kv_bytes: int = 0
    held: list[torch.Tensor] = dataclasses.field(default_factory=list)  # non-streaming mode


class PrefillWorker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id
        apply_cpu_affinity(config.cpu_affinity)
        args = dataclasses.replace(config.engine_args, detokenize=False)
        self.engine = LLMEngine(args)
        self.layout = KVLayout.from_model_config(self.engine.model_config)
        self.sender = TorchDistSender(self.worker_id, self.layout, device=self.engine.device,
                                      timeout_s=config.transfer_timeout_s)
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._finisher = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"{self.worker_id}-send")
        self._layers_sent_total = 0
        self.kv_bytes_sent = 0
        self.engine.layer_hook = self._on_layer
        self.loop = EngineLoop(self.engine, self._on_step, name=f"{self.worker_id}-loop")

    def info(self) -> WorkerInfo:
        import ray

        bm = self.engine.block_manager
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        return WorkerInfo(self.worker_id, "prefill", node, os.getpid(), self.layout, bm.num_blocks,
                          bm.block_size, self.engine.max_model_len)

    def load(self) -> WorkerLoad:
        bm = self.engine.block_manager
        sched = self.engine.scheduler
        return WorkerLoad(self.worker_id, "prefill", bm.num_used_blocks, bm.num_blocks, 0,
                          sched.num_running, len(sched.waiting), self.kv_bytes_sent)

    def layers_sent(self, request_id: str) -> int:
        """How many layers of an in-flight request's KV have been posted (tests, debugging)."""
        pending = self._pending.get(request_id)
        return pending.layers_sent if pending else -1

    def ping(self) -> str:
        return self.worker_id

    def prefill(self, req: PrefillRequest) -> PrefillResult:
        """Compute the prompt, stream its KV to ``req.destination``, return the first token.

        Blocks until every layer was sent. Raises KVTransferError on a failed/timed-out
        transfer, KVTransferAborted if ``abort`` was called, ValueError for bad input.
        """
        sp = req.sampling_params
        # One token here; stop strings and the rest of the budget are the decode side's.
        params = dataclasses.replace(sp, max_tokens=1, min_tokens=min(sp.min_tokens, 1), stop=[])
        pending = _Pending(req, Future(), time.monotonic())
        with self._lock:
            if req.request_id in self._pending:
                raise ValueError(f"duplicate request id {req.request_id!r}")
            self._pending[req.request_id] = pending

        def add(engine: LLMEngine) -> None:
            r = Request(req.request_id, list(req.prompt_token_ids), params, engine.clock(),
                        eos_token_ids=engine.eos_token_ids, export_kv=True)
            engine.enqueue(r)

        try:
            self.loop.call(add).result(_CALL_TIMEOUT_S)
            return pending.future.result()
        finally:
            with self._lock:
                self._pending.pop(req.request_id, None)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is None:
            return False
        self.loop.call(lambda e: e.scheduler.abort_request(request_id))
        self.sender.abort(pending.req.transfer)
        if not pending.future.done():
            pending.future.set_exception(KVTransferAborted(f"{request_id} aborted during prefill"))
        return True

    def shutdown(self) -> None:
        self.loop.stop()
        self._finisher.shutdown(wait=False, cancel_futures=True)
        self.sender.close()

    # ---- engine-loop thread -----------------------------------------------------------------
    def _on_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        sched = self.engine.current_step
        started = self.engine.step_started_at  # same clock (time.monotonic) as `arrival`
        for chunk in sched.chunks:
            if not chunk.export_kv:
                continue
            pending = self._pending.get(chunk.request_id)
            if pending is None:
                continue
            if pending.scheduled_at is None:
                pending.scheduled_at = started
            if not chunk.sample:
                continue  # an earlier chunk of a long prompt: its KV stays in our pages for now
            kv = self.engine.runner.read_layer_kv(layer, chunk.block_ids, chunk.end_pos)
            pending.kv_bytes += kv.numel() * kv.element_size()
            if self.config.stream_layers:
                self._send(pending, layer, kv)
            else:
                pending.held.append(kv)

    def _send(self, pending: _Pending, layer: int, kv: torch.Tensor) -> None:
        self.sender.send_layer(pending.req.destination, pending.req.transfer, layer, kv)
        self._layers_sent_total += 1
        pending.layers_sent += 1
        limit = self.config.fault_exit_after_layers
        if limit is not None and self._layers_sent_total >= limit:
            log.error("%s: fault injection: exiting after %d layers", self.worker_id, limit)
            os._exit(1)
        if self.config.fault_delay_per_layer_s:
            time.sleep(self.config.fault_delay_per_layer_s)

    def _on_step(self, outs: list[RequestOutput]) -> None:
        step_end = time.monotonic()
        for out in outs:
            pending = self._pending.get(out.request_id)
            if pending is None or not out.finished:
                continue
            if out.finish_reason == "abort" or not out.token_ids:
                continue
            for layer, kv in enumerate(pending.held):  # send-at-the-end mode
                self._send(pending, layer, kv)
            pending.held.clear()
            self._finisher.submit(self._finish, pending, out, step_end)

    def _finish(self, pending: _Pending, out: RequestOutput, step_end: float) -> None:
        req = pending.req
        try:
            self.sender.finish(req.transfer, self.config.transfer_timeout_s)
        except BaseException as e:
            self.sender.abort(req.transfer)
            if not pending.future.done():
                pending.future.set_exception(e)
            return
        done = time.monotonic()
        self.kv_bytes_sent += pending.kv_bytes
        scheduled = pending.scheduled_at or pending.arrival
        result = PrefillResult(req.request_id, out.token_ids[0], len(req.prompt_token_ids),
                               out.metrics.num_cached_tokens, scheduled - pending.arrival,
                               step_end - scheduled, done - step_end, pending.kv_bytes)
        if not pending.future.done():
            pending.future.set_result(result)
