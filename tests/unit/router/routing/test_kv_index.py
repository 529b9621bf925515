"""KV events -> the router's index -> routing: events mirror the prefix cache exactly, a hole
or a restart never leaves stale entries routable, and the kv_aware cost trades affinity
against queued work."""

from __future__ import annotations

import random

import pytest

from engine.core.block_manager import BlockManager
from engine.core.kv_events import AllCleared, BlockRemoved, BlockStored
from router.routing.kv_index import KVIndex
from router.routing.policy import Routing, RoutingConfig, WorkerView
from worker_protocol import WorkerLoad
from worker_protocol.kv_events import KVEventBatch, KVEventLog

BS = 4


def _replay(events, into: set[int]) -> None:
    for ev in events:
        if isinstance(ev, BlockStored):
            into.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            into.difference_update(ev.block_hashes)
        else:
            into.clear()


def test_events_mirror_the_prefix_cache_through_allocation_and_eviction():
    rng = random.Random(7)
    bm = BlockManager(num_blocks=12, block_size=BS)
    bm.record_events()
    mirror: set[int] = set()
    live: dict[str, list[int]] = {}
    prefixes = [[rng.randrange(100) for _ in range(4 * BS)] for _ in range(3)]
    evicted = 0
    for step in range(400):
        if live and (rng.random() < 0.45 or len(live) > 3):
            rid = rng.choice(list(live))
            bm.free(rid)
            del live[rid]
        else:  # a prompt sharing one of a few prefixes, so hits, sharing and eviction mix
            toks = rng.choice(prefixes)[:rng.randrange(1, 4 * BS)] + [
                rng.randrange(100) for _ in range(rng.randrange(0, 3 * BS))]
            rid = f"r{step}"
            computed = bm.get_computed_blocks(toks)
            if bm.allocate_slots(rid, len(toks), computed):
                bm.cache_full_blocks(rid, toks, len(toks))
                live[rid] = toks
        events = bm.take_events()
        evicted += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        _replay(events, mirror)
        assert mirror == set(bm.cached_hashes())
        bm.check_invariants()
    assert evicted > 0  # the pool was small enough to evict


def _log(worker="d0", inc="i1", keep=64) -> KVEventLog:
    return KVEventLog(worker, inc, BS, keep=keep)


def _index_with(log: KVEventLog) -> KVIndex:
    idx = KVIndex(hash_seed=0)
    idx.add_worker(log.worker_id, BS)
    idx.reset(log.snapshot([]))
    return idx


def test_an_evicted_block_is_never_matched():
    idx = KVIndex(hash_seed=0)
    prompt = list(range(3, 3 + 3 * BS + 1))
    h = idx.prompt_hashes(prompt, BS)
    log = _log()
    idx = _index_with(log)
    for batch in log.since(0, "i1").batches:
        idx.apply(batch)
    log.publish([BlockStored(tuple(h))])
    assert all(idx.apply(b) for b in log.since(1, "i1").batches)
    assert idx.match(prompt) == {"d0": 3}
    log.publish([BlockRemoved((h[1],))])  # the middle block goes: only the first still counts
    assert all(idx.apply(b) for b in log.since(2, "i1").batches)
    assert idx.match(prompt) == {"d0": 1}


def test_a_hole_makes_the_worker_match_nothing_until_a_snapshot():
    log = _log()
    idx = _index_with(log)
    prompt = list(range(3, 3 + 2 * BS + 1))
    h = idx.prompt_hashes(prompt, BS)
    log.publish([BlockStored(tuple(h))])  # seq 2
    log.publish([BlockRemoved((h[0],))])  # seq 3: lost on the way
    log.publish([BlockStored((h[0],))])  # seq 4
    batches = log.since(1, "i1").batches
    assert idx.apply(batches[0])
    assert idx.match(prompt) == {"d0": 2}
    assert not idx.apply(batches[2])  # seq 4 after 2: a hole
    assert idx.cursor("d0").stale and idx.match(prompt) == {} and idx.holes == 1
    idx.reset(log.snapshot(list(h)))
    assert idx.match(prompt) == {"d0": 2} and idx.cursor("d0").seq == 4


def test_a_restarted_worker_is_cleared():
    log = _log(inc="old")
    idx = _index_with(log)
    prompt = list(range(3, 3 + 2 * BS + 1))
    log.publish([BlockStored(tuple(idx.prompt_hashes(prompt, BS)))])
    for b in log.since(1, "old").batches:
        idx.apply(b)
    assert idx.match(prompt) == {"d0": 2}
    new = _log(inc="new")  # the new process: batch 1 is AllCleared
    assert new.since(0, "new").batches[0].events == (AllCleared(),)
    assert not idx.apply(new.since(0, "new").batches[0])  # another incarnation: stale
    assert idx.match(prompt) == {}
    assert not new.since(2, "old").complete  # a pull with the old cursor asks for a snapshot


def test_the_log_reports_batches_it_no_longer_holds():
    log = _log(keep=3)
    for i in range(10):
        log.publish([BlockStored((i,))])
    assert log.seq == 11
    assert not log.since(2, "i1").complete  # trimmed away
    feed = log.since(8, "i1")
    assert feed.complete and [b.seq for b in feed.batches] == [9, 10, 11]
    assert log.since(11, "i1").batches == () and log.publish([]) is None


def test_batches_round_trip_as_json():
    b = KVEventBatch("p-1", "abc", 7, 16, (BlockStored((2**64 - 1, 5)), BlockRemoved((9,)),
                                             BlockStored((3,), "disk"), AllCleared()))
    assert KVEventBatch.from_json(b.to_json()) == b


# ---- routing --------------------------------------------------------------------------------
def _view(wid: str, used=0, inflight_blocks=0, role="decode", inflight_prefill=0) -> WorkerView:
    v = WorkerView(wid, role, kv_blocks_total=1000, block_size=BS,
                   load=WorkerLoad(wid, role, used, 1000, 0, 0))
    v.inflight_blocks, v.inflight_prefill_tokens = inflight_blocks, inflight_prefill
    return v


def test_kv_aware_follows_the_cache_until_load_outweighs_it():
    r = Routing(RoutingConfig("kv_aware"))
    views = [_view("a"), _view("b")]
    prompt_len = 40 * BS
    assert r.pick_decode(views, prompt_len, prompt_len + 8, hits={"a": 30}).worker_id == "a"
    assert r.pick_decode(views, prompt_len, prompt_len + 8, hits={"b": 30}).worker_id == "b"
    # a holds 30 blocks (120 tokens saved), but its pool is 95% full (reservations in
    # flight count): 0.95 x 160 = 152 tokens of penalty, so b is cheaper.
    views[0].load = WorkerLoad("a", "decode", 900, 1000, 0, 0)
    views[0].inflight_blocks = 50
    assert r.pick_decode(views, prompt_len, prompt_len + 8, hits={"a": 30}).worker_id == "b"
    # Prefill workers: the cached one, unless the queue ahead of it costs more than it saves.
    pre = [_view("p0", role="prefill"), _view("p1", role="prefill", inflight_prefill=10)]
    assert r.pick_prefill(pre, prompt_len, hits={"p1": 20}).worker_id == "p1"
    pre[1].inflight_prefill_tokens = 500
    assert r.pick_prefill(pre, prompt_len, hits={"p1": 20}).worker_id == "p0"


def test_kv_aware_spreads_cold_prompts_and_avoids_a_full_pool():
    r = Routing()
    views = [_view("a", used=900), _view("b", used=100)]
    assert r.pick_decode(views, 64, 80).worker_id == "b"  # no hits anywhere: the emptier
    # A small prefix hit does not outweigh a nearly full pool.
    assert r.pick_decode(views, 64, 80, hits={"a": 2}).worker_id == "b"


def test_round_robin_and_load_ignore_the_cache():
    rr = Routing(RoutingConfig("round_robin"))
    views = [_view("a"), _view("b"), _view("c")]
    picks = [rr.pick_decode(views, 40, 48, hits={"a": 9}).worker_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    load = Routing(RoutingConfig("load"))
    views[0].load = WorkerLoad("a", "decode", 800, 1000, 0, 0)
    views[1].load = WorkerLoad("b", "decode", 100, 1000, 0, 0)
    views[2].load = WorkerLoad("c", "decode", 500, 1000, 0, 0)
    assert load.pick_decode(views, 40, 48, hits={"a": 9}).worker_id == "b"


def test_routing_config_is_checked():
    with pytest.raises(ValueError, match="routing policy must be one of"):
        RoutingConfig("random")
    with pytest.raises(ValueError, match="queue_weight must be >= 0"):
        RoutingConfig(queue_weight=-1)


def test_kv_aware_ties_take_turns():
    r = Routing()
    views = [_view("a"), _view("b")]
    assert [r.pick_decode(views, 40, 48).worker_id for _ in range(4)] == ["a", "b", "a", "b"]
    pre = [_view("p0", role="prefill"), _view("p1", role="prefill")]
    assert {r.pick_prefill(pre, 40).worker_id for _ in range(2)} == {"p0", "p1"}


def test_kv_aware_places_cold_prompts_where_the_cache_holds_least():
    """A pool full of other prompts' cached prefixes is full for a newcomer: cold prompts
    go to the worker with the smaller cached footprint (the working set spreads evenly)."""
    r = Routing()
    views = [_view("a"), _view("b")]
    views[0].cached_blocks, views[1].cached_blocks = 600, 200
    assert r.pick_decode(views, 64, 80).worker_id == "b"
    # ...but a prompt whose prefix a holds still goes to a.
    assert r.pick_decode(views, 64 * BS, 64 * BS + 8, hits={"a": 60}).worker_id == "a"


def test_a_reservation_is_counted_once():
    """From the worker's reserve to its commit a reservation is both in the last report and
    in the router's in-flight count: counted twice, it would turn a worker with room away."""
    v = _view("a")
    v.load = WorkerLoad("a", "decode", 300, 1000, 0, 0, kv_blocks_reserved=100)
    v.inflight_blocks = 120  # the 100 the report saw, and 20 not yet reserved there
    assert v.occupied_blocks == 320 and v.free_blocks == 680
    v.inflight_blocks = 0  # another router's reservations: the report's count stands
    assert v.occupied_blocks == 300


def test_nothing_is_recorded_without_a_reader():
    """An in-process engine never drains events: recording them would grow without bound."""
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.allocate_slots("a", 2 * BS)
    bm.cache_full_blocks("a", list(range(2 * BS)), 2 * BS)
    assert bm.take_events() == [] and len(bm.cached_hashes()) == 2


def _two_prefill_workers() -> tuple[KVIndex, KVEventLog, KVEventLog]:
    logs = (_log("p0"), _log("p1"))
    idx = KVIndex(hash_seed=0)
    for log in logs:
        idx.add_worker(log.worker_id, BS)
        idx.reset(log.snapshot([]))
    return idx, *logs


def test_in_flight_entries_route_the_second_same_prefix_request_to_the_first_ones_worker():
    """r1's new prefix goes to p1; before p1's events say so, r2 with the same prefix (and its
    own tail) is routed to p1 too, where without the entries both workers look cold and the
    tie takes turns to p0."""
    idx, _, log1 = _two_prefill_workers()
    prefix = list(range(3, 3 + 10 * BS))
    r1, r2 = prefix + [7, 8, 9], prefix + [11, 12]
    views = [_view("p0", role="prefill"), _view("p1", role="prefill")]
    routing = Routing(RoutingConfig("kv_aware"))
    assert routing.pick_prefill(views, len(r1), hits=idx.match(r1)).worker_id == "p0"
    assert routing.pick_prefill(views, len(r1), hits=idx.match(r1)).worker_id == "p1"
    idx.expect("r1", "p1", r1)  # what the orchestrator does on routing r1 to p1
    views[1].inflight_prefill_tokens = len(r1)  # ... and r1's prefill is queued there
    assert idx.match(r2) == {"p1": 10}
    detail = idx.match_detail(r2)
    assert (detail["p1"].blocks, detail["p1"].in_flight) == (10, 10)
    hits, in_flight = idx.match(r2), {w: m.in_flight for w, m in detail.items()}
    # waiting for r1's prefix costs r2 no more than computing it: it joins r1 on p1
    assert routing.pick_prefill(views, len(r2), hits=hits, in_flight=in_flight).worker_id == "p1"
    # counted as queued work, the prefix r2 would reuse outweighed it: it went to p0
    assert routing.pick_prefill(views, len(r2), hits=hits).worker_id == "p0"
    # other work queued on p1 beyond r1's still counts: past what the prefix saves, p0
    views[1].inflight_prefill_tokens = len(r1) + 2 * len(prefix)
    assert routing.pick_prefill(views, len(r2), hits=hits, in_flight=in_flight).worker_id == "p0"
    views[1].inflight_prefill_tokens = 0  # r1's prefill is done; its events not yet here
    assert routing.pick_prefill(views, len(r2), hits=hits, in_flight=in_flight).worker_id == "p1"
    # p1's events arrive: the entries end, the blocks stay matched (now for real)
    log1.publish([BlockStored(tuple(idx.prompt_hashes(r1, BS)))])
    assert all(idx.apply(b) for b in log1.since(1, "i1").batches)
    assert idx.requests_expected == 0 and idx.match(r2) == {"p1": 10}
    # evicted later, nothing in flight keeps them: no longer matched
    log1.publish([BlockRemoved(tuple(idx.prompt_hashes(r1, BS)))])
    assert all(idx.apply(b) for b in log1.since(2, "i1").batches)
    assert idx.match(r2) == {}


def test_in_flight_entries_end_with_their_request_or_its_failed_attempt():
    idx, _, _ = _two_prefill_workers()
    prompt = list(range(3, 3 + 4 * BS + 1))
    idx.expect("a", "p0", prompt)
    idx.expect("b", "p0", prompt)  # two requests expecting the same blocks
    idx.expect("b", "p1", prompt)
    assert idx.match(prompt) == {"p0": 4, "p1": 4} and idx.requests_expected == 2
    idx.forget("b", "p1")  # b's attempt on p1 failed
    assert idx.match(prompt) == {"p0": 4}
    idx.forget("a")  # a ended: b still expects them on p0
    assert idx.match(prompt) == {"p0": 4}
    idx.forget("b")
    assert idx.match(prompt) == {} and idx.requests_expected == 0
    idx.forget("never-routed")  # unknown ids are ignored
    # a snapshot listing the blocks ends the entries as their events would
    idx.expect("c", "p1", prompt)
    idx.reset(_log("p1").snapshot(idx.prompt_hashes(prompt, BS)))
    assert idx.requests_expected == 0 and idx.match(prompt) == {"p1": 4}
    # a worker added again (restarted) starts with nothing expected
    idx.expect("d", "p0", prompt)
    idx.add_worker("p0", BS)
    assert idx.requests_expected == 0 and idx.match(prompt) == {"p1": 4}
    # a stale worker's cache counts for nothing, what is routed to it since does
    idx.invalidate("p1")
    assert idx.match(prompt) == {}
    idx.expect("e", "p1", prompt)
    assert idx.match(prompt) == {"p1": 4}
    idx.forget("e")


def test_random_expect_forget_and_events_leave_nothing_behind():
    """Whatever the order of routing, events and request ends, the entries are exactly the
    blocks each live request still waits for, and none outlive their request."""
    rng = random.Random(5)
    idx, log0, log1 = _two_prefill_workers()
    logs = {"p0": log0, "p1": log1}
    prompts = [list(range(3, 3 + rng.randrange(1, 6) * BS + 1)) for _ in range(4)]
    live: dict[str, list[int]] = {}
    for step in range(300):
        op = rng.random()
        if op < 0.4:
            rid, wid = f"r{step}", rng.choice(["p0", "p1"])
            live[rid] = prompts[rng.randrange(4)]
            idx.expect(rid, wid, live[rid])
        elif op < 0.7 and live:
            rid = rng.choice(list(live))
            idx.forget(rid)
            del live[rid]
        else:
            wid = rng.choice(["p0", "p1"])
            h = idx.prompt_hashes(prompts[rng.randrange(4)], BS)
            log = logs[wid]
            log.publish([BlockStored(tuple(h))] if rng.random() < 0.6
                        else [BlockRemoved(tuple(h))])
            assert idx.apply(log.since(log.snapshot([]).seq - 1, "i1").batches[-1])
        assert set(idx._expected_by) <= set(live)
        for wid in ("p0", "p1"):
            c = idx._workers[wid]
            assert not set(c.expected) & c.hashes  # held for real: no longer expected
            assert all(rids <= set(live) and rids for rids in c.expected.values())
    for rid in list(live):
        idx.forget(rid)
    assert idx.requests_expected == 0
    assert not idx._workers["p0"].expected and not idx._workers["p1"].expected
