"""What the OpenAI door says it does, it does, through the real ``openai`` client on a real
server (both serving modes: the package's one backend each):

- ``user`` is taken on both generation endpoints and lands on every generation's trace
  (``enduser.id`` on the root span, as an operator's collector receives it);
- vLLM's ``add_special_tokens`` on ``/tokenize`` gives the ids the model's tokenizer gives
  with that flag (transformers' own, on the served model and on one whose tokenizer adds a
  BOS, where the flag changes the ids);
- a ``stop_token_ids`` hit leaves the stop token's text out, as vLLM does, unless
  ``include_stop_str_in_output`` (stop strings the same), ``finish_reason`` "stop" both ways;
- every field of OpenAI's request bodies (the documented list and the ``openai`` package's
  schemas) is accepted, or refused with a 400 naming it and giving the reason from the one
  list of fields refused on purpose (``router.frontdoor.openai.refused``)."""

from __future__ import annotations

import inspect
import json
import secrets
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from engine.text.tokenizer import load_tokenizer
from engine.weights.resolve import resolve_model
from router.embedded import EngineBackend
from router.frontdoor.lifecycle import serve_frontdoor
from router.frontdoor.openai.refused import REFUSED_FIELDS
from tests.helpers.async_util import LoopThread
from tests.unit.router.frontdoor.test_door_fields import bos_tokenizer_dir, openai_fields

PROMPT = "The capital of France is"
PARIS = [{"role": "user", "content": "Name three things to see in Paris."}]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_model(None).model_dir))


@pytest.fixture(scope="module")
def tokenizer():
    """The engine's (decodes as a served output does: special tokens skipped, no clean-up)."""
    return load_tokenizer(resolve_model(None).model_dir)


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _roots(otlp, trace_id: str, parent: str, n: int, timeout_s: float = 30.0) -> list:
    """The ``n`` root spans (generations) under the client's span ``parent``."""
    deadline = time.monotonic() + timeout_s
    while True:
        roots = [s for s in otlp.spans(trace_id) if s.parent_id == parent]
        if len(roots) >= n or time.monotonic() > deadline:
            return roots
        time.sleep(0.05)


# ---- user ------------------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["completions", "chat", "stream"])
def test_user_is_on_every_generations_trace(oai, model_id, otlp, endpoint):
    header, trace_id, client_span = _traceparent()
    user = f"end-user-{secrets.token_hex(4)}"
    kw = dict(model=model_id, max_tokens=3, temperature=0, user=user,
              extra_headers={"traceparent": header})
    if endpoint == "chat":
        oai.chat.completions.create(messages=PARIS, **kw)
        n, op = 1, "chat"
    elif endpoint == "stream":
        assert list(oai.chat.completions.create(messages=PARIS, stream=True, **kw))
        n, op = 1, "chat"
    else:  # two choices: two generations, each with its own root span
        oai.completions.create(prompt=PROMPT, n=2, **kw)
        n, op = 2, "text_completion"
    roots = _roots(otlp, trace_id, client_span, n)
    assert [r.name for r in roots] == [f"{op} {model_id}"] * n
    assert [r.attributes.get("enduser.id") for r in roots] == [user] * n


def test_a_request_without_user_records_none(oai, model_id, otlp):
    header, trace_id, client_span = _traceparent()
    oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=2,
                           extra_headers={"traceparent": header})
    (root,) = _roots(otlp, trace_id, client_span, 1)
    assert "enduser.id" not in root.attributes


# ---- /tokenize add_special_tokens ----------------------------------------------------------

def _tokenize(http, **body) -> list[int]:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _expected(hf, prompt=None, messages=None, flag=None) -> list[int]:
    """transformers' ids: a text with its special tokens unless ``flag`` is False; the
    rendered messages without them unless ``flag`` is True (vLLM's defaults)."""
    if prompt is not None:
        return hf(prompt, add_special_tokens=flag is not False).input_ids
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return hf(text, add_special_tokens=bool(flag)).input_ids


def _check_tokenize(http, hf) -> dict:
    got = {}
    for flag in (None, True, False):
        extra = {} if flag is None else {"add_special_tokens": flag}
        got["prompt", flag] = _tokenize(http, prompt=PROMPT, **extra)
        got["messages", flag] = _tokenize(http, messages=PARIS, **extra)
        assert got["prompt", flag] == _expected(hf, prompt=PROMPT, flag=flag)
        assert got["messages", flag] == _expected(hf, messages=PARIS, flag=flag)
    return got


def test_tokenize_add_special_tokens_matches_transformers(http, hf_tokenizer):
    """The served model's tokenizer adds no special token: the flag is taken, and the ids
    are transformers' with it either way."""
    got = _check_tokenize(http, hf_tokenizer)
    assert got["prompt", True] == got["prompt", False]


@pytest.fixture(scope="module")
def bos_http(tmp_path_factory):
    """A front door over the default weights with a tokenizer that adds a BOS (id 1)."""
    from engine import EngineArgs

    src = resolve_model(None).model_dir
    out = bos_tokenizer_dir(src, tmp_path_factory.mktemp("bos-model"))
    for f in src.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    loop = LoopThread()
    backend = EngineBackend(EngineArgs(model=str(out), max_num_seqs=2, num_threads=1,
                                       kv_cache_memory_bytes=64 << 20))
    fd = loop.run(serve_frontdoor(backend, grpc_port=0, http_port=0, drain_grace_s=1))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{fd.http_port}", timeout=60) as c:
            yield c, AutoTokenizer.from_pretrained(str(out))
    finally:
        loop.run(fd.stop(1))
        loop.run(backend.shutdown())
        loop.close()


def test_tokenize_add_special_tokens_adds_or_leaves_out_the_bos(bos_http):
    http, hf = bos_http
    got = _check_tokenize(http, hf)
    assert got["prompt", None] == got["prompt", True] == [1, *got["prompt", False]]
    assert got["messages", None] == got["messages", False]
    assert got["messages", True] == [1, *got["messages", False]]


# ---- stop_token_ids / include_stop_str_in_output ------------------------------------------

# Greedy, EOS ignored: every request below generates the same tokens up to its stop.
GREEDY = dict(max_tokens=12, temperature=0)
NO_EOS = {"ignore_eos": True}


def _ids(logprobs_tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


@pytest.fixture(scope="module")
def greedy(oai, model_id) -> tuple[list[int], str]:
    """The greedy continuation of PROMPT: its token ids and its text."""
    out = oai.completions.create(model=model_id, prompt=PROMPT, logprobs=0, **GREEDY,
                                 extra_body={**NO_EOS, "return_tokens_as_token_ids": True})
    return _ids(out.choices[0].logprobs.tokens), out.choices[0].text


def _stop_at(ids: list[int], tokenizer) -> int:
    """A position whose token appears there first (the stop hits it there), is not special
    and has text of its own."""
    special = set(tokenizer.hf_tokenizer.all_special_ids)
    return next(k for k in range(2, len(ids)) if ids[k] not in ids[:k]
                and ids[k] not in special and tokenizer.decode([ids[k]]).strip())


def test_a_stop_token_is_left_out_of_the_text_unless_included(oai, model_id, greedy,
                                                               tokenizer):
    ids, _ = greedy
    k = _stop_at(ids, tokenizer)
    kw = dict(model=model_id, prompt=PROMPT, **GREEDY)
    for include, want in ((False, ids[:k]), (True, ids[:k + 1])):
        extra = {**NO_EOS, "stop_token_ids": [ids[k]], "include_stop_str_in_output": include}
        out = oai.completions.create(**kw, extra_body=extra)
        (choice,) = out.choices
        assert choice.text == tokenizer.decode(want), (include, ids[k])
        assert choice.finish_reason == "stop"
        assert out.usage.completion_tokens == k + 1  # the stop token was generated
        streamed = "".join(c.choices[0].text for c in oai.completions.create(
            **kw, stream=True, extra_body=extra) if c.choices)
        assert streamed == choice.text
    # Chat: its own greedy tokens, read back as ids through logprobs.
    chat_kw = dict(model=model_id, messages=PARIS, **GREEDY)
    whole = oai.chat.completions.create(**chat_kw, logprobs=True, extra_body={
        **NO_EOS, "return_tokens_as_token_ids": True})
    cids = _ids([e.token for e in whole.choices[0].logprobs.content])
    j = _stop_at(cids, tokenizer)
    cut = oai.chat.completions.create(**chat_kw, extra_body={**NO_EOS,
                                                             "stop_token_ids": [cids[j]]})
    assert cut.choices[0].message.content == tokenizer.decode(cids[:j])
    assert cut.choices[0].finish_reason == "stop"


def test_include_stop_str_in_output_keeps_a_stop_string(oai, model_id, greedy, tokenizer):
    ids, text = greedy
    piece = tokenizer.decode(ids[_stop_at(ids, tokenizer):]).strip()[:3]
    at = text.index(piece)
    for include, want in ((False, text[:at]), (True, text[:at + len(piece)])):
        out = oai.completions.create(model=model_id, prompt=PROMPT, stop=[piece], **GREEDY,
                                     extra_body={**NO_EOS, "include_stop_str_in_output": include})
        assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")


# ---- every field of OpenAI's request bodies ------------------------------------------------

# A valid value of each field (not its default). A field OpenAI adds that is missing here
# fails the walk: give it a value, then honour it or list it as refused on purpose.
VALUES = {
    "audio": {"voice": "alloy", "format": "wav"}, "best_of": 2, "echo": True,
    "frequency_penalty": 0.5, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "logit_bias": {"5": 1.0},
    "logprobs": 2, "max_completion_tokens": 3, "max_tokens": 3, "metadata": {"k": "v"},
    "messages": PARIS, "modalities": ["text"], "moderation": {"enabled": True}, "n": 2,
    "parallel_tool_calls": False, "prediction": {"type": "content", "content": "Paris"},
    "presence_penalty": 0.5, "prompt": PROMPT, "prompt_cache_key": "k",
    "prompt_cache_options": {}, "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "safety_identifier": "s", "seed": 3,
    "service_tier": "auto", "stop": ["\n\n"], "store": True, "stream": True,
    "stream_options": {"include_usage": True}, "suffix": " and more", "temperature": 0.5,
    "tool_choice": "required",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "top_logprobs": 2, "top_p": 0.9, "user": "u", "verbosity": "low", "web_search_options": {},
}
CHAT_VALUES = {"logprobs": True}
# What a field needs beside it to be valid (the default model's chat template has no
# tool-call format, so tools are asked for with "required").
NEEDS = {"top_logprobs": {"logprobs": True}, "tools": {"tool_choice": "required"},
         "tool_choice": {"tools": VALUES["tools"]}, "stream_options": {"stream": True},
         "parallel_tool_calls": {"tools": VALUES["tools"], "tool_choice": "required"}}
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _send(oai, model_id: str, endpoint: str, body: dict) -> str:
    """``body`` through the openai client (its own keyword where it has one): "accepted",
    or the refusal as "400 <param>: <message>"."""
    create = (oai.completions if endpoint == "/v1/completions" else oai.chat.completions).create
    known = set(inspect.signature(create).parameters)
    kw = {k: v for k, v in body.items() if k in known}
    extra = {k: v for k, v in body.items() if k not in known}
    base = {"prompt": PROMPT} if endpoint == "/v1/completions" else {"messages": PARIS}
    try:
        out = create(**{"model": model_id, "max_tokens": 3, **base, **kw}, extra_body=extra)
        if body.get("stream"):
            for _ in out:
                pass
    except openai.BadRequestError as e:
        return f"400 {e.param}: {e.body['message']}"
    return "accepted"


@pytest.mark.parametrize("endpoint", list(ENDPOINTS), ids=list(ENDPOINTS.values()))
def test_every_openai_field_is_accepted_or_refused_on_purpose_by_name(oai, model_id,
                                                                      endpoint):
    refused = REFUSED_FIELDS[endpoint]
    outcomes, expected = {}, {}
    for name in sorted(openai_fields(endpoint)):
        value = model_id if name == "model" else (
            CHAT_VALUES if endpoint != "/v1/completions" else {}).get(name, VALUES[name])
        outcomes[name] = _send(oai, model_id, endpoint, {**NEEDS.get(name, {}), name: value})
        expected[name] = (f"400 {name}: {name}: refused, not ignored: {refused[name]}"
                          if name in refused else "accepted")
    assert outcomes == expected, json.dumps(
        {k: v for k, v in outcomes.items() if v != expected[k]}, indent=1)
