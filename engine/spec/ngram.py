"""Prompt-lookup (n-gram) drafts: the tokens that followed the sequence's last n tokens the
last time those n tokens occurred earlier in it (prompt or output).

Each sequence keeps an index from every n-gram (``lo <= n <= hi``) it holds to the end of its
latest occurrence, updated as tokens arrive (O(hi - lo + 1) per token), so a proposal is a few
dictionary lookups whatever the sequence's length. Longer n-grams are tried first: a longer
match is the better predictor. The index ends one token short of the sequence: the suffix
being looked up must not find itself. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One sequence's n-gram index (module docstring). ``extend`` it with every token the
    sequence gains, in order; ``propose`` reads it."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.tokens: list[int] = []
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(hi - lo + 1)]
        self._indexed = 0  # n-grams ending before this position are in the index

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        toks = self.tokens
        # Index every n-gram that ends at a position before the last one.
        for end in range(max(self._indexed, 1), len(toks)):
            for j, n in enumerate(range(self.lo, self.hi + 1)):
                if end >= n:
                    self._ends[j][tuple(toks[end - n:end])] = end
        self._indexed = max(self._indexed, len(toks))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens (none where no n-gram of the suffix occurred before)."""
        toks = self.tokens
        size = len(toks)
        for j in range(self.hi - self.lo, -1, -1):
            n = self.lo + j
            if size <= n:
                continue
            end = self._ends[j].get(tuple(toks[size - n:]))
            if end is not None:
                return toks[end:min(end + k, size)]
        return []


class NgramProposer:
    """Drafts for many sequences, each with its own ``NgramIndex``, fed from the request's
    tokens as they grow. ``drop`` a finished request's index."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self._index: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, prompt: Sequence[int], output: Sequence[int],
                k: int) -> list[int]:
        """Up to ``k`` drafts to follow ``prompt + output`` (which only ever grows)."""
        idx = self._index.get(request_id)
        if idx is None:
            idx = self._index[request_id] = NgramIndex(self.lo, self.hi)
            idx.extend(prompt)
        have = len(idx.tokens) - len(prompt)
        if have < len(output):
            idx.extend(output[have:])
        return idx.propose(k)

    def drop(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    def keep_only(self, request_ids: set[str]) -> None:
        """Forget every sequence not in ``request_ids`` (finished, aborted, moved away)."""
        for rid in [r for r in self._index if r not in request_ids]:
            del self._index[rid]
