"""``/v1/embeddings`` and gRPC ``Embed`` over both backends (one in-process engine; the real
disaggregated cluster): the real ``openai`` client's vectors (it asks for base64 and decodes
it) equal transformers' pooled final hidden states of the same tokens, cosine >= 0.9999;
float and base64 give the same floats; strings, token ids and lists of either; refused
fields and inputs answered 400 / 404 by name; in the cluster, embeddings run on the prefill
worker and the decode worker computes nothing for them."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from client import Client, InvalidArgument, RetryPolicy
from tests.helpers.hf_reference import default_model_embeddings

TEXTS = ["The capital of France is Paris.", "Decode is memory-bound; prefill is compute-bound."]
NO_RETRY = RetryPolicy(max_retries=0)


def _cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float32),
                                                 torch.as_tensor(b), dim=0).item()


@pytest.fixture(scope="module")
def refs(backend):
    ids = [backend.tokenize(t) for t in TEXTS]
    return ids, default_model_embeddings(ids)


def test_the_openai_client_gets_transformers_pooled_hidden_states(oai, http, refs, model_id,
                                                                  kv_probe):
    ids, ref = refs
    r = oai.embeddings.create(model=model_id, input=TEXTS)  # base64 on the wire, decoded
    assert [d.index for d in r.data] == [0, 1]
    assert min(_cos(d.embedding, v) for d, v in zip(r.data, ref, strict=True)) >= 0.9999
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(p) for p in ids)
    assert r.model == model_id
    floats = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "float"})
    b64 = http.post("/v1/embeddings", json={"input": ids[0], "encoding_format": "base64"})
    f = floats.json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(b64.json()["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(f, abs=1e-6)  # the same floats, token ids or text
    assert _cos(f, ref[0]) >= 0.9999
    many = http.post("/v1/embeddings", json={"input": ids, "encoding_format": "float"}).json()
    assert [round(_cos(d["embedding"], v), 4) >= 0.9999 for d, v in
            zip(many["data"], ref, strict=True)] == [True, True]
    kv_probe.wait_until_free()


@pytest.mark.parametrize(("body", "status", "match"), [
    ({"input": "x", "dimensions": 8}, 400, "dimensions"),
    ({"input": "x", "model": "no-such-model"}, 404, "no-such-model"),
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "pooling": "mean"}, 400, "pooling"),
])
def test_bad_embedding_requests_are_refused_by_name(http, body, status, match):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert match in r.json()["error"]["message"]


def test_grpc_embed_gives_the_same_vectors(frontdoor, refs):
    ids, ref = refs
    with Client(f"127.0.0.1:{frontdoor.grpc_port}", retry=NO_RETRY) as c:
        got = c.embed([TEXTS[0], ids[1]])
        with pytest.raises(InvalidArgument, match="inputs"):
            c.embed([""])
    assert min(_cos(g, v) for g, v in zip(got, ref, strict=True)) >= 0.9999


def test_embeddings_run_where_prompts_are_computed_and_never_on_a_decode_worker(
        backend, kv_probe, http):
    """The cluster: its prefill worker computes the input, its decode worker nothing. The
    embedded backend: its one engine computes it."""
    def computed():
        s = kv_probe.stats()
        return {"all": s.prefill_computed_tokens,
                **{w.role: w.prefill_tokens_computed for w in s.workers}}

    before = computed()
    r = http.post("/v1/embeddings", json={"input": "A prompt for the prefill worker only, "
                                                   "never reserved on a decode worker."})
    assert r.status_code == 200, r.text
    after = computed()
    if backend.model_info().mode == "disaggregated":
        assert after["prefill"] > before["prefill"] and after["decode"] == before["decode"]
    else:
        assert after["all"] > before["all"]
    kv_probe.wait_until_free()
