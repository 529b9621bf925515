"""The engine's only door for remote KV (disaggregation), split like vLLM's KV connector.

Scheduler side (call on the engine-loop thread, between steps, e.g. through
``EngineLoop.call``): a decode worker ``reserve``s pages for a prompt whose KV another worker
computes, ``admit``s the request once every layer and the first token are there, or
``release``s the reservation (lease expiry, abort, failed transfer).

Worker side: ``import_layer`` writes one arriving layer into the pages reserved for that
request (safe from any thread: no step reads those pages until ``admit``); a prefill worker
registers an ``exporter`` that the engine calls after each layer's KV is written, once per
request whose prompt the step completed, with the step's identity and timing passed in.

Prefix pulls (cluster-wide reuse): a worker that lacks a prompt's prefix another worker holds
``reserve_prefix``-es pages for it, takes the other worker's ``read_prefix`` layers through
``import_layer`` like any remote KV, and ``commit_prefix`` registers them in its prefix cache
(or ``release``-s them when the pull fails); the request that needed them then finds them
there instead of computing them.

Workers use this and ``LLMEngine``'s public methods only; they never touch the scheduler,
the block manager or the model runner.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.contract import SamplingParams, TokenLogprob
from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from engine.executor.model_runner import ModelRunner
from engine.lora.request import LoRARequest


@dataclass(frozen=True)
class StepInfo:
    """Which engine step is running: its number and when it started (the engine's clock)."""

    step_id: int
    started_at: float


@dataclass(frozen=True)
class LayerExport:
    """One layer of one request's prompt KV, complete and token-contiguous.

    ``kv`` is ``[2, num_tokens, num_kv_heads, head_dim]`` (K then V) for prompt positions
    ``[export_from, end)`` (the request's ``export_from``; 0 unless the receiver holds a
    prefix), a fresh tensor the exporter owns: the engine may reuse the pages it came from
    as soon as the request ends.
    """

    request_id: str
    layer: int
    kv: torch.Tensor
    step: StepInfo
    # The model's KV heads [lo, hi) in ``kv``: None, every one. Set when KV moves per rank
    # (``per_rank``): rank 0's own heads; each other rank's agent gets its own.
    heads: tuple[int, int] | None = None


Exporter = Callable[[LayerExport], None]
_pins = itertools.count()


@dataclass(frozen=True)
class Reservation:
    """The answer to ``reserve``: pages held for the remote KV, or why not."""

    ok: bool
    num_blocks: int = 0
    reason: str = ""  # set when refused
    # Leading prompt tokens this engine's prefix cache already holds (whole blocks, pinned
    # with the reservation): only the KV of the tokens after them must arrive.
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class Admission:
    """The answer to ``admit``: the request joined the running batch, or its first token
    already finished it (EOS, ``max_tokens=1``)."""

    finished: bool
    finish_reason: str | None = None


class KVConnector:
    """Owned by one ``LLMEngine``; see the module docstring for which thread calls what."""

    def __init__(self, scheduler: Scheduler, blocks: BlockManager, runner: ModelRunner,
                 eos_token_ids: tuple[int, ...], clock: Callable[[], float]) -> None:
        self._scheduler = scheduler
        self._blocks = blocks
        self._runner = runner
        self._eos_token_ids = eos_token_ids
        self._clock = clock
        # request id -> (its pages, the first position that arrives). The lock orders
        # import_layer's page writes against release: once release returns, no late layer
        # can land in pages now owned by another request (a receiver thread may still be
        # delivering when a lease expires).
        self._reserved: dict[str, tuple[list[int], int]] = {}
        self._lock = threading.Lock()
        self.exporter: Exporter | None = None
        # KV moves per tensor-parallel rank (``LLMEngine.attach_rank_agents``): exports carry
        # each rank's own heads, reservations are held on every rank, imports name their heads.
        self.per_rank = False
        self._step: StepInfo | None = None
        self._exports: list[ScheduledChunk] = []

    # ---- scheduler side (engine-loop thread) ----------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int],
                params: SamplingParams, hash_root: int = 0,
                lora_request: LoRARequest | None = None, priority: int = 0) -> Reservation:
        """Hold pages for the prompt (and its first generated token) until ``admit`` or
        ``release``, reusing the longest prefix this engine caches (``num_cached_tokens``:
        ``import_layer`` then takes only the rest). Refuses (``ok=False``, pool unchanged)
        when the pool is short right now; raises ValueError for an id the engine already
        knows. ``lora_request`` / ``hash_root``: the adapter the KV was computed under and
        its key (``LLMEngine.load_lora``): the prefix reused is that adapter's only;
        ``priority``: its place in the running batch (``Scheduler``: preempted last-first)."""
        req = Request(request_id, list(prompt_token_ids), params, self._clock(),
                      eos_token_ids=self._eos_token_ids)
        req.lora_request, req.hash_root, req.priority = lora_request, hash_root, priority
        if not self._scheduler.add_remote_request(req):
            need = self._blocks.num_blocks_needed(len(prompt_token_ids) + 1)
            return Reservation(False, reason=f"need {need} blocks, "
                                             f"{self._blocks.num_free_blocks} free")
        block_ids = list(self._blocks.block_ids(request_id))
        with self._lock:
            self._reserved[request_id] = (block_ids, req.num_cached_tokens)
        if self.per_rank and self._runner.tp is not None:
            # Sent with the next message to the other ranks: the caller's tell_ranks(now=True)
            # or the next step, which cannot touch these pages before then.
            self._runner.rank_kv.tell(("reserve", request_id, block_ids, req.num_cached_tokens))
        return Reservation(True, num_blocks=len(block_ids), num_cached_tokens=req.num_cached_tokens)

    def admit(self, request_id: str, first_token_id: int,
              first_logprob: TokenLogprob | None = None) -> Admission:
        """Every layer is in the reserved pages: the request joins the batch with its first
        token (and its log-probability, computed where it was sampled, when the request asked
        for logprobs). Raises KeyError when the reservation is gone (released or aborted)."""
        with self._lock:
            if self._reserved.pop(request_id, None) is None:
                raise KeyError(request_id)
        self._unreserve_ranks(request_id)
        update = self._scheduler.finish_remote_kv(request_id, first_token_id, first_logprob)
        return Admission(update.request.is_finished, update.request.status.finish_reason)

    def release(self, request_id: str) -> bool:
        """Free a reservation whose KV will not be used. False if there was none (already
        admitted, released, or never reserved)."""
        with self._lock:
            had = self._reserved.pop(request_id, None) is not None
        if had:
            self._unreserve_ranks(request_id)
        req = self._scheduler.remote.get(request_id)
        if req is not None:
            self._scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return had

    # ---- prefix pulls (engine-loop thread) --------------------------------------------------
    def reserve_prefix(self, pull_id: str, token_ids: list[int], end: int) -> Reservation:
        """Hold pages for positions ``[0, end)`` of ``token_ids`` (a prompt, longer than
        ``end``), whose KV another worker will send; ``num_cached_tokens``: the leading ones
        this engine's prefix cache holds already (only ``[num_cached_tokens, end)`` must
        arrive, through ``import_layer``). Then ``commit_prefix`` or ``release``."""
        if not 0 < end < len(token_ids):
            raise ValueError(f"prefix end {end} outside the prompt ({len(token_ids)} tokens)")
        # One token past the prefix: the cache never serves a prompt's last token, so the
        # prefix's own last block counts as held when it is.
        return self.reserve(pull_id, list(token_ids[:end + 1]), SamplingParams(max_tokens=1))

    def commit_prefix(self, pull_id: str, end: int) -> int:
        """Every layer of a pull is in its pages: cache the full blocks of ``[0, end)`` and
        free the rest (the cached ones stay, like a finished request's). Returns the tokens
        of the prefix now cached. Raises KeyError when the reservation is gone."""
        with self._lock:
            if self._reserved.pop(pull_id, None) is None:
                raise KeyError(pull_id)
        req = self._scheduler.remote[pull_id]
        self._blocks.cache_full_blocks(pull_id, req.prompt_token_ids, end)
        self._scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return end // self._blocks.block_size * self._blocks.block_size

    def read_prefix(self, token_ids: list[int], start: int, end: int) -> list[torch.Tensor] | None:
        """Positions ``[start, end)`` of this engine's cached prefix of ``token_ids``, one
        ``[2, end - start, kv_heads, head_dim]`` tensor per layer (fresh: the pages may be
        reused at once), or None when the cache no longer holds all of ``[0, end)``. Blocks
        in a second tier are restored first. Not under tensor parallelism (ValueError)."""
        if self._runner.tp is not None:
            raise ValueError("read_prefix: not with tensor_parallel_size > 1")
        bs = self._blocks.block_size
        cover = -(-end // bs) * bs
        if not 0 <= start < end or cover > len(token_ids):
            return None
        # The probe's extra token: the cache never serves a prompt's last one.
        computed = self._blocks.get_computed_blocks(list(token_ids[:cover]) + [0])
        if computed.num_tokens(bs) < cover:
            return None
        pin = f"read-prefix-{next(_pins)}"  # holds the blocks while they are read
        if not self._blocks.allocate_slots(pin, cover, computed):
            return None
        try:
            if self._blocks.adopted_tokens(pin) < cover:
                return None
            block_ids = self._blocks.block_ids(pin)
            return [self._runner.rank_kv.read_layer_kv(layer, block_ids, end, start=start)
                    for layer in range(len(self._runner.kv_caches))]
        finally:
            self._blocks.free(pin)

    def _unreserve_ranks(self, request_id: str) -> None:
        """The other ranks stop taking KV into the pages before the next step (which may
        give them to another request) runs there: the message goes ahead of it."""
        if self.per_rank and self._runner.tp is not None:
            self._runner.rank_kv.tell(("unreserve", request_id))

    @property
    def num_reserved_blocks(self) -> int:
        """Pages held for KV still in flight (part of the engine's used blocks)."""
        with self._lock:
            return sum(len(b) for b, _ in self._reserved.values())

    # ---- worker side ------------------------------------------------------------------------
    def import_layer(self, request_id: str, layer: int, kv: torch.Tensor,
                     heads: tuple[int, int] | None = None) -> None:
        """Scatter ``kv`` ``[2, num_tokens, kv_heads, head_dim]`` (the prompt's positions from
        ``num_cached_tokens`` on) into the request's reserved pages (any thread). ``heads``:
        ``kv`` holds only the model's KV heads ``[lo, hi)``, all of them this rank's (KV
        arriving per rank; the other ranks' agents import theirs). Raises KeyError when the
        reservation was released meanwhile."""
        with self._lock:
            reserved = self._reserved.get(request_id)
            if reserved is None:
                raise KeyError(f"no reservation for {request_id!r} (released)")
            block_ids, start = reserved
            self._runner.rank_kv.write_layer_kv(layer, block_ids, kv, start=start, heads=heads)

    # ---- called by LLMEngine.step ----------------------------------------------------------
    def begin_step(self, sched: SchedulerOutput, step: StepInfo) -> bool:
        """Note which requests this step completes whose KV must leave; True if any (the
        engine then calls ``layer_saved`` after each layer)."""
        self._step = step
        # Only a prompt's last chunk exports: earlier chunks of a long prompt stay in our pages
        # until the step that completes it, which then sends the whole prompt per layer.
        self._exports = [c for c in sched.chunks if c.export_kv and c.sample]
        return bool(self._exports and self.exporter is not None)

    def step_reads(self) -> list[tuple[str, list[int], int, int]]:
        """The reads ``layer_saved`` makes after each layer this step, in its order (request
        id, block ids, tokens, start): a tensor-parallel engine's other ranks make them too."""
        return [(c.request_id, c.block_ids, c.end_pos, c.export_from) for c in self._exports]

    def layer_saved(self, layer: int, kv_cache: torch.Tensor) -> None:
        """Layer ``layer``'s KV for this step is written: hand each completed prompt's copy
        to the exporter (which sends it while the next layer computes)."""
        assert self.exporter is not None and self._step is not None
        heads = self._runner.rank_kv.own_kv_heads if self.per_rank else None
        for chunk in self._exports:
            kv = self._runner.rank_kv.read_layer_kv(layer, chunk.block_ids, chunk.end_pos,
                                                    start=chunk.export_from,
                                                    gather=not self.per_rank)
            self.exporter(LayerExport(chunk.request_id, layer, kv, self._step, heads))
