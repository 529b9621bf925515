"""OpenAI's two ``logprobs`` shapes, from the engine's ``TokenLogprob``s.

``/v1/completions`` uses the legacy shape: parallel lists ``tokens`` / ``token_logprobs`` /
``top_logprobs`` (one dict per token: the sampled token and the ``logprobs`` most likely, text
to logprob) / ``text_offset`` (where each token's text starts in the choice's text).
``/v1/chat/completions`` uses ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``.
A streamed chunk carries the entries of its own tokens; ``text_offset`` keeps counting across a
choice's chunks, which is why a choice's ``CompletionLogprobs`` lives as long as its stream.

Pure: the token texts come from a ``TokenNames`` the renderer is given (the backend's
detokenizer, one id at a time, cached per response).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.contract import TokenLogprob

__all__ = ["CompletionLogprobs", "TokenNames", "chat_logprobs"]

# JSON has no -inf: a token the model rules out entirely reports this floor (vLLM's too).
_FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(float(x), _FLOOR)


@dataclass
class TokenNames:
    """A token id's text as logprobs report it: decoded alone (a piece of a multi-byte
    character decodes to U+FFFD, as in OpenAI's and vLLM's), or ``token_id:<id>`` when
    the request set vLLM's ``return_tokens_as_token_ids``."""

    decode: Callable[[list[int]], str]
    as_ids: bool = False
    _cache: dict[int, str] = field(default_factory=dict, init=False, repr=False)

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        name = self._cache.get(token_id)
        if name is None:
            name = self._cache[token_id] = self.decode([token_id])
        return name


@dataclass
class CompletionLogprobs:
    """One completion choice's logprobs, rendered chunk by chunk. ``offset``: where the next
    token's text starts (the echoed prompt's length first)."""

    names: TokenNames
    offset: int = 0

    def render(self, lps: list[TokenLogprob]) -> dict:
        """The entries of ``lps``; one whose logprob is NaN (a prompt's first token: nothing
        comes before it) has null logprob and alternatives, as in OpenAI's echo."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for lp in lps:
            name = self.names(lp.token_id)
            tokens.append(name)
            offsets.append(self.offset)
            self.offset += len(name)
            if math.isnan(lp.logprob):
                logprobs.append(None)
                tops.append(None)
                continue
            logprobs.append(_lp(lp.logprob))
            # The sampled token first, then the most likely (vLLM's shape: k + 1 entries
            # unless the sampled token is among the top k).
            top = {name: _lp(lp.logprob)}
            for tid, x in lp.top:
                top.setdefault(self.names(tid), _lp(x))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
                "text_offset": offsets}


def _bytes(name: str) -> list[int]:
    return list(name.encode("utf-8", errors="replace"))


def chat_logprobs(lps: list[TokenLogprob], names: TokenNames) -> dict:
    """Chat's ``logprobs`` object for ``lps`` (one entry per token, its ``top_logprobs``
    the request's k most likely, most likely first)."""
    content = []
    for lp in lps:
        name = names(lp.token_id)
        content.append({
            "token": name, "logprob": _lp(lp.logprob), "bytes": _bytes(name),
            "top_logprobs": [{"token": names(tid), "logprob": _lp(x),
                              "bytes": _bytes(names(tid))} for tid, x in lp.top]})
    return {"content": content}
