"""KV cache tiers on the router's side: stored events and snapshots carry each block's tier
(old batches without one still read as device), the index follows a block as it moves between
tiers, and routing prefers a prefix held on device over the same prefix on disk while never
counting a restored block as work to compute."""

from __future__ import annotations

import asyncio
import json
import pickle
import random
from types import SimpleNamespace

import pytest
import torch

from engine.config import KVTierConfig
from engine.core.block_manager import BlockManager
from engine.core.kv_events import TIERS, AllCleared, BlockRemoved, BlockStored, KVEventRecorder
from engine.executor.kv_tier import KVTier
from router.control.chooser import WorkerChooser
from router.control.request_state import WorkerSlot
from router.routing.kv_index import (
    DISK_BLOCK_WEIGHT,
    HOST_BLOCK_WEIGHT,
    TIER_BLOCK_WEIGHTS,
    KVIndex,
    PrefixMatch,
)
from router.routing.policy import Routing, WorkerView
from worker_protocol import WorkerInfo, WorkerLoad
from worker_protocol.kv_events import KVEventBatch, KVEventLog, KVSnapshot
from worker_protocol.kv_publisher import WorkerKVEvents

BS = 4


def _prompt(num_blocks: int, start: int = 3) -> list[int]:
    """A prompt of ``num_blocks`` full cacheable blocks (one more token: the last is computed)."""
    return list(range(start, start + num_blocks * BS + 1))


def _index(*workers: str) -> tuple[KVIndex, dict[str, KVEventLog]]:
    idx = KVIndex(hash_seed=0)
    logs = {w: KVEventLog(w, "i1", BS) for w in workers}
    for w, log in logs.items():
        idx.add_worker(w, BS)
        idx.reset(log.snapshot([]))
    return idx, logs


def _publish(idx: KVIndex, log: KVEventLog, *events) -> None:
    log.publish(list(events))
    assert idx.apply(log.since(log.seq - 1, log.incarnation).batches[-1])


# ---- the wire ---------------------------------------------------------------------------
def test_stored_tiers_round_trip_as_json_and_device_keeps_the_old_format():
    b = KVEventBatch("p-1", "abc", 7, 16, (
        BlockStored((2**64 - 1, 5), "host"), BlockStored((6,), "disk"), BlockStored((8,)),
        BlockRemoved((9,)), AllCleared()))
    assert KVEventBatch.from_json(b.to_json()) == b
    events = json.loads(b.to_json())["e"]
    # a reader from before tiers reads device blocks as it always did
    assert events[2] == ["s", [8]] and events[0] == ["s", [2**64 - 1, 5], "host"]


def test_a_batch_written_before_tiers_reads_as_all_on_device():
    old = '{"w": "d0", "i": "x", "s": 3, "b": 16, "e": [["s", [1, 2]], ["r", [1]], ["c"]]}'
    batch = KVEventBatch.from_json(old)
    assert batch.events == (BlockStored((1, 2), "device"), BlockRemoved((1,)), AllCleared())


def test_an_unknown_tier_is_refused_not_read_as_device():
    bad = '{"w": "d0", "i": "x", "s": 3, "b": 16, "e": [["s", [1], "tape"]]}'
    with pytest.raises(ValueError, match="unknown KV cache tier 'tape'"):
        KVEventBatch.from_json(bad)
    with pytest.raises(ValueError, match="unknown KV cache tier"):
        KVEventBatch("d0", "x", 1, 16, (BlockStored((1,), "tape"),)).to_json()
    # A batch that reached the index some other way (a Ray pull) with such a tier is
    # refused like a hole: the worker matches nothing until a snapshot.
    idx, logs = _index("d0")
    prompt = _prompt(2)
    _publish(idx, logs["d0"], BlockStored(tuple(idx.prompt_hashes(prompt, BS))))
    logs["d0"].publish([BlockStored((1,), "tape")])
    assert not idx.apply(logs["d0"].since(logs["d0"].seq - 1, "i1").batches[-1])
    assert idx.cursor("d0").stale and idx.match(prompt) == {}


def test_snapshots_carry_each_blocks_tier():
    log = KVEventLog("d0", "i1", BS)
    snap = log.snapshot([1, 2, 3], ["device", "host", "disk"])
    assert snap.block_tiers() == {1: "device", 2: "host", 3: "disk"}
    assert pickle.loads(pickle.dumps(snap)) == snap  # as a Ray reply carries it
    plain = log.snapshot([1, 2])  # a worker without a second tier
    assert plain.tiers == () and plain.block_tiers() == {1: "device", 2: "device"}
    with pytest.raises(ValueError, match="2 blocks has 1 tiers"):
        log.snapshot([1, 2], ["host"])
    with pytest.raises(ValueError, match="unknown KV cache tier 'tape'"):
        KVSnapshot("d0", "i1", 1, BS, (1,), ("tape",))


def test_the_index_refuses_a_snapshot_with_an_unknown_tier_and_stays_stale():
    idx, logs = _index("d0")
    idx.invalidate("d0")
    snap = logs["d0"].snapshot([1, 2], ["device", "host"])
    # what an unpickled snapshot from a newer worker would hold (__post_init__ not rerun)
    object.__setattr__(snap, "tiers", ("device", "tape"))
    with pytest.raises(ValueError, match="tape"):
        idx.reset(snap)
    assert idx.cursor("d0").stale and idx.cached_block_tiers("d0") == {}


# ---- the index ----------------------------------------------------------------------------
def test_the_index_follows_a_block_from_device_to_host_to_disk_to_gone():
    idx, logs = _index("d0")
    prompt = _prompt(3)
    h = idx.prompt_hashes(prompt, BS)
    _publish(idx, logs["d0"], BlockStored(tuple(h)))
    assert idx.match_detail(prompt)["d0"] == PrefixMatch(3, 0, 3.0)
    assert idx.num_cached_blocks("d0", "device") == 3
    _publish(idx, logs["d0"], BlockStored((h[0],), "host"))  # evicted from the pool to host
    assert idx.cached_block_tiers("d0") == {h[0]: "host", h[1]: "device", h[2]: "device"}
    m = idx.match_detail(prompt)["d0"]
    assert m.blocks == 3 and m.weighted == pytest.approx(2 + HOST_BLOCK_WEIGHT)
    assert idx.num_cached_blocks("d0", "device") == 2 and idx.num_cached_blocks("d0") == 3
    _publish(idx, logs["d0"], BlockStored((h[0],), "disk"))  # host memory full: to disk
    assert idx.cached_block_tiers("d0")[h[0]] == "disk"
    assert idx.match_detail(prompt)["d0"].weighted == pytest.approx(2 + DISK_BLOCK_WEIGHT)
    assert idx.num_cached_blocks("d0", "disk") == 1 and idx.num_cached_blocks("d0", "host") == 0
    _publish(idx, logs["d0"], BlockStored((h[0],)))  # a request restored it to the pool
    assert idx.match_detail(prompt)["d0"] == PrefixMatch(3, 0, 3.0)
    _publish(idx, logs["d0"], BlockStored((h[0],), "disk"), BlockRemoved((h[0],)))
    assert idx.match(prompt) == {}  # the first block is gone from every tier
    assert idx.cached_block_tiers("d0") == {h[1]: "device", h[2]: "device"}
    _publish(idx, logs["d0"], BlockStored((h[1],), "host"), AllCleared())
    assert idx.cached_block_tiers("d0") == {} and idx.num_cached_blocks("d0", "host") == 0


def test_a_snapshot_with_tiers_replaces_the_entry():
    idx, logs = _index("d0")
    prompt = _prompt(4)
    h = idx.prompt_hashes(prompt, BS)
    idx.invalidate("d0")
    idx.reset(logs["d0"].snapshot(h, ["device", "device", "host", "disk"]))
    want = dict(zip(h, ["device", "device", "host", "disk"], strict=True))
    assert idx.cached_block_tiers("d0") == want
    m = idx.match_detail(prompt)["d0"]
    assert m.blocks == 4
    assert m.weighted == pytest.approx(2 + HOST_BLOCK_WEIGHT + DISK_BLOCK_WEIGHT)
    _publish(idx, logs["d0"], BlockStored((h[3],)))  # events after the snapshot move it
    assert idx.cached_block_tiers("d0")[h[3]] == "device"
    idx.invalidate("d0")  # a snapshot without tiers: every block on device, none left slow
    idx.reset(logs["d0"].snapshot(h))
    assert idx.match_detail(prompt)["d0"] == PrefixMatch(4, 0, 4.0)


def test_in_flight_blocks_count_as_on_device():
    idx, logs = _index("p0")
    prompt = _prompt(4)
    h = idx.prompt_hashes(prompt, BS)
    _publish(idx, logs["p0"], BlockStored(tuple(h[:2]), "disk"))
    idx.expect("r1", "p0", prompt)  # computing the last two blocks there now
    m = idx.match_detail(prompt)["p0"]
    assert (m.blocks, m.in_flight) == (4, 2)
    assert m.weighted == pytest.approx(2 * DISK_BLOCK_WEIGHT + 2)
    idx.forget("r1")


def test_random_moves_between_tiers_keep_the_index_equal_to_the_worker():
    """Whatever blocks move where, the index (fed by events, and now and then by a snapshot
    through the worker's publisher) holds each block in the worker's tier, and its matches
    count and weigh exactly the worker's leading runs."""
    rng = random.Random(11)
    engine = _TieredEngine()
    pub = WorkerKVEvents(engine, "d0", "i1")
    idx = KVIndex(hash_seed=0)
    idx.add_worker("d0", BS)
    idx.reset(pub.snapshot(engine))
    prompts = [_prompt(n, start=s) for n, s in ((5, 3), (3, 3), (4, 50))]
    hashes = sorted({h for p in prompts for h in idx.prompt_hashes(p, BS)})
    for _ in range(400):
        h = rng.choice(hashes)
        if h in engine.tiers and rng.random() < 0.3:
            engine.drop(h)
        else:
            engine.move(h, rng.choice(TIERS))
        if rng.random() < 0.05:
            idx.invalidate("d0")
            idx.reset(pub.snapshot(engine))
        else:
            pub.after_work(engine)
            for b in pub.since(idx.cursor("d0").seq, "i1").batches:
                assert idx.apply(b)
        assert idx.cached_block_tiers("d0") == engine.tiers
        for p in prompts:
            run = []
            for ph in idx.prompt_hashes(p, BS):
                if ph not in engine.tiers:
                    break
                run.append(TIER_BLOCK_WEIGHTS[engine.tiers[ph]])
            want = {"d0": PrefixMatch(len(run), 0, sum(run, 0.0))} if run else {}
            assert idx.match_detail(p) == want


def test_the_index_mirrors_a_real_block_manager_with_a_host_and_disk_tier(tmp_path):
    """The engine's own cache (pool + host memory + disk, all tiny so blocks move all the
    time): after every step the router's index, fed its events, holds exactly what the cache
    says it holds, in the same tiers; so does a snapshot of it."""
    rng = random.Random(3)
    caches = [torch.zeros(6, 2, BS, 1, 2)]  # [num_blocks, 2, block_size, kv_heads, head_dim]
    block_bytes = caches[0][0].numel() * 4
    tier = KVTier(caches, KVTierConfig(3 * block_bytes, str(tmp_path), 8 * (block_bytes + 512)))
    bm = BlockManager(num_blocks=6, block_size=BS, tier=tier)
    bm.record_events()
    log = KVEventLog("d0", "i1", BS)
    idx = KVIndex(hash_seed=0)
    idx.add_worker("d0", BS)
    idx.reset(log.snapshot([]))
    prefixes = [[rng.randrange(100) for _ in range(4 * BS)] for _ in range(4)]
    live: list[str] = []
    seen_tiers: set[str] = set()
    try:
        for step in range(300):
            if live and (rng.random() < 0.5 or len(live) > 1):
                bm.free(live.pop(rng.randrange(len(live))))
            else:
                toks = rng.choice(prefixes)[:rng.randrange(1, 4 * BS)] + [
                    rng.randrange(100) for _ in range(rng.randrange(0, 2 * BS))]
                rid = f"r{step}"
                computed = bm.get_computed_blocks(toks)
                if bm.allocate_slots(rid, len(toks), computed):
                    bm.cache_full_blocks(rid, toks, len(toks))
                    live.append(rid)
            log.publish(bm.take_events())
            for b in log.since(idx.cursor("d0").seq, "i1").batches:
                assert idx.apply(b)
            assert idx.cached_block_tiers("d0") == bm.cached_tiers()
            seen_tiers.update(bm.cached_tiers().values())
        assert seen_tiers == set(TIERS)  # blocks did reach host memory and disk
        tiers = bm.cached_tiers()
        idx.invalidate("d0")
        idx.reset(log.snapshot(list(tiers), list(tiers.values())))
        assert idx.cached_block_tiers("d0") == tiers
    finally:
        tier.close()


class _TieredEngine:
    """The engine surface ``WorkerKVEvents`` uses, over a cache whose blocks move between
    tiers, recording events as the engine's cache does (``KVEventRecorder``)."""

    def __init__(self) -> None:
        self.tiers: dict[int, str] = {}
        self._events = KVEventRecorder()

    def record_kv_events(self) -> None:
        pass

    def stats(self):
        return SimpleNamespace(block_size=BS)

    def take_kv_events(self):
        return self._events.drain()

    def cached_block_tiers(self) -> dict[int, str]:
        return dict(self.tiers)

    def move(self, h: int, tier: str) -> None:
        self.tiers[h] = tier
        self._events.stored(h, tier)

    def drop(self, h: int) -> None:
        del self.tiers[h]
        self._events.removed(h)


# ---- routing ----------------------------------------------------------------------------
def _slot(wid: str, role: str) -> WorkerSlot:
    view = WorkerView(wid, role, kv_blocks_total=1000, block_size=BS,
                      load=WorkerLoad(wid, role, 0, 1000, 0, 0))
    info = WorkerInfo(wid, role, "node", 1, None, 1000, BS, 4096)
    return WorkerSlot(info, None, view)


def _holding(role: str, held: dict[str, tuple[list[int], str]]):
    """An index and slots where each worker holds its hashes in one tier (by snapshot)."""
    idx, logs = _index(*held)
    for wid, (hashes, tier) in held.items():
        idx.invalidate(wid)
        idx.reset(logs[wid].snapshot(hashes, [tier] * len(hashes)))
    return idx, {wid: _slot(wid, role) for wid in held}


def test_prefill_prefers_the_prefix_on_device_but_counts_a_restored_one_as_not_computed():
    prompt = _prompt(4)
    h = KVIndex(hash_seed=0).prompt_hashes(prompt, BS)
    for device_first in (True, False):  # the winner is the tier, not the name or the turn
        tiers = ("device", "disk") if device_first else ("disk", "device")
        idx, slots = _holding("prefill", {"p0": (h, tiers[0]), "p1": (h, tiers[1])})
        chooser = WorkerChooser(Routing(), idx, capacity_wait_s=1)
        slot, work = chooser.prefill(slots, prompt, set())
        assert slot.info.worker_id == ("p0" if device_first else "p1")
        assert work == 1  # only the last token is computed
    # Alone with the prefix on disk: the restored blocks are not queued as work.
    idx, slots = _holding("prefill", {"p0": (h, "disk")})
    slot, work = WorkerChooser(Routing(), idx, 1).prefill(slots, prompt, set())
    assert slot.info.worker_id == "p0" and work == 1


def test_a_long_run_on_disk_beats_a_much_shorter_one_on_device_as_the_weights_say():
    prompt = _prompt(6)
    h = KVIndex(hash_seed=0).prompt_hashes(prompt, BS)
    # 6 blocks on disk are worth 6 x 0.8 = 4.8 blocks computed: more than 2 on device...
    idx, slots = _holding("prefill", {"p0": (h[:2], "device"), "p1": (h, "disk")})
    slot, work = WorkerChooser(Routing(), idx, 1).prefill(slots, prompt, set())
    assert slot.info.worker_id == "p1" and work == 1
    # ... but less than 5 on device (restoring is not free).
    idx, slots = _holding("prefill", {"p0": (h[:5], "device"), "p1": (h, "disk")})
    slot, work = WorkerChooser(Routing(), idx, 1).prefill(slots, prompt, set())
    assert slot.info.worker_id == "p0" and work == 1 + BS
    # host memory is close to the pool: 6 on host beat 5 on device
    idx, slots = _holding("prefill", {"p0": (h[:5], "device"), "p1": (h, "host")})
    assert WorkerChooser(Routing(), idx, 1).prefill(slots, prompt, set())[0] is slots["p1"]


def test_decode_prefers_the_prefix_on_device_over_host():
    prompt = _prompt(8)
    h = KVIndex(hash_seed=0).prompt_hashes(prompt, BS)
    for tiers in (("device", "host"), ("host", "device")):
        idx, slots = _holding("decode", {"d0": (h, tiers[0]), "d1": (h, tiers[1])})
        chooser = WorkerChooser(Routing(), idx, capacity_wait_s=1)
        slot = asyncio.run(chooser.decode(slots, len(prompt) + 8, set(), prompt, lambda: False))
        assert slot.info.worker_id == ("d0" if tiers[0] == "device" else "d1")


def test_blocks_in_a_second_tier_do_not_fill_the_pool():
    """A cold prompt goes where the KV pool holds least: a worker whose many cached blocks
    are all on disk has an empty pool, so it takes the prompt over one whose pool is half
    full of cached prefixes."""
    idx, slots = _holding("decode", {"d0": (list(range(1, 601)), "disk"),
                                     "d1": (list(range(1000, 1500)), "device")})
    cold = _prompt(4, start=5000)
    chooser = WorkerChooser(Routing(), idx, capacity_wait_s=1)
    assert asyncio.run(chooser.decode(slots, len(cold) + 8, set(), cold,
                                      lambda: False)).info.worker_id == "d0"


def test_everything_on_device_matches_and_routes_as_before_tiers():
    prompt = _prompt(5)
    h = KVIndex(hash_seed=0).prompt_hashes(prompt, BS)
    idx, slots = _holding("prefill", {"p0": (h[:3], "device"), "p1": (h, "device")})
    detail = idx.match_detail(prompt)
    assert detail == {"p0": PrefixMatch(3), "p1": PrefixMatch(5)}
    assert detail["p1"].weighted == 5.0 and idx.match(prompt) == {"p0": 3, "p1": 5}
    slot, work = WorkerChooser(Routing(), idx, 1).prefill(slots, prompt, set())
    assert slot.info.worker_id == "p1" and work == 1


def test_each_tier_has_a_weight_cheapest_restore_highest():
    assert list(TIER_BLOCK_WEIGHTS) == list(TIERS)
    weights = [TIER_BLOCK_WEIGHTS[t] for t in TIERS]
    assert weights[0] == 1.0 and weights == sorted(weights, reverse=True) and weights[-1] > 0
