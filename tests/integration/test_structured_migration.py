"""Structured outputs across a decode worker's death: the grammar state a migrated stream's
new decode worker builds replays the tokens streamed so far, so the document continues where
it stopped. On the default model (a grammar needs a real tokenizer), in a real Ray cluster."""

from __future__ import annotations

import pytest

from engine import EngineArgs, SamplingParams
from router.cluster.ray_cluster import ClusterConfig
from router.contract import GenerateInput
from tests.helpers.async_util import assert_no_blocks_held, run_cluster


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


@pytest.mark.slow
def test_a_constrained_stream_migrates_and_stays_valid_for_its_schema(loop):
    """A JSON-schema-constrained generation on the default model (the grammar needs a real
    tokenizer) whose decode worker is SIGKILLed mid-document: it continues on the other
    decode worker, whose grammar state replays the tokens streamed so far, and the client's
    document equals an undisturbed run's and is valid for its schema."""
    import json
    import os
    import signal

    import jsonschema

    from engine.core.grammar import StructuredOutput
    from engine.weights.resolve import resolve_model

    schema = {"type": "object", "required": ["cities"], "additionalProperties": False,
              "properties": {"cities": {"type": "array", "minItems": 40, "maxItems": 40,
                                        "items": {"type": "string", "maxLength": 12}}}}
    params = SamplingParams(max_tokens=400, temperature=0,
                            structured=StructuredOutput("json_schema", json.dumps(schema)))
    messages = [{"role": "user", "content": "List forty cities."}]
    # fp32 weights: the migrated document is compared with an undisturbed run's, equal only
    # where the re-prefill on the new worker multiplies as decode did (the default's quantized
    # decode steps may take int8 activations, its prompt steps fp32: docs/models.md)
    fp = dict(num_threads=1, max_num_seqs=4, quantization="none")
    config = ClusterConfig(model=str(resolve_model(None).model_dir), num_prefill_workers=1,
                           num_decode_workers=2,
                           prefill_engine=EngineArgs(**fp), decode_engine=EngineArgs(**fp),
                           transfer_timeout_s=10.0, lease_s=10.0, worker_num_cpus=1.0,
                           worker_restarts=0)

    async def body(cluster):
        async def run(rid, kill_after=None):
            toks, text, pid = [], "", None
            async for ch in cluster.generate(GenerateInput(params, messages=messages,
                                                           request_id=rid)):
                toks += ch.token_ids
                text += ch.text
                if kill_after is not None and pid is None and len(toks) >= kill_after:
                    victim = cluster.orchestrator._streams[rid].decode_id
                    pid = {w.id: w.pid for w in await cluster.cluster_status()}[victim]
                    os.kill(pid, signal.SIGKILL)
            return toks, text, ch.finish_reason
        undisturbed = await run("calm")
        moved = await run("moved", kill_after=20)
        journal = [e.kind for e in cluster.store.journal_get("moved")]
        await assert_no_blocks_held(cluster, timeout_s=30)
        return undisturbed, moved, journal

    (calm_toks, calm_text, calm_reason), (toks, text, reason), journal = run_cluster(
        loop, config, body)
    assert journal.count("migrated") == 1
    assert calm_reason == reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    assert toks == calm_toks and text == calm_text
