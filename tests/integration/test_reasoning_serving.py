"""``--reasoning-parser`` through the HTTP front door and the real ``openai`` client: the
default model, held by a regex (structured outputs) to write a ``<think>`` span and then an
answer, gets ``message.reasoning_content`` and ``content`` apart, and the streamed
``delta.reasoning_content`` / ``delta.content`` add up to the same; the gRPC door and the SDK
split the same output the same way (whole and per chunk); ``chat_template_kwargs`` reach the
chat template. ``/v1/responses`` has no field that could hold a model to think tags (no regex),
so its reasoning items are served from a tiny real checkpoint that always thinks
(tests/helpers/thinking_model.py)."""

from __future__ import annotations

import re

import openai
import pytest

from client import Client
from engine import EngineArgs
from engine.weights.resolve import resolve_model
from router.embedded import EngineBackend
from router.frontdoor.lifecycle import serve_frontdoor
from tests.helpers.async_util import LoopThread
from tests.helpers.thinking_model import save_thinking_model

PATTERN = r"<think>[a-z]{3,8}</think>[A-Z][a-z]{2,8}"
EXTRA = {"structured_outputs": {"regex": PATTERN}}
MESSAGES = [{"role": "user", "content": "Think, then answer in one word."}]


@pytest.fixture(scope="module")
def door():
    loop = LoopThread()
    # the default model; no prefix cache: a prompt read from it may break a near-tie of the
    # quantized model the other way, and the doors' outputs are compared token for token
    backend = EngineBackend(EngineArgs(max_num_seqs=4, num_threads=1,
                                       enable_prefix_caching=False))
    fd = loop.run(serve_frontdoor(backend, grpc_port=0, http_port=0, drain_grace_s=1,
                                  reasoning_parser="qwen3"))
    try:
        yield fd
    finally:
        loop.run(fd.stop(1))
        loop.run(backend.shutdown())
        loop.close()


@pytest.fixture(scope="module")
def oai(door):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{door.http_port}/v1", api_key="x",
                       max_retries=0, timeout=120) as c:
        yield c


def test_reasoning_and_content_apart_whole_and_streamed(oai):
    r = oai.chat.completions.create(model=oai.models.list().data[0].id, messages=MESSAGES,
                                    max_tokens=40, temperature=0, extra_body=EXTRA)
    msg = r.choices[0].message
    thought = msg.model_extra["reasoning_content"]
    assert re.fullmatch("[a-z]{3,8}", thought), thought
    assert re.fullmatch("[A-Z][a-z]{2,8}", msg.content), msg.content
    stream = oai.chat.completions.create(model=r.model, messages=MESSAGES, max_tokens=40,
                                         temperature=0, extra_body=EXTRA, stream=True)
    reasoning = content = ""
    order = []
    for chunk in stream:
        if chunk.choices:
            d = chunk.choices[0].delta
            piece = (d.model_extra or {}).get("reasoning_content") or ""
            reasoning += piece
            content += d.content or ""
            order += ["reasoning"] * bool(piece) + ["content"] * bool(d.content)
    assert (reasoning, content) == (thought, msg.content)  # greedy, no prefix cache: alike
    assert order == sorted(order, key=lambda k: k == "content")  # thinking first, then answer


def test_grpc_splits_as_the_http_door_whole_and_per_chunk(door, oai):
    """One gRPC stream: each chunk's reasoning_content + content is its text's split (held-back
    tags included), joined they are the complete's whole split, which is the split HTTP's chat
    gives the same output (the raw text, rebuilt from HTTP's parts, is gRPC's text); a text
    prompt (a completion) is not split, as on the HTTP door."""
    with Client(f"127.0.0.1:{door.grpc_port}", timeout=120) as c:
        with c.stream(messages=MESSAGES, max_tokens=40, temperature=0,
                      structured={"regex": PATTERN}) as s:
            chunks = list(s)
            whole = s.result
        plain = c.generate("Think, then answer.", max_tokens=4, temperature=0)
    body, last = chunks[:-1], chunks[-1]
    assert last.finished and all(ch.reasoning_content is not None and ch.content is not None
                                 for ch in body)
    thought = "".join(ch.reasoning_content for ch in body)
    answer = "".join(ch.content for ch in body)
    assert re.fullmatch("[a-z]{3,8}", thought) and re.fullmatch("[A-Z][a-z]{2,8}", answer)
    assert (whole.reasoning_content, whole.content) == (thought, answer)
    assert (last.reasoning_content, last.content) == (thought, answer)
    assert whole.text == f"<think>{thought}</think>{answer}"  # the raw output, tags and all
    # a tag split over tokens is held back: some chunk carried text but none of the split
    assert any(ch.text and not (ch.reasoning_content or ch.content) for ch in body)
    # HTTP's chat of the same prompt: the same split (whole and streamed above)
    msg = oai.chat.completions.create(model=oai.models.list().data[0].id, messages=MESSAGES,
                                      max_tokens=40, temperature=0,
                                      extra_body=EXTRA).choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == (thought, answer)
    assert plain.reasoning_content is None and plain.content is None and plain.text


def test_chat_template_kwargs_reach_the_template(oai):
    """The default model's template ignores unknown variables: the same prompt either way;
    a variable the template does read changes it (tests/unit/engine/text)."""
    model = oai.models.list().data[0].id
    base = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                       temperature=0)
    kw = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                     temperature=0,
                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert kw.usage.prompt_tokens == base.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                    extra_body={"chat_template_kwargs": "no"})


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """The front door over a model that answers anything with
    ``<think>Two plus two</think>Four``, with ``--reasoning-parser qwen3``."""
    model = save_thinking_model(tmp_path_factory.mktemp("thinker") / "thinker",
                                resolve_model(None).model_dir, ["Two", " plus", " two"],
                                ["Four"])
    loop = LoopThread()
    backend = EngineBackend(EngineArgs(model=str(model), max_num_seqs=2, num_threads=1))
    fd = loop.run(serve_frontdoor(backend, grpc_port=0, http_port=0, drain_grace_s=1,
                                  reasoning_parser="qwen3"))
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{fd.http_port}/v1", api_key="x",
                           max_retries=0, timeout=120) as c:
            yield c
    finally:
        loop.run(fd.stop(1))
        loop.run(backend.shutdown())
        loop.close()


def test_responses_reasoning_item_before_the_message(thinker):
    model = thinker.models.list().data[0].id
    r = thinker.responses.create(model=model, input="What is two plus two?",
                                 max_output_tokens=20)
    assert r.status == "completed"
    assert [item.type for item in r.output] == ["reasoning", "message"]
    thought, message = r.output
    assert [(c.type, c.text) for c in thought.content] == [("reasoning_text", "Two plus two")]
    assert thought.summary == [] and thought.status == "completed"
    assert r.output_text == "Four"
    # the continuation's history carries the answer, not the thinking: the same reply again
    again = thinker.responses.create(model=model, input="And again?", previous_response_id=r.id,
                                     max_output_tokens=20)
    assert [item.type for item in again.output] == ["reasoning", "message"]
    assert again.usage.input_tokens > r.usage.input_tokens
    # a client that keeps the context itself replays the output items, reasoning included:
    # accepted, and left out of the prompt as the stored continuation leaves it
    replayed = thinker.responses.create(model=model, max_output_tokens=20, input=[
        {"role": "user", "content": "What is two plus two?"},
        *[item.model_dump(exclude_none=True) for item in r.output],
        {"role": "user", "content": "And again?"}])
    assert replayed.usage.input_tokens == again.usage.input_tokens


def test_responses_reasoning_streamed_in_openais_event_order(thinker):
    """The events parse as the ``openai`` package's own types; the reasoning item is added,
    streamed and done before the message item is added (OpenAI's one item after another)."""
    model = thinker.models.list().data[0].id
    events = list(thinker.responses.create(model=model, input="What is two plus two?",
                                           max_output_tokens=20, stream=True))
    kinds = [e.type for e in events]
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert squeezed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",  # the reasoning item
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",  # the message
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert type(events[4]).__name__ == "ResponseReasoningTextDeltaEvent"
    parts = [(e.type, e.part.type) for e in events if "content_part" in e.type]
    assert parts == [("response.content_part.added", "reasoning_text"),
                     ("response.content_part.done", "reasoning_text"),
                     ("response.content_part.added", "output_text"),
                     ("response.content_part.done", "output_text")]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Two plus two"
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert [(e.output_index, e.text) for e in done] == [(0, "Two plus two")]
    items = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.id) for i in items] == [(o.type, o.id) for o in events[-1].response.output]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Four"
    assert events[-1].response.output_text == "Four"
