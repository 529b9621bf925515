"""Which workers one request goes to: the routing policy (``router.routing.policy``) over the router's
live view of each worker, with the KV index's answer for this prompt (``router.routing.kv_index``).

Owned by the orchestrator; runs on its event loop. Waiting for decode capacity is bounded
(``capacity_wait_s``); nothing here calls a worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from engine.contract import QueueFullError
from router.contract import WorkerUnavailableError
from router.control.adapters import Adapter, AdapterCatalog
from router.control.fair_share import TenantShares, tenant_of
from router.control.request_state import Aborted, WorkerSlot
from router.routing.kv_index import KVIndex
from router.routing.policy import Routing


class WorkerChooser:
    """``adapters`` and ``prefill_rate`` (tokens/s of a worker) price a LoRA adapter's load on a
    worker that does not hold it (``AdapterCatalog.lora_penalty``); absent: no price."""

    def __init__(self, routing: Routing, index: KVIndex, capacity_wait_s: float,
                 adapters: AdapterCatalog | None = None,
                 prefill_rate: Callable[[str], float] | None = None,
                 shares: TenantShares | None = None) -> None:
        self.routing = routing
        self.index = index
        self.capacity_wait_s = capacity_wait_s
        self.adapters, self.prefill_rate = adapters, prefill_rate
        # Requests waiting for decode room now -> (engine priority, tenant): one waits while
        # a higher priority does, or an equal one of a tenant further below its share
        # (router.control.fair_share), so room that frees goes to that one first.
        self._waiting: dict[object, tuple[int, str]] = {}
        self.shares = shares or TenantShares()
        # How long the last requests that found no decode room waited for it (an EWMA, s;
        # 0 before any waited): the admission's price of a full cluster.
        self.room_wait_s = 0.0

    def _hits(self, detail: dict, slots, lora: Adapter | None) -> dict[str, float]:
        """Each worker's weighted prefix blocks, less the blocks' worth of prompt work that
        loading ``lora`` there would cost (negative: the policy's "missing" tokens then count
        the load beyond the whole prompt)."""
        hits = {wid: m.weighted for wid, m in detail.items()}
        if lora is None or self.adapters is None or self.prefill_rate is None:
            return hits
        for s in slots:
            penalty = self.adapters.lora_penalty(lora, s, self.prefill_rate)
            if penalty:
                wid = s.info.worker_id
                hits[wid] = hits.get(wid, 0.0) - penalty / s.view.block_size
        return hits

    async def decode(self, slots: dict[str, WorkerSlot], num_tokens: int, exclude: set[str],
                     prompt_ids: list[int], aborted: Callable[[], bool],
                     lora: Adapter | None = None, priority: int = 0,
                     request_id: str = "") -> WorkerSlot:
        """A decode worker with room for ``num_tokens``, chosen for this prompt (under LoRA
        adapter ``lora``: its KV keyed by the adapter, its load priced), waiting (bounded)
        for capacity to free up, behind every waiting request of a higher ``priority`` (the
        engines' order: higher first) or of an equal one whose tenant is further below its
        share (``request_id`` names the tenant; router.control.fair_share). Raises Aborted
        (``aborted()`` turned true), WorkerUnavailableError (none live or reachable) or QueueFullError (no room in time)."""
        deadline = time.monotonic() + self.capacity_wait_s
        delay = 0.01
        me, t0 = object(), time.monotonic()
        try:
            slot = await self._decode(slots, num_tokens, exclude, prompt_ids, aborted, lora,
                                      (priority, tenant_of(request_id)), me, deadline, delay)
        finally:
            if self._waiting.pop(me, None) is not None:  # it waited: how long room took
                self.room_wait_s += 0.3 * (time.monotonic() - t0 - self.room_wait_s)
        if request_id:
            self.shares.admitted(request_id)
        return slot

    async def _decode(self, slots, num_tokens, exclude, prompt_ids, aborted, lora, key,
                      me, deadline, delay) -> WorkerSlot:
        while True:
            if aborted():
                raise Aborted
            live = [s for s in slots.values() if s.view.alive]
            if not live:
                raise WorkerUnavailableError("no live decode worker")
            detail = self.index.match_detail(prompt_ids, [s.info.worker_id for s in live],
                                             lora.key if lora else 0)
            # ranked by what the cached blocks save there (a block on disk saves less)
            hits = self._hits(detail, live, lora)
            self._note_cached(live)
            ahead = any(self._before(other, key) for w, other in self._waiting.items()
                        if w is not me)
            view = None if ahead else self.routing.pick_decode(
                [s.view for s in live], len(prompt_ids), num_tokens, exclude, hits)
            if view is not None:
                return slots[view.worker_id]
            self._waiting[me] = key
            if all(s.info.worker_id in exclude for s in live):
                exclude.clear()  # every worker refused once: let them try again after a wait
            if time.monotonic() > deadline:
                now = time.monotonic()
                if not any(s.view.routable(now) for s in live):
                    raise WorkerUnavailableError(
                        "no reachable decode worker: " + ", ".join(
                            f"{s.info.worker_id} unreachable" for s in live))
                raise QueueFullError(f"no decode worker had KV room for {num_tokens} tokens "
                                     f"within {self.capacity_wait_s:.0f} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _before(self, a: tuple[int, str], b: tuple[int, str]) -> bool:
        """Whether waiter ``a`` (priority, tenant) gets room before ``b``."""
        if a[0] != b[0]:
            return a[0] > b[0]
        return a[1] != b[1] and self.shares.share(a[1]) < self.shares.share(b[1])

    def prefill(self, slots: dict[str, WorkerSlot], prompt_ids: list[int],
                exclude: set[str], lora: Adapter | None = None) -> tuple[WorkerSlot, int]:
        """The prefill worker for this prompt, and the prompt tokens it will compute there
        (what its cache does not hold in any tier: counted as queued on it meanwhile). Raises
        WorkerUnavailableError when none is live."""
        detail = self.index.match_detail(prompt_ids, list(slots), lora.key if lora else 0)
        self._note_cached(slots.values())
        # Ranked by what the cached blocks save there (a block on disk saves less) ...
        view = self.routing.pick_prefill([s.view for s in slots.values()], len(prompt_ids),
                                         exclude, self._hits(detail, slots.values(), lora),
                                         {wid: m.in_flight for wid, m in detail.items()})
        if view is None:
            raise WorkerUnavailableError("no live prefill worker")
        # ... but a block restored from any tier is not recomputed: not queued work.
        held = detail.get(view.worker_id)
        work = max(1, len(prompt_ids) - (held.blocks if held else 0) * view.block_size)
        return slots[view.worker_id], work

    @staticmethod
    def reprefill_on_decode(prefill: dict[str, WorkerSlot], policy: str) -> bool:
        """Whether a migrated stream's prompt + generated tokens are computed on its new
        decode worker (``DecodeWorker.submit``: ahead of that worker's waiting prompts, in
        its next step) rather than on a prefill worker and sent over: "decode" always,
        "prefill" never, "auto" when no prefill worker is idle now (routable, no prompt
        tokens this router routed there still in flight). The client's stream is frozen
        until that compute ends: on a busy prefill worker it first waits for the running
        step of new prompts (seconds on a small host, just when a fault brought extra work);
        on the decode worker it waits for one decode step, and that worker's other streams
        wait once for the re-prefill's step."""
        if policy != "auto":
            return policy == "decode"
        now = time.monotonic()
        return not any(s.view.routable(now) and s.view.inflight_prefill_tokens == 0
                       for s in prefill.values())

    def _note_cached(self, slots) -> None:
        """Give the policy its candidates' cache footprints in their KV pools (from the KV
        index; blocks in a second tier take no pool room)."""
        for s in slots:
            s.view.cached_blocks = self.index.num_cached_blocks(s.info.worker_id, "device")
