"""Prefix pulls, engine to engine (no transport; tests/integration/test_prefix_pull_serving.py
runs them between workers): the KV a source engine reads out of its prefix cache, imported
into the puller's reserved pages and committed, is a prefix-cache hit there, the puller
computes only the rest, and the tokens equal transformers' greedy ones; block sizes 8 and
16 on either side, and a source whose prefix sits in its second tier."""

from __future__ import annotations

import pytest

from engine import EngineArgs, LLMEngine, SamplingParams
from tests.helpers.tiny_models import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BLOCK_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny model: 2 layers, 2 KV heads of 16, fp32


def _engine(model_dir, block_size: int, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), block_size=block_size, detokenize=False,
                                **kw))


def _run(engine: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
    engine.add_request(prompt, GREEDY, request_id=rid)
    out: list[int] = []
    while engine.has_unfinished_requests:
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


def _pull(source: LLMEngine, puller: LLMEngine, pid: str, prompt: list[int], end: int) -> int:
    """The pull's engine half, as the workers run it; returns the tokens moved."""
    res = puller.kv_connector.reserve_prefix(pid, prompt, end)
    assert res.ok
    start = res.num_cached_tokens
    layers = source.kv_connector.read_prefix(prompt, start, end)
    assert layers is not None and all(kv.shape[1] == end - start for kv in layers)
    for layer, kv in enumerate(layers):
        puller.kv_connector.import_layer(pid, layer, kv)
    assert puller.kv_connector.commit_prefix(pid, end) == end
    return end - start


@pytest.mark.parametrize(("source_bs", "puller_bs"), [(8, 16), (16, 8), (16, 16)])
def test_a_pulled_prefix_serves_the_same_tokens_as_a_computed_one(tiny_llama_dir, source_bs,
                                                                   puller_bs):
    first = random_prompts(seed=51, count=1, max_len=50, min_len=50)[0]
    # The next request shares the first 48 tokens (3 blocks of 16, 6 of 8).
    second = first[:48] + random_prompts(seed=52, count=1, max_len=9, min_len=9)[0]
    source, puller = _engine(tiny_llama_dir, source_bs), _engine(tiny_llama_dir, puller_bs)
    out_first = _run(source, "first", first)
    assert _pull(source, puller, "pull", second, 48) == 48
    assert puller.block_manager.num_used_blocks == 0  # committed: cached, held by nobody
    before = puller.stats().num_prefill_tokens_computed
    out_second = _run(puller, "second", second)
    assert puller.stats().num_prefill_tokens_computed - before == len(second) - 48
    assert [out_first, out_second] == hf_greedy(tiny_llama_dir, "llama", [first, second],
                                                GREEDY.max_tokens)
    for e in (source, puller):
        assert e.block_manager.num_used_blocks == 0
        e.block_manager.check_invariants()


def test_only_what_the_puller_lacks_moves_and_a_lost_prefix_is_refused(tiny_llama_dir):
    prompt = random_prompts(seed=53, count=1, max_len=60, min_len=60)[0]
    source, puller = _engine(tiny_llama_dir, 8), _engine(tiny_llama_dir, 8)
    _run(source, "s", prompt)
    _run(puller, "p", prompt[:17])  # the puller holds 2 blocks of it
    assert _pull(source, puller, "pull", prompt, 48) == 48 - 16
    # The source cannot serve past what it caches (7 full blocks of 8 of the 60 tokens).
    assert source.kv_connector.read_prefix(prompt + [5] * 20, 0, 64) is None
    assert source.block_manager.num_used_blocks == 0


def test_a_source_restores_a_tier_held_prefix_before_sending(tiny_llama_dir):
    """The source's pool lost the prefix to other prompts; its host tier kept it."""
    block = 8
    source = _engine(tiny_llama_dir, block, max_model_len=96,
                     kv_cache_memory_bytes=12 * block * BLOCK_BYTES_PER_TOKEN,
                     kv_offload_memory_bytes=64 * block * BLOCK_BYTES_PER_TOKEN)
    puller = _engine(tiny_llama_dir, 16)
    first = random_prompts(seed=54, count=1, max_len=41, min_len=41)[0]
    _run(source, "first", first)
    for i, other in enumerate(random_prompts(seed=55, count=3, max_len=60, min_len=60)):
        _run(source, f"other{i}", other)
    second = first[:40] + random_prompts(seed=56, count=1, max_len=7, min_len=7)[0]
    restored = source.block_manager.num_restored_tokens
    assert _pull(source, puller, "pull", second, 32) == 32
    assert source.block_manager.num_restored_tokens - restored >= 32
    out = _run(puller, "second", second)
    assert out == hf_greedy(tiny_llama_dir, "llama", [second], GREEDY.max_tokens)[0]


def test_a_released_pull_leaves_nothing_behind(tiny_llama_dir):
    prompt = random_prompts(seed=57, count=1, max_len=40, min_len=40)[0]
    puller = _engine(tiny_llama_dir, 8)
    res = puller.kv_connector.reserve_prefix("pull", prompt, 32)
    assert res.ok and puller.block_manager.num_used_blocks > 0
    assert puller.kv_connector.release("pull")
    assert puller.block_manager.num_used_blocks == 0
    assert not puller.block_manager.cached_hashes()  # nothing half-written became a hit
    with pytest.raises(KeyError):
        puller.kv_connector.commit_prefix("pull", 32)
    with pytest.raises(ValueError, match="outside the prompt"):
        puller.kv_connector.reserve_prefix("bad", prompt, 40)
