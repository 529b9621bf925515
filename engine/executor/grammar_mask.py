"""Masks a step's logits to the tokens each constrained row's grammar allows next.

The masked tokens reach ``engine.executor.sampling.sample`` as -inf, which it re-imposes after
penalties, biases and temperature, so no sampling field can pick a token the grammar refuses.
The bitmask comes from xgrammar (``engine.core.grammar.GrammarState.fill_mask``) and is applied
by our C loop (``engine.ops.cpu_ops.apply_bitmask``): xgrammar's own CPU apply takes ~200 us a
row on a sparse mask, ours ~13 us (``python -m bench.studies.grammar_mask``,
docs/benchmarks.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.ops import cpu_ops

if TYPE_CHECKING:
    from engine.core.grammar import GrammarState


def mask_logits(logits: torch.Tensor, rows: list[int], states: list[GrammarState],
                advance: list[int | None] | None = None) -> None:
    """Keep, in each row ``rows[i]`` of ``logits [N, vocab]``, only the tokens ``states[i]``
    allows next (in place; the others become -inf, which ``engine.executor.sampling.sample``
    treats as a ban no logit adjustment lifts: pass it the masked logits).

    ``advance`` (speculative decoding): after filling row i, ``states[i]`` takes
    ``advance[i]`` (a draft) when not None, so the next row of the same state is masked for
    the position after that draft; every state is rolled back to where it was before
    returning. A draft the grammar refuses stops its state's advance (the rows after it
    keep that state's mask: their drafts cannot be accepted anyway, the row before refused
    it)."""
    # The C loop skips all-ones words and fills all-zeros ones.
    bitmask = torch.full((len(rows), (logits.shape[1] + 31) // 32), -1, dtype=torch.int32)
    taken: dict[int, tuple[GrammarState, int]] = {}  # id(state) -> (state, drafts it took)
    stuck: set[int] = set()
    for i, s in enumerate(states):
        s.fill_mask(bitmask, i)
        tok = advance[i] if advance is not None else None
        if tok is None or id(s) in stuck:
            continue
        if s.try_advance(tok):
            st, n = taken.get(id(s), (s, 0))
            taken[id(s)] = (st, n + 1)
        else:
            stuck.add(id(s))
    for s, n in taken.values():
        s.rollback(n)
    cpu_ops.apply_bitmask(logits, rows, bitmask)
