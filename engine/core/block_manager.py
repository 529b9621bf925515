"""Paged KV block allocator with reference counts and a prefix cache. Pure Python, no torch.

Owns which physical KV block belongs to which request. A request's blocks form its block table
(block ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``). Full blocks are hashed
with a chain (parent hash + token ids, seeded so every worker of a cluster agrees) and kept in
the prefix cache; a freed block keeps its cached content until it is reused (LRU), so a later
request with the same prefix gets it back without recomputation.

Once ``record_events()`` is called (a worker whose router indexes its cache), every change
of the prefix cache is recorded as a KV event (``engine.core.kv_events``: blocks stored, blocks
evicted); ``take_events`` drains them and ``cached_hashes`` is the snapshot they apply to.
Nothing is recorded otherwise (an in-process engine has no reader to drain them).

A second tier (``engine.executor.kv_tier``, optional): a cached block the pool evicts is offloaded to
host memory (and from there to disk) instead of lost; ``get_computed_blocks`` continues a
prompt's cached prefix into the tier, and ``allocate_slots`` restores those blocks into fresh
pool blocks (before the step that reads them) instead of leaving them to be recomputed. An
unreadable tier entry ends the prefix there (``adopted_tokens`` says how far it got). KV
events then say which tier holds each block (``BlockStored.tier``).

Blocks being computed: a request admitted to compute full prompt blocks no cache holds is
``note_computing``'d; until its ``cache_full_blocks`` registers them (or it is freed), another
request whose prompt continues its cached prefix with one of those blocks can ask
``in_progress`` and wait for them instead of computing them a second time (the scheduler does,
``engine.core.scheduler``).

Invariants the tests check: a block is either free (ref_cnt 0, in the free queue) or owned
(ref_cnt = number of requests whose table holds it); nothing is freed twice; when every request
has been freed, every block is free and no block is being computed.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from engine.config import cdiv
from engine.core.kv_events import KVEvent, KVEventRecorder

if TYPE_CHECKING:
    from engine.executor.kv_tier import KVTier


@dataclass
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # content of a cached full block, compared on a hit


class _BlockTable(dict):
    """Block id -> its ``_Block``, made on first use: a pool of small blocks has hundreds of
    thousands (a 1 GiB pool of a small model), and building them all up front cost ~0.3 s of
    every engine's start. A block never used is free, with no hash: what ``_Block`` defaults
    to."""

    def __missing__(self, block_id: int) -> _Block:
        block = self[block_id] = _Block(block_id)
        return block


RESTORE = -1  # a ``ComputedBlocks.block_ids`` entry the second tier holds, not the pool


@dataclass(frozen=True)
class ComputedBlocks:
    """A prefix-cache hit: the blocks holding the first ``num_tokens`` tokens. The pool's
    blocks come first; entries ``RESTORE`` follow, blocks the second tier holds (their token
    ids in ``restore_token_ids``, in order), copied into fresh blocks by ``allocate_slots``."""

    block_ids: tuple[int, ...] = ()
    block_hashes: tuple[int, ...] = ()
    restore_token_ids: tuple[tuple[int, ...], ...] = ()

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_hashes) * block_size

    @property
    def num_pool_blocks(self) -> int:
        return len(self.block_ids) - len(self.restore_token_ids)


@dataclass
class _RequestBlocks:
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the leading full blocks
    computing: list[int] = field(default_factory=list)  # hashes it noted (note_computing)


def hash_block(parent_hash: int, token_ids: tuple[int, ...] | list[int], seed: int) -> int:
    """Chained block hash: depends on the whole prefix, not only this block's tokens."""
    buf = array("Q", (seed & 0xFFFFFFFFFFFFFFFF, parent_hash, *token_ids)).tobytes()
    return xxhash.xxh3_64_intdigest(buf)


class BlockManager:
    """Allocates KV blocks to requests. All methods are O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 hash_seed: int = 0, tier: KVTier | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self._blocks = _BlockTable()
        # Free blocks in eviction order (front is evicted first); cached content survives here.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._reqs: dict[str, _RequestBlocks] = {}
        # hash of a full prompt block a request holds but has not computed yet -> that request
        self._computing: dict[int, str] = {}
        self.num_prefix_hit_tokens = 0  # cumulative, for metrics (restored blocks included)
        self.num_restored_tokens = 0  # cumulative: of those, restored from the second tier
        self.num_evicted_blocks = 0  # cumulative: cached blocks the pool reused for others
        self._events: KVEventRecorder | None = None
        self._tier = tier if enable_prefix_caching else None
        if self._tier is not None:
            self._tier.listener = self._tier_changed

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds none). Do not mutate."""
        rb = self._reqs.get(request_id)
        return rb.block_ids if rb else []

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reqs

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def get_computed_blocks(self, token_ids: list[int], root: int = 0) -> ComputedBlocks:
        """Longest cached prefix of ``token_ids`` in whole blocks; takes no references.
        ``root``: the first block's parent hash, which names what else the KV depends on
        (a LoRA adapter's key; 0 for the base model): prefixes of different roots never
        match.

        The last token is never served from cache: a forward pass must compute at least one
        token to produce the next-token logits.
        """
        if not self.enable_prefix_caching:
            return ComputedBlocks()
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        ids: list[int] = []
        hashes: list[int] = []
        restore: list[tuple[int, ...]] = []
        parent = root
        for i in range(max_blocks):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            h = hash_block(parent, toks, self.hash_seed)
            bid = self._cached.get(h)
            if not restore and bid is not None and self._blocks[bid].token_ids == toks:
                ids.append(bid)
            elif self._tier is not None and self._tier.tier_of(h, toks) is not None:
                # Once the run leaves the pool it continues in the tier only: the restores
                # are the table's tail, so a failed one cannot strand a pool block after it.
                ids.append(RESTORE)
                restore.append(toks)
            else:
                break
            hashes.append(h)
            parent = h
        return ComputedBlocks(tuple(ids), tuple(hashes), tuple(restore))

    def note_computing(self, request_id: str, token_ids: list[int],
                       computed: ComputedBlocks | None, root: int = 0) -> None:
        """``request_id`` (just allocated) will compute the full blocks of ``token_ids``
        after ``computed``: other requests may wait for them (``in_progress``). Blocks
        another request is already computing stay that request's."""
        rb = self._caching(request_id)
        if rb is None:
            return
        bs = self.block_size
        parent = computed.block_hashes[-1] if computed and computed.block_hashes else root
        for i in range(len(computed.block_hashes) if computed else 0, (len(token_ids) - 1) // bs):
            parent = hash_block(parent, tuple(token_ids[i * bs:(i + 1) * bs]), self.hash_seed)
            if parent not in self._computing and parent not in self._cached:
                self._computing[parent] = request_id
                rb.computing.append(parent)

    def in_progress(self, token_ids: list[int], computed: ComputedBlocks,
                    root: int = 0) -> str | None:
        """The request computing the block of ``token_ids`` right after its cached prefix
        ``computed`` (``get_computed_blocks``' answer), or None: none is, or the prompt has
        no full block there to reuse."""
        if not self._computing:
            return None
        bs = self.block_size
        i = len(computed.block_hashes)
        if i >= (len(token_ids) - 1) // bs:
            return None
        parent = computed.block_hashes[-1] if computed.block_hashes else root
        return self._computing.get(hash_block(parent, tuple(token_ids[i * bs:(i + 1) * bs]),
                                              self.hash_seed))

    def cached_hashes(self) -> list[int]:
        """Every hash the prefix cache holds now, in the pool or the second tier: the snapshot
        that the events drained by ``take_events`` from here on apply to."""
        return list(self.cached_tiers())

    def cached_tiers(self) -> dict[int, str]:
        """``cached_hashes`` with where each block's cheapest copy is (``engine.core.kv_events``
        tiers: ``device`` for the pool)."""
        out = {h: t for h, t in self._tier.items()} if self._tier is not None else {}
        out.update((h, "device") for h in self._cached)
        return out

    def record_events(self) -> None:
        """Record the prefix cache's changes from now on (idempotent)."""
        if self._events is None:
            self._events = KVEventRecorder()

    def take_events(self) -> list[KVEvent]:
        """The prefix cache's changes since the last call, oldest first ([] while not
        recording)."""
        return self._events.drain() if self._events is not None else []

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_tokens: int,
                       computed: ComputedBlocks | None = None) -> bool:
        """Make the request's table cover ``num_tokens`` tokens in total.

        ``computed`` (only on the request's first allocation) are prefix-cache hits to adopt.
        Returns False and changes nothing when the pool is too small.
        """
        rb = self._reqs.get(request_id)
        if computed and rb and rb.block_ids:
            raise ValueError(f"request {request_id!r} already holds blocks; cannot adopt a prefix")
        needed = self._num_new_blocks(request_id, num_tokens, computed)
        if needed > self._num_available(computed):
            return False
        if rb is None:
            rb = self._reqs[request_id] = _RequestBlocks()
        if computed:
            n = computed.num_pool_blocks
            for bid in computed.block_ids[:n]:
                self._touch(bid)
            rb.block_ids.extend(computed.block_ids[:n])
            rb.block_hashes.extend(computed.block_hashes[:n])
            self.num_prefix_hit_tokens += n * self.block_size
            needed -= self._restore(rb, computed)
        for _ in range(needed):
            rb.block_ids.append(self._pop_free())
        return True

    def shortfall(self, request_id: str, num_tokens: int,
                  computed: ComputedBlocks | None = None) -> int:
        """How many more free blocks ``allocate_slots`` with the same arguments needs to
        succeed (0: it would). Changes nothing."""
        return max(0, self._num_new_blocks(request_id, num_tokens, computed)
                   - self._num_available(computed))

    def freeable(self, request_id: str, keep: ComputedBlocks | None = None) -> int:
        """How many blocks ``free(request_id)`` would return to the pool, not counting those
        of ``keep`` (a prefix hit that would adopt them again): the blocks no other request
        holds. Changes nothing."""
        rb = self._reqs.get(request_id)
        if rb is None:
            return 0
        kept = set(keep.block_ids[:keep.num_pool_blocks]) if keep else set()
        return sum(1 for bid in rb.block_ids if self._blocks[bid].ref_cnt == 1 and bid not in kept)

    def adopted_tokens(self, request_id: str) -> int:
        """Right after the request's first ``allocate_slots``: the leading tokens whose KV its
        table already holds (the prefix hit, restored blocks included). Less than the hit's
        ``num_tokens`` only when a second-tier entry turned out unreadable."""
        rb = self._reqs.get(request_id)
        return len(rb.block_hashes) * self.block_size if rb else 0

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int,
                          root: int = 0) -> None:
        """Register the request's now-full, computed blocks in the prefix cache (``root``: as
        for ``get_computed_blocks``)."""
        rb = self._caching(request_id)
        if rb is None:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(rb.block_ids))
        parent = rb.block_hashes[-1] if rb.block_hashes else root
        for i in range(len(rb.block_hashes), num_full):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            h = hash_block(parent, toks, self.hash_seed)
            rb.block_hashes.append(h)
            parent = h
            if self._computing.get(h) == request_id:
                del self._computing[h]  # computed: cached below, or already by another
            block = self._blocks[rb.block_ids[i]]
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                block.token_ids = toks
                self._cached[h] = block.block_id
                if self._events is not None:
                    self._events.stored(h)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Give back the request's trailing blocks past ``num_tokens`` tokens (speculative
        decoding: slots of rejected drafts); returns how many. They hold no computed token of
        the sequence, so none is cached: they go to the front of the free queue."""
        rb = self._reqs.get(request_id)
        if rb is None:
            return 0
        keep = max(self.num_blocks_needed(num_tokens), len(rb.block_hashes))
        freed = 0
        while len(rb.block_ids) > keep:
            bid = rb.block_ids.pop()
            block = self._blocks[bid]
            block.ref_cnt -= 1
            assert block.ref_cnt == 0 and block.block_hash is None, f"block {bid} trimmed shared"
            self._free[bid] = None
            self._free.move_to_end(bid, last=False)
            freed += 1
        return freed

    def free(self, request_id: str) -> int:
        """Drop the request's references; returns how many blocks became free. Idempotent."""
        rb = self._reqs.pop(request_id, None)
        if rb is None:
            return 0
        for h in rb.computing:  # blocks it will not compute now: nobody waits for them
            if self._computing.get(h) == request_id:
                del self._computing[h]
        freed = 0
        # Reverse order: the tail of a sequence is the least likely to be shared, so it is
        # evicted first and the common prefix stays cached longest.
        for bid in reversed(rb.block_ids):
            block = self._blocks[bid]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {bid} freed twice"
            if block.ref_cnt == 0:
                self._free[bid] = None
                freed += 1
        return freed

    # ---- internals -----------------------------------------------------------------------
    def _restore(self, rb: _RequestBlocks, computed: ComputedBlocks) -> int:
        """Copy the hit's second-tier blocks into fresh pool blocks, in order, registering
        each in the prefix cache; after an unreadable one the rest stay plain fresh blocks
        (recomputed). Returns how many fresh blocks it took."""
        n = computed.num_pool_blocks
        restored = True
        for h, toks in zip(computed.block_hashes[n:], computed.restore_token_ids, strict=True):
            bid = self._pop_free()  # offloads what it evicts before the copy overwrites it
            rb.block_ids.append(bid)
            restored = restored and self._tier.restore(h, toks, bid)
            if not restored:
                continue
            rb.block_hashes.append(h)
            self.num_prefix_hit_tokens += self.block_size
            self.num_restored_tokens += self.block_size
            if h not in self._cached:
                block = self._blocks[bid]
                block.block_hash, block.token_ids = h, toks
                self._cached[h] = bid
                if self._events is not None:
                    self._events.stored(h)
        return len(computed.restore_token_ids)

    def _tier_changed(self, block_hash: int, tier: str | None) -> None:
        """The tier moved or dropped a block on its own account: tell the router unless the
        pool holds it (the pool's copy is the cheapest, its events speak for it)."""
        if self._events is None or block_hash in self._cached:
            return
        if tier is None:
            self._events.removed(block_hash)
        else:
            self._events.stored(block_hash, tier)

    def _caching(self, request_id: str) -> _RequestBlocks | None:
        """The request's blocks where the prefix cache is on and the request holds any."""
        return self._reqs.get(request_id) if self.enable_prefix_caching else None

    def _num_new_blocks(self, request_id: str, num_tokens: int,
                        computed: ComputedBlocks | None) -> int:
        rb = self._reqs.get(request_id)
        have = len(rb.block_ids) if rb else 0
        if computed:
            have += computed.num_pool_blocks  # restored blocks take fresh ones
        return max(0, self.num_blocks_needed(num_tokens) - have)

    def _num_available(self, computed: ComputedBlocks | None) -> int:
        # Adopting a cached-but-free block takes it off the free queue too.
        n = len(self._free)
        if computed:
            n -= sum(1 for bid in computed.block_ids[:computed.num_pool_blocks]
                     if self._blocks[bid].ref_cnt == 0)
        return n

    def _touch(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_cnt == 0:
            del self._free[block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        bid, _ = self._free.popitem(last=False)
        block = self._blocks[bid]
        if block.block_hash is not None:  # evict its cached content
            h = block.block_hash
            if self._cached.get(h) == bid:
                del self._cached[h]
                self.num_evicted_blocks += 1
                # Its pages still hold the content: the tier copies it before reuse.
                tier = self._tier.offload(h, block.token_ids, bid) if self._tier else None
                if self._events is not None:
                    if tier is None:
                        self._events.removed(h)
                    else:
                        self._events.stored(h, tier)
            block.block_hash = None
            block.token_ids = ()
        block.ref_cnt = 1
        return bid

    def check_invariants(self) -> None:
        """Assert the allocator's bookkeeping is consistent (used by property tests)."""
        refs = [0] * self.num_blocks
        for rb in self._reqs.values():
            for bid in rb.block_ids:
                refs[bid] += 1
        for bid in range(self.num_blocks):
            block = self._blocks.get(bid) or _Block(bid)  # not made yet: never used
            assert block.ref_cnt == refs[block.block_id], f"block {block.block_id} refcount"
            assert (block.ref_cnt == 0) == (block.block_id in self._free), f"block {block.block_id} free state"
        for h, bid in self._cached.items():
            assert self._blocks[bid].block_hash == h
        for h, rid in self._computing.items():
            assert rid in self._reqs and h not in self._reqs[rid].block_hashes, \
                f"block {h} noted as being computed by {rid}, which holds or computed it"
