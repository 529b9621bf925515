"""The front doors' promises that hold for the float products only, over an fp32 in-process
engine and an fp32 disaggregated cluster (1 prefill + 1 decode worker), this package's own;
the front-door package (tests/integration/frontdoor/) runs everything else on the default
quantization, what `pdcluster serve` runs. The integer products round a step's activations,
so a near-tied token can move with the step's batch or plan (docs/models.md, "Exactness"):
what needs the float products is that n choices, a batch of prompts, best_of's reruns and a
request with fuzzed requests beside it each give the tokens the same request gives alone (with
seed + j for choice j), that a greedy request streamed gives the text it gives whole, and that
reported logprobs are transformers' fp32 log-softmax."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from client import Client, RetryPolicy
from engine.text.tokenizer import load_tokenizer
from engine.weights.resolve import resolve_model
from proto.pdcluster.v1 import generation_pb2 as pb
from proto.pdcluster.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers.hf_reference import greedy_logprobs
from tests.helpers.http_asserts import assert_openai_error
from tests.helpers.schemas import SCIENTIST

PROMPT = "The capital of France is"
PARIS = [{"role": "user", "content": "Name three things to see in Paris."}]
# Test clients retry nothing: a retried UNAVAILABLE would hide the refusal under test.
NO_RETRY = RetryPolicy(max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None).model_dir)


def test_a_greedy_json_schema_answer_streamed_is_the_answer_whole(oai, model_id, kv_probe):
    """Moved from frontdoor/test_structured_outputs.py: the same greedy request twice, whole
    and then streamed (its prompt then in the prefix cache), gives the same text."""
    fmt = {"type": "json_schema",
           "json_schema": {"name": "scientist", "schema": SCIENTIST, "strict": True}}
    kw = dict(model=model_id, messages=[{"role": "user",
                                         "content": "Describe one famous scientist."}],
              max_tokens=150, response_format=fmt, temperature=0)
    whole = oai.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        **kw, stream=True) if c.choices)
    assert streamed == whole
    kv_probe.wait_until_free()


# ---- several choices: n, a batch of prompts, best_of ----------------------------------------
def _complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"max_tokens": 6, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_n_greedy_choices_are_equal_and_usage_counts_the_prompt_once(http):
    one = _complete(http, prompt=PROMPT, temperature=0)
    three = _complete(http, prompt=PROMPT, temperature=0, n=3)
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert {c["text"] for c in three["choices"]} == {one["choices"][0]["text"]}
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert three["usage"]["completion_tokens"] == 3 * 6


def test_seeded_choices_differ_and_choice_j_is_seed_plus_j(http):
    many = _complete(http, prompt=PROMPT, temperature=1.0, seed=40, n=3, max_tokens=12)
    texts = [c["text"] for c in many["choices"]]
    assert len(set(texts)) == 3
    for j in range(3):
        alone = _complete(http, prompt=PROMPT, temperature=1.0, seed=40 + j, max_tokens=12)
        assert alone["choices"][0]["text"] == texts[j]


def test_a_batch_of_prompts_answers_each_in_order(http, tokenizer):
    prompts = [PROMPT, "Water boils at", "The largest planet is"]
    batch = _complete(http, prompt=prompts, temperature=0, n=2)
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    singles = [_complete(http, prompt=p, temperature=0) for p in prompts]
    assert [c["text"] for c in batch["choices"]] == [
        s["choices"][0]["text"] for s in singles for _ in range(2)]
    assert batch["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    as_ids = _complete(http, prompt=[tokenizer.encode(p) for p in prompts], temperature=0)
    assert [c["text"] for c in as_ids["choices"]] == [s["choices"][0]["text"] for s in singles]


def test_streamed_choices_each_name_their_index_and_add_up(http, model_id):
    body = {"messages": PARIS, "max_tokens": 8, "temperature": 0, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and not any(line.startswith("id: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    text = {0: "", 1: ""}
    roles = {0: 0, 1: 0}
    for p in payloads[:-1]:
        (choice,) = p["choices"]
        roles[choice["index"]] += choice["delta"].get("role") == "assistant"
        text[choice["index"]] += choice["delta"].get("content", "")
    whole = http.post("/v1/chat/completions", json={**body, "stream": False,
                                                    "stream_options": None}).json()
    assert roles == {0: 1, 1: 1}
    assert [text[0], text[1]] == [c["message"]["content"] for c in whole["choices"]]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"] == whole["usage"]


def test_echo_starts_each_choice_with_its_prompt(http, tokenizer):
    plain = _complete(http, prompt=PROMPT, temperature=0)["choices"][0]["text"]
    echoed = _complete(http, prompt=PROMPT, temperature=0, echo=True, n=2)
    assert [c["text"] for c in echoed["choices"]] == [PROMPT + plain] * 2
    ids = tokenizer.encode(PROMPT)
    by_ids = _complete(http, prompt=ids, temperature=0, echo=True)["choices"][0]["text"]
    assert by_ids == tokenizer.decode(ids, skip_special_tokens=False) + plain
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0,
            "echo": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + plain


def test_best_of_returns_the_most_likely_of_its_generations(http):
    """best_of 4, n 2: four sampled generations, the two with the highest mean token logprob
    returned (ranked from the logprobs the server computed for the purpose), usage counting
    all four; with logprobs asked too, they show the ranking held."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 5,
            "ignore_eos": True, "best_of": 4, "n": 2, "logprobs": 0}
    r = _complete(http, **body)
    choices = sorted(r["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    means = [sum(c["logprobs"]["token_logprobs"]) / 6 for c in choices]
    assert means[0] >= means[1]  # best first
    assert r["usage"]["completion_tokens"] == 4 * 6  # every generation is paid for
    all_four = _complete(http, **{**body, "best_of": None, "n": 4})["choices"]  # seeds 5-8 too
    ranked = sorted(all_four, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    assert [c["text"] for c in choices] == [c["text"] for c in ranked[:2]]
    plain = _complete(http, **{**body, "logprobs": None})
    assert [c["text"] for c in plain["choices"]] == [c["text"] for c in choices]
    assert all(c["logprobs"] is None for c in plain["choices"])  # ranked, not returned


def test_grpc_n_choices_with_the_sdk(frontdoor, kv_probe):
    from client import InvalidArgument

    with Client(f"127.0.0.1:{frontdoor.grpc_port}", retry=NO_RETRY) as c:
        greedy = c.choices(PROMPT, n=3, max_tokens=6, temperature=0, ignore_eos=True)
        one = c.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
        assert [r.token_ids for r in greedy] == [one.token_ids] * 3
        assert all(r.usage.completion_tokens == 6 for r in greedy)
        kw = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
        seeded = c.choices(PROMPT, n=2, seed=3, **kw)
        assert [r.token_ids for r in seeded] == [c.generate(PROMPT, seed=s, **kw).token_ids
                                                 for s in (3, 4)]  # choice j: seed + j
        with c.stream(PROMPT, n=2, seed=3, **kw) as s:
            assert {chunk.index for chunk in s} == {0, 1}
        for bad in (dict(n=65), dict(n=0), dict(n=2, resume=True)):
            with pytest.raises(InvalidArgument, match="n must|resumable"):
                c.generate(PROMPT, max_tokens=2, **bad)
    kv_probe.wait_until_free()


# ---- logprobs ------------------------------------------------------------------------------
LOGPROB_TOKENS = 8


@pytest.fixture(scope="module")
def reference(tokenizer):
    """transformers' greedy continuation of PROMPT on the served weights, with the logprobs
    of its tokens and of the prompt's (tests/helpers/hf_reference.py)."""
    return greedy_logprobs(tokenizer.encode(PROMPT), LOGPROB_TOKENS)


def _name(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _merged_completion_logprobs(http, body) -> tuple[str, dict]:
    """A streamed completion's text and its chunks' logprobs joined list by list."""
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            if choice["logprobs"] is not None:
                for k in merged:
                    merged[k] += choice["logprobs"][k]
    return text, merged


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completion_logprobs_are_transformers_log_softmax(http, tokenizer, reference, stream):
    """In a cluster the first token's logprob comes from the prefill worker, the rest from the
    decode worker: every one equals transformers' log-softmax of the same sequence."""
    body = {"prompt": reference["prompt"], "max_tokens": LOGPROB_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 3}
    if stream:
        pairs = [_merged_completion_logprobs(http, body)]
    else:
        choices = _complete(http, **body, n=2)["choices"]
        pairs = [(c["text"], c["logprobs"]) for c in choices]
        assert len(pairs) == 2
    names = [_name(tokenizer, t) for t in reference["tokens"]]
    for text, lp in pairs:
        assert lp["tokens"] == names and "".join(names) == text
        for step, (got, want) in enumerate(zip(lp["token_logprobs"], reference["logprobs"],
                                               strict=True)):
            assert abs(got - want) < 1e-3, (step, got, want)
            top = lp["top_logprobs"][step]  # the sampled token, then the 3 most likely
            want_top = [_name(tokenizer, t) for t in reference["top_ids"][step][:3]]
            assert list(top) == list(dict.fromkeys([names[step], *want_top]))
            for name, value in zip(want_top, reference["top_values"][step], strict=False):
                assert abs(top[name] - value) < 1e-3
        assert lp["text_offset"] == [sum(map(len, names[:i])) for i in range(len(names))]


def test_return_tokens_as_token_ids_names_each_token_by_its_id(http, reference):
    lp = _complete(http, prompt=reference["prompt"], max_tokens=LOGPROB_TOKENS, temperature=0,
                   logprobs=0, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in reference["tokens"]]
    assert [list(d) for d in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]


def test_grpc_logprobs_are_the_same_numbers(frontdoor, reference):
    from client import InvalidArgument

    with Client(f"127.0.0.1:{frontdoor.grpc_port}", retry=NO_RETRY) as c:
        res = c.generate(prompt_token_ids=reference["prompt"], max_tokens=LOGPROB_TOKENS,
                         temperature=0, ignore_eos=True, logprobs=2)
        assert [lp.token_id for lp in res.logprobs] == res.token_ids == reference["tokens"]
        for step, lp in enumerate(res.logprobs):
            assert abs(lp.logprob - reference["logprobs"][step]) < 1e-3 and lp.rank == 1
            assert [t for t, _ in lp.top] == reference["top_ids"][step][:2]
        assert c.generate(PROMPT, max_tokens=2).logprobs is None
        with pytest.raises(InvalidArgument, match="logprobs"):
            c.generate(PROMPT, max_tokens=2, logprobs=1, resume=True)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_echo_with_logprobs_gives_the_prompts_logprobs_too(http, tokenizer, reference, stream):
    """The echoed prompt's entries come first (its first token's logprob null: nothing comes
    before it), each equal to transformers' log-softmax; in a cluster they are computed by
    the prefill worker, which then skips its prefix cache for the prompt."""
    body = {"prompt": reference["prompt"], "max_tokens": LOGPROB_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 2, "echo": True}
    if stream:
        text, lp = _merged_completion_logprobs(http, body)
    else:
        choice = _complete(http, **body)["choices"][0]
        text, lp = choice["text"], choice["logprobs"]
    prompt, n = reference["prompt"], len(reference["prompt"])
    names = [_name(tokenizer, t) for t in prompt + reference["tokens"]]
    assert lp["tokens"] == names and text == tokenizer.decode(prompt) + "".join(names[n:])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = reference["prompt_logprobs"] + reference["logprobs"]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want, strict=True)) < 1e-3
    assert lp["text_offset"] == [sum(map(len, names[:i])) for i in range(len(names))]


# ---- fuzzed requests beside a good one ---------------------------------------------------

def test_fuzzed_requests_get_an_answer_or_a_400_naming_the_field(base_url, http, backend,
                                                                  kv_probe):
    """Random prompts and sampling fields (any JSON type, out of range, too many, outside
    the vocabulary) through /v1/completions while a good greedy request runs beside them:
    each gets a 200 or a 400 naming a field it set (never a 5xx), the good request's text
    equals its run alone, every worker stays ready and no KV block is left held."""
    from hypothesis import HealthCheck, example, given, settings

    from tests.helpers.fuzz_inputs import BackgroundStream, json_bodies, names_a_field

    good = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    alone = http.post("/v1/completions", json=good).json()["choices"][0]["text"]

    def bystander() -> str:
        with httpx.Client(base_url=base_url, timeout=300) as c:
            r = c.post("/v1/completions", json=good)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

    bg = BackgroundStream(bystander)
    seen: dict[int, int] = {}

    @settings(max_examples=5, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(json_bodies(backend.model_info().vocab_size))
    @example({"prompt": PROMPT, "max_tokens": 3, "seed": 7})  # both outcomes, every run
    @example({"prompt": [5, 6], "seed": 2**62, "stop": ["."] * 17})
    def one(body):
        r = http.post("/v1/completions", json=body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        if r.status_code == 200:
            out = r.json()
            assert out["choices"][0]["finish_reason"] in ("stop", "length"), out
            if isinstance(body.get("max_tokens"), int):
                assert out["usage"]["completion_tokens"] <= body["max_tokens"]
            return
        err = assert_openai_error(r, 400)
        assert err["type"] == "invalid_request_error"
        given_fields = {k: v for k, v in body.items() if k != "prompt"}
        assert names_a_field(err["message"], given_fields), (body, err["message"])

    assert bg.running()  # the fuzz starts while the good request is mid-way
    one()
    assert bg.result(300) == alone
    assert seen.get(200) and seen.get(400), seen  # both outcomes were exercised
    workers = http.get("/v1/cluster").json()["workers"]
    assert all(w["state"] == "ready" for w in workers), workers
    kv_probe.wait_until_free()


def test_fuzzed_requests_get_an_answer_or_invalid_argument_naming_the_field(address, client,
                                                                             backend, kv_probe):
    """Random prompts and sampling fields at the limits of their wire types (NaN and
    infinite floats, int64 seeds, uint32 stop ids, 300 stop ids, long stop strings) through
    the raw stub while a good greedy request runs beside them: each stream ends OK or with
    INVALID_ARGUMENT naming a field it set, never another code; the good request's tokens
    equal its run alone, and no KV block is left held."""
    from hypothesis import HealthCheck, example, given, settings

    from tests.helpers.fuzz_inputs import BackgroundStream, names_a_field, proto_fields

    alone = client.generate(PROMPT, max_tokens=64, temperature=0, ignore_eos=True).token_ids
    def bystander() -> list[int]:
        with Client(address, timeout=300, retry=NO_RETRY) as c:
            return c.generate(PROMPT, max_tokens=64, temperature=0, ignore_eos=True).token_ids

    bg = BackgroundStream(bystander)
    seen: dict[str, int] = {}

    @settings(max_examples=5, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(proto_fields(backend.model_info().vocab_size))
    @example((PROMPT, {"max_tokens": 3, "seed": 7}))  # both outcomes, every run
    @example(([5, 6], {"temperature": float("nan"), "max_tokens": 2}))
    def one(case):
        prompt, fields = case
        kw = {"text": prompt} if isinstance(prompt, str) else {"token_ids": pb.TokenIds(ids=prompt)}
        req = pb.GenerateRequest(sampling=pb.SamplingParams(**fields), **kw)
        with grpc.insecure_channel(address) as ch:
            try:
                list(pb_grpc.GenerationStub(ch).Generate(req, timeout=120))
                seen["OK"] = seen.get("OK", 0) + 1
            except grpc.RpcError as e:
                seen[e.code().name] = seen.get(e.code().name, 0) + 1
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, e.code(), e.details())
                assert names_a_field(e.details(), fields), (case, e.details())

    assert bg.running()
    one()
    assert bg.result(300) == alone
    assert seen.get("OK") and seen.get("INVALID_ARGUMENT"), seen
    kv_probe.wait_until_free()
