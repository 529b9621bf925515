"""Speculative decoding through the whole engine: greedy tokens equal transformers' (tiny
model) and the engine's own without speculation (the default model, as ``LLM()`` serves it),
under chunked prefill, preemption and first-token-first; stop strings, max_tokens, logprobs,
seeds and json_schema outputs as without it; every KV block back; bad configs refused."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.core.grammar import StructuredOutput
from tests.helpers.spec import EVERY_STEP, repetitive_prompts
from tests.helpers.tiny_models import hf_greedy

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_refs(tiny_llama_dir):
    prompts = repetitive_prompts()
    return prompts, hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)


@pytest.mark.parametrize("setup", [
    dict(),
    dict(max_num_seqs=4, max_num_batched_tokens=24, block_size=4),  # chunked, drafts squeezed
    # ~20 blocks of 4 tokens for 10 requests of up to 84 tokens: forces preemption
    dict(max_num_seqs=8, block_size=4, kv_cache_memory_bytes=2 * 2 * 2 * 16 * 4 * 4 * 20),
    dict(max_num_seqs=5, block_size=8, first_token_first=True),
], ids=["default", "chunked", "preempt", "first-token-first"])
def test_greedy_tokens_equal_transformers_with_drafts_accepted_and_rejected(
        tiny_llama_dir, tiny_refs, setup):
    prompts, refs = tiny_refs
    llm = LLM(str(tiny_llama_dir), speculative_config=EVERY_STEP, **setup)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    stats = llm.engine.spec.stats
    assert 0 < stats.accepted < stats.proposed, stats  # both paths ran
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks  # no block kept for a rejected draft
    if "kv_cache_memory_bytes" in setup:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A tiny model of the same shape and vocabulary with other random weights: its greedy
    drafts are almost never the target's."""
    from tests.helpers.tiny_models import save_tiny_model

    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-draft"), seed=3)


@pytest.mark.parametrize("setup", [
    dict(),
    dict(max_num_seqs=4, max_num_batched_tokens=24, block_size=4),
    dict(max_num_seqs=8, block_size=4, kv_cache_memory_bytes=2 * 2 * 2 * 16 * 4 * 4 * 20),
], ids=["default", "chunked", "preempt"])
def test_a_draft_model_that_is_the_target_has_every_draft_accepted(tiny_llama_dir, tiny_refs,
                                                                    setup):
    """The target as its own draft proposes exactly the target's greedy tokens, so every
    draft must be accepted: any draft K/V left wrong (the prompt computed in pieces, drafts
    rolled back, a preempted sequence's pages dropped and its K/V recomputed) would cost
    acceptance. Tokens equal transformers', every block comes back."""
    prompts, refs = tiny_refs
    llm = LLM(str(tiny_llama_dir), speculative_config={
        "method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3,
        "adaptive": False}, **setup)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    s = llm.engine.spec.stats
    assert s.proposed > 0 and s.accepted == s.proposed, s
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    if "kv_cache_memory_bytes" in setup:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("method", ["other", "self_draft"])
def test_draft_methods_are_exact_whatever_the_draft(tiny_llama_dir, tiny_refs, other_draft_dir,
                                                    method):
    """Another model's drafts (nearly all rejected) and the target's own int4 copy (some
    accepted): the tokens are the target's either way."""
    prompts, refs = tiny_refs
    cfg = ({"method": "draft_model", "model": str(other_draft_dir)} if method == "other"
           else {"method": "self_draft"})
    llm = LLM(str(tiny_llama_dir), speculative_config={**cfg, "num_speculative_tokens": 3,
                                                       "adaptive": False})
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    s = llm.engine.spec.stats
    assert s.proposed > 0 and s.accepted < s.proposed
    if method == "self_draft":
        assert s.accepted > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("floor", [0.0, 1.0], ids=["no-floor", "never-sure"])
def test_a_hesitant_draft_is_its_sequences_last_of_the_step(tiny_llama_dir, tiny_refs, floor):
    """A draft the draft model gives less probability than ``min_confidence`` ends its
    sequence's drafts for the step (it is still verified). The target as its own draft: with
    a floor of 1 (no draft is that sure) every verifying step has one draft, with none the
    drafts run to k; the tokens are the target's either way and every block comes back."""
    prompts, refs = tiny_refs
    llm = LLM(str(tiny_llama_dir), speculative_config={
        "method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3,
        "adaptive": False})
    # adaptive off verifies every draft (floor 0): the floor under test set by hand
    llm.engine.spec.drafter.min_confidence = floor
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    s = llm.engine.spec.stats
    assert s.accepted == s.proposed > 0, s
    if floor:
        assert s.proposed == s.verified_seqs and len(s.proposed_by_position) == 1, s
    else:
        assert len(s.proposed_by_position) == 3 and s.proposed_by_position[2] > 0, s
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_draft_of_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    from tests.helpers.tiny_models import save_tiny_model

    other = save_tiny_model("llama", tmp_path / "v300", vocab_size=300)
    with pytest.raises(ValueError, match="has a vocabulary of 300 tokens, the served model 256"):
        LLM(str(tiny_llama_dir), speculative_config={"method": "draft_model",
                                                     "model": str(other),
                                                     "num_speculative_tokens": 2})


def test_adaptive_default_config_is_exact_too(tiny_llama_dir, tiny_refs):
    prompts, refs = tiny_refs
    llm = LLM(str(tiny_llama_dir), speculative_config='{"method": "ngram", '
              '"num_speculative_tokens": 3}')
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True))
    assert [o.token_ids for o in outs] == refs


def test_tensor_parallel_2_is_exact(tiny_llama_dir, tiny_refs):
    """Rank 0 samples every verifying row; the other rank runs the same rows' forward."""
    prompts, refs = tiny_refs
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, speculative_config=EVERY_STEP) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                    ignore_eos=True))
        assert [o.token_ids for o in outs] == refs
        assert llm.engine.spec.stats.accepted > 0


def test_a_stream_stopped_early_frees_its_blocks_and_its_drafts_index(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), speculative_config=EVERY_STEP)
    for out in llm.stream(repetitive_prompts()[4], SamplingParams(max_tokens=40, temperature=0,
                                                                  ignore_eos=True)):
        if len(out.token_ids) >= 6:
            break  # the consumer stops: the request is aborted mid-stream
    eng = llm.engine
    assert eng.spec.stats.proposed > 0 and eng.spec.proposer._index == {}
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_bad_config_is_refused_before_loading(tiny_llama_dir):
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer in 1..16"):
        LLM(str(tiny_llama_dir), speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 0})


# ---- the default model, as LLM() serves it (its shipped Q4_1 GGUF) ------------------------
REWRITE = ("Rewrite the following paragraph with British spelling, changing nothing else:\n\n"
           "The color of the theater curtains was analyzed by the organization's program "
           "director, who realized that the gray fabric had been favored by the neighbors. "
           "The center of the theater was remodeled to optimize the behavior of the audience.")


@pytest.fixture(scope="module")
def default_pair():
    # Threads pinned: the governor (engine/runtime/cpu_threads.py) may move one of the two
    # engines to another thread count's kernel plans mid-test when a parallel test process
    # takes a core, and another plan's LM head rounds the logprobs compared below differently.
    # k fixed ("adaptive": False): the controller speculates where measured step times say
    # it pays, and a parallel test process moves those times, so under the suite's load it
    # sometimes verified no draft here and the drafts-accepted checks failed; these tests are
    # about what verification does with drafts (the controller: test_spec_controller.py).
    off = LLM(adaptive_threads=False)
    on = LLM(adaptive_threads=False,
             speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                 "adaptive": False})
    yield off, on
    off.close()
    on.close()


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_default_model_greedy_equal_and_drafts_accepted(default_pair):
    off, on = default_pair
    sp = SamplingParams(max_tokens=64, temperature=0)
    a, b = off.chat(_chat(REWRITE), sp)[0], on.chat(_chat(REWRITE), sp)[0]
    assert b.token_ids == a.token_ids and b.text == a.text
    assert on.engine.spec.stats.accepted > 10  # the rewrite repeats its input
    assert on.engine.spec.stats.mean_accepted_length > 1.5


def test_default_model_stop_string_max_tokens_and_logprobs(default_pair):
    off, on = default_pair
    base = off.chat(_chat(REWRITE), SamplingParams(max_tokens=48, temperature=0))[0]
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 6]  # inside a repeated run
    for sp in (SamplingParams(max_tokens=48, temperature=0, stop=[stop]),
               SamplingParams(max_tokens=23, temperature=0),
               SamplingParams(max_tokens=30, temperature=0, logprobs=3)):
        a, b = off.chat(_chat(REWRITE), sp)[0], on.chat(_chat(REWRITE), sp)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        if sp.logprobs:
            assert len(b.logprobs) == len(b.token_ids)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 0.05
                assert [t for t, _ in x.top] == [t for t, _ in y.top][:len(x.top)] or \
                    abs(x.top[0][1] - y.top[0][1]) < 0.05
    assert len(on.chat(_chat(REWRITE), SamplingParams(max_tokens=23, temperature=0))[0]
               .token_ids) == 23


def test_default_model_seeded_sampling_and_json_schema(default_pair):
    off, on = default_pair
    seeded = SamplingParams(max_tokens=40, temperature=0.7, seed=11)
    assert on.chat(_chat(REWRITE), seeded)[0].token_ids == \
        off.chat(_chat(REWRITE), seeded)[0].token_ids
    schema = {"type": "object", "properties": {"text": {"type": "string"}},
              "required": ["text"], "additionalProperties": False}
    sp = SamplingParams(max_tokens=80, temperature=0,
                        structured=StructuredOutput("json_schema", json.dumps(schema)))
    prompt = _chat(REWRITE + "\n\nAnswer as JSON with the key 'text'.")
    accepted = on.engine.spec.stats.accepted
    a, b = off.chat(prompt, sp)[0], on.chat(prompt, sp)[0]
    assert b.token_ids == a.token_ids
    assert on.engine.spec.stats.accepted > accepted  # drafts ran under the grammar's masks
    if a.finish_reason == "stop":
        assert set(json.loads(b.text)) == {"text"}
    bm = on.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_a_thread_count_change_keeps_the_draft_models_linear_plan(tiny_llama_dir):
    """The CPU thread governor applies the served model's plans for a new thread count (one
    linear plan per process): the draft model's entries come back with them, the served
    model's winning where both have one (before, they were dropped and the draft's weights
    ran the untuned paths)."""
    from engine.ops.linear import LinearPlan, linear_plan, set_linear_plan
    from engine.runtime.build import keep_draft_plan

    held = linear_plan()
    try:
        llm = LLM(str(tiny_llama_dir), speculative_config={
            "method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 2})
        threads = llm.engine.threads
        assert threads is not None and threads.adaptive  # the default on the CPU
        draft = llm.engine.spec.drafter.linear_plan
        draft.choices[(96, 64, 1, "int4")] = "cqint"  # an entry only the draft has
        threads.on_change(1)
        assert linear_plan().choices[(96, 64, 1, "int4")] == "cqint"
        served = LinearPlan({(64, 64, 1, "int4"): "cqpanel"})
        draft = LinearPlan({(64, 64, 1, "int4"): "cquant", (32, 64, 1, "int4"): "cqint"})
        keep_draft_plan(lambda n: set_linear_plan(served), draft)(2)
        assert linear_plan().choices == {(64, 64, 1, "int4"): "cqpanel",
                                         (32, 64, 1, "int4"): "cqint"}
    finally:
        set_linear_plan(held)
