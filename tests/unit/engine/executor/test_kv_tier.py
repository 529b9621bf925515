"""The second KV cache tier (engine.executor.kv_tier): blocks the pool evicts go to host memory (and on
to disk), come back on a hit byte-exact, and the served tokens equal transformers' greedy
ones; caps hold under random operations, the KV events mirror every tier, an unreadable file
is a miss, and the disk directory is gone after close."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from engine import EngineArgs, LLMEngine, SamplingParams
from engine.config import KVTierConfig
from engine.core.block_manager import RESTORE, BlockManager
from engine.core.kv_events import AllCleared, BlockRemoved, BlockStored
from engine.executor.kv_tier import KVTier
from tests.helpers.tiny_models import hf_greedy, random_prompts, serve_in_turn

BS = 4
LAYERS, HEADS, DIM = 3, 2, 4


def _pool(num_blocks: int) -> list[torch.Tensor]:
    # [num_blocks, 2, block_size, kv_heads, head_dim] per layer, as the runner's
    return [torch.zeros(num_blocks, 2, BS, HEADS, DIM) for _ in range(LAYERS)]


def _block_bytes() -> int:
    return LAYERS * 2 * BS * HEADS * DIM * 4


class _Sim:
    """A block manager over a real pool whose blocks get content derived from their hash
    (what a forward pass would write), so a restore can be checked byte for byte."""

    def __init__(self, num_blocks: int, tier: KVTierConfig | None, tmp=None) -> None:
        self.caches = _pool(num_blocks)
        self.tier = KVTier(self.caches, tier) if tier is not None else None
        self.bm = BlockManager(num_blocks, BS, tier=self.tier)
        self.bm.record_events()
        self.mirror: dict[int, str] = {}  # what a router applying the events believes

    @staticmethod
    def content(block_hash: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(block_hash & 0x7FFFFFFF)
        return torch.randn(LAYERS, 2, BS, HEADS, DIM, generator=g)

    def run(self, rid: str, prompt: list[int]) -> int:
        """Admit and "compute" a prompt; returns the tokens served from a cache."""
        computed = self.bm.get_computed_blocks(prompt)
        if not self.bm.allocate_slots(rid, len(prompt), computed):
            return -1
        adopted = self.bm.adopted_tokens(rid)
        table = self.bm.block_ids(rid)
        for i in range(adopted // BS):  # adopted blocks must already hold their content
            want = self.content(computed.block_hashes[i])
            for layer, c in enumerate(self.caches):
                assert torch.equal(c[table[i]], want[layer]), f"block {i} of {rid} differs"
        self.bm.cache_full_blocks(rid, prompt, len(prompt))
        for i, h in enumerate(self.bm._reqs[rid].block_hashes):  # write what compute would
            if i >= adopted // BS:
                for layer, c in enumerate(self.caches):
                    c[table[i]] = self.content(h)[layer]
        return adopted

    def finish(self, rid: str) -> None:
        """Free ``rid`` and check that the router's picture and both bookkeepings hold."""
        self.drain()
        assert self.mirror == self.bm.cached_tiers()
        self.bm.free(rid)
        self.bm.check_invariants()
        if self.tier is not None:
            self.tier.check_invariants()

    def drain(self) -> None:
        for ev in self.bm.take_events():
            if isinstance(ev, BlockStored):
                self.mirror.update((h, ev.tier) for h in ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self.mirror.pop(h)
            elif isinstance(ev, AllCleared):
                self.mirror.clear()


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_evicted_blocks_come_back_from_host_memory_byte_exact():
    sim = _Sim(6, KVTierConfig(memory_bytes=32 * _block_bytes()))
    rng = random.Random(0)
    a = _prompt(rng, 4 * BS + 1)
    assert sim.run("a", a) == 0
    sim.bm.free("a")
    for i in range(3):  # other prompts take the whole pool: a's blocks are evicted
        assert sim.run(f"x{i}", _prompt(rng, 5 * BS)) == 0
        sim.bm.free(f"x{i}")
    assert sim.bm.get_computed_blocks(a).block_ids.count(RESTORE) == 4
    assert sim.run("a2", a) == 4 * BS  # restored, and the content check in run() held
    assert sim.bm.num_restored_tokens == 4 * BS
    sim.finish("a2")


def test_without_a_tier_the_same_sequence_recomputes():
    sim = _Sim(6, None)
    rng = random.Random(0)
    a = _prompt(rng, 4 * BS + 1)
    sim.run("a", a)
    sim.bm.free("a")
    for i in range(3):
        sim.run(f"x{i}", _prompt(rng, 5 * BS))
        sim.bm.free(f"x{i}")
    assert sim.run("a2", a) == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_caps_and_events_hold_under_random_operations(tmp_path, seed):
    """Random prompts over a few shared prefixes, random frees: after every operation the
    host tier holds at most its slots, the disk at most its bytes, no file is stray, every
    adopted block holds its content, and the events mirror ``cached_tiers`` exactly."""
    memory_slots = 3
    disk_bytes = 5 * (_block_bytes() + 200)  # ~5 files (header and token ids included)
    sim = _Sim(8, KVTierConfig(memory_slots * _block_bytes(), str(tmp_path), disk_bytes))
    rng = random.Random(seed)
    prefixes = [_prompt(rng, rng.randint(1, 4) * BS) for _ in range(6)]
    live: list[str] = []
    seen: set[str] = set()
    restored_before = 0
    for step in range(400):
        if live and (rng.random() < 0.5 or len(live) > 2):
            sim.bm.free(live.pop(rng.randrange(len(live))))
        else:
            rid = f"r{step}"
            prompt = rng.choice(prefixes) + _prompt(rng, rng.randint(1, 2 * BS))
            if sim.run(rid, prompt) >= 0:
                live.append(rid)
        sim.drain()
        sim.bm.check_invariants()
        sim.tier.check_invariants()
        stats = sim.tier.stats()
        assert stats.memory_blocks <= memory_slots and stats.disk_bytes <= disk_bytes
        assert sim.mirror == sim.bm.cached_tiers()
        restored_before = stats.restored_blocks
        seen.update(sim.mirror.values())
    assert restored_before > 0 and sim.tier.stats().dropped_blocks > 0  # both paths ran
    assert seen == {"device", "host", "disk"}  # the events told the router every tier
    for rid in live:
        sim.bm.free(rid)
    sim.tier.close()
    assert not sim.tier.dir.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "swap"])
def test_an_unreadable_disk_file_is_a_miss_not_a_crash(tmp_path, damage):
    sim = _Sim(6, KVTierConfig(_block_bytes(), str(tmp_path), 64 * _block_bytes()))
    rng = random.Random(5)
    a = _prompt(rng, 4 * BS + 1)
    sim.run("a", a)
    sim.bm.free("a")
    for i in range(3):
        sim.run(f"x{i}", _prompt(rng, 5 * BS))
        sim.bm.free(f"x{i}")
    computed = sim.bm.get_computed_blocks(a)
    assert computed.block_ids.count(RESTORE) == 4  # on disk, behind a one-block memory tier
    files = sorted(sim.tier.dir.iterdir())
    target = sim.tier.dir / f"{computed.block_hashes[1]:016x}.kv"  # a's second block
    assert target in files
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "delete":
        target.unlink()
    else:  # another block's (valid) file under this block's name
        other = next(f for f in files if f != target)
        target.write_bytes(other.read_bytes())
    # Block 0 restores, block 1 fails: the prefix ends there, blocks 1.. are recomputed.
    assert sim.run("a2", a) == BS
    assert sim.tier.stats().restore_failures == 1
    sim.finish("a2")


def test_config_is_refused_by_name():
    with pytest.raises(ValueError, match="kv-offload-dir and --kv-offload-disk"):
        KVTierConfig(1 << 20, "/tmp/x", 0)
    with pytest.raises(ValueError, match="needs --kv-offload-memory"):
        KVTierConfig(0, "/tmp/x", 1 << 20)
    with pytest.raises(ValueError, match="holds no block"):
        KVTier(_pool(2), KVTierConfig(memory_bytes=10))


def test_a_dead_process_directory_is_removed_on_the_next_start(tmp_path):
    # A tier in a child process that is SIGKILLed leaves its directory behind ...
    code = ("import os, torch; from engine.config import KVTierConfig; from engine.executor.kv_tier import KVTier;"
            f"t = KVTier([torch.zeros(2, 2, 4, 2, 4)], KVTierConfig(1 << 16, {str(tmp_path)!r},"
            " 1 << 16)); print(t.dir, flush=True); os.kill(os.getpid(), 9)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.getcwd(), timeout=120)
    left = proc.stdout.strip()
    assert left and os.path.isdir(left)
    # ... and the next tier started on this host removes it.
    tier = KVTier(_pool(2), KVTierConfig(1 << 16, str(tmp_path), 1 << 16))
    assert not os.path.exists(left) and tier.dir.exists()
    tier.close()
    assert not tier.dir.exists()


# ---- the engine: served tokens --------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)



@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_restored_prefixes_serve_the_same_tokens_as_transformers(tiny_llama_dir, tmp_path, tier):
    """A conversation's prompt, pushed out of a small pool by other prompts, comes back from
    the tier (host memory, or disk behind a one-block memory tier) and its next turn's tokens
    equal transformers' greedy ones."""
    block, per_token = 8, 2 * 2 * 2 * 16 * 4  # tiny model: 2 layers, 2 KV heads of 16, fp32
    block_bytes = block * per_token
    memory = 64 * block_bytes if tier == "memory" else block_bytes
    args = EngineArgs(model=str(tiny_llama_dir), block_size=block, detokenize=False,
                      kv_cache_memory_bytes=12 * block_bytes, max_model_len=96,
                      kv_offload_memory_bytes=memory,
                      kv_offload_dir=str(tmp_path) if tier == "disk" else None,
                      kv_offload_disk_bytes=128 * (block_bytes + 256) if tier == "disk" else 0)
    engine = LLMEngine(args)
    try:
        base = random_prompts(seed=21, count=1, max_len=41, min_len=41)[0]
        others = random_prompts(seed=22, count=3, max_len=60, min_len=60)
        follow = base[:40] + random_prompts(seed=23, count=1, max_len=7, min_len=7)[0]
        prompts = [base, *others, follow]
        got = serve_in_turn(engine, prompts, GREEDY)
        bm = engine.block_manager
        assert bm.num_restored_tokens >= 40  # the 5 leading blocks came back, not recomputed
        if tier == "disk":
            assert engine.kv_tier.stats().disk_blocks > 0
        assert got == hf_greedy(tiny_llama_dir, "llama", prompts, GREEDY.max_tokens)
        assert bm.num_used_blocks == 0
        bm.check_invariants()
        engine.kv_tier.check_invariants()
        tier_dir = engine.kv_tier.dir
    finally:
        engine.close()
    if tier == "disk":
        assert not tier_dir.exists()


def test_engine_refuses_a_tier_it_cannot_use(tiny_llama_dir):
    with pytest.raises(ValueError, match="needs prefix caching on"):
        LLMEngine(EngineArgs(model=str(tiny_llama_dir), enable_prefix_caching=False,
                             kv_offload_memory_bytes=1 << 20))


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_an_int8_pool_restores_its_rows_and_scales(tiny_llama_dir, tmp_path, tier):
    """``kv_cache_dtype="int8"``: blocks (int8 values and their scales in one row) go to the
    tier and come back as stored: the restored prefix serves the tokens an int8 engine with
    room for everything (nothing evicted, nothing restored) serves."""
    block, per_token = 8, 2 * 2 * 2 * (16 + 4)  # tiny model, int8 rows of 16 values + scale
    block_bytes = block * per_token
    memory = 64 * block_bytes if tier == "memory" else block_bytes
    base = random_prompts(seed=21, count=1, max_len=41, min_len=41)[0]
    others = random_prompts(seed=22, count=3, max_len=60, min_len=60)
    follow = base[:40] + random_prompts(seed=23, count=1, max_len=7, min_len=7)[0]
    prompts = [base, *others, follow]
    roomy = LLMEngine(EngineArgs(model=str(tiny_llama_dir), block_size=block, detokenize=False,
                                 kv_cache_dtype="int8", max_model_len=96))
    try:
        want = serve_in_turn(roomy, prompts, GREEDY)
        assert roomy.block_manager.num_restored_tokens == 0
    finally:
        roomy.close()
    engine = LLMEngine(EngineArgs(
        model=str(tiny_llama_dir), block_size=block, detokenize=False, kv_cache_dtype="int8",
        kv_cache_memory_bytes=12 * block_bytes, max_model_len=96,
        kv_offload_memory_bytes=memory, kv_offload_dir=str(tmp_path) if tier == "disk" else None,
        kv_offload_disk_bytes=128 * (block_bytes + 256) if tier == "disk" else 0))
    try:
        assert engine.block_manager.num_blocks == 12
        assert engine.kv_tier.block_bytes == block_bytes
        got = serve_in_turn(engine, prompts, GREEDY)
        bm = engine.block_manager
        assert bm.num_restored_tokens >= 40
        if tier == "disk":
            assert engine.kv_tier.stats().disk_blocks > 0
        assert got == want
        assert bm.num_used_blocks == 0
        bm.check_invariants()
        engine.kv_tier.check_invariants()
    finally:
        engine.close()
