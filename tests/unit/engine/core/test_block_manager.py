"""BlockManager: a hypothesis state machine over allocate/append/cache/free/lookup, plus
example tests for prefix reuse, LRU eviction and all-or-nothing allocation."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from engine.core.block_manager import BlockManager

BS = 4


# Shared "documents" so random prompts overlap in whole blocks and actually hit the cache;
# docs 0 and 1 share their second block but not their first (chained hashes must tell apart).
_DOCS = ([0, 1, 1, 0, 2, 2, 2, 2, 0, 0, 1, 1, 2, 0, 2, 0],
         [1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 1, 1, 2, 0, 2, 0],
         [2, 0, 2, 0, 2, 0, 2, 0, 1, 2, 1, 2, 1, 2, 1, 2])
_prompts = st.builds(lambda d, k, tail: _DOCS[d][:k] + tail, st.integers(0, 2),
                     st.integers(0, 16), st.lists(st.integers(0, 2), max_size=6)
                     ).filter(bool)


class BlockManagerMachine(RuleBasedStateMachine):
    """Models each live request's tokens and, per block, the token prefix its KV was computed
    under (a block's KV depends on every earlier token, not only its own)."""

    reqs = Bundle("reqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(12, BS, hash_seed=7)
        self.tokens: dict[str, list[int]] = {}  # tokens whose KV the request has "computed"
        self.kv: dict[int, tuple[int, ...]] = {}  # block id -> prefix its content belongs to
        self.next_id = 0
        self.num_hits = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _write(self, rid: str, start: int, toks: list[int]) -> None:
        """The request computes KV for positions [start, len(toks)) into its own blocks."""
        table = self.bm.block_ids(rid)
        for i in range(start // BS, self.bm.num_blocks_needed(len(toks))):
            bid = table[i]
            # Writing into a block another live request holds would corrupt its KV.
            assert self.bm._blocks[bid].ref_cnt == 1, f"writing into shared block {bid}"
            self.kv[bid] = tuple(toks[:min((i + 1) * BS, len(toks))])

    @rule(target=reqs, prompt=_prompts, use_cache=st.sampled_from([True, True, False]))
    def allocate(self, prompt, use_cache):
        rid = self._new_id()
        computed = self.bm.get_computed_blocks(prompt) if use_cache else None
        free_before = self.bm.num_free_blocks
        if not self.bm.allocate_slots(rid, len(prompt), computed):
            assert self.bm.num_free_blocks == free_before
            assert not self.bm.has_request(rid)
            return multiple()
        table = self.bm.block_ids(rid)
        assert len(table) == self.bm.num_blocks_needed(len(prompt))
        hit_tokens = 0
        if computed:
            assert table[:len(computed.block_ids)] == list(computed.block_ids)
            hit_tokens = computed.num_tokens(BS)
            self.num_hits += 1
        self.tokens[rid] = list(prompt)
        self._write(rid, hit_tokens, prompt)
        return rid

    @rule(rid=reqs, extra=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, rid, extra):
        if rid not in self.tokens:
            return
        toks = self.tokens[rid]
        before = list(self.bm.block_ids(rid))
        if self.bm.allocate_slots(rid, len(toks) + len(extra)):
            start = len(toks)
            toks.extend(extra)
            # Growing never rewrites the existing part of the table.
            assert self.bm.block_ids(rid)[:len(before)] == before
            self._write(rid, start, toks)
        else:
            assert self.bm.block_ids(rid) == before

    @rule(rid=reqs)
    def cache(self, rid):
        if rid in self.tokens:
            toks = self.tokens[rid]
            self.bm.cache_full_blocks(rid, toks, len(toks))

    @rule(rid=consumes(reqs))
    def free(self, rid):
        if rid in self.tokens:
            del self.tokens[rid]
            self.bm.free(rid)
        assert self.bm.free(rid) == 0  # idempotent: a second free releases nothing

    @rule(query=_prompts)
    def lookup(self, query):
        hit = self.bm.get_computed_blocks(query)
        assert hit.num_tokens(BS) < len(query)  # the last token is always computed
        for i, bid in enumerate(hit.block_ids):
            # The served block holds KV computed under exactly this query's prefix.
            assert self.kv.get(bid) == tuple(query[:(i + 1) * BS])

    @precondition(lambda self: not self.tokens)
    @rule()
    def all_freed(self):
        assert self.bm.num_free_blocks == self.bm.num_blocks

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        live_blocks = {b for rid in self.tokens for b in self.bm.block_ids(rid)}
        assert self.bm.num_used_blocks == len(live_blocks)
        for rid, toks in self.tokens.items():
            assert len(self.bm.block_ids(rid)) >= self.bm.num_blocks_needed(len(toks))
            # A request's full blocks hold its own prefix (shared or not).
            for i, bid in enumerate(self.bm.block_ids(rid)[:len(toks) // BS]):
                assert self.kv.get(bid) == tuple(toks[:(i + 1) * BS])

    def teardown(self):
        for rid in list(self.tokens):
            self.bm.free(rid)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                 deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# ---- examples -------------------------------------------------------------------------------
def test_shared_prefix_reuses_the_same_blocks():
    bm = BlockManager(16, BS)
    a = list(range(10))  # 2 full blocks + 2 tokens
    assert bm.allocate_slots("a", len(a))
    bm.cache_full_blocks("a", a, len(a))
    b = a[:8] + [99, 98, 97]
    hit = bm.get_computed_blocks(b)
    assert hit.block_ids == tuple(bm.block_ids("a")[:2])
    assert hit.num_tokens(BS) == 8
    assert bm.allocate_slots("b", len(b), hit)
    assert bm.block_ids("b")[:2] == bm.block_ids("a")[:2]
    assert bm.block_ids("b")[2] != bm.block_ids("a")[2]
    assert bm.num_prefix_hit_tokens == 8
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 16


def test_different_earlier_block_breaks_the_chain():
    bm = BlockManager(16, BS)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    bm.allocate_slots("a", len(a))
    bm.cache_full_blocks("a", a, len(a))
    # Second block's tokens match but the first differs: chained hashes must not hit.
    assert bm.get_computed_blocks([0, 2, 3, 4, 5, 6, 7, 8, 9]).block_ids == ()


def test_last_token_never_served_from_cache():
    bm = BlockManager(16, BS)
    a = list(range(8))  # exactly two full blocks
    bm.allocate_slots("a", 8)
    bm.cache_full_blocks("a", a, 8)
    assert len(bm.get_computed_blocks(a).block_ids) == 1  # the 2nd block holds the last token
    assert len(bm.get_computed_blocks(a + [100]).block_ids) == 2


def test_freed_blocks_stay_cached_until_lru_evicted():
    bm = BlockManager(4, BS)
    a = list(range(8))
    bm.allocate_slots("a", 8)
    bm.cache_full_blocks("a", a, 8)
    bm.free("a")
    assert bm.num_free_blocks == 4
    hit = bm.get_computed_blocks(a + [0])
    assert len(hit.block_ids) == 2  # content survives the free
    # Taking the two never-used blocks leaves the cached ones alone ...
    assert bm.allocate_slots("x", 8)
    assert len(bm.get_computed_blocks(a + [0]).block_ids) == 2
    # ... the next allocation must evict cached content (the tail block first).
    assert bm.allocate_slots("y", 4)
    assert len(bm.get_computed_blocks(a + [0]).block_ids) == 1
    assert bm.allocate_slots("z", 4)
    assert bm.get_computed_blocks(a + [0]).block_ids == ()
    bm.check_invariants()


def test_cache_hit_on_a_free_block_counts_against_the_pool():
    bm = BlockManager(3, BS)
    a = list(range(8))
    bm.allocate_slots("a", 8)
    bm.cache_full_blocks("a", a, 8)
    bm.free("a")
    hit = bm.get_computed_blocks(a + [1])
    assert len(hit.block_ids) == 2
    # 4 blocks needed, 2 from cache (both currently free) + 2 new: only 1 other block exists.
    assert not bm.allocate_slots("b", 16, hit)
    assert bm.allocate_slots("b", 12, hit)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_allocate_slots_fails_without_side_effects():
    bm = BlockManager(4, BS)
    assert bm.allocate_slots("a", 12)
    table = list(bm.block_ids("a"))
    assert not bm.allocate_slots("a", 20)  # would need 2 more, 1 free
    assert bm.block_ids("a") == table
    assert bm.num_free_blocks == 1
    assert not bm.allocate_slots("b", 5)
    assert not bm.has_request("b")
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_adopting_a_prefix_twice_is_rejected():
    bm = BlockManager(8, BS)
    a = list(range(9))
    bm.allocate_slots("a", 9)
    bm.cache_full_blocks("a", a, 9)
    hit = bm.get_computed_blocks(a)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate_slots("a", 12, hit)


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = list(range(9))
    bm.allocate_slots("a", 9)
    bm.cache_full_blocks("a", a, 9)
    assert bm.get_computed_blocks(a).block_ids == ()


def test_hash_seed_separates_clusters():
    a = list(range(9))
    bm = BlockManager(8, BS, hash_seed=1)
    bm.allocate_slots("a", 9)
    bm.cache_full_blocks("a", a, 9)
    other = BlockManager(8, BS, hash_seed=2)
    other.allocate_slots("a", 9)
    other.cache_full_blocks("a", a, 9)
    assert bm._blocks[0].block_hash != other._blocks[0].block_hash
