"""The router's picture of every worker's prefix cache, built only from the workers' KV events.

Per worker: the set of chained block hashes its cache holds (``engine.core.kv_events``), its block
size, and a cursor (incarnation, last batch applied). No TTLs and no guesses: a block is in
the index from the batch that stored it until the batch that evicted it. A batch that does
not follow the cursor (a hole: batches trimmed or dropped; a new incarnation) is refused, and
the worker's entry is marked stale until a snapshot (``reset``) replaces it; a stale worker
matches nothing, so routing never relies on what might have been evicted.

``match`` answers, for a prompt, how many of its leading full blocks each worker holds: the
prompt's hashes are computed once per block size in use (workers of one cluster may differ)
with the cluster's seed, then each worker's run is walked until the first miss.

In-flight affinity: the events for a prompt's blocks arrive only after its prefill (and, on a
decode worker, after its KV landed), so a second request with the same new prefix, routed
meanwhile, would see no worker holding it and scatter. ``expect`` records, per worker, the
blocks of a prompt just routed there; ``match`` counts them as held. Each such entry ends when
the event storing its block arrives (or a snapshot lists it), or when its request is
``forget``-ten (the request ended, or its attempt on that worker failed), whichever is first:
the entries are bounded by the requests in flight, never by a timer.

Tiers: a worker with a second cache tier (``engine.executor.kv_tier``) holds some blocks in host memory
or on disk, not in its KV pool. The index keeps each held block's cheapest tier (a
``BlockStored`` moves a block to its tier; ``BlockRemoved`` means no tier holds it), and
``match_detail`` answers both counts a router needs: ``blocks``, the leading blocks the worker
will not recompute (a restored block is not recomputed), and ``weighted``, the same run with
each block worth what it saves (``TIER_BLOCK_WEIGHTS``: 1 on device, a little less where it
must be restored first), which ranks workers: of two holding one prefix, the one holding it
on device wins, yet a long run on disk still beats a much shorter one on device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.block_manager import hash_block
from engine.core.kv_events import AllCleared, BlockRemoved, BlockStored
from worker_protocol.kv_events import KVEventBatch, KVSnapshot

# What a cached block saves a request routed to its worker, as a fraction of computing the
# block: 1 - (cost of restoring it from its tier) / (cost of recomputing it). On the 2-core
# CPU box with the default model (16-token blocks, ~0.7 MB of KV each), recomputing a block
# costs ~5-8 ms of prefill, restoring it from host memory (a memcpy) ~0.2 ms (1 - 0.2/6 ~
# 0.97), from disk (read + checksum, from the page cache) ~1-2 ms (1 - 1.5/6 ~ 0.75). Round
# figures: the ratios move with the disk, the page cache and the accelerator, and what
# matters is the order (device > host > disk) and that a restore is far cheaper than a
# recompute (a long run on disk beats a much shorter one on device).
DEVICE_BLOCK_WEIGHT = 1.0  # in the KV pool: nothing to restore
HOST_BLOCK_WEIGHT = 0.95
DISK_BLOCK_WEIGHT = 0.8
TIER_BLOCK_WEIGHTS = {"device": DEVICE_BLOCK_WEIGHT, "host": HOST_BLOCK_WEIGHT,
                      "disk": DISK_BLOCK_WEIGHT}  # one per engine.core.kv_events.TIERS
# A block a request routed to the worker is computing there now (``KVIndex.expect``) will
# be in its pool when the next request needs it.
IN_FLIGHT_BLOCK_WEIGHT = 1.0


@dataclass
class _WorkerCache:
    block_size: int
    incarnation: str = ""
    seq: int = 0  # last batch applied
    stale: bool = True  # no snapshot yet, or a hole since: matches nothing until reset
    hashes: set[int] = field(default_factory=set)  # held in any tier
    # Of ``hashes``, those whose cheapest copy is not on device -> their tier ("host",
    # "disk"); kept apart so a worker without a second tier costs nothing extra.
    slow: dict[int, str] = field(default_factory=dict)
    # Blocks of prompts routed here whose stored events have not arrived yet: hash -> the
    # requests expecting it (module docstring, in-flight affinity)
    expected: dict[int, set[str]] = field(default_factory=dict)

    def store(self, hashes, tier: str) -> None:
        """The blocks' cheapest copy is now in ``tier`` (stored, or moved between tiers)."""
        self.hashes.update(hashes)
        if tier != "device":
            self.slow.update(dict.fromkeys(hashes, tier))
        elif self.slow:
            for h in hashes:
                self.slow.pop(h, None)

    def remove(self, hashes) -> None:
        self.hashes.difference_update(hashes)
        if self.slow:
            for h in hashes:
                self.slow.pop(h, None)

    def clear(self) -> None:
        self.hashes, self.slow = set(), {}


@dataclass(frozen=True)
class PrefixMatch:
    """A worker's leading run of a prompt's blocks: ``blocks`` in all (in any tier: none of
    them is recomputed there), ``in_flight`` of them expected from requests routed there, not
    yet stored (``KVIndex.expect``). ``weighted``: the run's blocks each weighted by what it
    saves (``TIER_BLOCK_WEIGHTS``; in-flight ones count 1), for ranking workers; equal to
    ``blocks`` when every block is on device (the default when not given)."""

    blocks: int
    in_flight: int = 0
    weighted: float | None = None

    def __post_init__(self) -> None:
        if self.weighted is None:
            object.__setattr__(self, "weighted", float(self.blocks))


@dataclass(frozen=True)
class Cursor:
    """Where a worker's event feed must continue from (``stale``: take a snapshot)."""

    incarnation: str
    seq: int
    stale: bool


class KVIndex:
    """Not thread-safe: owned by the router's event loop."""

    def __init__(self, hash_seed: int) -> None:
        self.hash_seed = hash_seed
        self._workers: dict[str, _WorkerCache] = {}
        # request id -> worker id -> the hashes it still expects there (``expect``)
        self._expected_by: dict[str, dict[str, set[int]]] = {}
        self.batches_applied = 0
        self.holes = 0  # batches refused for not following their worker's cursor

    # ---- feeding --------------------------------------------------------------------------
    def add_worker(self, worker_id: str, block_size: int) -> None:
        """Track a worker (stale, empty) until its first snapshot."""
        for rid in [r for r, by in self._expected_by.items() if worker_id in by]:
            del self._expected_by[rid][worker_id]
            if not self._expected_by[rid]:
                del self._expected_by[rid]
        self._workers[worker_id] = _WorkerCache(block_size)

    def invalidate(self, worker_id: str) -> None:
        """The worker restarted or its feed broke: match nothing until the next snapshot."""
        cache = self._workers.get(worker_id)
        if cache is not None:
            cache.stale = True
            cache.clear()

    def cursor(self, worker_id: str) -> Cursor | None:
        c = self._workers.get(worker_id)
        return None if c is None else Cursor(c.incarnation, c.seq, c.stale)

    def reset(self, snap: KVSnapshot) -> None:
        """Replace a worker's entry by its snapshot (the batches after ``snap.seq`` follow).
        Raises ValueError, the entry left as it was, when the snapshot's tiers are not one
        per block or name a tier this router does not know."""
        tiers = snap.block_tiers()
        c = self._workers.setdefault(snap.worker_id, _WorkerCache(snap.block_size))
        c.block_size, c.incarnation, c.seq = snap.block_size, snap.incarnation, snap.seq
        c.hashes, c.stale = set(tiers), False
        c.slow = {h: t for h, t in tiers.items() if t != "device"} if snap.tiers else {}
        self._arrived(snap.worker_id, c, c.hashes)

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply one batch in order. Returns False (entry now stale, nothing applied) when it
        does not follow the worker's cursor; an already-applied batch is ignored (True)."""
        c = self._workers.get(batch.worker_id)
        if c is None or c.stale:
            return False
        if batch.incarnation == c.incarnation and batch.seq <= c.seq:
            return True  # a duplicate (two feeds, or a replay overlapping the snapshot)
        if batch.incarnation != c.incarnation or batch.seq != c.seq + 1:
            self.holes += 1
            self.invalidate(batch.worker_id)
            return False
        if any(isinstance(ev, BlockStored) and ev.tier not in TIER_BLOCK_WEIGHTS
               for ev in batch.events):
            # A tier this router cannot weigh (a newer worker): unusable, like a hole; the
            # entry waits stale for a snapshot (whose reset refuses it too, until upgraded).
            self.holes += 1
            self.invalidate(batch.worker_id)
            return False
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                c.store(ev.block_hashes, ev.tier)
                self._arrived(batch.worker_id, c, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                c.remove(ev.block_hashes)
            elif isinstance(ev, AllCleared):
                c.clear()
        c.seq = batch.seq
        self.batches_applied += 1
        return True

    # ---- in-flight affinity ----------------------------------------------------------------
    def expect(self, request_id: str, worker_id: str, prompt_ids: list[int],
               root: int = 0) -> None:
        """``request_id``'s prompt was just routed to ``worker_id``: count its full blocks
        as held there until their events arrive or the request is forgotten. ``root``: what
        else its KV depends on (a LoRA adapter's key; ``prompt_hashes``)."""
        c = self._workers.get(worker_id)
        if c is None or not prompt_ids:
            return
        missing = [h for h in self.prompt_hashes(prompt_ids, c.block_size, root)
                   if h not in c.hashes]
        if not missing:
            return
        mine = self._expected_by.setdefault(request_id, {}).setdefault(worker_id, set())
        mine.update(missing)
        for h in missing:
            c.expected.setdefault(h, set()).add(request_id)

    def forget(self, request_id: str, worker_id: str | None = None) -> None:
        """Drop what ``request_id`` expects (on ``worker_id`` only, when given): it ended, or
        its attempt there failed. Unknown ids are ignored."""
        by_worker = self._expected_by.get(request_id)
        if by_worker is None:
            return
        for wid in [worker_id] if worker_id is not None else list(by_worker):
            hashes = by_worker.pop(wid, ())
            c = self._workers.get(wid)
            for h in hashes if c is not None else ():
                waiting = c.expected.get(h)
                if waiting is not None:
                    waiting.discard(request_id)
                    if not waiting:
                        del c.expected[h]
        if not by_worker:
            del self._expected_by[request_id]

    def _arrived(self, worker_id: str, c: _WorkerCache, hashes) -> None:
        """Stored blocks are held for real now: end the entries that expected them."""
        if not c.expected:
            return
        for h in hashes:
            for rid in c.expected.pop(h, ()):
                by_worker = self._expected_by.get(rid)
                mine = by_worker.get(worker_id) if by_worker else None
                if mine is None:
                    continue
                mine.discard(h)
                if not mine:
                    del by_worker[worker_id]
                    if not by_worker:
                        del self._expected_by[rid]

    @property
    def requests_expected(self) -> int:
        """Requests with in-flight entries (each ends with its request: a leak shows here)."""
        return len(self._expected_by)

    # ---- reading --------------------------------------------------------------------------
    def match(self, prompt_ids: list[int] | None,
              worker_ids: list[str] | None = None, root: int = 0) -> dict[str, int]:
        """``match_detail``'s blocks alone: worker id -> leading blocks held (any tier) or
        expected."""
        return {wid: m.blocks
                for wid, m in self.match_detail(prompt_ids, worker_ids, root).items()}

    def match_detail(self, prompt_ids: list[int] | None, worker_ids: list[str] | None = None,
                     root: int = 0) -> dict[str, PrefixMatch]:
        """Worker id -> the leading full blocks of the prompt its cache holds in any tier, or
        will hold once the requests routed there are computed (``expect``), and their
        tier-weighted count (``PrefixMatch.weighted``); only workers with at least one; a
        stale worker's cache counts for nothing (its in-flight blocks do). ``worker_ids``
        limits the answer to those workers; ``root`` as for ``prompt_hashes``."""
        if not prompt_ids:
            return {}
        ids = worker_ids if worker_ids is not None else list(self._workers)
        by_size: dict[int, list[int]] = {}
        out: dict[str, PrefixMatch] = {}
        for wid in ids:
            c = self._workers.get(wid)
            # A stale entry's cache may have evicted anything: only what requests routed
            # there since are computing counts (a new worker is stale until its snapshot).
            held = set() if c is None or c.stale else c.hashes
            if c is None or not (held or c.expected):
                continue
            hashes = by_size.get(c.block_size)
            if hashes is None:
                hashes = by_size[c.block_size] = self.prompt_hashes(prompt_ids, c.block_size,
                                                                     root)
            slow = c.slow if held else {}
            n = in_flight = 0
            weighted = 0.0
            for h in hashes:
                if h not in held:
                    if h not in c.expected:
                        break
                    in_flight += 1
                    weighted += IN_FLIGHT_BLOCK_WEIGHT
                else:
                    tier = slow.get(h)
                    weighted += (DEVICE_BLOCK_WEIGHT if tier is None
                                 else TIER_BLOCK_WEIGHTS[tier])
                n += 1
            if n:
                out[wid] = PrefixMatch(n, in_flight, weighted)
        return out

    def held_tokens(self, prompt_ids: list[int], worker_ids: list[str]) -> dict[str, int]:
        """Worker id -> the leading prompt tokens its cache holds now, in any tier (whole
        blocks of its own size; not the in-flight ones: they cannot be read yet). What a
        prefix pull may take from it (``router.control.prefix_pull``)."""
        out: dict[str, int] = {}
        by_size: dict[int, list[int]] = {}
        for wid in worker_ids:
            c = self._workers.get(wid)
            if c is None or c.stale or not c.hashes:
                continue
            hashes = by_size.get(c.block_size)
            if hashes is None:
                hashes = by_size[c.block_size] = self.prompt_hashes(prompt_ids, c.block_size)
            n = 0
            while n < len(hashes) and hashes[n] in c.hashes:
                n += 1
            if n:
                out[wid] = n * c.block_size
        return out

    def prompt_hashes(self, prompt_ids: list[int], block_size: int, root: int = 0) -> list[int]:
        """Chained hashes of the prompt's full blocks, as the engine's prefix cache computes
        them: ``root`` is the first block's parent (a LoRA adapter's key, 0 for the base
        model), so the same prompt under two adapters matches nothing of the other's. The
        last token never comes from a cache (it must be computed to sample), so a prompt of
        exactly k blocks counts k - 1."""
        out, parent = [], root
        for i in range((len(prompt_ids) - 1) // block_size):
            parent = hash_block(parent, prompt_ids[i * block_size:(i + 1) * block_size],
                                self.hash_seed)
            out.append(parent)
        return out

    def cached_hashes(self, worker_id: str) -> frozenset[int]:
        """The block hashes the index says the worker holds in any tier (none while stale or
        unknown)."""
        c = self._workers.get(worker_id)
        return frozenset() if c is None or c.stale else frozenset(c.hashes)

    def cached_block_tiers(self, worker_id: str) -> dict[int, str]:
        """Each block hash the index says the worker holds -> its cheapest tier (empty while
        stale or unknown): what the worker's ``LLMEngine.cached_block_tiers()`` says."""
        c = self._workers.get(worker_id)
        if c is None or c.stale:
            return {}
        return {h: c.slow.get(h, "device") for h in c.hashes}

    def num_cached_blocks(self, worker_id: str, tier: str | None = None) -> int:
        """Blocks the worker holds in ``tier`` (its cheapest copy there), or in any tier when
        None; 0 while stale or unknown. ``"device"``: the blocks taking room in its KV pool."""
        c = self._workers.get(worker_id)
        if c is None or c.stale:
            return 0
        if tier is None:
            return len(c.hashes)
        if tier == "device":
            return len(c.hashes) - len(c.slow)
        return sum(1 for t in c.slow.values() if t == tier)
