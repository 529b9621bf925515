"""The routes of a KV transfer between workers of any two TP sizes (``kv_transfer.routes``):
each decode rank gets each of its KV heads exactly once, from a prefill rank that holds it, and
a handshake whose two ends cannot be mapped is refused naming both sides."""

from __future__ import annotations

import pytest

from engine.parallel.sharding import kv_head_range
from kv_transfer import KVHandshakeError, KVLayout, KVTransferSpec
from kv_transfer.routes import KVPlace, KVRoute, kv_routes, pair_heads, rank_peer_id, route_spec


def _valid(kvh: int, tp: int) -> bool:  # TPShard.check's rule for the KV heads
    return kvh >= tp or tp % kvh == 0


CASES = [(h, p, d) for h in (1, 2, 3, 4, 8) for p in (1, 2, 3, 4, 8) for d in (1, 2, 3, 4, 8)
         if _valid(h, p) and _valid(h, d)]


@pytest.mark.parametrize("kvh,prefill_tp,decode_tp", CASES)
def test_every_decode_rank_gets_each_of_its_heads_once_from_a_holder(kvh, prefill_tp, decode_tp):
    routes = kv_routes(kvh, prefill_tp, decode_tp)
    for j in range(decode_tp):
        got = [h for r in routes if r.decode_rank == j for h in range(*r.heads)]
        assert got == list(kv_head_range(kvh, j, decode_tp))
    for r in routes:
        held = kv_head_range(kvh, r.prefill_rank, prefill_tp)
        assert held.start <= r.heads[0] < r.heads[1] <= held.stop


def test_the_documented_mappings():
    # docs/parallelism.md's diagram, with the tiny model's 2 KV heads
    assert kv_routes(2, 2, 1) == [KVRoute(0, 0, (0, 1)), KVRoute(1, 0, (1, 2))]
    assert kv_routes(2, 1, 2) == [KVRoute(0, 0, (0, 1)), KVRoute(0, 1, (1, 2))]
    assert kv_routes(2, 2, 4) == [KVRoute(0, 0, (0, 1)), KVRoute(0, 1, (0, 1)),
                                  KVRoute(1, 2, (1, 2)), KVRoute(1, 3, (1, 2))]
    assert kv_routes(4, 1, 1) == [KVRoute(0, 0, (0, 4))]  # TP 1: the whole transfer
    # SmolLM2-135M's 3 KV heads at TP 2 split 1 + 2
    assert kv_routes(3, 2, 1) == [KVRoute(0, 0, (0, 1)), KVRoute(1, 0, (1, 3))]


def test_replicated_heads_are_sent_by_their_replicas_in_turn():
    # 2 KV heads over 4 prefill ranks: ranks 0,1 hold head 0, ranks 2,3 head 1
    sources = {(r.decode_rank, r.heads): r.prefill_rank for r in kv_routes(2, 4, 4)}
    assert sources == {(0, (0, 1)): 0, (1, (0, 1)): 1, (2, (1, 2)): 2, (3, (1, 2)): 3}


LAYOUT = KVLayout("m", "float32", num_layers=2, num_kv_heads=2, head_dim=4)


def test_a_route_spec_carries_its_heads_and_keeps_tp1_unchanged():
    spec = KVTransferSpec("r", 7, 5, LAYOUT, start_token=16)
    assert route_spec(spec, KVRoute(0, 0, (0, 2))) == spec
    part = route_spec(spec, KVRoute(1, 0, (1, 2)))
    assert (part.request_id, part.transfer_id, part.start_token, part.heads) == ("r@p1>d0", 7, 16,
                                                                                 (1, 2))
    assert part.layer_shape == (2, 5, 1, 4)
    assert rank_peer_id("decode-0", 0) == "decode-0" and rank_peer_id("decode-0", 2) == "decode-0/tp2"
    with pytest.raises(ValueError, match="heads"):
        KVTransferSpec("r", 1, 5, LAYOUT, heads=(1, 3))


def test_the_handshake_maps_a_pair_and_refuses_what_it_cannot_naming_both_sides():
    p0, d1 = KVPlace(LAYOUT, 1, 0), KVPlace(LAYOUT, 2, 1)
    assert pair_heads(p0, p0.heads, d1, "prefill-0", "decode-0/tp1") == (1, 2)
    place, claimed = KVPlace.from_json(KVPlace(LAYOUT, 2, 0).to_json())
    assert (place, claimed) == (KVPlace(LAYOUT, 2, 0), (0, 1))
    with pytest.raises(KVHandshakeError) as e:  # prefill rank 0 of 2 holds head 0 only
        pair_heads(place, claimed, d1, "prefill-0", "decode-0/tp1")
    assert ("'prefill-0' rank 0 of tp=2 (KV heads 0..0 of 2)" in str(e.value)
            and "'decode-0/tp1' rank 1 of tp=2 (KV heads 1..1 of 2)" in str(e.value))
    with pytest.raises(KVHandshakeError, match="claims KV heads 0..1.*decode 'd'"):
        pair_heads(place, (0, 2), KVPlace(LAYOUT), "p", "d")  # a different split
    other = KVPlace(KVLayout("m", "float32", num_layers=3, num_kv_heads=2, head_dim=4))
    with pytest.raises(KVHandshakeError, match="num_layers differs"):
        pair_heads(other, other.heads, d1, "p", "d")
