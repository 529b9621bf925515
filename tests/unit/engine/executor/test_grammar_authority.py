"""A grammar's mask has the last word: whatever penalties, biases and temperatures do to the
logits, the sampler chooses a token the grammar allows, and no sampling field makes it raise.

The bug this pins: ``{"prompt": "0", "max_tokens": 8, "temperature": 0, "repetition_penalty":
5e-324, "response_format": {"type": "json_object"}}`` answered HTTP 500 "structured output:
token 32 does not continue the grammar". 5e-324 is 0 in fp32: the prompt's token "0", masked
to -inf (the grammar wants "{" first), was multiplied by it into nan, and argmax took the nan.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.core.grammar import Grammars, StructuredOutput
from engine.executor.sampling import SampleRow, sample
from engine.ops.cpu_ops import apply_bitmask

JSON_OBJECT = StructuredOutput("json_object")
EOS = 2


@pytest.fixture(scope="module")
def byte_llm(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer (one token per byte, as SmolLM2's
    single characters are): grammars need a real vocabulary, the default model's engine is
    too heavy for a unit test. A 1 GiB KV pool is beside the point here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.helpers.tiny_models import save_tiny_model

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": EOS, **{c: 3 + i for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    model_dir = save_tiny_model("llama", tmp_path_factory.mktemp("byte-llama"),
                                vocab_size=len(vocab))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(model_dir)
    # Kernels timed as by default: its layers are the tiny Llama's, whose plans the host has
    # cached by then (test_defaults_families.py times them first; alone, cold: ~3 s).
    llm = LLM(str(model_dir), kv_cache_memory_bytes=4 << 20)
    yield llm
    llm.close()


def _grammar_start(llm: LLM):
    eng = llm.engine
    return Grammars(eng.tokenizer, eng.model_config.vocab_size, eng.eos_token_ids).start(
        JSON_OBJECT)


def test_the_500_request_continues_its_grammar(byte_llm):
    """The reported request, at the engine: it ends by its grammar (or its length) with
    every token one the grammar accepts, and the degenerate path really ran: the prompt's
    token is one the grammar forbids first, and the penalty turns it into nan."""
    zero = byte_llm.tokenizer.encode("0", add_special_tokens=False)
    assert len(zero) == 1
    state = _grammar_start(byte_llm)
    words = torch.full((1, (byte_llm.engine.model_config.vocab_size + 31) // 32), -1,
                       dtype=torch.int32)
    state.fill_mask(words, 0)
    assert not (int(words[0, zero[0] // 32]) >> (zero[0] % 32)) & 1  # "0" is masked at step 1
    assert torch.isnan(torch.tensor([float("-inf")]) * 5e-324).all()  # what the penalty does

    params = SamplingParams(max_tokens=8, temperature=0, repetition_penalty=5e-324,
                            structured=JSON_OBJECT)
    out = byte_llm.generate(["0"], params)[0]
    assert out.error is None and out.finish_reason in ("stop", "length"), out.error
    assert out.token_ids and out.text.startswith("{")
    check = _grammar_start(byte_llm)
    assert all(check.accept(t) for t in out.token_ids), check.error


@pytest.mark.parametrize("repetition_penalty", [5e-324, 1e300])
@pytest.mark.parametrize("temperature,seed", [(0, None), (5e-324, None), (1.0, 7), (100.0, 3)])
def test_degenerate_penalties_keep_every_sampled_token_in_the_grammar(
        byte_llm, temperature, seed, repetition_penalty):
    """Greedy, subnormal, ordinary and the hottest temperature, each with every adjustment at
    an extreme at once (a repetition penalty that is 0 or inf in fp32): still the grammar's
    tokens, and no request fails."""
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=seed,
                            repetition_penalty=repetition_penalty, presence_penalty=-2,
                            frequency_penalty=2,
                            logit_bias={t: 100.0 for t in range(3, 40)}, structured=JSON_OBJECT)
    outs = byte_llm.generate(['{"a": 0}', "0"], params)
    for out in outs:
        assert out.error is None, out.error
        check = _grammar_start(byte_llm)
        assert all(check.accept(t) for t in out.token_ids), check.error


def _row(params: SamplingParams, **kw) -> SampleRow:
    return SampleRow(params, kw.pop("num_output_tokens", 0), (EOS,), **kw)


def test_a_row_left_with_no_allowed_token_above_minus_inf_picks_an_allowed_one():
    """Only EOS allowed by the grammar, and min_tokens bans EOS: the grammar wins (EOS, greedy
    and sampled) rather than the first token of the vocabulary."""
    logits = torch.full((1, 64), float("-inf"))
    logits[0, EOS] = 3.0
    for temperature in (0, 1.0):
        params = SamplingParams(max_tokens=8, min_tokens=4, temperature=temperature, seed=1,
                                structured=JSON_OBJECT)
        assert sample(logits.clone(), [_row(params)]) == [EOS]
    # Two allowed, both seen, and a penalty that is inf in fp32: -5 * inf = -inf, 0 * inf =
    # nan. Greedy takes the first allowed one.
    logits = torch.full((1, 64), float("-inf"))
    logits[0, [9, 17]] = torch.tensor([-5.0, 0.0])
    params = SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1e300,
                            structured=JSON_OBJECT)
    assert sample(logits.clone(), [_row(params, prompt_token_ids=[9, 17])]) == [9]


# ---- the property: any sampling fields, any mask --------------------------------------------
_EDGE = [0.0, 5e-324, 1e-320, 1e-45, 1e-40, 1.2e-38, 1e-30, 1e-5, 0.5, 1.0, 2.0, 100.0, 1e10,
         3.4e38, 1e300, 1.7e308]


def _number(lo: float, hi: float, positive: bool = False):
    """Edge values inside [lo, hi] (> 0 where ``positive``), negatives mirrored, and any float
    between (subnormals included)."""
    edges = sorted({v for e in _EDGE for v in (e, -e)
                    if lo <= v <= hi and (v > 0 or not positive)})
    return st.one_of(st.sampled_from(edges),
                     st.floats(lo, hi, exclude_min=positive, allow_subnormal=True))


@st.composite
def _batch(draw):
    vocab = draw(st.integers(1, 300))
    n = draw(st.integers(1, 4))
    scale = draw(st.sampled_from([1.0, 30.0, 1e30, 3e38]))
    # A model's logits: finite (-inf is how a caller bans a token), up to fp32's largest.
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(draw(
        st.integers(0, 2**31)))).mul_(scale).nan_to_num_()
    ids = st.integers(0, vocab - 1)
    words = (vocab + 31) // 32
    bitmask = torch.zeros(n, words, dtype=torch.int32)
    rows, allowed = [], []
    for i in range(n):
        ok = draw(st.sets(ids, min_size=1, max_size=vocab))
        for t in ok:  # bit t % 32 of word t // 32; bit 31 is the int32's sign
            bitmask[i, t // 32] |= (1 << (t % 32)) if t % 32 != 31 else -(1 << 31)
        allowed.append(ok)
        max_tokens = draw(st.integers(1, 8))
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=draw(_number(0, 100)),
            top_p=draw(_number(0, 1, positive=True)),
            top_k=draw(st.one_of(st.sampled_from([-1, 0, 1]), st.integers(-1, vocab + 5))),
            min_p=draw(_number(0, 1)),
            repetition_penalty=draw(_number(0, 1.7e308, positive=True)),
            presence_penalty=draw(_number(-2, 2)),
            frequency_penalty=draw(_number(-2, 2)),
            logit_bias=draw(st.dictionaries(ids, _number(-100, 100), max_size=6)),
            seed=draw(st.one_of(st.none(), st.integers(0, 2**32 - 1))),
            min_tokens=draw(st.integers(0, max_tokens)),
            stop_token_ids=draw(st.lists(ids, max_size=3)),
            # The sampler keys on the -inf bans alone, grammar or not (the engine sets both).
            structured=draw(st.sampled_from([JSON_OBJECT, None])))
        rows.append(SampleRow(params, draw(st.integers(0, max_tokens - 1)), (min(EOS, vocab - 1),),
                              draw(st.lists(ids, min_size=1, max_size=12)),
                              draw(st.lists(ids, max_size=12))))
    return logits, bitmask, rows, allowed


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(_batch())
def test_any_sampling_fields_choose_an_allowed_token(batch):
    """Random logits (up to fp32's range), a random non-empty mask per row applied as the
    engine applies it, and every sampling field at random, edges and subnormals included:
    each row's token is one its mask allows, and nothing raises."""
    logits, bitmask, rows, allowed = batch
    apply_bitmask(logits, list(range(len(rows))), bitmask)
    tokens = sample(logits, rows)
    for tok, ok in zip(tokens, allowed, strict=True):
        assert tok in ok


@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")), ("temperature", 1e300), ("logit_bias", {5: 1e300}),
    ("presence_penalty", 1e300), ("top_p", 0.0)])
def test_values_with_no_meaning_are_refused_naming_the_field(field, value):
    """What the property above leaves out: values the door refuses (a 400 naming the field),
    never reaching the sampler."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
