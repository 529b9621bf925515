"""KVConnector: the engine's door for remote KV, exercised engine-to-engine without a transport.

A "prefill" engine exports each layer of each completed prompt; a "decode" engine with
another block size reserves pages, imports those layers and admits the requests. Its greedy
tokens must equal transformers' own, and every page must come back on every path.
"""

from __future__ import annotations

import pytest
import torch

from engine import EngineArgs, LLMEngine, SamplingParams
from engine.runtime.kv_connector import LayerExport
from tests.helpers.tiny_models import hf_greedy, random_prompts

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts_and_refs(tiny_llama_dir):
    prompts = random_prompts(seed=3, count=6, max_len=60, min_len=20)
    return prompts, hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)


def _prefill(model_dir, prompts, **engine_kw) -> tuple[dict[str, int], list[LayerExport]]:
    """Run every prompt as a one-token export_kv request; returns first tokens and exports."""
    eng = LLMEngine(EngineArgs(model=str(model_dir), detokenize=False, **engine_kw))
    exports: list[LayerExport] = []
    eng.kv_connector.exporter = exports.append
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"r{i}", export_kv=True)
    first: dict[str, int] = {}
    while eng.has_unfinished_requests:
        for out in eng.step():
            if out.finished:
                first[out.request_id] = out.token_ids[0]
    assert eng.stats().kv_blocks_used == 0
    return first, exports


@pytest.mark.parametrize("prefill_kw", [
    dict(block_size=16),
    dict(block_size=4, max_num_batched_tokens=24),  # long prompts prefilled in chunks
    # every prompt in chunks of at most 7 tokens, several prompts' chunks in each step
    dict(block_size=4, max_num_batched_tokens=32, max_prefill_chunk=7),
], ids=["one-step", "chunked", "chunk-cap"])
def test_exported_kv_imported_elsewhere_decodes_like_transformers(tiny_llama_dir, prompts_and_refs,
                                                                  prefill_kw):
    prompts, refs = prompts_and_refs
    first, exports = _prefill(tiny_llama_dir, prompts, **prefill_kw)
    num_layers = 2  # tests.helpers.tiny_models: 2 layers, 2 KV heads of 16
    # One export per layer per prompt, only from the step that completed the prompt; all
    # layers of one prompt carry that one step's identity, and the whole prompt's tokens.
    for i, p in enumerate(prompts):
        mine = [e for e in exports if e.request_id == f"r{i}"]
        assert [e.layer for e in mine] == list(range(num_layers))
        assert len({e.step for e in mine}) == 1
        assert all(e.kv.shape[:2] == (2, len(p)) for e in mine)

    dec = LLMEngine(EngineArgs(model=str(tiny_llama_dir), block_size=8, detokenize=False))
    conn = dec.kv_connector
    for i, p in enumerate(prompts):
        res = conn.reserve(f"r{i}", p, GREEDY)
        assert res.ok and res.num_blocks == -(-(len(p) + 1) // 8)
    assert dec.stats().kv_blocks_reserved == dec.stats().kv_blocks_used > 0
    for e in exports:
        conn.import_layer(e.request_id, e.layer, e.kv)
    outs: dict[str, list[int]] = {}
    for i in range(len(prompts)):
        adm = conn.admit(f"r{i}", first[f"r{i}"])
        assert not adm.finished
        outs[f"r{i}"] = [first[f"r{i}"]]
    assert dec.stats().kv_blocks_reserved == 0
    while dec.has_unfinished_requests:
        for out in dec.step():
            outs[out.request_id].extend(out.new_token_ids)
    assert [outs[f"r{i}"] for i in range(len(prompts))] == refs
    assert dec.stats().kv_blocks_used == 0


def test_release_frees_the_pages_and_late_layers_are_refused(tiny_llama_dir):
    dec = LLMEngine(EngineArgs(model=str(tiny_llama_dir), block_size=8, detokenize=False))
    conn = dec.kv_connector
    prompt = list(range(3, 23))
    assert conn.reserve("a", prompt, GREEDY).ok
    layer0 = torch.ones(2, len(prompt), 2, 16)
    conn.import_layer("a", 0, layer0)  # lands while reserved
    assert conn.release("a")
    assert dec.stats().kv_blocks_used == 0 and dec.stats().num_waiting == 0
    with pytest.raises(KeyError):  # a receiver thread delivering after the lease expired
        conn.import_layer("a", 1, layer0)
    with pytest.raises(KeyError):
        conn.admit("a", 5)
    assert not conn.release("a")  # idempotent


def test_abort_of_a_reserved_request_releases_it(tiny_llama_dir):
    dec = LLMEngine(EngineArgs(model=str(tiny_llama_dir), block_size=8, detokenize=False))
    assert dec.kv_connector.reserve("a", list(range(3, 23)), GREEDY).ok
    out = dec.abort_request("a")
    assert out is not None and out.finish_reason == "abort"
    assert dec.stats().kv_blocks_used == 0 and dec.stats().kv_blocks_reserved == 0
    with pytest.raises(KeyError):
        dec.kv_connector.import_layer("a", 0, torch.ones(2, 20, 2, 16))


def test_reserve_refuses_when_the_pool_is_short(tiny_llama_dir):
    pool = 2 * 2 * 2 * 16 * 4 * 8 * 2  # two blocks of 8 tokens
    dec = LLMEngine(EngineArgs(model=str(tiny_llama_dir), block_size=8, detokenize=False,
                               kv_cache_memory_bytes=pool))
    res = dec.kv_connector.reserve("big", list(range(3, 43)), GREEDY)
    assert not res.ok and res.reason == "need 6 blocks, 2 free"
    assert dec.stats().kv_blocks_used == 0 and not dec.has_unfinished_requests
    with pytest.raises(ValueError, match="duplicate"):
        dec.kv_connector.reserve("x", [5, 6], GREEDY)
        dec.kv_connector.reserve("x", [5, 6], GREEDY)


def test_first_token_that_stops_finishes_at_admission(tiny_llama_dir):
    dec = LLMEngine(EngineArgs(model=str(tiny_llama_dir), block_size=8, detokenize=False))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    assert dec.kv_connector.reserve("a", [5, 6, 7], one).ok
    adm = dec.kv_connector.admit("a", 9)
    assert adm.finished and adm.finish_reason == "length"
    assert dec.stats().kv_blocks_used == 0
