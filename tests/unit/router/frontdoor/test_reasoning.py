"""Reasoning parsers (``--reasoning-parser``): a whole output and the same output streamed in
any split (a tag cut between deltas included) give the same reasoning and content; qwen3
reasons only inside an opening tag, deepseek_r1 from the start; chat responses carry them as
``reasoning_content`` and ``content``, tool calls parsed from the content only."""

from __future__ import annotations

import pytest

from router.contract import GenerationChunk
from router.frontdoor.openai.reasoning import ReasoningStream, split_reasoning
from router.frontdoor.openai.render import ChatRenderer, Collected

CASES = [
    ("qwen3", "<think>\nweigh it</think>\n\nParis.", ("\nweigh it", "\n\nParis.")),
    ("qwen3", "  <think>a<b</think>c", ("a<b", "c")),
    ("qwen3", "Paris, no thinking.", (None, "Paris, no thinking.")),
    ("qwen3", "<think>never closed", ("never closed", None)),
    ("qwen3", "<thi", (None, "<thi")),
    ("deepseek_r1", "weigh it</think>Paris.", ("weigh it", "Paris.")),
    ("deepseek_r1", "<think>weigh it</think>Paris.", ("weigh it", "Paris.")),
    ("deepseek_r1", "all thought, no end", ("all thought, no end", None)),
    ("deepseek_r1", "x</thin", ("x</thin", None)),
]


@pytest.mark.parametrize(("parser", "text", "want"), CASES)
def test_whole_and_every_two_way_split_agree(parser, text, want):
    assert split_reasoning(parser, text) == want
    for cut in range(len(text) + 1):
        s = ReasoningStream(parser)
        parts = [s.feed(text[:cut]), s.feed(text[cut:]), s.finish()]
        reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        assert (reasoning or None, content or None) == (
            want[0] if want[0] else None, want[1]), cut


def test_one_character_at_a_time():
    text = "<think>step one</think>The answer."
    s = ReasoningStream("qwen3")
    parts = [s.feed(ch) for ch in text] + [s.finish()]
    assert "".join(p[0] for p in parts) == "step one"
    assert "".join(p[1] for p in parts) == "The answer."


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        ReasoningStream("o1")


def test_chat_responses_carry_reasoning_content_whole_and_streamed():
    text = "<think>consider</think>Paris"
    r = ChatRenderer("chatcmpl-1", 0, "m", reasoning="qwen3")
    whole = r.whole([Collected("r", text=text, finish_reason="stop")],
                    usage=_usage())["choices"][0]["message"]
    assert whole == {"role": "assistant", "reasoning_content": "consider", "content": "Paris"}
    s = ChatRenderer("chatcmpl-1", 0, "m", reasoning="qwen3")
    deltas = [s.chunk(GenerationChunk("r", [1], piece)) for piece in
              ("<thi", "nk>consi", "der</th", "ink>Par", "is")]
    deltas.append(s.chunk(GenerationChunk("r", [], "", True, "stop")))
    got = [d["choices"][0]["delta"] for d in deltas if d is not None]
    assert "".join(d.get("reasoning_content", "") for d in got) == "consider"
    assert "".join(d.get("content", "") for d in got) == "Paris"
    assert got[0]["role"] == "assistant"
    assert deltas[0] is None  # nothing a client could see yet (a tag being assembled)


def _usage():
    from router.contract import Usage

    return Usage(3, 2)
