"""How a draft model's catch-up is split into passes (engine/executor/draft.py): every missing
token runs as a decode row, at most ``ROWS_UP_TO`` rows a pass, each sequence's tokens in
order and each exactly once, the last pass holding every drafting sequence's newest tokens
(the rows whose last one drafts). Fakes for the runner and the block manager: no model."""

from __future__ import annotations

from dataclasses import dataclass

from engine.executor.draft import ROWS_UP_TO, DraftProposer


@dataclass
class _Req:
    request_id: str
    n: int

    @property
    def num_tokens(self) -> int:
        return self.n

    def token_slice(self, start: int, end: int) -> list[int]:
        return list(range(start, end))  # a token's id is its position


class _Blocks:
    def block_ids(self, request_id: str) -> list[int]:
        return [0]


def _check(heads, tails):
    drafter = DraftProposer(runner=None, blocks=_Blocks(), cost_ratio=0.2)
    passes = drafter._passes_of(list(heads), list(tails))
    steady = sum(min(2, r.num_tokens - s) for r, s in tails)
    for p in passes:
        assert sum(c.num_tokens for c in p) <= max(ROWS_UP_TO, steady)
        assert all(c.as_rows for c in p)
        assert len({c.request_id for c in p}) == len(p)  # one piece of a sequence a pass
    # each sequence's missing tokens exactly once, in order, across the passes
    seen: dict[str, list[int]] = {}
    for p in passes:
        for c in p:
            assert c.token_ids == list(range(c.start_pos, c.start_pos + c.num_tokens))
            seen.setdefault(c.request_id, []).extend(c.token_ids)
    for r, s in tails:
        assert seen[r.request_id] == list(range(s, r.num_tokens))
    for r, s, e in heads:
        assert seen[r.request_id] == list(range(s, e))
    # the last pass samples every drafting sequence's newest token, nothing else
    last = passes[-1] if tails else []
    assert sorted((c.request_id, c.start_pos + c.num_tokens) for c in last if c.sample) == \
        sorted((r.request_id, r.num_tokens) for r, _ in tails)
    assert not any(c.sample for p in passes[:-1] for c in p)
    return passes


def test_a_long_prompts_catch_up_runs_in_full_passes_of_rows():
    a, b, c = _Req("a", 110), _Req("b", 50), _Req("c", 41)
    passes = _check([], [(a, 0), (b, 48), (c, 30)])
    # 110 + 2 + 11 missing tokens: the fewest passes of at most 32 rows
    assert len(passes) == -(-(110 + 2 + 11) // ROWS_UP_TO)


def test_steady_sequences_draft_in_one_pass_and_a_partial_catch_up_goes_first():
    steady = [(_Req(f"s{i}", 60), 58) for i in range(4)]
    partial = (_Req("p", 300), 0, 256)  # part of a long prompt's catch-up, no drafts yet
    passes = _check([partial], steady)
    assert [c.request_id for c in passes[-1]] == ["s0", "s1", "s2", "s3"]
    assert len(passes) == 9  # 256 + 8 rows: 8 full passes of the partial one, then the last


def test_many_steady_sequences_keep_their_drafting_rows_together():
    tails = [(_Req(f"s{i}", 60), 58) for i in range(24)]  # 48 rows: over one pass's rows
    passes = _check([], tails)
    assert len(passes) == 1
