"""Priorities in routing: requests waiting for decode room get it in priority order (the
engines' order, higher first: a lower client value), whatever order they came in."""

from __future__ import annotations

import asyncio

from router.control.chooser import WorkerChooser
from router.control.request_state import WorkerSlot
from router.routing.kv_index import KVIndex
from router.routing.policy import Routing, WorkerView
from worker_protocol import WorkerInfo, WorkerLoad
from worker_protocol.kv_events import KVEventLog

BS = 4


def _one_decode_worker(blocks: int, used: int):
    """A decode worker's view of ``blocks`` blocks, ``used`` of them in use, its slots and an
    empty KV index."""
    view = WorkerView("d0", "decode", kv_blocks_total=blocks, block_size=BS,
                      load=WorkerLoad("d0", "decode", used, blocks, 0, 0))
    slots = {"d0": WorkerSlot(WorkerInfo("d0", "decode", "node", 1, None, blocks, BS, 4096),
                              None, view)}
    idx = KVIndex(hash_seed=0)
    idx.add_worker("d0", BS)
    idx.reset(KVEventLog("d0", "i1", BS).snapshot([]))
    return view, slots, idx



def test_room_that_frees_goes_to_the_higher_priority_waiter_first():
    """Two requests wait for decode room (the worker's pool is full): the one of the higher
    engine priority (a lower client value) gets it first, though it came second."""
    view, slots, idx = _one_decode_worker(blocks=10, used=10)
    chooser = WorkerChooser(Routing(), idx, capacity_wait_s=10.0)
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await chooser.decode(slots, 8, set(), list(range(3, 11)), lambda: False,
                             priority=priority)
        order.append(name)
        view.inflight_blocks += 9  # what the orchestrator holds for it: room for one only

    async def body():
        low = asyncio.ensure_future(wait("low", -5))
        await asyncio.sleep(0.05)
        high = asyncio.ensure_future(wait("high", 5))
        await asyncio.sleep(0.05)
        assert order == []  # no room yet
        view.load = WorkerLoad("d0", "decode", 0, 10, 0, 0)  # room for one request frees
        await asyncio.wait_for(high, 5)
        await asyncio.sleep(0.3)
        still_waiting = not low.done()
        view.inflight_blocks = 0  # the first one finished
        await asyncio.wait_for(low, 5)
        return still_waiting

    assert asyncio.run(body())
    assert order == ["high", "low"]


def test_tenants_hold_room_in_the_ratio_of_their_weights_under_contention():
    """Forty requests each of two tenants (weights 2 and 1) wait for a worker with room for
    three: as room frees one request at a time, the heavier tenant holds it about twice as
    often (within 10% of 2/3 over the first 30 admissions), though both always wait."""
    from router.control.fair_share import TenantShares

    view, slots, idx = _one_decode_worker(blocks=6, used=0)
    shares = TenantShares({"gold": 2.0, "free": 1.0})
    chooser = WorkerChooser(Routing(), idx, capacity_wait_s=60.0, shares=shares)
    admitted: list[str] = []

    async def request(rid: str) -> None:
        await chooser.decode(slots, 8, set(), list(range(3, 11)), lambda: False,
                             request_id=rid)
        view.inflight_blocks += 2  # what the orchestrator holds for it
        admitted.append(rid)

    async def body():
        tasks = [asyncio.ensure_future(request(f"{t}/{i}")) for i in range(40)
                 for t in ("gold", "free")]
        done = 0
        while len(admitted) < 30:
            await asyncio.sleep(0.01)
            if len(admitted) - done == 3:  # the room is full: the oldest finishes
                shares.ended(admitted[done])
                view.inflight_blocks -= 2
                done += 1
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(body())
    gold = sum(r.startswith("gold/") for r in admitted[:30]) / 30
    assert abs(gold - 2 / 3) <= 0.1, admitted[:30]
