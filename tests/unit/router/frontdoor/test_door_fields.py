"""The OpenAI door's request fields, read without a server: every field of OpenAI's request
bodies (the ``openai`` package's own schemas, and the documented list) is declared by our
request models or refused on purpose (``router.frontdoor.openai.refused``, each named in
docs/api.md), never both; ``user`` reaches every generation a request makes; and
``add_special_tokens`` (vLLM's /tokenize flag) changes the ids where the tokenizer adds
special tokens. Pure: schemas, the tokenizer and the input processor only."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import ValidationError

from engine.text.input_processor import InputProcessor
from engine.text.tokenizer import Tokenizer
from engine.weights.resolve import resolve_model
from router.frontdoor.openai.refused import REFUSED_FIELDS, refusal
from router.frontdoor.openai.schema import (
    MAX_USER_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)

DOCS = Path(__file__).resolve().parents[4] / "docs" / "api.md"

# OpenAI's documented request bodies (API reference), beside what the installed package's
# schemas list: a field either source names must be honoured or refused on purpose.
DOCUMENTED = {
    "/v1/completions": {
        "model", "prompt", "suffix", "max_tokens", "temperature", "top_p", "n", "stream",
        "stream_options", "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty",
        "best_of", "logit_bias", "user", "seed"},
    "/v1/chat/completions": {
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
        "stream", "stream_options", "stop", "presence_penalty", "frequency_penalty",
        "logit_bias", "logprobs", "top_logprobs", "user", "seed", "response_format", "tools",
        "tool_choice", "parallel_tool_calls", "service_tier", "store", "metadata",
        "modalities", "prediction", "audio", "reasoning_effort", "web_search_options"},
}
SCHEMAS = {"/v1/completions": completion_create_params.CompletionCreateParamsBase,
           "/v1/chat/completions": chat_create_params.CompletionCreateParamsBase}
MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def openai_fields(endpoint: str) -> set[str]:
    """Every request field of ``endpoint`` OpenAI documents or its package declares."""
    return DOCUMENTED[endpoint] | set(SCHEMAS[endpoint].__annotations__) | {"stream"}


def _declared(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


@pytest.mark.parametrize("endpoint", list(MODELS))
def test_every_openai_field_is_declared_or_refused_on_purpose_never_both(endpoint):
    fields = openai_fields(endpoint)
    declared, refused = _declared(MODELS[endpoint]), set(REFUSED_FIELDS[endpoint])
    assert {"user", "seed", "stop"} <= fields  # the walk really reads the schemas
    assert fields - declared - refused == set(), "refused by accident: honour or list them"
    assert declared & refused == set(), "listed as refused but declared"
    assert refused <= fields  # the list names OpenAI's fields, nothing else
    assert "user" in declared


def test_every_field_refused_on_purpose_is_documented_as_refused_with_its_reason():
    docs = DOCS.read_text()
    rows = [line for line in docs.splitlines() if line.startswith("| ") and "refused" in line]
    for endpoint, fields in REFUSED_FIELDS.items():
        for name, why in fields.items():
            assert why and refusal(endpoint, name) == why
            assert any(re.search(rf"`{name}`", row) for row in rows), (
                f"{name} ({endpoint}) is refused but docs/api.md lists it in no refused row")
    assert refusal("/v1/completions", "user") is None


def test_user_reaches_every_generation_of_a_request():
    inputs = CompletionRequest(prompt=["a", "b"], n=2, user="alice").to_inputs("rid")
    assert len(inputs) == 4 and {i.user for i in inputs} == {"alice"}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                 user="bob")
    assert [i.user for i in chat.to_inputs("rid", 64, lambda m, tools=None: [1])] == ["bob"]
    assert CompletionRequest(prompt="a").to_inputs("rid")[0].user is None
    with pytest.raises(ValidationError, match="user"):
        CompletionRequest(prompt="a", user="u" * (MAX_USER_CHARS + 1))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # Same cache path as test_tokenizer.py, so the default model is converted once per session.
    cache: Path = tmp_path_factory.getbasetemp() / "pdcluster-model-cache"
    return resolve_model(None, cache_dir=cache).model_dir


def bos_tokenizer_dir(model_dir: Path, out: Path) -> Path:
    """The default model's tokenizer files, its tokenizer made to add a BOS (id 1) to every
    text as Llama's does: SmolLM2's adds no special token, so the flag would change nothing."""
    for name in ("tokenizer_config.json", "chat_template.jinja", "config.json",
                 "generation_config.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    bos, seq = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {
        "Sequence": {"id": "A", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing", "single": [bos, seq],
        "pair": [bos, seq, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                            "tokens": ["<|im_start|>"]}}}
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def test_add_special_tokens_is_what_the_tokenizer_adds_or_not(model_dir, tmp_path):
    tok = Tokenizer.from_dir(bos_tokenizer_dir(model_dir, tmp_path))
    inputs = InputProcessor(tok, tok.vocab_size, 2048)
    plain = tok.encode("Paris", add_special_tokens=False)
    assert inputs.encode("Paris").token_ids == [1, *plain]  # a generation's default
    assert inputs.encode("Paris", add_special_tokens=True).token_ids == [1, *plain]
    assert inputs.encode("Paris", add_special_tokens=False).token_ids == plain
    msgs = [{"role": "user", "content": "Paris"}]
    templated = inputs.encode(msgs).token_ids  # the template's own <|im_start|>, no more
    assert templated[0] == 1 and templated[1] != 1
    assert inputs.encode(msgs, add_special_tokens=False).token_ids == templated
    assert inputs.encode(msgs, add_special_tokens=True).token_ids == [1, *templated]


def test_tokenize_takes_add_special_tokens_and_nothing_else_new():
    assert TokenizeRequest(prompt="a", add_special_tokens=False).add_special_tokens is False
    assert TokenizeRequest(prompt="a").add_special_tokens is None
    with pytest.raises(ValidationError, match="return_token_strs"):
        TokenizeRequest(prompt="a", return_token_strs=True)


def test_the_recent_requests_log_names_the_user():
    """``user`` is in /v1/cluster's ``slowest_recent`` (operators'), not a metric label."""
    import asyncio

    from router.contract import GenerationChunk, Usage
    from router.frontdoor.metrics import Metrics

    async def chunks():
        yield GenerationChunk("r1", [5], "a", prompt_tokens=3)
        yield GenerationChunk("r1", [6], "b", True, "stop", Usage(3, 2), prompt_tokens=3)

    async def run(user):
        m = Metrics(backend=None)
        async for _ in m.track(chunks(), api="http", user=user):
            pass
        return m.recent.slowest(), m.registry

    (recent,), registry = asyncio.run(run("alice"))
    assert recent["user"] == "alice" and recent["request_id"] == "r1"
    assert all("user" not in s.labels for f in registry.collect() if f.name.startswith(
        "pdcluster_e2e") for s in f.samples)
    assert asyncio.run(run(None))[0][0]["user"] is None
