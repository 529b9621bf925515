"""Speculative decoding's pure parts: the config a user writes, the n-gram index,
verification's acceptance rule and the sampler under it (a deliberately bad draft leaves the
target's distribution unchanged). The controller's choice of k: test_spec_controller.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from engine.contract import SamplingParams
from engine.core.step_io import ScheduledChunk
from engine.spec.config import SpeculativeConfig, parse_speculative_config
from engine.spec.ngram import NgramIndex, NgramProposer


def test_config_parses_vllms_names():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, '
                                   '"prompt_lookup_max": 5, "prompt_lookup_min": 1}')
    assert cfg == SpeculativeConfig("ngram", 3, 5, 1, True)
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    assert parse_speculative_config(cfg.to_dict()) == cfg
    draft = parse_speculative_config({"method": "draft_model", "model": "/m",
                                      "num_speculative_tokens": 2})
    assert (draft.model, draft.draft_quantization) == ("/m", "auto")
    assert parse_speculative_config(draft.to_dict()) == SpeculativeConfig(
        "draft_model", 2, model="/m", quantization="auto")
    own = parse_speculative_config({"method": "self_draft", "num_speculative_tokens": 3})
    assert own.draft_quantization == "int4" and own.to_dict()["quantization"] == "int4"

@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": -2}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "in 1..16"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be"),
    ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
    ('{"num_speculative_tokens": 2}', "'method' is required"),
    ('{"method": "lookahead", "num_speculative_tokens": 2}', "unknown method 'lookahead'"),
    ('{"method": "ngram", "model": "/m", "num_speculative_tokens": 2}',
     "'model' do(es) not apply to method 'ngram'"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}',
     "method 'draft_model' needs 'model'"),
    ('{"method": "self_draft", "num_speculative_tokens": 2, "quantization": "gguf"}',
     "quantization for self_draft must be one of int4, int8, got 'gguf'"),
    ('{"method": "self_draft", "num_speculative_tokens": 2, "prompt_lookup_min": 1}',
     "'prompt_lookup_min' do(es) not apply to method 'self_draft'"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported yet"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "prompt_lookup_min (4) is greater than prompt_lookup_max (2)"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}',
     "prompt_lookup_min must be a positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown key(s) 'typo'"),
    ('{"method": "ngram", ', "not valid JSON"),
    ('[1, 2]', "expected a JSON object, got list"),
])
def test_bad_configs_are_refused_naming_the_problem(value, message):
    with pytest.raises(ValueError) as e:
        parse_speculative_config(value)
    assert message in str(e.value)
    assert str(e.value).startswith("speculative_config: ")


def _brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # latest earlier occurrence first
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


@pytest.mark.parametrize("seed", range(5))
def test_ngram_index_proposes_what_a_search_finds(seed):
    rng = random.Random(seed)
    idx = NgramIndex(2, 4)
    toks: list[int] = []
    for _ in range(300):
        new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        idx.extend(new)
        toks += new
        assert idx.propose(5) == _brute_force(toks, 2, 4, 5)


def test_ngram_proposer_reads_prompt_and_growing_output():
    p = NgramProposer(2, 3)
    prompt = [7, 1, 2, 3, 4, 5, 9]
    out: list[int] = []
    assert p.propose("r", prompt, out, 3) == []  # "5 9" never occurred before
    out += [1, 2]
    assert p.propose("r", prompt, out, 3) == [3, 4, 5]  # "1 2" -> what followed it
    out += [3]
    assert p.propose("r", prompt, out, 2) == [4, 5]  # the longer match "1 2 3"
    p.keep_only(set())
    assert p._index == {}


def _sample_rows(logits: torch.Tensor, chunk: ScheduledChunk):
    """The model runner's sampling of one chunk's rows (no model needed)."""
    from engine.executor.model_runner import ModelRunner

    fake = SimpleNamespace(eos_token_ids=())
    return ModelRunner._sample(fake, logits.clone(), [chunk], {})


def _chunk(drafts: list[int], params: SamplingParams, n_out: int = 3) -> ScheduledChunk:
    return ScheduledChunk("r", [5, *drafts], 10, [0], True, params, n_out, [1] * n_out,
                          [1] * 7, num_draft=len(drafts))


def test_greedy_verification_keeps_drafts_up_to_the_first_disagreement():
    v = 8
    logits = torch.full((4, v), -5.0)
    for row, tok in enumerate([3, 4, 6, 1]):  # the target's choices after each position
        logits[row, tok] = 5.0
    greedy = SamplingParams(temperature=0, max_tokens=20)
    out = _sample_rows(logits, _chunk([3, 4, 2], greedy))
    assert out.spec_token_ids["r"] == [3, 4, 6]  # two drafts held, the third replaced
    out = _sample_rows(logits, _chunk([3, 4, 6], greedy))
    assert out.spec_token_ids["r"] == [3, 4, 6, 1]  # all held, and one more
    out = _sample_rows(logits, _chunk([0, 4, 6], greedy))
    assert out.spec_token_ids["r"] == [3]


def test_a_bad_draft_leaves_the_target_distribution_unchanged():
    """Chi-square of the first two output tokens against the target's distribution, with a
    draft that always proposes the target's least likely token first."""
    torch.manual_seed(0)
    v = 5
    target = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])
    logits = target.log().repeat(3, 1)  # the same distribution at every position
    params = SamplingParams(temperature=1.0, max_tokens=50)
    n = 4000
    first = torch.zeros(v)
    second = torch.zeros(v)
    n_second = 0
    for _ in range(n):
        toks = _sample_rows(logits, _chunk([4, 4], params)).spec_token_ids["r"]
        first[toks[0]] += 1
        if len(toks) > 1:
            second[toks[1]] += 1
            n_second += 1
    # 4 degrees of freedom: chi-square 18.47 is p = 0.001
    chi1 = float((((first - n * target) ** 2) / (n * target)).sum())
    assert chi1 < 18.47, (first / n).tolist()
    # The second token exists only when the first draft (token 4) was drawn: ~5% of runs,
    # and is then distributed as the target again.
    assert abs(n_second / n - 0.05) < 0.02
    exp2 = n_second * target
    chi2 = float((((second - exp2) ** 2) / exp2).sum())
    assert chi2 < 18.47, (second / max(n_second, 1)).tolist()


def test_seeded_rows_draw_the_noise_of_their_output_index():
    """A seeded request's token at output index i is drawn with the noise of index i, as
    without speculation: the verifying rows reproduce three plain draws."""
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=50)
    from engine.executor.sampling import SampleRow, sample

    plain = [sample(logits[i:i + 1].clone(), [SampleRow(params, 3 + i, ())])[0] for i in range(3)]
    out = _sample_rows(logits, _chunk(plain[:2], params)).spec_token_ids["r"]
    assert out == plain
