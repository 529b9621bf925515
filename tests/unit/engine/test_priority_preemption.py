"""A whole engine over a KV pool too small for two requests at once: a higher-priority request
arriving while a lower one fills the pool preempts it (engine.core.priority_room) instead of
waiting for it to finish; it finishes first, the preempted one is recomputed and finishes
after, both with transformers' greedy tokens, and every block comes back."""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.helpers.tiny_models import hf_greedy, random_prompts

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4  # layers x (K, V) x KV heads x head dim x fp32 x 4 tokens


def test_a_higher_priority_arrival_preempts_the_request_filling_the_pool(tiny_llama_dir):
    low_prompt, high_prompt = random_prompts(seed=57, count=2, max_len=20, min_len=16)
    low_params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    high_params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    refs = hf_greedy(tiny_llama_dir, "llama", [low_prompt], 24) + hf_greedy(
        tiny_llama_dir, "llama", [high_prompt], 4)
    # 12 blocks of 4 tokens: ``low`` alone grows to 11, ``high`` needs 5 (the default would
    # hold both: this pool is what makes room short)
    engine = LLM(str(tiny_llama_dir), block_size=4,
                 kv_cache_memory_bytes=12 * BLOCK_BYTES).engine
    engine.add_request(low_prompt, low_params, request_id="low", priority=0)
    tokens: dict[str, list[int]] = {"low": [], "high": []}
    finished: list[str] = []

    def step() -> None:
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                finished.append(o.request_id)

    while engine.block_manager.num_free_blocks > 3:  # low holds 9 of the 12
        step()
    assert not finished
    engine.add_request(high_prompt, high_params, request_id="high", priority=1)
    step()
    assert engine.scheduler.num_preemptions == 1  # low, in the step that admitted high
    assert [r.request_id for r in engine.scheduler.running] == ["high"]
    while engine.scheduler.has_unfinished:
        step()
    assert finished == ["high", "low"]
    assert [tokens["low"], tokens["high"]] == refs
    assert engine.scheduler.num_preemptions == 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
