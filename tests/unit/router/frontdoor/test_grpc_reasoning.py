"""The gRPC door's reasoning split (``ReasoningSplitter``): every output of the HTTP parser's
cases, streamed one character a chunk, gives chunks whose reasoning_content / content join to
the whole split, and a complete that carries it; what a tag held back at the end goes out in a
chunk of its own; tool calls are parsed from the content only."""

from __future__ import annotations

import pytest

from router.contract import GenerationChunk, Usage
from router.frontdoor.grpc_messages import ReasoningSplitter, ToolCallCollector, chunk_to_responses
from router.frontdoor.openai.reasoning import split_reasoning
from router.frontdoor.openai.tools import plan_tools
from tests.unit.router.frontdoor.test_reasoning import CASES


def _stream(text: str, index: int = 0, last_text: bool = False) -> list[GenerationChunk]:
    """``text`` a character a chunk, then the finishing chunk (bringing the last character
    when ``last_text``, else nothing)."""
    body = text[:-1] if last_text else text
    chunks = [GenerationChunk(f"r{index}", [k], ch) for k, ch in enumerate(body)]
    tail = text[-1:] if last_text else ""
    chunks.append(GenerationChunk(f"r{index}", [len(body)] if tail else [], tail, True, "stop",
                                  Usage(3, len(text))))
    return chunks


def _run(split: ReasoningSplitter, chunks, index: int = 0, calls=None) -> list:
    out = []
    for c in chunks:
        responses = chunk_to_responses(c, "rid")
        for r in responses:
            r.index = index
        for r in split.split(index, responses):
            if calls is not None:
                calls.add(index, r)
            out.append(r)
    return out


@pytest.mark.parametrize("last_text", [False, True])
@pytest.mark.parametrize(("parser", "text", "want"), CASES)
def test_chunks_join_to_the_whole_split_the_complete_carries(parser, text, want, last_text):
    out = _run(ReasoningSplitter(parser), _stream(text, last_text=last_text))
    *body, complete = out
    assert complete.WhichOneof("response") == "complete"
    assert all(r.WhichOneof("response") == "chunk" for r in body)
    assert "".join(r.chunk.text for r in body) == text  # the raw text is untouched
    thought = "".join(r.chunk.reasoning_content for r in body)
    content = "".join(r.chunk.content for r in body)
    assert (thought or None, content or None) == (want[0] or None, want[1])
    c = complete.complete
    got = (c.reasoning_content if c.HasField("reasoning_content") else None,
           c.content if c.HasField("content") else None)
    assert got == split_reasoning(parser, text)


def test_a_tag_held_at_the_end_goes_out_in_a_chunk_of_its_own():
    out = _run(ReasoningSplitter("qwen3"), _stream("<think>a</th"))
    *_, flush, complete = out
    assert (list(flush.chunk.token_ids), flush.chunk.text) == ([], "")  # nothing new but
    assert (flush.chunk.reasoning_content, flush.chunk.content) == ("</th", "")  # what waited
    assert complete.complete.reasoning_content == "a</th"


def test_choices_are_split_apart_and_calls_come_from_the_content():
    split = ReasoningSplitter("qwen3")
    fn = {"name": "get_weather", "parameters": {"type": "object"}}
    calls = ToolCallCollector(plan_tools([fn], "auto", parser="hermes"))
    call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    # a call written inside the thinking is not a call; the one after it is
    a = _stream(f"<think>maybe {call}</think>Sure. {call}", index=0)
    b = _stream("<think>no</think>Plain.", index=1)
    out: list = []
    for ca, cb in zip(a[:len(b)], b, strict=False):  # interleaved, as merged choices arrive
        out += _run(split, [ca], 0, calls) + _run(split, [cb], 1, calls)
    out += _run(split, a[len(b):], 0, calls)
    done = {r.index: r.complete for r in out if r.WhichOneof("response") == "complete"}
    assert done[0].reasoning_content == f"maybe {call}"
    assert [x.name for x in done[0].tool_calls] == ["get_weather"]
    assert done[0].content.strip() == "Sure."
    assert done[0].finish_reason == "tool_calls"
    assert (done[1].reasoning_content, done[1].content, len(done[1].tool_calls)) == (
        "no", "Plain.", 0)
