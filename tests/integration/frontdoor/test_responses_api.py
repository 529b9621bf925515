"""``/v1/responses`` through the real ``openai`` client over both backends: a text input and
message items; the streamed events in OpenAI's order with their sequence numbers, adding up to
the whole response; function tools (a required call) and a json_schema ``text.format``;
``previous_response_id`` continuing a stored conversation, ``store: false`` leaving nothing to
continue, another tenant's id and an unknown one 404; fields not served refused by name."""

from __future__ import annotations

import json

import openai
import pytest

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def test_a_text_input_gets_a_message_item(oai, model_id, kv_probe):
    r = oai.responses.create(model=model_id, input="Say hello.", max_output_tokens=8,
                             temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.id.startswith("resp_") and r.model == model_id
    msg = r.output[-1]
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "output_text" and r.output_text == msg.content[0].text
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens > 0
    kv_probe.wait_until_free()


def test_streamed_events_come_in_openais_order_and_add_up(oai, model_id):
    events = list(oai.responses.create(model=model_id, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Count to three."}]}],
        max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", kinds[-1]]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == next(
        e.text for e in events if e.type == "response.output_text.done")


def test_a_required_tool_call_and_a_json_schema_format(oai, model_id):
    r = oai.responses.create(model=model_id, input="Weather in Paris?", tools=[WEATHER],
                             tool_choice="required", max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
              "required": ["answer"], "additionalProperties": False}
    r = oai.responses.create(model=model_id, input="Answer in JSON.", temperature=0,
                             max_output_tokens=60, text={"format": {
                                 "type": "json_schema", "name": "a", "schema": schema,
                                 "strict": True}})
    assert set(json.loads(r.output_text)) == {"answer"}


def test_previous_response_id_continues_and_store_false_keeps_nothing(oai, model_id, http):
    first = oai.responses.create(model=model_id, input="My name is Ada.", max_output_tokens=4,
                                 temperature=0)
    second = oai.responses.create(model=model_id, input="What is my name?",
                                  previous_response_id=first.id, max_output_tokens=4,
                                  temperature=0)
    # the conversation grew by the first turn: its prompt holds the first input and output
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    assert oai.responses.retrieve(first.id).id == first.id
    unstored = oai.responses.create(model=model_id, input="x", max_output_tokens=2,
                                    store=False)
    for rid in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError, match="no response"):
            oai.responses.create(model=model_id, input="y", previous_response_id=rid,
                                 max_output_tokens=2)
    r = http.get(f"/v1/responses/{unstored.id}")
    assert r.status_code == 404


@pytest.mark.parametrize(("field", "value"), [
    ("metadata", {"a": "b"}), ("reasoning", {"effort": "low"}), ("truncation", "auto"),
    ("background", True)])
def test_fields_not_served_are_refused_by_name(http, field, value):
    r = http.post("/v1/responses", json={"input": "x", field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_another_tenants_stored_response_is_not_found(backend, server_loop, tmp_path):
    """With API keys a stored response is its tenant's: team-b's retrieval, and its
    previous_response_id, of team-a's id are 404; team-a's are served."""
    import httpx

    from router.frontdoor.lifecycle import serve_frontdoor
    from router.frontdoor.security import Gate, SecurityConfig

    keys = tmp_path / "keys"
    keys.write_text("team-a:sk-team-a-0123456789abcdef\nteam-b:sk-team-b-0123456789abcdef\n")
    fd = server_loop.run(serve_frontdoor(backend, grpc_port=0, http_port=0, drain_grace_s=1,
                                         gate=Gate.from_config(SecurityConfig(str(keys)))))
    try:
        url = f"http://127.0.0.1:{fd.http_port}"
        with httpx.Client(base_url=url, timeout=60, headers={
                "Authorization": "Bearer sk-team-a-0123456789abcdef"}) as a, \
                httpx.Client(base_url=url, timeout=60, headers={
                    "Authorization": "Bearer sk-team-b-0123456789abcdef"}) as b:
            r = a.post("/v1/responses", json={"input": "Hello.", "max_output_tokens": 2})
            assert r.status_code == 200, r.text
            rid = r.json()["id"]
            assert a.get(f"/v1/responses/{rid}").json()["id"] == rid
            assert b.get(f"/v1/responses/{rid}").status_code == 404
            cont = {"input": "Again.", "previous_response_id": rid, "max_output_tokens": 2}
            assert b.post("/v1/responses", json=cont).status_code == 404
            assert a.post("/v1/responses", json=cont).status_code == 200
    finally:
        server_loop.run(fd.stop(1))
