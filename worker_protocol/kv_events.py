"""A worker's KV events on their way to routers: numbered batches, a bounded log, snapshots.

Every engine step's prefix-cache changes (``engine.core.kv_events``) leave the worker as one
``KVEventBatch`` numbered ``seq`` = 1, 2, ... within the worker's incarnation (its process),
so a reader can tell a complete run from one with a hole. The worker keeps the last
``keep`` batches in a ``KVEventLog`` (the in-memory bus: routers pull ``since(seq)`` through
Ray) and may also hand each batch to a sink (Redis Streams, ``worker_protocol.kv_stream``).
A reader that finds a hole (batches trimmed away, a sink that dropped some while Redis was
down) or a new incarnation asks the worker for a ``KVSnapshot`` and replays from its ``seq``.

Batch 1 of every incarnation is ``AllCleared``: a restarted worker's old entries are void.

Tiers (``engine.core.kv_events.TIERS``): a stored event's tier travels as a third element of its
JSON list, left out for ``device`` so batches written before tiers existed still parse (and
read as all on device); a tier this code does not know is refused (ValueError), never read
as device. A snapshot carries each block's tier beside its hash (``KVSnapshot.tiers``).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.kv_events import TIERS, AllCleared, BlockRemoved, BlockStored, KVEvent

DEFAULT_KEEP_BATCHES = 4096


@dataclass(frozen=True)
class KVEventBatch:
    """One engine step's prefix-cache changes on one worker, in order."""

    worker_id: str
    incarnation: str
    seq: int  # 1, 2, ... per incarnation, no gaps
    block_size: int
    events: tuple[KVEvent, ...]

    def to_json(self) -> str:
        return json.dumps({"w": self.worker_id, "i": self.incarnation, "s": self.seq,
                           "b": self.block_size,
                           "e": [_event_to_list(e) for e in self.events]})

    @classmethod
    def from_json(cls, text: str | bytes) -> KVEventBatch:
        d = json.loads(text)
        return cls(d["w"], d["i"], int(d["s"]), int(d["b"]),
                   tuple(_event_from_list(e) for e in d["e"]))


@dataclass(frozen=True)
class KVSnapshot:
    """Every block hash a worker's prefix cache holds after batch ``seq``, in any tier.

    ``tiers``: each block's cheapest tier, parallel to ``block_hashes``; empty means every
    block is on ``device`` (a worker without a second tier). Any other length, or a tier not
    in ``TIERS``, is refused (ValueError)."""

    worker_id: str
    incarnation: str
    seq: int
    block_size: int
    block_hashes: tuple[int, ...]
    tiers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._check()

    def block_tiers(self) -> dict[int, str]:
        """Block hash -> its cheapest tier. Checks the tiers again (ValueError): a snapshot
        unpickled from another process (a Ray reply) skipped ``__post_init__``."""
        self._check()
        if not self.tiers:
            return dict.fromkeys(self.block_hashes, "device")
        return dict(zip(self.block_hashes, self.tiers, strict=True))

    def _check(self) -> None:
        if self.tiers and len(self.tiers) != len(self.block_hashes):
            raise ValueError(f"a snapshot of {len(self.block_hashes)} blocks has "
                             f"{len(self.tiers)} tiers")
        for tier in set(self.tiers):
            _check_tier(tier)


@dataclass(frozen=True)
class KVEventFeed:
    """The answer to ``KVEventLog.since``: the batches after the reader's ``seq``, or
    ``complete=False`` when some of them are gone (a new incarnation, or trimmed): the
    reader must take a snapshot instead."""

    incarnation: str
    batches: tuple[KVEventBatch, ...]
    complete: bool


Sink = Callable[[KVEventBatch], None]


class KVEventLog:
    """Numbers and keeps a worker's batches. ``publish`` and ``snapshot`` run on the engine
    thread (the one that drains the events, so a snapshot and the numbering agree); ``since``
    is safe from any thread."""

    def __init__(self, worker_id: str, incarnation: str, block_size: int,
                 keep: int = DEFAULT_KEEP_BATCHES, sink: Sink | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.block_size = block_size
        self._batches: deque[KVEventBatch] = deque(maxlen=keep)
        self._seq = 0
        self._sink = sink
        self._lock = threading.Lock()
        self.publish([AllCleared()])

    @property
    def seq(self) -> int:
        return self._seq

    def publish(self, events: list[KVEvent]) -> KVEventBatch | None:
        """Number and keep one step's events (nothing for no events) and hand the batch to
        the sink. A sink that raises loses only its own copy (readers see the hole)."""
        if not events:
            return None
        with self._lock:
            self._seq += 1
            batch = KVEventBatch(self.worker_id, self.incarnation, self._seq, self.block_size,
                                 tuple(events))
            self._batches.append(batch)
        if self._sink is not None:
            self._sink(batch)
        return batch

    def snapshot(self, block_hashes: list[int],
                 tiers: list[str] | None = None) -> KVSnapshot:
        """The cache's content right after the last published batch (call on the engine
        thread with the engine's cached blocks, after publishing its events). ``tiers``:
        each block's cheapest tier, parallel to ``block_hashes``; None when all on device."""
        with self._lock:
            return KVSnapshot(self.worker_id, self.incarnation, self._seq, self.block_size,
                              tuple(block_hashes), tuple(tiers or ()))

    def since(self, seq: int, incarnation: str = "") -> KVEventFeed:
        """The batches after ``seq`` of ``incarnation`` (a reader's cursor)."""
        with self._lock:
            if incarnation != self.incarnation:
                return KVEventFeed(self.incarnation, (), False)
            if seq >= self._seq:
                return KVEventFeed(self.incarnation, (), True)
            first = self._batches[0].seq if self._batches else self._seq + 1
            if seq + 1 < first:  # trimmed: the reader missed batches
                return KVEventFeed(self.incarnation, (), False)
            return KVEventFeed(self.incarnation,
                               tuple(b for b in self._batches if b.seq > seq), True)


def _check_tier(tier) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown KV cache tier {tier!r}: expected one of {', '.join(TIERS)}")


def _event_to_list(e: KVEvent) -> list:
    if isinstance(e, BlockStored):
        _check_tier(e.tier)
        # "device" is left out: the format of batches from before tiers existed
        return (["s", list(e.block_hashes)] if e.tier == "device"
                else ["s", list(e.block_hashes), e.tier])
    if isinstance(e, BlockRemoved):
        return ["r", list(e.block_hashes)]
    return ["c"]


def _event_from_list(v: list) -> KVEvent:
    kind = v[0]
    if kind == "s":
        tier = v[2] if len(v) > 2 else "device"
        _check_tier(tier)
        return BlockStored(tuple(int(h) for h in v[1]), tier)
    if kind == "r":
        return BlockRemoved(tuple(int(h) for h in v[1]))
    if kind == "c":
        return AllCleared()
    raise ValueError(f"unknown KV event kind {kind!r}")
