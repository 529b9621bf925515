"""router.routing.kv_sync: each worker's KV events are refreshed on their own, so a worker that
does not answer (SIGSTOPped, hung: its call waits out its deadline) never holds back the
others'. Before, one refresh gathered every worker and the next waited for it: a stopped decode
worker kept every prefill worker's new blocks out of the index for a whole call deadline, and a
migrated stream found no prefix to pull. Workers are stand-in actor handles whose answers the
test gives (the Ray path: tests/integration/test_kv_aware_routing.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from router.routing.kv_index import KVIndex
from router.routing.kv_sync import KVEventSync
from worker_protocol.kv_events import KVEventFeed, KVSnapshot


class _Method:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def options(self, **_):
        return self

    def remote(self, *args):
        fut = asyncio.get_running_loop().create_future()
        self.calls.append(fut)
        return fut


@dataclass
class _Handle:
    snapshots: list = field(default_factory=list)
    events: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kv_snapshot = _Method(self.snapshots)
        self.kv_events = _Method(self.events)


@dataclass
class _Info:
    worker_id: str


@dataclass
class _Slot:
    info: _Info
    handle: _Handle = field(default_factory=_Handle)


def test_a_worker_that_does_not_answer_holds_back_no_other():
    async def scenario():
        index = KVIndex(0)
        sync = KVEventSync(index, call_timeout_s=30.0)
        stopped, fine = _Slot(_Info("decode-0")), _Slot(_Info("prefill-0"))
        for s in (stopped, fine):
            sync.track(s.info.worker_id, 16)
        sync.kick([stopped, fine])
        await asyncio.sleep(0)
        assert len(stopped.handle.snapshots) == len(fine.handle.snapshots) == 1
        # prefill-0 answers; decode-0 never does
        fine.handle.snapshots[0].set_result(KVSnapshot("prefill-0", "inc", 3, 16, (11, 12)))
        await asyncio.sleep(0.01)
        assert not index.cursor("prefill-0").stale and index.cached_hashes("prefill-0") == {11, 12}
        assert index.cursor("decode-0").stale
        # The next round: prefill-0 is asked for its new batches; decode-0 is not asked again
        # while its first call still waits.
        sync.kick([stopped, fine])
        await asyncio.sleep(0)
        assert len(stopped.handle.snapshots) == 1 and not stopped.handle.events
        assert len(fine.handle.events) == 1
        fine.handle.events[0].set_result(KVEventFeed("inc", (), True))
        await asyncio.sleep(0.01)
        sync.kick([stopped, fine])
        await asyncio.sleep(0)
        assert len(fine.handle.events) == 2 and len(stopped.handle.snapshots) == 1
        # close ends every refresh still waiting
        await sync.close()
        assert stopped.handle.snapshots[0].cancelled()

    asyncio.run(scenario())
