"""What a worker's prefix cache did, as events a router can index (KV-aware routing).

The block manager records one event per change of its prefix cache, in order: a run of
blocks became cached (``BlockStored``: their chained hashes, in prompt order), cached blocks
were evicted (``BlockRemoved``), or everything was dropped (``AllCleared``). The hashes are the
same chained hashes the router computes for a prompt (``engine.core.block_manager.hash_block`` with
the cluster's seed and the worker's block size), so "worker W holds blocks h0..hk" answers
"how many leading blocks of this prompt would W not recompute".

Tiers: a worker with a second cache tier (``engine.executor.kv_tier``: host memory, disk) keeps blocks
evicted from its pool there. ``BlockStored.tier`` is where the worker's cheapest copy of each
block now is (``device``: the pool, nothing to restore; ``host``; ``disk``), so a block moving
from the pool to host memory is a ``BlockStored`` with ``tier="host"``, and ``BlockRemoved``
means the worker holds the block in no tier at all.

Pure dataclasses, no I/O: workers batch them per engine step and publish them
(``worker_protocol.kv_events``); the router applies them (``router.routing.kv_index``).
"""

from __future__ import annotations

from dataclasses import dataclass

TIERS = ("device", "host", "disk")  # cheapest restore first


@dataclass(frozen=True)
class BlockStored:
    """These blocks now hold cached content (hashes in chain order), their cheapest copy in
    ``tier`` (one of ``TIERS``)."""

    block_hashes: tuple[int, ...]
    tier: str = "device"


@dataclass(frozen=True)
class BlockRemoved:
    """These blocks were evicted from every tier: their content is gone."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllCleared:
    """The whole prefix cache is empty: a worker process's first batch says so, so a
    restarted worker's old entries are void (``worker_protocol.kv_events``)."""


KVEvent = BlockStored | BlockRemoved | AllCleared


class KVEventRecorder:
    """Collects events between drains, merging consecutive ones of one kind (a step that
    caches 12 blocks yields one ``BlockStored`` of 12 hashes, not 12 events)."""

    def __init__(self) -> None:
        # (event kind, tier or None for removals, its hashes so far)
        self._runs: list[tuple[type, str | None, list[int]]] = []

    def stored(self, block_hash: int, tier: str = "device") -> None:
        self._append(BlockStored, tier, block_hash)

    def removed(self, block_hash: int) -> None:
        self._append(BlockRemoved, None, block_hash)

    def drain(self) -> list[KVEvent]:
        """The events since the last drain, oldest first."""
        runs, self._runs = self._runs, []
        return [BlockStored(tuple(hashes), tier) if kind is BlockStored
                else BlockRemoved(tuple(hashes)) for kind, tier, hashes in runs]

    def _append(self, kind: type, tier: str | None, block_hash: int) -> None:
        if self._runs and self._runs[-1][0] is kind and self._runs[-1][1] == tier:
            self._runs[-1][2].append(block_hash)
        else:
            self._runs.append((kind, tier, [block_hash]))
