"""Structured outputs through the front doors, in the embedded engine and through a
disaggregated cluster (the prefill worker samples the first token under the mask, the decode
worker the rest): OpenAI's ``response_format`` (json_object, json_schema) with the real
``openai`` client, vLLM's ``structured_outputs`` (json, regex, choice, grammar) on both
endpoints, streamed and whole, ``n`` choices, gRPC with the SDK; a spec that does not compile
is a 400 / INVALID_ARGUMENT naming the field and the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from client import Client, InvalidArgument, RetryPolicy
from tests.helpers.http_asserts import assert_400_naming
from tests.helpers.schemas import SCIENTIST

QUESTION = [{"role": "user", "content": "Describe one famous scientist."}]
# Test clients retry nothing: a retried UNAVAILABLE would hide the refusal under test.
NO_RETRY = RetryPolicy(max_retries=0)
SCHEMA = SCIENTIST
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "scientist", "schema": SCHEMA, "strict": True}}


def test_json_schema_response_format_with_the_openai_client(oai, model_id, kv_probe):
    kw = dict(model=model_id, messages=QUESTION, max_tokens=150, response_format=JSON_SCHEMA_FORMAT)
    free = oai.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=40,
                                       temperature=0)
    with pytest.raises(json.JSONDecodeError):  # left alone, the model writes prose
        json.loads(free.choices[0].message.content)
    whole = oai.chat.completions.create(**kw, temperature=0)
    choice = whole.choices[0]
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert choice.finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        **kw, temperature=0, stream=True) if c.choices)
    # streamed and whole valid alike; that they are the same text (a request again, its
    # prompt now in the prefix cache: another plan bucket's prompt step) needs the float
    # products: tests/integration/frontdoor_fp32/test_frontdoor_float_products.py
    jsonschema.validate(json.loads(streamed), SCHEMA)
    several = oai.chat.completions.create(**kw, temperature=1.0, seed=11, n=3)
    for c in several.choices:  # sampled, and still valid
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    kv_probe.wait_until_free()


def test_json_object_response_format(oai, model_id):
    out = oai.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=300,
                                      temperature=0.7, seed=3,
                                      response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    text = oai.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=5,
                                       temperature=0, response_format={"type": "text"})
    assert text.choices[0].finish_reason == "length"  # "text" is the unconstrained default


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("constraint,check", [
    ({"choice": ["Marie Curie", "Isaac Newton"]}, lambda t: t in {"Marie Curie", "Isaac Newton"}),
    ({"regex": r"[A-Z][a-z]+ [A-Z][a-z]+, born [0-9]{4}"},
     lambda t: re.fullmatch(r"[A-Z][a-z]+ [A-Z][a-z]+, born [0-9]{4}", t)),
    ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in {"yes", "no"}),
    ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
], ids=["choice", "regex", "gbnf", "json"])
def test_vllm_structured_outputs_on_both_endpoints(http, endpoint, constraint, check):
    body = {"max_tokens": 150, "temperature": 0, "structured_outputs": constraint}
    body |= ({"prompt": "One famous scientist:"} if endpoint == "/v1/completions"
             else {"messages": QUESTION})
    r = http.post(endpoint, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if endpoint == "/v1/completions" else choice["message"]["content"]
    assert check(text), text
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("body,field,problem", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "parenthesis is not closed"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs",
     'Rule "nowhere" is not defined'),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not together"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", ""),
], ids=["bad-schema", "no-schema", "bad-regex", "bad-grammar", "two", "both-fields",
        "unknown-option"])
def test_a_constraint_that_does_not_compile_is_a_400_naming_it(http, kv_probe, body, field,
                                                               problem):
    r = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 5, **body})
    err = assert_400_naming(r, field)
    assert problem in err["message"]
    kv_probe.wait_until_free()


def test_grpc_structured_output_with_the_sdk(frontdoor):
    with Client(f"127.0.0.1:{frontdoor.grpc_port}", retry=NO_RETRY) as c:
        res = c.generate(messages=QUESTION, max_tokens=150, temperature=0,
                         structured={"json": SCHEMA})
        jsonschema.validate(json.loads(res.text), SCHEMA)
        assert res.finish_reason == "stop"
        assert c.generate("Pick:", max_tokens=10, temperature=0,
                          structured={"choice": ["red", "blue"]}).text in {"red", "blue"}
        with pytest.raises(InvalidArgument, match="objekt"):
            c.generate("x", max_tokens=2, structured={"json": {"type": "objekt"}})


# ---- tools -----------------------------------------------------------------------------------
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS,
                                           "description": "The weather in a city"}},
         {"type": "function", "function": {"name": "get_time", "description": "The time"}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED_CALL = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>')


def _streamed_tool_calls(chunks) -> tuple[str, dict[int, dict], str | None]:
    """A streamed chat's content, its tool calls assembled from the deltas, and its finish."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] = d.function.name or call["name"]
                call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_a_named_tool_choice_is_a_call_with_schema_valid_arguments(oai, model_id):
    kw = dict(model=model_id, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = oai.chat.completions.create(**kw).choices[0]
    (call,) = whole.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    assert whole.message.content is None and whole.finish_reason == "stop"  # OpenAI's, forced
    content, calls, finish = _streamed_tool_calls(oai.chat.completions.create(**kw, stream=True))
    assert content == "" and finish == "stop"
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert calls[0]["arguments"] == call.function.arguments  # streamed as they were generated


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_choice_calls_one_of_the_tools(oai, model_id, parallel):
    kw = dict(model=model_id, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
              tool_choice="required", parallel_tool_calls=parallel)
    whole = oai.chat.completions.create(**kw).choices[0]
    calls = whole.message.tool_calls
    assert whole.finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
    for c in calls:
        assert c.function.name in {"get_weather", "get_time"}
        if c.function.name == "get_weather":
            jsonschema.validate(json.loads(c.function.arguments), WEATHER_PARAMS)
    content, streamed, finish = _streamed_tool_calls(oai.chat.completions.create(**kw,
                                                                                 stream=True))
    assert finish == "tool_calls" and not content
    assert [(s["name"], s["arguments"]) for s in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in calls]


def test_auto_is_refused_for_a_model_without_a_tool_call_format(http):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 5})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("tool_choice: auto needs")


@pytest.fixture(scope="module")
def hermes_frontdoor(backend, server_loop):
    """A second front door over the same backend, told the model writes Hermes tool calls."""
    from router.frontdoor.lifecycle import serve_frontdoor

    fd = server_loop.run(serve_frontdoor(backend, grpc_port=0, http_port=0, drain_grace_s=5,
                                         tool_call_parser="hermes"))
    yield fd
    server_loop.run(fd.stop(1))


@pytest.fixture(scope="module")
def hermes_oai(hermes_frontdoor):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{hermes_frontdoor.http_port}/v1",
                       api_key="x", max_retries=0, timeout=120) as c:
        yield c


def test_auto_parses_the_models_own_tool_calls(hermes_oai, model_id):
    """The model's output is pinned (a one-string choice) to a Hermes call after some prose:
    the parser, not luck, must turn it into tool_calls, whole and streamed."""
    kw = dict(model=model_id, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
              extra_body={"structured_outputs": {"choice": [FORCED_CALL]}})
    whole = hermes_oai.chat.completions.create(**kw).choices[0]
    assert whole.message.content == "Sure." and whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris", "unit": "celsius"})
    content, calls, finish = _streamed_tool_calls(
        hermes_oai.chat.completions.create(**kw, stream=True))
    assert content.strip() == "Sure." and finish == "tool_calls"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    prose = hermes_oai.chat.completions.create(model=model_id, messages=ASK, tools=TOOLS,
                                               max_tokens=8, temperature=0).choices[0]
    assert prose.message.tool_calls is None and prose.message.content  # no call: plain text
    two = FORCED_CALL + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    for parallel, names in ((True, ["get_weather", "get_time"]), (False, ["get_weather"])):
        out = hermes_oai.chat.completions.create(**{
            **kw, "extra_body": {"structured_outputs": {"choice": [two]}}, "max_tokens": 120,
            "parallel_tool_calls": parallel}).choices[0]
        assert [c.function.name for c in out.message.tool_calls] == names
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    with pytest.raises(openai.BadRequestError, match="tools: strict"):
        hermes_oai.chat.completions.create(model=model_id, messages=ASK, tools=strict,
                                           max_tokens=5)


def test_a_conversation_with_earlier_calls_renders(oai, model_id):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    out = oai.chat.completions.create(model=model_id, messages=history, tools=TOOLS,
                                      tool_choice="none", max_tokens=8, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


@pytest.mark.parametrize("body,field", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "logprobs": True}, "logprobs"),
    ({"tools": TOOLS, "tool_choice": "required", "resumable": True}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools"),
], ids=["unknown-name", "with-response-format", "no-tools", "logprobs", "resumable",
        "duplicate-names", "bad-parameters"])
def test_tool_requests_it_cannot_serve_are_400_naming_the_field(http, body, field):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **body})
    assert_400_naming(r, field)


def test_grpc_tool_calls_with_the_sdk_match_the_http_apis(frontdoor, oai, model_id, kv_probe):
    """The SDK's named / required / none choices: the same calls the OpenAI API returns for
    the same greedy request, the raw output alongside, refusals by field name."""
    named_choice = {"type": "function", "function": {"name": "get_weather"}}
    with Client(f"127.0.0.1:{frontdoor.grpc_port}", retry=NO_RETRY) as c:
        named = c.chat(ASK, tools=TOOLS, tool_choice=named_choice, max_tokens=80, temperature=0)
        (call,) = named.tool_calls
        assert (call.name, named.finish_reason, named.content) == ("get_weather", "stop", None)
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
        assert call.arguments == named.text  # the stream carried the arguments themselves
        http_call = oai.chat.completions.create(
            model=model_id, messages=ASK, tools=TOOLS, tool_choice=named_choice, max_tokens=80,
            temperature=0).choices[0].message.tool_calls[0]
        assert http_call.function.arguments == call.arguments

        required = c.chat(ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                          max_tokens=120, temperature=0)
        assert required.finish_reason == "tool_calls" and len(required.tool_calls) == 1
        assert required.tool_calls[0].name in {"get_weather", "get_time"}

        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
        answer = c.chat(history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
        assert answer.tool_calls is None and answer.text and answer.finish_reason == "length"

        with pytest.raises(InvalidArgument, match="tools: only with a messages prompt"):
            c.generate("x", tools=TOOLS, tool_choice="required", max_tokens=2)
        with pytest.raises(InvalidArgument, match="tool_choice: auto needs"):
            c.chat(ASK, tools=TOOLS, max_tokens=2)
    kv_probe.wait_until_free()


def test_grpc_auto_parses_each_choices_own_calls(hermes_frontdoor):
    """tool_choice auto over gRPC with n=2: the output pinned to a Hermes call after prose,
    each choice's complete carries its parsed call and the prose as content."""
    with Client(f"127.0.0.1:{hermes_frontdoor.grpc_port}", retry=NO_RETRY) as c:
        results = c.choices(messages=ASK, n=2, tools=TOOLS, max_tokens=80, temperature=0,
                            structured={"choice": [FORCED_CALL]})
    for r in results:
        assert (r.text, r.content, r.finish_reason) == (FORCED_CALL, "Sure.", "tool_calls")
        (call,) = r.tool_calls
        assert (call.name, json.loads(call.arguments)) == (
            "get_weather", {"city": "Paris", "unit": "celsius"})
    assert results[0].tool_calls[0].id != results[1].tool_calls[0].id


# A resumed stream against an unbroken run needs the float products:
# tests/integration/frontdoor_fp32/test_frontdoor_float_resume.py.
