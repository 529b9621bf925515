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


def mask_logits(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Keep, in each row ``rows[i]`` of ``logits [N, vocab]``, only the tokens ``states[i]``
    allows next (in place; the others become -inf, which ``engine.executor.sampling.sample``
    treats as a ban no logit adjustment lifts: pass it the masked logits)."""
    # The C loop skips all-ones words and fills all-zeros ones.
    bitmask = torch.full((len(rows), (logits.shape[1] + 31) // 32), -1, dtype=torch.int32)
    for i, s in enumerate(states):
        s.fill_mask(bitmask, i)
    cpu_ops.apply_bitmask(logits, rows, bitmask)
