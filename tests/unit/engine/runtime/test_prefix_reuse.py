"""Disaggregated prefix reuse, engine to engine (no transport): a decode engine that already
holds a conversation's first blocks pins them, the prefill engine sends only the rest, and
the tokens still equal transformers' greedy ones; block sizes 8 and 16 on either side."""

from __future__ import annotations

import pytest

from engine import EngineArgs, LLMEngine, SamplingParams
from engine.runtime.kv_connector import LayerExport
from tests.helpers.tiny_models import hf_greedy, random_prompts

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _engine(model_dir, block_size: int) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), block_size=block_size, detokenize=False))


def _serve(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int]
           ) -> tuple[list[int], int, int]:
    """One disaggregated request: reserve on ``decode`` (which may pin a cached prefix),
    prefill on ``prefill`` exporting only the tokens ``decode`` lacks, import, admit, decode.
    Returns (tokens, tokens skipped by the transfer, tokens transferred)."""
    res = decode.kv_connector.reserve(rid, prompt, GREEDY)
    assert res.ok
    skip = res.num_cached_tokens
    exports: list[LayerExport] = []
    prefill.kv_connector.exporter = exports.append
    prefill.add_request(prompt, ONE, request_id=rid, export_kv=True, export_from=skip)
    first = None
    while prefill.has_unfinished_requests:
        for out in prefill.step():
            if out.finished:
                first = out.token_ids[0]
    moved = {e.kv.shape[1] for e in exports}
    assert len(exports) == 2 and moved == {len(prompt) - skip}  # 2 layers, only the rest
    for e in exports:
        decode.kv_connector.import_layer(rid, e.layer, e.kv)
    tokens = [first]
    decode.kv_connector.admit(rid, first)
    while decode.has_unfinished_requests:
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    return tokens, skip, len(prompt) - skip


@pytest.mark.parametrize(("prefill_bs", "decode_bs"), [(8, 16), (16, 8), (16, 16)])
def test_second_turn_transfers_only_what_the_decode_worker_lacks(tiny_llama_dir, prefill_bs,
                                                                  decode_bs):
    first_turn = random_prompts(seed=11, count=1, max_len=45, min_len=45)[0]
    prefill, decode = _engine(tiny_llama_dir, prefill_bs), _engine(tiny_llama_dir, decode_bs)
    out1, skip1, _ = _serve(prefill, decode, "t1", first_turn)
    assert skip1 == 0  # a cold decode worker receives everything
    # The next turn: the whole conversation so far plus a new user message.
    second_turn = first_turn + out1 + random_prompts(seed=12, count=1, max_len=9, min_len=9)[0]
    hits_before = decode.stats().num_prefix_hit_tokens
    computed_before = prefill.stats().num_prefill_tokens_computed
    out2, skip2, moved2 = _serve(prefill, decode, "t2", second_turn)
    # The decode worker cached the first turn's prompt and the full blocks of its output.
    cached_blocks = (len(first_turn) + len(out1) - 1) // decode_bs
    assert skip2 == cached_blocks * decode_bs > len(first_turn) - decode_bs
    assert moved2 == len(second_turn) - skip2
    assert decode.stats().num_prefix_hit_tokens - hits_before == skip2
    # The prefill worker computed only what its own cache lacks (it holds the first prompt).
    own = (len(first_turn) // prefill_bs) * prefill_bs
    assert prefill.stats().num_prefill_tokens_computed - computed_before == len(second_turn) - own
    ref1, ref2 = hf_greedy(tiny_llama_dir, "llama", [first_turn, second_turn], MAX_TOKENS)
    assert out1 == ref1 and out2 == ref2
    for eng in (prefill, decode):  # nothing leaked; cached content stays, owned by no one
        assert eng.stats().kv_blocks_used == 0
        eng.block_manager.check_invariants()


def test_a_released_reservation_unpins_the_shared_prefix(tiny_llama_dir):
    prefill, decode = _engine(tiny_llama_dir, 8), _engine(tiny_llama_dir, 8)
    prompt = random_prompts(seed=5, count=1, max_len=40, min_len=40)[0]
    _serve(prefill, decode, "a", prompt)
    res = decode.kv_connector.reserve("b", prompt + [7, 8, 9], GREEDY)
    assert res.ok and res.num_cached_tokens == 40
    assert decode.kv_connector.release("b")
    assert decode.stats().kv_blocks_used == 0
    decode.block_manager.check_invariants()
    # The prefix is still cached for the next one.
    res = decode.kv_connector.reserve("c", prompt + [1], GREEDY)
    assert res.ok and res.num_cached_tokens == 40
    decode.abort_request("c")
    assert decode.stats().kv_blocks_used == 0


def test_export_from_outside_the_prompt_is_refused(tiny_llama_dir):
    eng = _engine(tiny_llama_dir, 8)
    with pytest.raises(ValueError, match="export_from 5 outside the prompt"):
        eng.add_request([3, 4, 5, 6, 7], ONE, request_id="x", export_kv=True, export_from=5)
    assert not eng.has_unfinished_requests
