"""LoRA adapters under tensor parallelism (CPU, gloo, one real process per extra rank): each
rank holds its shard of every adapter (A whole and B's rows of its outputs for q/k/v and
gate/up; A's columns of its inputs and B whole for o and down), so three adapters and the base
mixed in one batch at TP 2 give peft's greedy tokens, as TP 1 does; loads, unloads and LRU
evictions on rank 0 reach the other rank before any step names the adapter; KV prefilled
under adapters at TP 2 decodes to peft's tokens on a TP 1 engine."""

from __future__ import annotations

import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.helpers.lora import ALL_TARGETS, peft_greedy, save_adapter, step_adapters
from tests.helpers.tiny_models import random_prompts, save_tiny_model

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# One thread a rank (a 2-core host's share anyway) and a small pool, as the TP tests run;
# block_size=4 so the short prompts fill several blocks (the adapter-rooted hashes in play);
# max_loras=3: all three adapters in one running batch; max_cpu_loras=3: a fourth load evicts.
SETUP = dict(num_threads=1, kv_cache_memory_bytes=1 << 22, block_size=4, enable_lora=True,
             max_loras=3, max_cpu_loras=3)
NAMES = [None, "qv", "all", "mlp"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The default model's attention shape in miniature: 9 query heads over 3 KV heads, which
    2 ranks split unevenly (3 query heads + 1 KV head, 6 + 2), so each rank's rows of a fused
    q/k/v B are cut at different offsets."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-9q3kv"), hidden_size=72,
                           num_attention_heads=9, num_key_value_heads=3, intermediate_size=50)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Three adapters unlike each other (as tests/unit/engine/lora/test_lora_engine.py's):
    q/v at rank 4; every target at rank 8 with rsLoRA; o/gate/down at rank 2 on layer 1."""
    d = tmp_path_factory.mktemp("tp-loras")
    return {
        "qv": save_adapter(model_dir, "llama", d / "qv", r=4, alpha=8, seed=1),
        "all": save_adapter(model_dir, "llama", d / "all", r=8, alpha=16, targets=ALL_TARGETS,
                            seed=2, use_rslora=True),
        "mlp": save_adapter(model_dir, "llama", d / "mlp", r=2, alpha=4,
                            targets=["o_proj", "gate_proj", "down_proj"], seed=3,
                            layers_to_transform=[1]),
    }


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(seed=21, count=8, max_len=14)


@pytest.fixture(scope="module")
def refs(model_dir, adapters, prompts):
    """transformers + peft's greedy tokens of every prompt under each adapter and the base."""
    return {n: peft_greedy(model_dir, "llama", adapters[n] if n else None, prompts, MAX_TOKENS)
            for n in NAMES}


@pytest.fixture(scope="module")
def tp2(model_dir):
    with LLM(str(model_dir), tensor_parallel_size=2, **SETUP) as llm:
        yield llm


def _requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path))
            for i, (name, path) in enumerate(adapters.items())}


def _mixed(llm, adapters, prompts) -> tuple[list[list[int]], list[str | None], list[set]]:
    """Every prompt under NAMES in turn, all at once; the tokens, the choice per prompt and
    the adapters (None: the base) of each step's chunks as rank 0's runner was handed them."""
    reqs = _requests(adapters)
    chosen = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    with step_adapters(llm) as steps:
        outs = llm.generate(prompts, GREEDY,
                            lora_request=[reqs[n] if n else None for n in chosen])
    return [o.token_ids for o in outs], chosen, steps


def test_three_adapters_and_the_base_in_one_batch_at_tp2_give_pefts_tokens(
        tp2, model_dir, adapters, prompts, refs):
    for n in NAMES[1:]:  # each adapter changes what the base model says
        assert refs[n] != refs[None], n
    tokens, chosen, steps = _mixed(tp2, adapters, prompts)
    assert tokens == [refs[n][i] for i, n in enumerate(chosen)]
    assert any(s == set(NAMES) for s in steps)  # a step mixed all three and the base
    bm = tp2.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # no KV block leaked
    # TP 1 on the same weights and adapters: the same tokens
    with LLM(str(model_dir), **SETUP) as tp1:
        assert _mixed(tp1, adapters, prompts)[0] == tokens


def test_unload_load_and_eviction_at_tp2_reach_every_rank(tp2, model_dir, adapters, prompts,
                                                         refs):
    """After an unload, the name loaded again from another folder runs that folder's adapter
    on both ranks (a rank still holding the old one would refuse the load, or compute the old
    product); a fourth adapter evicts the least recently used one on both ranks, and the
    evicted one named again is read again everywhere."""
    engine = tp2.engine
    reqs = _requests(adapters)
    for r in reqs.values():  # held, in this order (least recently used first)
        engine.load_lora(r)
    engine.remove_lora("qv")
    swapped = LoRARequest("qv", 9, str(adapters["mlp"]))
    out = tp2.generate(prompts[:2], GREEDY, lora_request=swapped)
    assert [o.token_ids for o in out] == refs["mlp"][:2]
    # held: all, mlp, qv(=mlp's folder); a fourth evicts "all" on every rank
    fourth = LoRARequest("four", 10, str(adapters["all"]))
    evictions = engine.lora.num_evictions
    out = tp2.generate(prompts[2:4], GREEDY, lora_request=fourth)
    assert engine.lora.num_evictions == evictions + 1
    assert [r.lora_name for r in engine.list_loras()] == ["mlp", "qv", "four"]
    assert [o.token_ids for o in out] == refs["all"][2:4]
    # "all" named again: read again on rank 0 and shipped again (evicting "mlp")
    out = tp2.generate(prompts[4:6], GREEDY, lora_request=reqs["all"])
    assert [o.token_ids for o in out] == refs["all"][4:6]
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    for name in ("qv", "four"):  # the module's other test names "qv" from its own folder
        engine.remove_lora(name)


def test_kv_a_tp2_prefill_computes_under_adapters_decodes_on_a_tp1_engine(
        tp2, model_dir, adapters, prompts, refs):
    """Both sides of the split: the TP 2 engine prefills each prompt under its adapter (or the
    base) as a one-token export, its ranks gathering the KV heads computed with their shards
    of A and B; a TP 1 engine holding the same adapters takes that KV (reserved under each
    adapter's key) and decodes peft's tokens."""
    from engine import EngineArgs, LLMEngine

    engine, reqs = tp2.engine, _requests(adapters)
    chosen = [NAMES[(i + 1) % len(NAMES)] for i in range(len(prompts))]
    exports: list = []
    engine.kv_connector.exporter = exports.append
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    try:
        for i, (p, n) in enumerate(zip(prompts, chosen, strict=True)):
            engine.add_request(p, one, request_id=f"x{i}", export_kv=True,
                               lora_request=reqs[n] if n else None)
        first = {}
        while engine.has_unfinished_requests:
            for out in engine.step():
                if out.finished:
                    first[out.request_id] = out.token_ids[0]
    finally:
        engine.kv_connector.exporter = None
    dec = LLMEngine(EngineArgs(model=str(model_dir), detokenize=False, **SETUP))
    try:
        conn = dec.kv_connector
        for i, (p, n) in enumerate(zip(prompts, chosen, strict=True)):
            lora = reqs[n] if n else None
            root = dec.load_lora(lora).key if lora else 0
            assert conn.reserve(f"x{i}", p, GREEDY, root, lora).ok
        for e in exports:
            conn.import_layer(e.request_id, e.layer, e.kv)
        outs = {rid: [tok] for rid, tok in first.items()}
        for rid, tok in first.items():
            assert not conn.admit(rid, tok).finished
        while dec.has_unfinished_requests:
            for out in dec.step():
                outs[out.request_id].extend(out.new_token_ids)
        assert dec.stats().kv_blocks_used == 0
    finally:
        dec.close()
    assert [outs[f"x{i}"] for i in range(len(prompts))] == [refs[n][i]
                                                           for i, n in enumerate(chosen)]
    assert engine.stats().kv_blocks_used == 0
