"""Prefix affinity for routing: which worker already caches the leading blocks of a prompt.

The router hashes a prompt's full blocks with the engine's own chained hash (same seed, same
block size as the worker), records them for the worker that computed them, and asks the
cluster store which workers hold the longest run. Stored entries expire (TTL) — KV-aware
routing on the workers' real cache events replaces these guesses in wave 2 [5/7].
"""

from __future__ import annotations

from engine.block_manager import hash_block

_RECORD_TTL_S = 600.0


class PrefixAffinity:
    """Over a ``ClusterStore`` (or None: no affinity at all)."""

    def __init__(self, store, hash_seed: int) -> None:
        self.store = store
        self.hash_seed = hash_seed

    def hashes(self, prompt_ids: list[int], block_size: int) -> list[int]:
        """Chained hashes of the prompt's full blocks, as the engine's prefix cache computes them."""
        out, parent = [], 0
        for i in range(len(prompt_ids) // block_size):
            parent = hash_block(parent, prompt_ids[i * block_size:(i + 1) * block_size],
                                self.hash_seed)
            out.append(parent)
        return out

    async def hits(self, prompt_ids: list[int] | None, block_size: int) -> dict[str, int]:
        """Worker id -> how many leading blocks of the prompt it caches (none while a remote
        store is down or slow: routing never waits on it)."""
        if self.store is None or not prompt_ids:
            return {}
        hashes = self.hashes(prompt_ids, block_size)
        return await self.store.match_prefix_async(hashes) if hashes else {}

    def record(self, worker_id: str, prompt_ids: list[int], block_size: int) -> None:
        """``worker_id`` has just computed this prompt's KV."""
        if self.store is None:
            return
        hashes = self.hashes(prompt_ids, block_size)
        if hashes:
            self.store.record_prefix(worker_id, hashes, ttl_s=_RECORD_TTL_S)
