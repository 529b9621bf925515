"""Poison requests: bad values are refused at the door naming the field, and a request that
still raises inside an engine step fails alone while its batch goes on."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.contract import MAX_SEED
from engine.text.input_processor import InputProcessor
from tests.helpers.tiny_models import VOCAB, hf_greedy, random_prompts


@pytest.mark.parametrize("kwargs,field", [
    (dict(seed=2**62), "seed"), (dict(seed=-1), "seed"), (dict(seed=True), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(temperature=math.inf), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=1e9), "temperature"), (dict(temperature="hot"), "temperature"),
    (dict(top_p=math.nan), "top_p"), (dict(top_k=2.5), "top_k"), (dict(min_tokens=-1), "min_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=["a"]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(300))), "stop_token_ids"),
    (dict(stop=["a"] * 17), "stop"), (dict(stop=["a" * 257]), "stop"), (dict(stop=[3]), "stop"),
    (dict(max_tokens=True), "max_tokens"),
])
def test_bad_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field)


def test_limits_themselves_are_accepted():
    SamplingParams(seed=0)
    SamplingParams(seed=MAX_SEED, temperature=100, stop=["a" * 256] * 16,
                   stop_token_ids=list(range(256)))


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    inputs = InputProcessor(None, VOCAB, 512)
    with pytest.raises(ValueError, match=r"^stop_token_ids: token id 1000000 is outside"):
        inputs.validate(4, SamplingParams(stop_token_ids=[1_000_000], min_tokens=1))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_num_seqs=8)


@pytest.fixture(scope="module")
def refs(tiny_llama_dir):
    prompts = random_prompts(seed=5, count=3, max_len=30, min_len=5)
    return prompts, hf_greedy(tiny_llama_dir, "llama", prompts, 6)


def test_a_request_that_raises_in_a_step_fails_alone(llm, refs):
    """Validation is bypassed on purpose (a case it might miss): the poisoned row fails with
    finish_reason "error", the others in the same batch finish with transformers' tokens."""
    prompts, expected = refs
    eng = llm.engine
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reqs = [eng.make_request(p, greedy, request_id=f"ok-{i}") for i, p in enumerate(prompts)]
    poison = eng.make_request(prompts[0], SamplingParams(max_tokens=6, temperature=0.8, seed=1),
                              request_id="poison")
    poison.sampling_params.seed = 2**62  # overflows the sampler's generator seed
    for r in (reqs[0], poison, *reqs[1:]):
        eng.enqueue(r)
    outs = {}
    while eng.has_unfinished_requests:
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs["poison"].finish_reason == "error"
    assert "sampling failed" in outs["poison"].error
    assert [outs[f"ok-{i}"].token_ids for i in range(len(prompts))] == expected
    assert eng.stats().kv_blocks_used == 0
    # and the engine keeps serving
    assert llm.generate([prompts[1]], greedy)[0].token_ids == expected[1]


_values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
                    st.lists(st.integers(-5, 2 * VOCAB), max_size=4))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["seed", "temperature", "top_p", "top_k", "min_tokens",
                                        "max_tokens", "stop_token_ids"]), _values, max_size=3))
def test_random_sampling_params_never_break_the_engine(llm, refs, kwargs):
    """Any value either is refused with a ValueError naming a field, or generates; a good
    request batched with it always finishes with its reference tokens."""
    prompts, expected = refs
    try:
        params = SamplingParams(**{"max_tokens": 4, **kwargs})
    except (ValueError, TypeError) as e:
        assert isinstance(e, ValueError), f"{kwargs}: {e!r}"  # never a TypeError from a compare
        assert any(str(e).startswith(k) for k in kwargs) or "min_tokens" in str(e), (kwargs, e)
        return
    good = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    try:
        outs = llm.generate([prompts[2], prompts[0]], [good, params])
    except ValueError as e:  # the request as a whole does not fit (e.g. a stop id >= vocab)
        assert "stop_token_ids" in str(e) or "max_tokens" in str(e), (kwargs, e)
        outs = llm.generate([prompts[2]], [good])
    assert outs[0].token_ids == expected[2]
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert llm.engine.stats().kv_blocks_used == 0
