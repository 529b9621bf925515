"""No 5xx from any request a client can send: random combinations of every sampling field
the HTTP door accepts (router.frontdoor.openai.schema), each from its range's edges, the
degenerate floats (5e-324, 1e308, -0.0, ...) and a little past them, with each
``response_format`` (none, text, json_object, json_schema), on /v1/completions and
/v1/chat/completions, streamed or not. Every answer is a 200 or a 400; a 400 names a field the
request set; a 200 has finished choices, no error event in its stream, and under a JSON format
text that is JSON so far (a whole document, valid against the schema, when the grammar ended
it). Afterwards no KV block is held. Over both of the package's backends (conftest.py).

The bug that started this: ``{"prompt": "0", "max_tokens": 8, "temperature": 0,
"repetition_penalty": 5e-324, "response_format": {"type": "json_object"}}`` answered 500 (a
masked logit times 0 in fp32 made nan, which argmax chose;
tests/unit/engine/executor/test_grammar_authority.py).
"""

from __future__ import annotations

import json
import re
import zlib

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from engine.contract import (
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
)
from tests.helpers.sse import sse_events_with_ids

pytestmark = pytest.mark.slow

MAX_TOKENS = 8  # every request: an example costs a few decode steps
VOCAB = 49152  # the default model's (SmolLM2); asserted against the server below
EOS = 2
SMALL_SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "string", "enum": ["yes", "no"]},
]
FORMATS = [None, {"type": "text"}, {"type": "json_object"},
           *({"type": "json_schema", "json_schema": {"name": "small", "schema": s}}
             for s in SMALL_SCHEMAS),
           {"type": "json_schema",
            "json_schema": {"name": "small", "schema": SMALL_SCHEMAS[0], "strict": True}}]
PROMPTS = ["0", "Hello", '{"', "Name a colour:"]
# Completions also take token ids: EOS, the vocabulary's last id and one past it (a 400).
TOKEN_PROMPTS = [[EOS], [VOCAB - 1, 0], [VOCAB]]


# ---- values: mostly inside each field's range (a generation runs), 1 in 8 outside -----------
def _mostly(valid, invalid):
    # Shrinks toward 0: a minimal failing example keeps valid values where it can.
    return st.integers(0, 7).flatmap(lambda i: invalid if i == 7 else valid)


def _edges(*values):
    return st.sampled_from(values)


_TINY = (0.0, -0.0, 5e-324, 1e-320, 1e-45, 1.2e-38, 1e-7)
_ANY_FLOAT = st.floats(allow_nan=False, allow_infinity=False)  # JSON has neither
_PAST = _edges(-5e-324, -1e-7, -1.0, 1e308, -1e308, 1.7976931348623157e308) | _ANY_FLOAT

# The default model's ids of what the JSON grammars start or end with, and "0" (the prompt of
# the known bug): a bias against them or a stop on them meets the grammar's mask head on.
JSON_TOKENS = {"{": 107, "}": 109, '"': 18, '{"': 39428, '":': 1799, "yes": 10407, "no": 4607,
               "0": 32}
_TOKEN_IDS = (_edges(0, 1, EOS, VOCAB - 1, *JSON_TOKENS.values())
              | st.integers(0, VOCAB - 1))
_BAD_TOKEN_IDS = _edges(-1, VOCAB, VOCAB + 1, 2**31, 2**64)
_STOP = _edges("\n", ".", "}", '"', "e", "yes", "a" * MAX_STOP_STRING_CHARS)

VALUES = {
    "temperature": _mostly(_edges(*_TINY, 0.5, 1.0, 2.0, MAX_TEMPERATURE)
                           | st.floats(0, MAX_TEMPERATURE),
                           _edges(MAX_TEMPERATURE + 1e-9, 1e308) | _PAST),
    "top_p": _mostly(_edges(5e-324, 1e-45, 1e-7, 0.1, 0.9, 1.0) | st.floats(0, 1, exclude_min=True),
                     _edges(0.0, -0.0, 1.0000001) | _PAST),
    "top_k": _mostly(_edges(-1, 0, 1, 2, 50, VOCAB - 1, VOCAB, VOCAB + 1, 2**31, 2**63),
                     _edges(-2, -2**63, 2**64)),
    "min_p": _mostly(_edges(*_TINY, 0.05, 0.5, 1.0) | st.floats(0, 1),
                     _edges(1.0000001) | _PAST),
    "repetition_penalty": _mostly(_edges(5e-324, 1e-320, 1e-45, 1e-7, 0.5, 1.0, 1.3, 1e10, 1e38,
                                         3.5e38, 1e308, 1.7976931348623157e308)
                                  | st.floats(0, 1e308, exclude_min=True),
                                  _edges(0.0, -0.0) | _PAST),
    **{name: _mostly(_edges(*_TINY, -5e-324, -2.0, -1.0, 1.0, 2.0) | st.floats(-2, 2),
                     _edges(2.0000001, -2.0000001) | _PAST)
       for name in ("presence_penalty", "frequency_penalty")},
    "logit_bias": _mostly(
        st.dictionaries(_TOKEN_IDS.map(str),
                        _edges(-100.0, 100.0, 5e-324, -5e-324, 0.0, 1e-7) | st.floats(-100, 100),
                        min_size=1, max_size=4),
        st.dictionaries(_BAD_TOKEN_IDS.map(str) | _edges("x", "-1", "1.5", ""),
                        _edges(100.0000001, -1e308) | _ANY_FLOAT, min_size=1, max_size=2)),
    "seed": _mostly(_edges(0, 1, MAX_SEED) | st.integers(0, MAX_SEED),
                    _edges(-1, MAX_SEED + 1, 2**64)),
    "n": _mostly(st.integers(1, 3), _edges(0, -1, 65)),
    "min_tokens": _mostly(st.integers(0, MAX_TOKENS), _edges(-1, MAX_TOKENS + 1, 2**63)),
    "stop": _mostly(_STOP | st.lists(_STOP, min_size=1, max_size=MAX_STOP_STRINGS),
                    _edges("", "a" * (MAX_STOP_STRING_CHARS + 1), ["."] * (MAX_STOP_STRINGS + 1),
                           [""])),
    "stop_token_ids": _mostly(st.lists(_TOKEN_IDS, max_size=4)
                              | st.just(list(range(MAX_STOP_TOKEN_IDS))),
                              st.lists(_BAD_TOKEN_IDS, min_size=1, max_size=2)
                              | st.just(list(range(MAX_STOP_TOKEN_IDS + 1)))),
    "logprobs": _mostly(st.integers(0, MAX_LOGPROBS), _edges(-1, MAX_LOGPROBS + 1)),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
    "echo": st.booleans(),  # completions only
    "best_of": _mostly(st.integers(1, 4), _edges(0, 65)),  # completions only
    "user": st.text(max_size=8),
}
_STREAM_OPTIONS = st.fixed_dictionaries({}, optional={
    "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()})
_CHAT_ONLY_NOT = ("echo", "best_of")


@st.composite
def bodies(draw):
    """A /v1/completions body (the chat one is made from it: ``as_chat``): a prompt, 1..8
    tokens, a response format and any of the sampling fields."""
    body = {"prompt": draw(st.sampled_from(PROMPTS + TOKEN_PROMPTS)),
            "max_tokens": draw(_mostly(st.integers(1, MAX_TOKENS), _edges(0, -1)))}
    fmt = draw(st.sampled_from(FORMATS))
    if fmt is not None:
        body["response_format"] = fmt
    names = draw(st.lists(st.sampled_from(sorted(VALUES)), min_size=2, max_size=9,
                          unique=True))
    body.update({name: draw(VALUES[name]) for name in names})
    stream = draw(st.sampled_from([None, False, True]))
    if stream is not None:
        body["stream"] = stream
    # stream_options: half the streams; 1 in 8 of the others (a 400 naming it).
    if draw(st.booleans() if stream else st.integers(0, 7).map(lambda i: i == 7)):
        body["stream_options"] = draw(_STREAM_OPTIONS)
    return body


def as_chat(body: dict, max_completion_tokens: bool) -> dict:
    """The chat request of a completions ``body``: the prompt as one user message, logprobs
    as chat spells them (``logprobs: true`` + ``top_logprobs``), the max under either name."""
    chat = {k: v for k, v in body.items() if k not in ("prompt", *_CHAT_ONLY_NOT)}
    prompt = body["prompt"]
    chat["messages"] = [{"role": "user", "content": prompt if isinstance(prompt, str)
                         else json.dumps(prompt)}]
    if "logprobs" in chat:
        chat["top_logprobs"] = chat.pop("logprobs")
        chat["logprobs"] = True
    if max_completion_tokens:
        chat["max_completion_tokens"] = chat.pop("max_tokens")
    return chat


# ---- what a client checks -------------------------------------------------------------------
class _Ended(Exception):
    """The text ended inside a JSON value: it is a prefix so far."""


_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


def json_prefix(text: str) -> bool:
    """Whether ``text`` is the start of some JSON document (a whole one included): what a
    grammar-constrained generation cut short by ``max_tokens`` or a stop must be. A
    recursive-descent reader that accepts running out of text anywhere."""
    pos = 0

    def ws() -> None:
        nonlocal pos
        while pos < len(text) and text[pos] in " \t\n\r":
            pos += 1

    def peek() -> str:
        if pos >= len(text):
            raise _Ended
        return text[pos]

    def value() -> None:
        nonlocal pos
        ws()
        c = peek()
        if c == "{":
            pos += 1
            ws()
            if peek() == "}":
                pos += 1
                return
            while True:
                ws()
                if peek() != '"':
                    raise ValueError(f"key expected at {pos}")
                string()
                ws()
                if peek() != ":":
                    raise ValueError(f"':' expected at {pos}")
                pos += 1
                value()
                ws()
                if peek() == "}":
                    pos += 1
                    return
                if peek() != ",":
                    raise ValueError(f"',' or '}}' expected at {pos}")
                pos += 1
        elif c == "[":
            pos += 1
            ws()
            if peek() == "]":
                pos += 1
                return
            while True:
                value()
                ws()
                if peek() == "]":
                    pos += 1
                    return
                if peek() != ",":
                    raise ValueError(f"',' or ']' expected at {pos}")
                pos += 1
        elif c == '"':
            string()
        elif c in "tfn":
            word = {"t": "true", "f": "false", "n": "null"}[c]
            got = text[pos:pos + len(word)]
            if not word.startswith(got):
                raise ValueError(f"{word} expected at {pos}")
            pos += len(got)
            if len(got) < len(word):
                raise _Ended
        else:
            end = pos
            while end < len(text) and text[end] in "+-0123456789.eE":
                end += 1
            num = text[pos:end]
            # At the end of the text a number may go on: a prefix of one is fine.
            if end == len(text) and num and (_NUMBER.fullmatch(num)
                                             or _NUMBER.fullmatch(num + "0")):
                raise _Ended
            if not _NUMBER.fullmatch(num):
                raise ValueError(f"value expected at {pos}")
            pos = end

    def string() -> None:
        nonlocal pos
        pos += 1  # the opening quote
        while True:
            c = peek()
            pos += 1
            if c == '"':
                return
            if c == "\\":
                e = peek()
                pos += 1
                if e == "u":
                    hex4 = text[pos:pos + 4]
                    if not re.fullmatch(r"[0-9a-fA-F]*", hex4):
                        raise ValueError(f"bad \\u escape at {pos}")
                    pos += len(hex4)
                    if len(hex4) < 4:
                        raise _Ended
                elif e not in '"\\/bfnrt':
                    raise ValueError(f"bad escape at {pos}")
            elif ord(c) < 0x20:
                raise ValueError(f"control character in a string at {pos}")

    try:
        value()
        ws()
    except _Ended:
        return True
    except ValueError:
        return False
    return pos == len(text)


def test_json_prefix_reader():
    """The reader the property relies on: prefixes in, anything that cannot go on out."""
    doc = '{"ok": [true, -1.5e+3, "a\\u00e9\\n", null, {}], "x": false}'
    assert all(json_prefix(doc[:i]) for i in range(len(doc) + 1))
    for bad in ('{"ok" 1', "{,", "[1,]", "tx", '"\x01"', "01", "{} x", '{"a":1}}', "-a",
                '"\\q"', "1.e5"):
        assert not json_prefix(bad), bad


def _named(err: dict) -> str:
    """The field a 400 names: its ``param``'s first part, else its message's first word."""
    param = err.get("param") or ""
    return re.split(r"[.\[ ]", param)[0] if param else re.match(r"\w*", err["message"])[0]


def _choices_of_stream(r) -> tuple[dict[int, str], dict[int, str | None]]:
    """Each choice's text and finish reason from a 200 SSE response; no event is an error."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    events = sse_events_with_ids(r.iter_lines())
    assert events and events[-1][1] == "[DONE]", events[-3:]
    for _, data in events[:-1]:
        chunk = json.loads(data)
        assert "error" not in chunk, chunk  # what a fault after the 200 becomes
        for c in chunk["choices"]:
            piece = c["text"] if "text" in c else (c["delta"].get("content") or "")
            texts[c["index"]] = texts.get(c["index"], "") + piece
            if c["finish_reason"] is not None:
                reasons[c["index"]] = c["finish_reason"]
    return texts, reasons


def _check_json(text: str, reason: str | None, body: dict) -> str:
    """A choice under a JSON format: JSON so far; a whole document matching the schema when
    the grammar ended it ("stop" with no stop string or stop token that could have cut it).
    Returns what the check could say: "whole" or "prefix"."""
    fmt = body["response_format"]
    assert json_prefix(text), (text, reason)
    if reason == "stop" and not body.get("stop") and not body.get("stop_token_ids"):
        value = json.loads(text)
        if fmt["type"] == "json_schema":
            jsonschema.validate(value, fmt["json_schema"]["schema"])
        else:
            assert isinstance(value, dict), value
        return "whole"
    return "prefix"


def _check_answer(r, body: dict, seen: dict, detokenize) -> None:
    assert r.status_code < 500, (r.status_code, r.read().decode(errors="replace"), body)
    if r.status_code != 200:
        r.read()
        assert r.status_code == 400, (r.status_code, r.text, body)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error", err
        assert _named(err) in body, (err, body)  # the field at fault is one the request set
        seen["400"] = seen.get("400", 0) + 1
        return
    n = body.get("n", 1)
    if body.get("stream"):
        texts, reasons = _choices_of_stream(r)
    else:
        r.read()
        out = r.json()
        texts = {c["index"]: c["text"] if "text" in c else c["message"]["content"] or ""
                 for c in out["choices"]}
        reasons = {c["index"]: c["finish_reason"] for c in out["choices"]}
        generations = body.get("best_of") or n
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        assert out["usage"]["completion_tokens"] <= generations * max_tokens, out["usage"]
    assert sorted(reasons) == list(range(n)), (reasons, body)
    assert set(reasons.values()) <= {"stop", "length"}, reasons
    seen["200"] = seen.get("200", 0) + 1
    fmt = body.get("response_format")
    if fmt is None or fmt["type"] == "text":
        return
    for i, text in texts.items():
        if body.get("echo"):  # the choice's text starts with the prompt's
            prompt = body["prompt"]
            echoed = prompt if isinstance(prompt, str) else detokenize(prompt)
            assert text.startswith(echoed), (text, body)
            text = text[len(echoed):]
        kind = _check_json(text, reasons[i], body)
        seen[kind] = seen.get(kind, 0) + 1


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_no_request_gets_a_5xx(http, backend, kv_probe, endpoint, request):
    """The property over 15 bodies per endpoint and backend, 60 in all. Both of the
    package's backends: the door's checks are shared, but the sampling runs in the engine or
    in the cluster's prefill and decode workers; both already run for the package, so each
    costs only its examples (~0.25 s each). Seeded per test: the four draw different bodies,
    the same every run. The known 500 and a few corners come first. Then nothing is held,
    both outcomes and a whole JSON document were seen (the checks ran, not only the
    refusals), and the backend still serves."""
    assert backend.model_info().vocab_size == VOCAB
    assert backend.model_info().eos_token_ids == (EOS,)
    assert {t: http.post("/tokenize", json={"prompt": t, "add_special_tokens": False}).json()[
        "tokens"] for t in JSON_TOKENS} == {t: [i] for t, i in JSON_TOKENS.items()}

    def detokenize(ids: list[int]) -> str:
        return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]

    chat = endpoint.endswith("chat/completions")
    seen: dict[str, int] = {}

    @seed(zlib.crc32(request.node.name.encode()))
    @settings(max_examples=15, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=bodies(), mct=st.booleans())
    # The bug this property found first: a 500.
    @example(body={"prompt": "0", "max_tokens": 8, "temperature": 0,
                   "repetition_penalty": 5e-324, "response_format": {"type": "json_object"}},
             mct=False)
    # The grammar is done (the enum's word) before min_tokens, with EOS ignored: it ends.
    @example(body={"prompt": "0", "max_tokens": 8, "temperature": 0, "min_tokens": 8,
                   "ignore_eos": True, "response_format": FORMATS[4]}, mct=True)
    # Bias for EOS (the grammar bans it until done) and against '"' (the object's key needs
    # it), at a subnormal temperature, two streamed choices.
    @example(body={"prompt": "Hello", "max_tokens": 8, "temperature": 1e-45, "seed": 0,
                   "logit_bias": {str(EOS): 100.0, str(JSON_TOKENS['"']): -100.0}, "n": 2,
                   "stream": True, "response_format": FORMATS[3]}, mct=False)
    # Found by this property: echo decoded a token-id prompt before it was checked, and the
    # 400 named /detokenize's "tokens", a field the request does not have.
    @example(body={"prompt": [VOCAB], "max_tokens": 1, "echo": True}, mct=False)
    def one(body, mct):
        sent = as_chat(body, mct) if chat else body
        with http.stream("POST", endpoint, json=sent) as r:
            _check_answer(r, sent, seen, detokenize)

    one()
    kv_probe.wait_until_free()
    assert seen.get("200") and seen.get("400") and seen.get("whole"), seen
    ok = http.post(endpoint, json=as_chat({"prompt": "Hello", "max_tokens": 2}, False) if chat
                   else {"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200, ok.text  # the engine still serves
