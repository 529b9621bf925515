"""``--reasoning-parser`` through the HTTP front door and the real ``openai`` client: the
default model, held by a regex (structured outputs) to write a ``<think>`` span and then an
answer, gets ``message.reasoning_content`` and ``content`` apart, and the streamed
``delta.reasoning_content`` / ``delta.content`` add up to the same; ``chat_template_kwargs``
reach the chat template."""

from __future__ import annotations

import re

import openai
import pytest

from engine import EngineArgs
from router.embedded import EngineBackend
from router.frontdoor.lifecycle import serve_frontdoor
from tests.helpers.async_util import LoopThread

PATTERN = r"<think>[a-z]{3,8}</think>[A-Z][a-z]{2,8}"
EXTRA = {"structured_outputs": {"regex": PATTERN}}
MESSAGES = [{"role": "user", "content": "Think, then answer in one word."}]


@pytest.fixture(scope="module")
def oai():
    loop = LoopThread()
    backend = EngineBackend(EngineArgs(max_num_seqs=4, num_threads=1))  # the default model
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
    # (greedy, but the second run reads the prompt from the prefix cache: a near-tie of the
    # quantized default model may go the other way, so the stream is checked on its own)
    assert re.fullmatch("[a-z]{3,8}", reasoning), reasoning
    assert re.fullmatch("[A-Z][a-z]{2,8}", content), content
    assert order == sorted(order, key=lambda k: k == "content")  # thinking first, then answer


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
