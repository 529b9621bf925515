"""Tool calls out of generated text: each tool_choice's parse, the streaming hold-back of
``auto`` (content streams, a call goes out whole), and the schemas that enforce ``required``
and a named function (they compile, and admit exactly the calls they should)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.core.grammar import StructuredOutput
from router.frontdoor.openai.tools import (
    ToolCallStream,
    ToolPlan,
    named_schema,
    parse_calls,
    required_schema,
)

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time"}  # no parameters


def test_hermes_calls_are_parsed_and_the_rest_is_content():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parse_calls(ToolPlan("auto", parser="hermes"), text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    one = ToolPlan("auto", parser="hermes", parallel=False)  # parallel_tool_calls: false
    assert [c.name for c in parse_calls(one, text)[1]] == ["get_weather"]
    prose = "It is sunny in Paris."
    assert parse_calls(ToolPlan("auto", parser="hermes"), prose) == (prose, [])
    broken = '<tool_call>{"name": "get_weather", "argu'  # cut by max_tokens: stays text
    assert parse_calls(ToolPlan("auto", parser="hermes"), broken) == (broken, [])


def test_llama3_json_calls():
    plan = ToolPlan("auto", parser="llama3_json")
    content, calls = parse_calls(plan, '<|python_tag|>{"name": "get_weather", '
                                       '"parameters": {"city": "Oslo"}}')
    assert content is None and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert parse_calls(plan, "Oslo is cold.") == ("Oslo is cold.", [])


def test_required_and_named_outputs():
    content, calls = parse_calls(ToolPlan("required"),
                                 '[{"name": "get_time", "parameters": {}}, '
                                 '{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    content, calls = parse_calls(ToolPlan("named", name="get_weather"), '{"city": "Rome"}')
    assert content is None and calls[0].arguments == '{"city": "Rome"}'
    assert ToolPlan("named", name="x").finish_reason == "stop"
    assert ToolPlan("required").finish_reason == "tool_calls"


@pytest.mark.parametrize("chunks", [
    ["Let me ", "check. <tool", "_call>{\"name\": \"get_time\", ", "\"arguments\": {}}</tool_call>"],
    ["Let me check. ", "<", "tool_call>", "{\"name\": \"get_time\", \"arguments\": {}}"],
])
def test_auto_streams_content_and_holds_a_call_back_until_it_is_whole(chunks):
    stream = ToolCallStream(ToolPlan("auto", parser="hermes"))
    sent = [stream.feed(c) for c in chunks]
    assert "".join(sent) == "Let me check. "  # nothing of the tag leaked out
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["get_time"]
    plain = ToolCallStream(ToolPlan("auto", parser="hermes"))
    out = [plain.feed(c) for c in ["a <", "b", " c<tool"]]
    assert "".join(out) == "a <b c" and plain.finish() == ("<tool", [])


def test_the_enforcing_schemas_admit_exactly_the_calls():
    tools = [WEATHER, TIME]
    one = required_schema(tools, parallel=False)
    many = required_schema(tools, parallel=True)
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}}]
    jsonschema.validate(good, one)
    jsonschema.validate(good * 2, many)
    for bad, schema in ((good * 2, one), ([], many), ([{"name": "nope", "parameters": {}}], many),
                        ([{"name": "get_weather", "parameters": {}}], many)):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    for schema in (one, many, named_schema(WEATHER), named_schema(TIME)):
        StructuredOutput("json_schema", json.dumps(schema))  # compiles for the engine
