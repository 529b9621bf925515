"""Reasoning output (``pdcluster serve --reasoning-parser``): a reasoning model writes its thinking
between ``<think>`` and ``</think>`` before the answer; chat responses carry the thinking as
``reasoning_content`` and the rest as ``content`` (whole, and as streamed deltas), as vLLM's
parsers of the same names do.

- ``qwen3``: reasoning only when the output opens with ``<think>`` (Qwen3 with thinking on;
  with ``chat_template_kwargs: {"enable_thinking": false}`` its template closes an empty span
  in the prompt and the output is all content), up to ``</think>``.
- ``deepseek_r1``: the template opens ``<think>`` in the prompt, so the output starts inside
  the reasoning (an opening tag it repeats is dropped) and is reasoning up to ``</think>``;
  with no ``</think>`` at all, all of it is reasoning.

Tool calls are parsed from the content only. Pure text in, text out; a tag split across two
deltas is held back until it is whole."""

from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek_r1")
_OPEN, _CLOSE = "<think>", "</think>"


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """A whole output as (reasoning, content); None where there is none."""
    stream = ReasoningStream(parser)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    reasoning, content = r1 + r2, c1 + c2
    return (reasoning if stream.had_reasoning else None), (content or None)


class ReasoningStream:
    """One choice's output, delta by delta: ``feed(text)`` -> (reasoning, content) to send
    now; ``finish()`` -> what was held back."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {parser!r}")
        self.parser = parser
        # "start": nothing decided yet (qwen3: is there an opening tag?); "reasoning"; "content"
        self.state = "start"
        self.held = ""
        self.had_reasoning = parser == "deepseek_r1"

    def feed(self, text: str) -> tuple[str, str]:
        buf = self.held + text
        self.held = ""
        reasoning = content = ""
        while buf:
            if self.state == "start":
                lead = buf.lstrip()
                if _OPEN.startswith(lead) and len(lead) < len(_OPEN):
                    self.held = buf  # may still become the opening tag
                    return reasoning, content
                if lead.startswith(_OPEN):
                    buf, self.state, self.had_reasoning = lead[len(_OPEN):], "reasoning", True
                else:
                    self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
            elif self.state == "reasoning":
                end = buf.find(_CLOSE)
                if end >= 0:
                    reasoning += buf[:end]
                    buf, self.state = buf[end + len(_CLOSE):], "content"
                    continue
                keep = _partial_suffix(buf, _CLOSE)
                reasoning += buf[:len(buf) - keep]
                self.held = buf[len(buf) - keep:]
                return reasoning, content
            else:
                content += buf
                buf = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held-back text: an unfinished tag is plain text where it stands."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "start" and self.parser == "deepseek_r1"):
            return held, ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
