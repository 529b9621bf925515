"""Structured outputs through the front doors, in the embedded engine and through a
disaggregated cluster (the prefill worker samples the first token under the mask, the decode
worker the rest): OpenAI's ``response_format`` (json_object, json_schema) with the real
``openai`` client, vLLM's ``structured_outputs`` (json, regex, choice, grammar) on both
endpoints, streamed and whole, ``n`` choices, gRPC with the SDK; a spec that does not compile
is a 400 / INVALID_ARGUMENT naming the field and the problem."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from client import Client, InvalidArgument

QUESTION = [{"role": "user", "content": "Describe one famous scientist."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40},
                   "born": {"type": "integer", "minimum": 1000, "maximum": 2100},
                   "fields": {"type": "array", "items": {"type": "string", "maxLength": 20},
                              "minItems": 1, "maxItems": 3}},
    "required": ["name", "born", "fields"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "scientist", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def base_url(frontdoor) -> str:
    return f"http://127.0.0.1:{frontdoor.http_port}"


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(backend) -> str:
    return backend.model_info().model_id


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
    assert streamed == choice.message.content
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
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err.get("param") == field or err["message"].startswith(field), err
    assert problem in err["message"]
    kv_probe.wait_until_free()


def test_grpc_structured_output_with_the_sdk(frontdoor):
    with Client(f"127.0.0.1:{frontdoor.grpc_port}") as c:
        res = c.generate(messages=QUESTION, max_tokens=150, temperature=0,
                         structured={"json": SCHEMA})
        jsonschema.validate(json.loads(res.text), SCHEMA)
        assert res.finish_reason == "stop"
        assert c.generate("Pick:", max_tokens=10, temperature=0,
                          structured={"choice": ["red", "blue"]}).text in {"red", "blue"}
        with pytest.raises(InvalidArgument, match="objekt"):
            c.generate("x", max_tokens=2, structured={"json": {"type": "objekt"}})
