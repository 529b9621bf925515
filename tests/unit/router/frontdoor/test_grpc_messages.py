"""The gRPC request's tools, from the SDK's arguments through the wire to the backend's input:
what the chat template is shown, which grammar enforces the choice, what is refused (by
field name), and how the calls are parsed into the ``complete`` message."""

from __future__ import annotations

import json

import pytest

from client.types import build_request, chunk_from_response
from proto.pdcluster.v1 import generation_pb2 as pb
from router.contract import InvalidRequestError
from router.frontdoor.grpc_messages import ToolCallCollector, request_to_generation

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"name": "get_time"}  # a bare function definition: the SDK takes both forms
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class Template:
    """Records what the front door asks the chat template to render."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[dict], list[dict] | None]] = []

    def __call__(self, messages, tools=None) -> list[int]:
        self.calls.append((messages, tools))
        return [1, 2, 3]


def _generation(template=None, parser=None, messages=ASK, **kw):
    req = build_request(None, None, messages, None, None, kw.pop("sampling", {}), **kw)
    # Through the wire and back: what the server really receives.
    req = pb.GenerateRequest.FromString(req.SerializeToString())
    return request_to_generation(req, "r1", template or Template(), parser)


def test_the_template_sees_the_tools_and_the_generation_runs_on_its_ids():
    template = Template()
    gen = _generation(template, tools=[WEATHER, TIME], tool_choice="none")
    assert gen.tools is None  # none: nothing to parse
    (messages, tools), = template.calls
    assert messages == ASK
    assert tools == [WEATHER, {"type": "function", "function": {"name": "get_time"}}]
    assert gen.inputs[0].token_ids == [1, 2, 3] and gen.inputs[0].messages is None
    assert gen.inputs[0].sampling.structured is None


def test_a_named_choice_is_enforced_by_its_parameters_schema():
    gen = _generation(tools=[WEATHER, TIME], n=2,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (gen.tools.mode, gen.tools.name) == ("named", "get_weather")
    for inp in gen.inputs:  # every choice constrained alike
        assert inp.sampling.structured.kind == "json_schema"
        assert json.loads(inp.sampling.structured.spec) == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("parallel,max_items", [(None, None), (False, 1)])
def test_required_is_an_array_of_calls(parallel, max_items):
    gen = _generation(tools=[WEATHER, TIME], tool_choice="required",
                      parallel_tool_calls=parallel)
    schema = json.loads(gen.inputs[0].sampling.structured.spec)
    assert schema["type"] == "array" and schema.get("maxItems") == max_items
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == [
        "get_weather", "get_time"]


def test_auto_needs_a_parser_and_then_leaves_the_output_free():
    with pytest.raises(InvalidRequestError, match="^tool_choice: auto needs"):
        _generation(tools=[WEATHER])
    gen = _generation(parser="hermes", tools=[WEATHER])
    assert (gen.tools.mode, gen.tools.parser) == ("auto", "hermes")
    assert gen.inputs[0].sampling.structured is None


def test_earlier_calls_and_tool_results_reach_the_template():
    template = Template()
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    _generation(template, messages=history, tools=[WEATHER], tool_choice="none")
    (messages, _), = template.calls
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}


@pytest.mark.parametrize("kw,field", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(parallel_tool_calls=False), "parallel_tool_calls"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "tools"),
    (dict(tools=[{"name": "bad name"}], tool_choice="required"), "tools"),
    (dict(tools=[{"name": "f", "parameters": {"type": "objekt"}}], tool_choice="required"),
     "tools"),
    (dict(tools=[{"name": "f", "parameters": "[1"}], tool_choice="required"), "tools"),
    (dict(tools=[WEATHER], tool_choice="required", resumable=True), "tools"),
    (dict(tools=[WEATHER], tool_choice="required", sampling={"logprobs": 2}), "logprobs"),
    (dict(tools=[WEATHER], tool_choice="required",
          sampling={"structured": {"json_object": True}}), "tool_choice"),
    (dict(tools=[{**WEATHER["function"], "strict": True}]), "tools"),
], ids=["unknown-name", "no-tools", "parallel-without-tools", "duplicate", "bad-name",
        "bad-schema", "parameters-not-json", "resumable", "logprobs", "with-structured",
        "strict-auto"])
def test_tool_requests_it_cannot_serve_name_the_field(kw, field):
    with pytest.raises(InvalidRequestError, match=f"^{field}:"):
        _generation(parser="hermes", **kw)


def test_tools_need_a_messages_prompt():
    req = build_request("Weather?", None, None, None, None, {}, tools=[WEATHER],
                        tool_choice="required")
    with pytest.raises(InvalidRequestError, match="^tools: only with a messages prompt"):
        request_to_generation(req, "r1", Template())


def test_the_sdk_refuses_a_malformed_tool_choice_before_sending():
    with pytest.raises(ValueError, match="tool_choice"):
        build_request(None, None, ASK, None, None, {}, tools=[WEATHER], tool_choice="get_time")
    with pytest.raises(ValueError, match="tools"):
        build_request(None, None, ASK, None, None, {}, tools=[{"description": "no name"}])


def _complete(collector: ToolCallCollector, index: int, texts: list[str]) -> pb.GenerateResponse:
    for t in texts:
        collector.add(index, pb.GenerateResponse(chunk=pb.GenerateChunk(text=t), index=index))
    done = pb.GenerateResponse(complete=pb.GenerateComplete(finish_reason="stop"), index=index)
    collector.add(index, done)
    return done


def test_each_choice_complete_carries_the_calls_parsed_from_its_own_text():
    gen = _generation(parser="hermes", tools=[WEATHER, TIME])
    collector = ToolCallCollector(gen.tools)
    collector.add(1, pb.GenerateResponse(chunk=pb.GenerateChunk(text="Just prose."), index=1))
    call = _complete(collector, 0, ['Sure. <tool_call>{"name": "get_weather", ',
                                    '"arguments": {"city": "Paris"}}</tool_call>'])
    prose = _complete(collector, 1, [])
    got = chunk_from_response(call)
    assert got.finish_reason == "tool_calls" and got.content == "Sure."
    (c,) = got.tool_calls
    assert (c.name, json.loads(c.arguments)) == ("get_weather", {"city": "Paris"})
    assert c.id.startswith("call_")
    plain = chunk_from_response(prose)
    assert plain.finish_reason == "stop" and plain.tool_calls is None
    assert plain.content == "Just prose."


def test_a_named_call_ends_stop_as_openais_does():
    gen = _generation(tools=[WEATHER], tool_choice={"type": "function",
                                                    "function": {"name": "get_weather"}})
    got = chunk_from_response(_complete(ToolCallCollector(gen.tools), 0, ['{"city": "Oslo"}']))
    assert got.finish_reason == "stop" and got.content is None
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
