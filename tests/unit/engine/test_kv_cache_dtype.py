"""``LLM(kv_cache_dtype="int8")`` on the default model as ``LLM()`` serves it otherwise
(its shipped Q4_1 GGUF, the host's kernel plans): the pool holds 3.76x the blocks for the same
bytes, greedy output stays with the fp32 KV cache's at the level docs/kv-cache.md states,
and every block comes back."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "What is the boiling point of water in Celsius?",
    "Explain what a hash table is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "The quick brown fox",
    "Name a famous physicist and one discovery.",
]
TOKENS = 24
# The levels docs/kv-cache.md states, asserted so that a regression fails: prompts whose 24
# greedy tokens equal the fp32 cache's, and the largest and the mean difference of a chosen
# token's logprob while both runs agree. Measured: AMD EPYC Zen 3 (2026-12-06) 7 of 8, 0.113,
# 0.019; AMD EPYC Zen 4 (2026-12-07) under two kernel plans 6 of 8 and 0.252, 4 of 8 and
# 0.169 (mean 0.029). The quantized projections' int8 activations flip near-ties more often
# than fp32 weights (7 of 8 there), by how much depends on the plan: the mean is the stable
# figure.
MIN_IDENTICAL = 3
MAX_LOGPROB_DIFF = 0.35
MAX_MEAN_LOGPROB_DIFF = 0.04


@pytest.fixture(scope="module")
def runs():
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    out = {}
    for dtype in ("auto", "int8"):
        llm = LLM(kv_cache_dtype=dtype)
        outs = llm.generate(PROMPTS, params)
        bm = llm.engine.block_manager
        out[dtype] = (outs, bm.num_blocks, bm.num_free_blocks, llm.engine.runner.kv_cache_bytes,
                      llm.engine.cache_config.kv_cache_memory_bytes)
        llm.close()
    return out


def test_int8_pool_holds_more_blocks_in_the_same_bytes(runs):
    _, fp_blocks, _, fp_bytes, budget = runs["auto"]
    _, q_blocks, _, q_bytes, q_budget = runs["int8"]
    assert budget == q_budget == 1 << 30  # LLM()'s own default on the CPU
    assert q_blocks / fp_blocks >= 3.5  # 256 / 68 bytes per row at head_dim 64: 3.76x
    assert fp_bytes <= budget and q_bytes <= budget


def test_greedy_output_stays_with_the_fp32_cache(runs):
    fp, q = runs["auto"][0], runs["int8"][0]
    identical = sum(a.token_ids == b.token_ids for a, b in zip(fp, q, strict=True))
    diffs = []
    for a, b in zip(fp, q, strict=True):
        assert len(b.token_ids) == TOKENS
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs,
                                  strict=True):
            if ta != tb:
                break
            diffs.append(abs(la.logprob - lb.logprob))
    assert identical >= MIN_IDENTICAL, f"{identical} of {len(PROMPTS)} prompts identical"
    assert max(diffs) <= MAX_LOGPROB_DIFF, f"largest logprob difference {max(diffs):.4f}"
    mean = sum(diffs) / len(diffs)
    assert mean <= MAX_MEAN_LOGPROB_DIFF, f"mean logprob difference {mean:.4f}"


def test_no_block_leaks(runs):
    for dtype in ("auto", "int8"):
        _, blocks, free, _, _ = runs[dtype]
        assert free == blocks, dtype
