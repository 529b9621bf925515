"""Phi-3's LongRoPE (the 128k and Phi-3.5 checkpoints): one factor set per engine, chosen by
the context it serves. Within the original context (``max_model_len`` <= it) the short
factors: transformers' tokens for every prompt. Beyond it the long factors: transformers'
tokens for every sequence longer than the original context (transformers recomputes a
sequence's whole KV with the long factors once it outgrows it: the same numbers)."""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.helpers.tiny_models import hf_greedy, random_prompts

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
ORIGINAL = 16  # the fixture's original context; its context is 512


def test_within_the_original_context_the_short_factors_give_transformers_tokens(
        tiny_phi3_longrope_dir):
    prompts = random_prompts(seed=21, count=4, max_len=ORIGINAL - MAX_TOKENS, min_len=2)
    llm = LLM(str(tiny_phi3_longrope_dir), max_model_len=ORIGINAL)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_phi3_longrope_dir, "phi3", prompts,
                                                   MAX_TOKENS)


def test_beyond_it_the_long_factors_give_transformers_tokens_for_long_sequences(
        tiny_phi3_longrope_dir):
    # 17-40 token prompts: longer than the original context from their first token on.
    prompts = random_prompts(seed=22, count=4, max_len=40, min_len=ORIGINAL + 1)
    llm = LLM(str(tiny_phi3_longrope_dir))
    assert llm.engine.max_model_len == 512
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_phi3_longrope_dir, "phi3", prompts,
                                                   MAX_TOKENS)
    # ...and a short prompt computes something else than within the original context (the
    # factor sets differ): the choice is real, not a no-op.
    short = random_prompts(seed=23, count=1, max_len=6, min_len=6)
    with_long = llm.generate(short, SamplingParams(max_tokens=1, temperature=0, logprobs=3))[0]
    llm_short = LLM(str(tiny_phi3_longrope_dir), max_model_len=ORIGINAL)
    with_short = llm_short.generate(short, SamplingParams(max_tokens=1, temperature=0,
                                                          logprobs=3))[0]
    assert with_long.logprobs != with_short.logprobs
