"""``/openapi.json`` tells the truth: a schema-based fuzzer (schemathesis) generates requests
from the published document, valid and invalid, and checks each answer against it: no server
error, only documented status codes and content types, bodies in the documented shape, and
schema-invalid requests refused. Run on the default model with a short context (generations
stay a few tokens long) behind the real front door."""

from __future__ import annotations

import httpx
import pytest
import schemathesis  # a declared dev dependency: missing, the module fails, it does not skip


@pytest.fixture(scope="module")
def base_url(server_loop):
    from engine.runtime.llm_engine import EngineArgs
    from router.embedded import EngineBackend
    from router.frontdoor.lifecycle import serve_frontdoor

    backend = EngineBackend(EngineArgs(max_model_len=48, max_num_seqs=4, max_waiting=64))
    fd = server_loop.run(serve_frontdoor(backend, grpc_port=0, http_port=0, drain_grace_s=5))
    yield f"http://127.0.0.1:{fd.http_port}"
    server_loop.run(fd.stop(1))
    server_loop.run(backend.shutdown(), 60)


def test_the_document_declares_what_the_server_answers(base_url):
    spec = httpx.get(f"{base_url}/openapi.json").json()
    ops = spec["paths"]
    assert "422" not in str({p: sorted(o) for p, m in ops.items() for o in m.values()})
    completions = ops["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(completions)
    assert "text/event-stream" in completions["200"]["content"]
    assert list(ops["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    prompt = spec["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    assert {"type": "string", "minLength": 1} in prompt["anyOf"]  # {"prompt": ""} is invalid


def test_a_schema_fuzzer_finds_the_server_true_to_its_document(base_url):
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance, negative_data_rejection]
    schema = schemathesis.openapi.from_dict(httpx.get(f"{base_url}/openapi.json").json())
    labels = []
    for result in schema.get_all_operations():
        op = result.ok()
        labels.append(op.label)

        @settings(max_examples=30, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            case.call_and_validate(base_url=base_url, checks=checks, timeout=60)

        run()
    assert "POST /v1/completions" in labels and "POST /v1/chat/completions" in labels
