"""Which prefill rank sends which KV heads to which decode rank, between any two TP sizes.

Under tensor parallelism every rank of a worker holds only its KV heads
(``engine.parallel.sharding.kv_head_range``: a share of them, or one replicated head when
there are fewer KV heads than ranks). A prompt's KV therefore moves as a set of **routes**,
one per (prefill rank, decode rank) pair that shares heads: decode rank ``j`` receives each of
its heads from one prefill rank that holds it, over that pair's own channel. Where several
prefill ranks hold a head (replication), the decode ranks take it from them in turn, so the
sends spread over the replicas instead of all leaving one rank.

Both ends compute the same routes from the model's KV head count and the two TP sizes, so
the wire carries no plan; the pair's handshake (``KVPlace``) carries each end's TP size, rank
and heads, and the receiver refuses a pair whose claims it cannot map, naming both sides.

Pure (no I/O): the workers, the transports and their tests read the same answers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from engine.parallel.sharding import kv_head_range
from kv_transfer.protocol import KVHandshakeError, KVLayout, KVTransferSpec

__all__ = ["KVPlace", "KVRoute", "kv_routes", "pair_heads", "rank_peer_id", "route_spec"]


@dataclass(frozen=True)
class KVRoute:
    """One pair's share of a transfer: the model's KV heads ``[heads[0], heads[1])`` go from
    prefill rank ``prefill_rank`` to decode rank ``decode_rank``."""

    prefill_rank: int
    decode_rank: int
    heads: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]


def _heads(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    r = kv_head_range(num_kv_heads, rank, size)
    return r.start, r.stop


def kv_routes(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> list[KVRoute]:
    """Every route of a transfer from a worker of ``prefill_tp`` ranks to one of
    ``decode_tp``, ordered by decode rank then head. Each decode rank's heads are covered
    exactly once; consecutive heads from one prefill rank form one route.

    >>> kv_routes(2, 2, 1)   # P tp=2 -> D tp=1: each prefill rank sends its head to D0
    [KVRoute(prefill_rank=0, decode_rank=0, heads=(0, 1)), KVRoute(prefill_rank=1, decode_rank=0, heads=(1, 2))]
    """
    if prefill_tp < 1 or decode_tp < 1:
        raise ValueError(f"TP sizes must be >= 1, got prefill {prefill_tp}, decode {decode_tp}")
    held = [range(*_heads(num_kv_heads, i, prefill_tp)) for i in range(prefill_tp)]
    routes: list[KVRoute] = []
    for j in range(decode_tp):
        lo, hi = _heads(num_kv_heads, j, decode_tp)
        for h in range(lo, hi):
            holders = [i for i in range(prefill_tp) if h in held[i]]
            src = holders[j % len(holders)]  # replicas take turns across decode ranks
            last = routes[-1] if routes else None
            if last and (last.decode_rank, last.prefill_rank, last.heads[1]) == (j, src, h):
                routes[-1] = dataclasses.replace(last, heads=(last.heads[0], h + 1))
            else:
                routes.append(KVRoute(src, j, (h, h + 1)))
    return routes


def rank_peer_id(worker_id: str, rank: int) -> str:
    """The KV endpoint name of a worker's rank: the worker's id for rank 0 (as at TP 1)."""
    return worker_id if rank == 0 else f"{worker_id}/tp{rank}"


def route_spec(spec: KVTransferSpec, route: KVRoute) -> KVTransferSpec:
    """The transfer one route carries: the same tokens and transfer id, its heads only. Rank
    0 -> rank 0 keeps the request id (at TP 1 it is the whole transfer); the others are named
    apart, since one endpoint may send to (or receive from) several ranks for one request."""
    rid = spec.request_id
    if (route.prefill_rank, route.decode_rank) != (0, 0):
        rid = f"{rid}@p{route.prefill_rank}>d{route.decode_rank}"
    heads = None if route.heads == (0, spec.layout.num_kv_heads) else route.heads
    return dataclasses.replace(spec, request_id=rid, heads=heads)


@dataclass(frozen=True)
class KVPlace:
    """What one end of a pair says in the handshake: its model's KV layout, and which rank of
    how many it is (so which KV heads it holds)."""

    layout: KVLayout
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KV rank {self.tp_rank} of {self.tp_size}: needs tp_size >= 1 "
                             "and 0 <= tp_rank < tp_size")

    @property
    def heads(self) -> tuple[int, int]:
        return _heads(self.layout.num_kv_heads, self.tp_rank, self.tp_size)

    def describe(self, role: str, worker_id: str) -> str:
        lo, hi = self.heads
        return (f"{role} {worker_id!r} rank {self.tp_rank} of tp={self.tp_size} "
                f"(KV heads {lo}..{hi - 1} of {self.layout.num_kv_heads})")

    def to_json(self) -> str:
        return json.dumps({"layout": json.loads(self.layout.to_json()), "tp_size": self.tp_size,
                           "tp_rank": self.tp_rank, "heads": list(self.heads)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> tuple[KVPlace, tuple[int, int]]:
        """The place, and the heads its sender claims to hold (checked by ``pair_heads``)."""
        raw = json.loads(text)
        place = cls(KVLayout(**raw["layout"]), raw["tp_size"], raw["tp_rank"])
        return place, tuple(raw["heads"])


def pair_heads(sender: KVPlace, claimed: tuple[int, int], receiver: KVPlace,
               sender_id: str, receiver_id: str) -> tuple[int, int]:
    """The heads the pair (sender -> receiver) carries; KVHandshakeError naming both sides
    when the models differ, the sender's heads are not the ones its rank holds here (a
    different split), or the two ranks share no route."""
    receiver.layout.check_compatible(sender.layout)
    src = sender.describe("prefill", sender_id)
    dst = receiver.describe("decode", receiver_id)
    if tuple(claimed) != sender.heads:
        raise KVHandshakeError(
            f"KV handshake refused: {src} claims KV heads {claimed[0]}..{claimed[1] - 1}, which "
            f"that rank does not hold here; cannot map it to {dst}")
    for r in kv_routes(sender.layout.num_kv_heads, sender.tp_size, receiver.tp_size):
        if (r.prefill_rank, r.decode_rank) == (sender.tp_rank, receiver.tp_rank):
            return r.heads
    raise KVHandshakeError(f"KV handshake refused: {src} holds none of the heads {dst} "
                           "takes from it; no route maps that pair")
