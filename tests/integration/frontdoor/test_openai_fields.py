"""Every field of OpenAI's request schemas is honoured or refused with a 400 naming it, never
accepted and ignored; the logit adjustments (logit_bias, penalties, min_p) reach the sampler,
in the embedded engine and through a disaggregated cluster (the prefill worker samples the
first token), over HTTP with the real ``openai`` client and over gRPC with the SDK."""

from __future__ import annotations

import json

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from client import Client, RetryPolicy
from engine.text.tokenizer import load_tokenizer
from engine.weights.resolve import resolve_model
from tests.helpers.http_asserts import assert_400_naming

PROMPT = "The capital of France is"
PARIS = [{"role": "user", "content": "Name three things to see in Paris."}]
# Test clients retry nothing: a retried UNAVAILABLE would hide the refusal under test.
NO_RETRY = RetryPolicy(max_retries=0)

# A value of each OpenAI request field that differs from its default. A field OpenAI adds that
# is missing here fails the walk below: decide whether it is honoured or refused.
VALUES = {
    "audio": {"voice": "alloy", "format": "wav"}, "best_of": 2, "echo": True,
    "frequency_penalty": 0.5, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "logit_bias": {"5": 1.0},
    "logprobs": 2, "max_completion_tokens": 3, "max_tokens": 3, "metadata": {"k": "v"},
    "modalities": ["text"], "moderation": {"enabled": True}, "n": 2,
    "parallel_tool_calls": False, "prediction": {"type": "content", "content": "Paris"},
    "presence_penalty": 0.5, "prompt_cache_key": "k", "prompt_cache_options": {},
    "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "safety_identifier": "s", "seed": 3,
    "service_tier": "auto", "stop": ["\n\n"], "store": True,
    "stream_options": {"include_usage": True}, "suffix": " and more", "temperature": 0.5,
    "tool_choice": "required",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "top_logprobs": 2, "top_p": 0.9, "user": "u", "verbosity": "low", "web_search_options": {},
}
# Fields this server implements, with the value above. Everything else must be a 400.
HONOURED = {"best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens",
            "max_tokens", "n", "parallel_tool_calls", "presence_penalty", "response_format",
            "seed", "stop", "temperature", "tool_choice", "tools", "top_logprobs", "top_p",
            "user"}
# Where an endpoint spells a field's value its own way, and what a field needs beside it.
ENDPOINT_VALUES = {"/v1/chat/completions": {"logprobs": True}}
# (The default model's chat template has no tool-call format, so tool_choice "auto", the
# default once tools are given, is refused: the walk asks for "required".)
NEEDS = {"top_logprobs": {"logprobs": True}, "tools": {"tool_choice": "required"},
         "tool_choice": {"tools": VALUES["tools"]},
         "parallel_tool_calls": {"tools": VALUES["tools"], "tool_choice": "required"}}
BASE = {"/v1/completions": {"prompt": PROMPT, "max_tokens": 3},
        "/v1/chat/completions": {"messages": PARIS, "max_tokens": 3}}
SCHEMAS = {"/v1/completions": completion_create_params.CompletionCreateParamsBase,
           "/v1/chat/completions": chat_create_params.CompletionCreateParamsBase}


def _fields(endpoint: str) -> list[str]:
    return sorted(set(SCHEMAS[endpoint].__annotations__) - {"model", "prompt", "messages"})


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None).model_dir)


@pytest.mark.parametrize("endpoint", list(SCHEMAS))
def test_every_openai_request_field_is_honoured_or_refused_by_name(http, endpoint):
    fields = _fields(endpoint)
    assert {"n", "logit_bias", "stop"} <= set(fields)  # the walk really reads the schema
    outcomes = {}
    for name in fields:
        value = ENDPOINT_VALUES.get(endpoint, {}).get(name, VALUES[name])
        body = {**BASE[endpoint], **NEEDS.get(name, {}), name: value}
        r = http.post(endpoint, json=body)
        if r.status_code == 200:
            outcomes[name] = "honoured"
        else:
            err = r.json()["error"]
            named = err.get("param") == name or err["message"].startswith(name)
            outcomes[name] = f"{r.status_code} naming it" if named else f"{r.status_code}: {err}"
    expected = {n: "honoured" if n in HONOURED else "400 naming it" for n in fields}
    assert outcomes == expected


def test_stream_options_are_honoured_with_a_stream(http):
    body = {**BASE["/v1/completions"], "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200 and '"usage": {' in lines[-1].replace('"usage":{', '"usage": {')


def test_logit_bias_forces_a_token(oai, model_id, tokenizer):
    tok = tokenizer.encode(" Lyon")[-1]
    out = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0,
                                 logit_bias={str(tok): 100})
    assert out.choices[0].text == tokenizer.decode([tok] * 4)


def test_min_p_of_one_keeps_only_the_most_likely_token(oai, model_id):
    greedy = oai.chat.completions.create(model=model_id, messages=PARIS, max_tokens=24,
                                         temperature=0)
    hot = oai.chat.completions.create(model=model_id, messages=PARIS, max_tokens=24,
                                      temperature=1.5, seed=11, extra_body={"min_p": 1.0})
    assert hot.choices[0].message.content == greedy.choices[0].message.content


def test_penalties_change_a_repetitive_answer(oai, model_id, tokenizer):
    def ids(**kw) -> list[int]:
        out = oai.chat.completions.create(model=model_id, messages=PARIS, max_tokens=48,
                                          temperature=0, **kw)
        return tokenizer.encode(out.choices[0].message.content)

    plain = ids()
    assert len(plain) > len(set(plain))  # greedy repeats itself: there is something to penalize
    assert ids(frequency_penalty=2.0) != plain
    assert ids(presence_penalty=2.0) != plain
    assert ids(extra_body={"repetition_penalty": 2.0}) != plain


def test_bad_adjustments_are_400_naming_the_field(http):
    for body, field in [({"presence_penalty": 3}, "presence_penalty"),
                        ({"logit_bias": {"999999999": 1}}, "logit_bias"),
                        ({"logit_bias": {"7": 500}}, "logit_bias"),
                        ({"min_p": -0.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty")]:
        r = http.post("/v1/completions", json={**BASE["/v1/completions"], **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"].startswith(field), (body, r.text)


def test_grpc_sdk_carries_the_logit_adjustments(frontdoor, tokenizer):
    tok = tokenizer.encode(" Lyon")[-1]
    with Client(f"127.0.0.1:{frontdoor.grpc_port}", retry=NO_RETRY) as c:
        forced = c.generate(PROMPT, max_tokens=3, temperature=0, logit_bias={tok: 100.0})
        assert forced.token_ids == [tok] * 3
        plain = c.generate(PROMPT, max_tokens=24, temperature=0)
        hot = c.generate(PROMPT, max_tokens=24, temperature=1.5, seed=3, min_p=1.0)
        assert hot.token_ids == plain.token_ids
        penalized = c.generate(PROMPT, max_tokens=24, temperature=0, repetition_penalty=3.0,
                               frequency_penalty=1.0, presence_penalty=1.0)
        assert penalized.token_ids != plain.token_ids


def test_tokenize_counts_what_a_generation_runs_on_and_detokenize_inverts_it(http, oai, model_id,
                                                                            tokenizer):
    text = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert text["tokens"] == tokenizer.encode(PROMPT) and text["count"] == len(text["tokens"])
    assert text["max_model_len"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    back = http.post("/detokenize", json={"tokens": text["tokens"], "model": model_id}).json()
    assert back == {"prompt": tokenizer.decode(text["tokens"], skip_special_tokens=False)}
    chat = http.post("/tokenize", json={"messages": PARIS}).json()
    used = oai.chat.completions.create(model=model_id, messages=PARIS, max_tokens=1).usage
    assert chat["count"] == used.prompt_tokens


@pytest.mark.parametrize("path,body,status,field", [
    ("/tokenize", {"prompt": PROMPT, "messages": PARIS}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"prompt": PROMPT, "return_token_strs": True}, 400, "return_token_strs"),
    ("/tokenize", {"prompt": PROMPT, "model": "other"}, 404, None),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
], ids=["both", "neither", "empty", "unsupported-flag", "other-model", "outside-vocab", "not-ids"])
def test_bad_tokenize_requests(http, path, body, status, field):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    if field is not None:
        err = r.json()["error"]
        assert err.get("param") == field or err["message"].startswith(field), err


def test_continuous_usage_stats_count_every_chunk(http):
    body = {**BASE["/v1/completions"], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        payloads = [json.loads(line[6:]) for line in r.iter_lines()
                    if line.startswith("data: {")]
    usage = [p["usage"] for p in payloads]
    prompt = usage[-1]["prompt_tokens"]
    assert prompt > 0 and all(u["prompt_tokens"] == prompt for u in usage)
    counts = [u["completion_tokens"] for u in usage]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usage)
    r = http.post("/v1/completions", json={**body, "stream_options": {
        "continuous_usage_stats": True}})
    assert r.status_code == 400 and "continuous_usage_stats" in r.json()["error"]["message"]


# ---- several choices: n, and a batch of prompts -------------------------------------------
# (Their tokens against each request alone, best_of's reruns and the logprobs against
# transformers need the float products: tests/integration/frontdoor_fp32/test_frontdoor_float_products.py.)

def _complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"max_tokens": 6, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_n_choices_share_the_prompts_kv_instead_of_computing_it_n_times(http, backend,
                                                                        server_loop, tokenizer):
    prompt = " ".join(f"item {i} is on shelf {i * 7 % 13};" for i in range(40))
    prompt_tokens = len(tokenizer.encode(prompt))
    before = server_loop.run(backend.stats())
    _complete(http, prompt=prompt, temperature=0, n=4, max_tokens=2)
    after = server_loop.run(backend.stats())
    computed = after.prefill_computed_tokens - before.prefill_computed_tokens
    assert prompt_tokens < computed < 1.5 * prompt_tokens  # once, plus three partial blocks


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_bad_prompt_in_a_batch_fails_the_whole_request_and_frees_everything(http, kv_probe,
                                                                              stream):
    # The good prompt's choice is being reserved on a decode worker when the bad one fails
    # the request; the abort must not overtake that reserve (it once did, and the reservation
    # sat until its lease ran out). Several rounds, each well under the lease.
    for i in range(8):
        r = http.post("/v1/completions", json={"prompt": [[5, 6, 7 + i], [1, 10**9]], "n": 2,
                                               "max_tokens": 4, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt"), r.text
        kv_probe.wait_until_free(timeout_s=5)


@pytest.mark.parametrize("body,field", [
    ({"n": 65}, "n"), ({"n": 8, "prompt": [PROMPT] * 9}, "n"), ({"n": 2, "resumable": True},
                                                                "resumable"),
], ids=["n-too-many", "choices-too-many", "resumable"])
def test_choice_limits_are_400_naming_the_field(http, body, field):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **body})
    assert_400_naming(r, field)


# ---- logprobs ------------------------------------------------------------------------------

def test_chat_logprobs_through_the_openai_client_streamed_and_not(oai, model_id):
    kw = dict(model=model_id, messages=PARIS, max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=2)
    whole = oai.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert len(content) == 6 and "".join(e.token for e in content) == whole.message.content
    for e in content:
        assert e.bytes == list(e.token.encode("utf-8", errors="replace"))
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token  # greedy
        assert e.top_logprobs[0].logprob == e.logprob >= e.top_logprobs[1].logprob
    streamed = []
    for chunk in oai.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(streamed, content, strict=True))
    plain = oai.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("endpoint,body,field", [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": 1, "resumable": True}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
], ids=["too-many", "resumable", "top-without-logprobs", "top-too-many"])
def test_logprobs_it_cannot_serve_are_400_naming_the_field(http, endpoint, body, field):
    r = http.post(endpoint, json={**BASE[endpoint], **body})
    assert_400_naming(r, field)


@pytest.mark.parametrize("body,field", [
    ({"best_of": 1, "n": 2}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
    ({"best_of": 65}, "best_of"), ({"best_of": 33, "prompt": [PROMPT, PROMPT]}, "best_of"),
], ids=["below-n", "stream", "too-many", "too-many-prompts"])
def test_best_of_it_cannot_serve_is_400_naming_it(http, body, field):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **body})
    assert_400_naming(r, field)
