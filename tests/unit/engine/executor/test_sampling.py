"""Sampler: greedy, seeded reproducibility independent of the batch, top-k/top-p limits,
temperature distribution against softmax, and min_tokens suppression of stop tokens."""

from __future__ import annotations

import pytest
import torch

from engine.contract import SamplingParams
from engine.executor.sampling import SampleRow, sample

VOCAB = 32
EOS = 3


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * 3  # [n, VOCAB]


def _row(num_output_tokens: int = 0, eos: tuple[int, ...] = (EOS,), **sp) -> SampleRow:
    return SampleRow(SamplingParams(**sp), num_output_tokens, eos)


def test_greedy_is_argmax():
    logits = _logits(6)
    rows = [_row(temperature=0.0) for _ in range(6)]
    assert sample(logits.clone(), rows) == logits.argmax(dim=-1).tolist()


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = _logits(4)
    rows = [_row(temperature=0.0), _row(temperature=1.0, seed=1),
            _row(temperature=0.0), _row(temperature=1.0)]
    out = sample(logits.clone(), rows)
    assert out[0] == logits[0].argmax().item() and out[2] == logits[2].argmax().item()


def test_seeded_sampling_is_reproducible():
    logits = _logits(1)
    rows = [_row(temperature=1.0, seed=1234, num_output_tokens=5)]
    draws = {sample(logits.clone(), rows)[0] for _ in range(10)}
    assert len(draws) == 1
    # A different output index draws fresh noise: over many indices, not always the same token.
    seq = {sample(logits.clone(), [_row(temperature=1.0, seed=1234, num_output_tokens=i)])[0]
           for i in range(40)}
    assert len(seq) > 1


def test_seeded_sample_independent_of_batch_and_row_order():
    target = _logits(1, seed=5)  # [1, VOCAB]
    others = _logits(5, seed=6)  # [5, VOCAB]
    rows = {i: _row(temperature=0.8, top_k=10, top_p=0.9, seed=42, num_output_tokens=i)
            for i in range(30)}
    alone = [sample(target.clone(), [rows[i]])[0] for i in range(30)]
    filler = [_row(temperature=1.0), _row(temperature=0.0), _row(temperature=0.5, seed=7),
              _row(temperature=2.0, top_k=3), _row(temperature=1.0, top_p=0.5)]
    for pos in (0, 3, 5):  # target first, in the middle, last
        got = []
        for i in range(30):
            logits = torch.cat([others[:pos], target, others[pos:]])  # [6, VOCAB]
            batch_rows = filler[:pos] + [rows[i]] + filler[pos:]
            got.append(sample(logits, batch_rows)[pos])
        assert got == alone


def test_top_k_one_is_greedy():
    logits = _logits(8, seed=3)
    rows = [_row(temperature=1.5, top_k=1) for _ in range(8)]
    for _ in range(5):
        assert sample(logits.clone(), rows) == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = _logits(8, seed=4)
    rows = [_row(temperature=1.5, top_p=1e-6) for _ in range(8)]
    for _ in range(5):
        assert sample(logits.clone(), rows) == logits.argmax(dim=-1).tolist()


def test_top_k_never_picks_outside_the_k_best():
    logits = _logits(1, seed=8)
    allowed = set(torch.topk(logits[0], 4).indices.tolist())
    picks = {sample(logits.clone(), [_row(temperature=5.0, top_k=4, seed=s)])[0]
             for s in range(300)}
    assert picks <= allowed and len(picks) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two (0.5 < 0.7 <= 0.8).
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    rows_for = lambda s: [SampleRow(SamplingParams(temperature=1.0, top_p=0.7, seed=s), 0, ())]  # noqa: E731
    picks = [sample(logits.clone(), rows_for(s))[0] for s in range(400)]
    assert set(picks) == {0, 1}


def test_temperature_sampling_matches_softmax():
    temp = 0.7
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])  # [1, 6]
    expected = torch.softmax(logits[0] / temp, dim=-1)
    n = 6000
    counts = torch.zeros(6)
    for s in range(n):
        tok = sample(logits.clone(), [SampleRow(SamplingParams(temperature=temp, seed=s), 0, ())])
        counts[tok[0]] += 1
    exp_counts = expected * n
    chi2 = (((counts - exp_counts) ** 2) / exp_counts).sum().item()
    # 5 degrees of freedom: P(chi2 > 25) ~ 1e-4. Seeds are fixed, so this is deterministic.
    assert chi2 < 25, (counts.tolist(), exp_counts.tolist())
    # And temperature matters: a sharper distribution would not fit the same counts.
    sharp = torch.softmax(logits[0] / 0.3, dim=-1) * n
    assert (((counts - sharp) ** 2) / sharp).sum().item() > 100


def test_min_tokens_bans_eos_and_stop_token_ids():
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 100.0
    logits[:, 7] = 50.0
    logits[:, 9] = 10.0
    rows = [_row(num_output_tokens=1, temperature=0.0, min_tokens=3, stop_token_ids=[7]),
            _row(num_output_tokens=3, temperature=0.0, min_tokens=3, stop_token_ids=[7])]
    assert sample(logits.clone(), rows) == [9, EOS]  # row 1 reached min_tokens: no ban


def test_min_tokens_with_ignore_eos_leaves_eos_alone():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 100.0
    rows = [_row(temperature=0.0, min_tokens=2, ignore_eos=True)]
    assert sample(logits.clone(), rows) == [EOS]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_ban_applies_to_random_sampling_too(temperature):
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 20.0
    for s in range(20):
        rows = [_row(temperature=temperature, seed=s, min_tokens=1)]
        assert sample(logits.clone(), rows) != [EOS]


# ---- logit adjustments: logit_bias, repetition / frequency / presence penalties, min_p ----

def _adjusted_row(prompt=(), output=(), **sp) -> SampleRow:
    return SampleRow(SamplingParams(**sp), len(output), (EOS,), list(prompt), list(output))


def test_logit_bias_forces_and_bans_tokens():
    logits = _logits(1)
    top = logits[0].argmax().item()
    other = (top + 5) % VOCAB
    assert sample(logits.clone(), [_adjusted_row(temperature=0, logit_bias={other: 100})]) == [other]
    banned = sample(logits.clone(), [_adjusted_row(temperature=0, logit_bias={top: -100})])
    assert banned != [top] and banned == [logits[0].clone().index_fill_(0, torch.tensor([top]),
                                                                       float("-inf")).argmax().item()]
    # JSON keys (stream logs, HTTP bodies) are strings: the same request.
    assert SamplingParams(logit_bias={str(other): 100}).logit_bias == {other: 100}


def test_frequency_and_presence_penalties_are_openais_formula():
    logits = _logits(1, seed=3)
    output = [7, 7, 7, 9]
    rows = [_adjusted_row(output=output, temperature=0, frequency_penalty=0.5, presence_penalty=1.25)]
    ref = logits[0].clone()
    for tok in set(output):
        ref[tok] -= 0.5 * output.count(tok) + 1.25
    # Push a penalized token to the top by a margin the penalty (2.75 for 7) must undo.
    base = logits.clone()
    base[0, 7] = base[0].max() + 2.0
    ref[7] = base[0, 7] - 2.75
    assert sample(base.clone(), rows) == [ref.argmax().item()] and ref.argmax().item() != 7
    # Without output tokens nothing changes.
    assert sample(base.clone(), [_adjusted_row(temperature=0, frequency_penalty=2.0)]) == [7]


def test_repetition_penalty_divides_seen_positive_and_multiplies_seen_negative_logits():
    logits = torch.zeros(1, VOCAB)
    logits[0, 4], logits[0, 5], logits[0, 6] = 3.0, 2.9, -1.0
    # 4 is in the prompt: 3.0 / 2 = 1.5 < 2.9, so 5 wins; unseen 5 is left alone.
    assert sample(logits.clone(), [_adjusted_row(prompt=[4, 6], temperature=0,
                                                 repetition_penalty=2.0)]) == [5]
    # A seen negative logit goes further down, never up past the unseen zeros.
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 6] = -1.0
    assert sample(logits.clone(), [_adjusted_row(output=[6], temperature=0,
                                                 repetition_penalty=10.0)]) != [6]


def test_penalties_count_tokens_generated_before_a_migration():
    """A migrated request carries its earlier output at the end of its prompt
    (sample_index_offset of them): it must be penalized exactly as if it had stayed."""
    logits = _logits(2, seed=5)
    logits[:, 8] = logits.max(dim=-1).values + 1.0  # on top unless its two earlier uses count
    kw = dict(temperature=0, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)
    stayed = _adjusted_row(prompt=[1, 2, 3], output=[8, 8, 11, 2], **kw)
    moved = _adjusted_row(prompt=[1, 2, 3, 8, 8, 11], output=[2], sample_index_offset=3, **kw)
    for i in range(2):
        picked = sample(logits[i:i + 1].clone(), [stayed])
        assert picked != [8] and picked == sample(logits[i:i + 1].clone(), [moved])


def test_min_p_never_samples_below_the_threshold():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08] + [0.0] * (VOCAB - 4)]) + 1e-30)
    rows = [_adjusted_row(temperature=1.0, min_p=0.2, seed=s) for s in range(400)]
    picked = sample(logits.repeat(400, 1), rows)
    # 0.5 * 0.2 = 0.1: tokens 0, 1 and 2 stay, 3 and the zeros go; all survivors are drawn.
    assert set(picked) == {0, 1, 2}


@pytest.mark.parametrize("kwargs,field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={5: 101}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"), (dict(presence_penalty=float("nan")), "presence_penalty"),
])
def test_bad_logit_adjustments_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
