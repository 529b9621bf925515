"""Whole-engine behaviour: greedy tokens equal transformers' generate under every batching
setup, KV blocks are all returned, bad input is refused without disturbing other requests."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers.tiny_models import VOCAB, hf_greedy, random_prompts

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts_and_refs(tiny_llama_dir):
    prompts = random_prompts(seed=0, count=18, max_len=70)
    return prompts, hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# ~22 blocks of 4 tokens for 18 requests of up to 82 tokens: forces preemption.
TINY_POOL = 2 * 2 * 2 * 16 * 4 * 4 * 22


@pytest.mark.parametrize("setup", [
    dict(),
    dict(max_num_seqs=5, max_num_batched_tokens=32, block_size=8),  # fewer slots, chunked prefill
    dict(max_num_seqs=8, max_num_batched_tokens=24, block_size=4, kv_cache_memory_bytes=TINY_POOL),
    dict(batching="static", max_num_seqs=5, max_num_batched_tokens=48),
    dict(batching="dynamic", max_num_seqs=5, max_num_batched_tokens=48, dynamic_window_s=0.0),
    dict(batching="static", max_num_seqs=6, block_size=4, kv_cache_memory_bytes=TINY_POOL),
    # every prompt in chunks of at most 5 tokens, several prompts sharing each step
    dict(max_num_seqs=6, max_num_batched_tokens=24, max_prefill_chunk=5, block_size=4),
    # later prompts admitted as slots free up, each in a step without the decodes
    dict(max_num_seqs=5, max_num_batched_tokens=96, block_size=8, first_token_first=True),
], ids=["default", "chunked", "preempt", "static", "dynamic", "static-preempt", "chunk-cap",
        "first-token-first"])
def test_greedy_matches_transformers(tiny_llama_dir, prompts_and_refs, setup):
    prompts, refs = prompts_and_refs
    llm = LLM(str(tiny_llama_dir), **setup)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    assert all(o.finish_reason == "length" for o in outs)
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    stats = engine.stats()
    if "kv_cache_memory_bytes" in setup:
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        # ... and what an operator reads (pdcluster_preemptions_total, _evictions_total)
        assert stats.num_preemptions == engine.scheduler.num_preemptions
        assert stats.num_evicted_blocks > 0  # the small pool reused cached blocks
    else:
        assert stats.num_preemptions == 0
    if setup.get("max_num_batched_tokens"):
        assert engine.scheduler.num_steps > len(prompts)  # prompts really were chunked/queued
    # Every step that ran lands in the step histogram (pdcluster_engine_step_seconds).
    *counts, seconds = stats.step_seconds
    assert 0 < sum(counts) <= engine.scheduler.num_steps and seconds > 0


def test_prefix_cache_hits_give_same_tokens(tiny_llama_dir, prompts_and_refs):
    prompts, refs = prompts_and_refs
    llm = LLM(str(tiny_llama_dir), block_size=4)
    shared = prompts[0][:40]
    first = llm.generate([shared + [7, 8]], GREEDY)[0]
    second = llm.generate([shared + [7, 8]], GREEDY)[0]
    assert second.metrics.num_cached_tokens >= 36
    assert first.token_ids == second.token_ids
    assert llm.engine.block_manager.num_used_blocks == 0


def test_streaming_yields_every_token_once(tiny_llama_dir, prompts_and_refs):
    prompts, refs = prompts_and_refs
    llm = LLM(str(tiny_llama_dir), max_num_seqs=4)
    got: dict[str, list[int]] = {}
    order = []
    for out in llm.stream(prompts[:6], GREEDY):
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
        order.append(out.request_id)
    assert len(order) == 6 * MAX_TOKENS
    assert [got[k] for k in sorted(got, key=lambda r: int(r.split("-")[1]))] == refs[:6]


def test_abandoned_stream_frees_blocks(tiny_llama_dir, prompts_and_refs):
    prompts, _ = prompts_and_refs
    llm = LLM(str(tiny_llama_dir))
    stream = llm.stream(prompts[:4], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    next(stream)
    stream.close()
    assert llm.engine.block_manager.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama_dir, prompts_and_refs):
    prompts, _ = prompts_and_refs
    llm = LLM(str(tiny_llama_dir))
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=20, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[3]], sp)[0].token_ids
    batched = llm.generate(prompts[:8], [sp if i == 3 else SamplingParams(max_tokens=10, seed=i)
                                         for i in range(8)])[3].token_ids
    assert alone == batched
    other = llm.generate([prompts[3]], SamplingParams(max_tokens=10, temperature=0.9, seed=99,
                                                      ignore_eos=True))[0].token_ids
    assert other != alone


def test_stop_conditions(tiny_llama_dir, prompts_and_refs):
    prompts, refs = prompts_and_refs
    llm = LLM(str(tiny_llama_dir))
    ref = refs[0]
    # stop_token_ids: ends at the first occurrence of the reference's 4th token
    stop_tok = ref[3]
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                     stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[: ref.index(stop_tok) + 1]
    # min_tokens suppresses the stop token until reached
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, min_tokens=8,
                                                     stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert len(out.token_ids) >= 8 and stop_tok not in out.token_ids[:7]
    # eos (id 2 in the tiny config) stops unless ignore_eos
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.finish_reason in ("length", "stop")


BAD_INPUT = [
    ([], SamplingParams(max_tokens=4), "empty"),
    ([5] * 600, SamplingParams(max_tokens=4), "context"),
    ([5] * 10, SamplingParams(max_tokens=600, temperature=0), "exceeds"),
    ([VOCAB + 5], SamplingParams(max_tokens=4), "vocabulary"),
    ("text prompt", SamplingParams(max_tokens=4), "tokenizer"),
]


@pytest.mark.parametrize("prompt,params,message", BAD_INPUT, ids=[b[2] for b in BAD_INPUT])
def test_bad_input_is_refused_and_engine_keeps_serving(tiny_llama_dir, prompts_and_refs, prompt,
                                                       params, message):
    prompts, refs = prompts_and_refs
    llm = LLM(str(tiny_llama_dir))
    with pytest.raises(ValueError, match=message):
        llm.generate([prompts[0], prompt], [GREEDY, params])
    assert not llm.engine.has_unfinished_requests  # nothing half-queued
    assert llm.generate([prompts[1]], GREEDY)[0].token_ids == refs[1]


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="not found"):
        LLM("/nonexistent/model/dir")


def test_unsupported_architecture(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10,
        "n_embd": 8, "n_layer": 1, "n_head": 2}))
    with pytest.raises(ValueError, match="GPT2"):
        LLM(str(tmp_path))


def test_engine_counts_its_pure_decode_steps_by_batch_size(tiny_llama_dir):
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), max_num_seqs=4)
    assert llm.engine.stats().decode_steps == ()
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm.generate([[5, 9, 2], [7, 1, 3, 4], [8, 8]], sp)
    # One step prefills all three and samples their first tokens; tokens 2..5 come from four
    # decode steps of batch 3 (timed from schedule to outputs).
    [(batch, steps, seconds)] = llm.engine.stats().decode_steps
    assert (batch, steps) == (3, 4) and seconds > 0
    llm.generate([[4, 4, 4]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    rows = {b: n for b, n, _ in llm.engine.stats().decode_steps}
    assert rows == {1: 2, 3: 4}
    assert llm.engine.stats().mixed_steps == ()  # no step ran decode rows beside a prefill


@pytest.mark.parametrize("first_token_first", [False, True])
def test_engine_times_decode_rows_that_share_a_step_with_prefill_apart(tiny_llama_dir,
                                                                      first_token_first):
    """A prompt arriving while others decode is prefilled in the same step as their decode
    rows: that step is counted as mixed, by its decode rows, and not as a decode step. Under
    first_token_first the prompt's step runs alone and a and b decode the step after (with c):
    that pair of steps is what their tokens waited for, one mixed step of its rows."""
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), max_num_seqs=4, first_token_first=first_token_first)
    engine = llm.engine
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request([5, 9, 2], sp, "a")
    engine.add_request([7, 1, 3], sp, "b")
    engine.step()  # prefill a and b (first tokens)
    engine.step()  # decode a and b
    engine.add_request([8, 8, 4, 4], sp, "c")
    engine.step()  # decode a and b beside c's prefill; first_token_first: c alone
    if first_token_first:
        assert engine.stats().mixed_steps == ()  # held: counted with the next step
        engine.step()  # a, b and c decode
    while engine.has_unfinished_requests:
        engine.step()
    s = engine.stats()
    rows_mixed = 3 if first_token_first else 2
    [(rows, steps, seconds)] = s.mixed_steps
    assert (rows, steps) == (rows_mixed, 1) and seconds > 0
    # 5 decode tokens each for a, b and c; those of the mixed step are not in pure steps.
    assert sum(b * n for b, n, _ in s.decode_steps) == 5 + 5 + 5 - rows_mixed
    assert sum(s.step_seconds[:-1]) == engine.scheduler.num_steps  # every step in the histogram


@pytest.mark.parametrize("ours,theirs", [
    (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
    (dict(logit_bias={5: 4.0, 9: -100.0}), dict(sequence_bias={(5,): 4.0, (9,): -100.0})),
], ids=["repetition_penalty", "logit_bias"])
def test_logit_adjustments_match_transformers(tiny_llama_dir, ours, theirs):
    """repetition_penalty and logit_bias are transformers' RepetitionPenalty and SequenceBias
    processors: greedy tokens equal, and different from plain greedy (the test can fail)."""
    prompts = random_prompts(seed=1, count=6, max_len=40)
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS, **theirs)
    assert refs != hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)
    llm = LLM(str(tiny_llama_dir), max_num_seqs=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True, **ours))
    assert [o.token_ids for o in outs] == refs


def test_penalized_request_continues_identically_after_a_migration(tiny_llama_dir):
    """What the router does when a decode worker dies: re-prefill prompt + generated tokens
    with ``sample_index_offset``; penalties and seeds must give the rest of the same stream."""
    prompt = random_prompts(seed=2, count=1, max_len=30)[0]
    kw = dict(temperature=0.8, seed=7, frequency_penalty=1.2, presence_penalty=0.6,
              repetition_penalty=1.3, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir))
    whole = llm.generate([prompt], SamplingParams(max_tokens=16, **kw))[0].token_ids
    k = 6
    rest = llm.generate([prompt + whole[:k]], SamplingParams(max_tokens=16 - k,
                                                             sample_index_offset=k, **kw))[0]
    assert rest.token_ids == whole[k:]
    plain = llm.generate([prompt + whole[:k]], SamplingParams(max_tokens=16 - k, **kw))[0]
    assert plain.token_ids != whole[k:]  # without the offset it is another stream


def test_logprobs_are_transformers_log_softmax_of_each_generated_token(tiny_llama_dir):
    """SamplingParams.logprobs: each generated token's log-probability, its rank and the top-k
    equal transformers' own forward over the same sequence, for greedy and for a penalized,
    temperature-sampled request (logprobs describe the model's raw logits, not the sampler)."""
    import torch

    from tests.helpers.tiny_models import load_hf

    hf = load_hf(tiny_llama_dir, "llama")
    prompts = random_prompts(seed=3, count=3, max_len=20)
    llm = LLM(str(tiny_llama_dir))
    for params in (SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=4),
                   SamplingParams(max_tokens=8, temperature=1.3, seed=5, ignore_eos=True,
                                  logprobs=2, repetition_penalty=1.5, logit_bias={7: 3.0}),
                   SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)):
        for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
            assert len(out.logprobs) == len(out.token_ids) == 8
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
            ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # [8, vocab]
            for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
                assert lp.token_id == tok
                assert abs(lp.logprob - ref[step, tok].item()) < 1e-4
                assert lp.rank == int((ref[step] > ref[step, tok]).sum()) + 1
                top_ids = torch.topk(ref[step], params.logprobs).indices.tolist()
                assert [t for t, _ in lp.top] == top_ids
                assert all(abs(v - ref[step, t].item()) < 1e-4 for t, v in lp.top)
            if params.temperature == 0:
                assert all(lp.rank == 1 for lp in out.logprobs)
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=2))[0]
    assert plain.logprobs is None  # nothing computed unless asked


@pytest.mark.parametrize("setup", [{}, {"max_num_batched_tokens": 8, "block_size": 4}],
                         ids=["whole", "chunked"])
def test_prompt_logprobs_are_transformers_log_softmax_of_each_prompt_token(tiny_llama_dir,
                                                                           setup):
    """SamplingParams.prompt_logprobs: position i's log-probability given the tokens before
    it, its rank and the top k, equal to transformers' forward over the prompt; computed
    chunk by chunk under chunked prefill, and whole even when the prefix cache holds the
    prompt (a second, identical request)."""
    import math

    import torch

    from tests.helpers.tiny_models import load_hf

    hf = load_hf(tiny_llama_dir, "llama")
    prompts = random_prompts(seed=5, count=3, max_len=30, min_len=12)
    llm = LLM(str(tiny_llama_dir), **setup)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    for _ in range(2):  # the second round's prompts are all in the prefix cache
        for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
            lps = out.prompt_logprobs
            assert len(lps) == len(prompt) and lps[0].token_id == prompt[0]
            assert math.isnan(lps[0].logprob)  # nothing comes before it
            for i in range(1, len(prompt)):
                lp, want = lps[i], ref[i - 1]
                assert lp.token_id == prompt[i]
                assert abs(lp.logprob - want[prompt[i]].item()) < 1e-4
                assert lp.rank == int((want > want[prompt[i]]).sum()) + 1
                assert [t for t, _ in lp.top] == torch.topk(want, 3).indices.tolist()
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=2))[0].prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 2.5, True])
def test_bad_logprobs_are_refused(value):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=value)
