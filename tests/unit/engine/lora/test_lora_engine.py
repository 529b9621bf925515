"""LoRA adapters on one base model (engine.lora), through ``LLM(enable_lora=True)``: rows of
several adapters and of the base model in one batch give ``peft``'s own greedy tokens; no KV is
shared across adapters; the running batch holds at most ``max_loras`` adapters; bad adapters
are refused with the reason, and nothing is left queued."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from tests.helpers.lora import ALL_TARGETS, peft_greedy, save_adapter, step_adapters
from tests.helpers.quantized import dequantized_hf, near_greedy_misses
from tests.helpers.tiny_models import random_prompts

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# block_size=4 in the tiny-model engines: their 2-24-token prompts then fill several blocks,
# so the adapter-rooted block hashes and the prefix cache are exercised (16 would hold none);
# the default model's test below runs LLM's defaults.


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """Three adapters unlike each other: q/v at rank 4; every target at rank 8 with rsLoRA's
    scaling; o/gate/down at rank 2 on the second layer only."""
    d = tmp_path_factory.mktemp("loras")
    return {
        "qv": save_adapter(tiny_llama_dir, "llama", d / "qv", r=4, alpha=8, seed=1),
        "all": save_adapter(tiny_llama_dir, "llama", d / "all", r=8, alpha=16,
                            targets=ALL_TARGETS, seed=2, use_rslora=True),
        "mlp": save_adapter(tiny_llama_dir, "llama", d / "mlp", r=2, alpha=4,
                            targets=["o_proj", "gate_proj", "down_proj"], seed=3,
                            layers_to_transform=[1]),
    }


def _requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path))
            for i, (name, path) in enumerate(adapters.items())}


def test_three_adapters_and_the_base_in_one_batch_give_pefts_tokens(tiny_llama_dir, adapters):
    prompts = random_prompts(seed=3, count=12, max_len=24)
    names = [None, "qv", "all", "mlp"]
    refs = {n: peft_greedy(tiny_llama_dir, "llama", adapters[n] if n else None, prompts,
                           MAX_TOKENS) for n in names}
    for n in names[1:]:  # each adapter changes what the base model says
        assert refs[n] != refs[None], n
    # max_loras=3: all three adapters in one running batch (the default, vLLM's, is 1)
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_loras=3, block_size=4)
    reqs = _requests(adapters)
    chosen = [names[i % 4] for i in range(len(prompts))]
    with step_adapters(llm) as steps:
        outs = llm.generate(prompts, GREEDY,
                            lora_request=[reqs[n] if n else None for n in chosen])
    assert [o.token_ids for o in outs] == [refs[n][i] for i, n in enumerate(chosen)]
    assert any(s == set(names) for s in steps)  # a step mixed all three and the base
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_batch_holds_at_most_max_loras_adapters(tiny_llama_dir, adapters):
    """The default max_loras (1): requests of three adapters all finish with peft's tokens,
    each step running one adapter at most (beside base-model rows)."""
    prompts = random_prompts(seed=5, count=6, max_len=16)
    # max_cpu_loras=3: all three adapters stay held while their requests queue (with the
    # default, max_loras=1, the second load would find the only slot in use and be refused)
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_cpu_loras=3, block_size=4)
    reqs = _requests(adapters)
    chosen = ["qv", "all", "mlp", None, "all", "qv"]
    with step_adapters(llm) as steps:
        outs = llm.generate(prompts, GREEDY,
                            lora_request=[reqs[n] if n else None for n in chosen])
    for name in ("qv", "all", "mlp"):
        idx = [i for i, n in enumerate(chosen) if n == name]
        ref = peft_greedy(tiny_llama_dir, "llama", adapters[name], [prompts[i] for i in idx],
                          MAX_TOKENS)
        assert [outs[i].token_ids for i in idx] == ref, name
    assert all(len(s - {None}) <= 1 for s in steps)
    assert {n for s in steps for n in s} == {None, "qv", "all", "mlp"}


def test_no_kv_is_shared_across_adapters(tiny_llama_dir, adapters):
    """One prompt of four full blocks under adapter qv, then all, then the base: the second
    and third reuse none of the first's blocks (and get their own right tokens); the same
    prompt under qv again reuses its blocks."""
    prompt = random_prompts(seed=9, count=1, max_len=17, min_len=17)[0]
    llm = LLM(str(tiny_llama_dir), enable_lora=True, block_size=4)
    bm = llm.engine.block_manager
    reqs = _requests(adapters)
    hits = []
    for lora in (reqs["qv"], reqs["all"], None, reqs["qv"]):
        before = bm.num_prefix_hit_tokens
        out = llm.generate([prompt], GREEDY, lora_request=lora)[0]
        hits.append(bm.num_prefix_hit_tokens - before)
        ref = peft_greedy(tiny_llama_dir, "llama", adapters[lora.lora_name] if lora else None,
                          [prompt], MAX_TOKENS)[0]
        assert out.token_ids == ref, lora
    assert hits == [0, 0, 0, 16]


def test_int8_base_weights_with_an_fp32_adapter(tiny_llama_dir, adapters, tmp_path):
    """A quantized base: the adapter's tokens are peft's greedy choices on the dequantized
    weights, up to the near-ties the integer products may flip (tests/helpers/quantized.py)."""
    from peft import PeftModel

    prompts = random_prompts(seed=11, count=4, max_len=16)
    llm = LLM(str(tiny_llama_dir), enable_lora=True, quantization="int8", block_size=4)
    reqs = _requests(adapters)
    outs = llm.generate(prompts, GREEDY, lora_request=reqs["all"])
    hf = dequantized_hf(tiny_llama_dir, "llama", "int8", tmp_path / "deq")
    ref = PeftModel.from_pretrained(hf, str(adapters["all"])).eval()
    assert near_greedy_misses(ref, prompts, [o.token_ids for o in outs]) == []


def test_bad_adapters_are_refused_with_the_reason(tiny_llama_dir, tiny_qwen3_dir, adapters,
                                                  tmp_path):
    llm = LLM(str(tiny_llama_dir), enable_lora=True, block_size=4)

    def refused(lora, match, **kwargs):
        with pytest.raises(ValueError, match=match):
            llm.generate([[5, 6, 7]], GREEDY, lora_request=lora)
        assert not llm.engine.has_unfinished_requests

    d = tmp_path
    dora = save_adapter(tiny_llama_dir, "llama", d / "dora", use_dora=True)
    refused(LoRARequest("dora", 1, str(dora)), r"DoRA \(use_dora\) = True is not supported")
    head = save_adapter(tiny_llama_dir, "llama", d / "head", targets=["q_proj", "lm_head"])
    refused(LoRARequest("head", 2, str(head)),
            r"tensor 'base_model\.model\.lm_head\.[a-z_.AB]*' is not supported: LoRA on the "
            "q/k/v/o/gate/up/down projections only")
    big = save_adapter(tiny_llama_dir, "llama", d / "big", r=32)
    refused(LoRARequest("big", 3, str(big)), "rank 32 exceeds max_lora_rank 16")
    other = save_adapter(tiny_qwen3_dir, "qwen3", d / "other")  # wider heads than the llama's
    refused(LoRARequest("other", 4, str(other)), r"an adapter of another base model\?")
    refused(LoRARequest("gone", 5, str(d / "nowhere")), "no such directory")
    (d / "empty").mkdir()
    refused(LoRARequest("empty", 6, str(d / "empty")), "no adapter_config.json")
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, str(adapters["qv"]))
    # a name held with one path is not loaded again from another
    llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("qv", 7, str(adapters["qv"])))
    refused(LoRARequest("qv", 7, str(adapters["all"])), "unload it before loading")
    off = LLM(str(tiny_llama_dir), block_size=4)
    with pytest.raises(ValueError, match="LoRA adapters are off"):
        off.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("qv", 1, str(adapters["qv"])))
    assert not off.engine.has_unfinished_requests


def test_unload_is_refused_while_in_use_and_evicts_least_recently_used(tiny_llama_dir, adapters):
    # max_cpu_loras=2: three adapters must evict one (the LRU order is what is checked)
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_cpu_loras=2, block_size=4)
    engine = llm.engine
    reqs = _requests(adapters)
    req = engine.add_request([5, 6, 7, 8], GREEDY, lora_request=reqs["qv"])
    with pytest.raises(ValueError, match=r"'qv' is in use by 1 request\(s\); unload refused"):
        engine.remove_lora("qv")
    while engine.has_unfinished_requests:
        engine.step()
    assert req.is_finished and len(req.output_token_ids) == MAX_TOKENS
    engine.remove_lora("qv")
    with pytest.raises(KeyError, match="'qv' is not loaded"):
        engine.remove_lora("qv")
    # held: at most max_cpu_loras, the least recently used one giving way
    for name in ("qv", "all", "mlp"):
        engine.load_lora(reqs[name])
    assert [r.lora_name for r in engine.list_loras()] == ["all", "mlp"]
    loads = engine.lora.num_loads
    out = llm.generate([[9, 10, 11]], GREEDY, lora_request=reqs["qv"])[0]  # read again
    assert engine.lora.num_loads == loads + 1
    assert out.token_ids == peft_greedy(tiny_llama_dir, "llama", adapters["qv"], [[9, 10, 11]],
                                        MAX_TOKENS)[0]


def test_the_default_model_as_llm_serves_it_with_an_adapter(tmp_path):
    """``LLM(enable_lora=True)`` with nothing else set (the default model in its Q4_1
    blocks, kernels timed as at any start) under an all-linear rank-8 adapter made with peft
    on the same weights dequantized: every token is peft's greedy choice up to the near-ties
    the integer products may flip (tests/helpers/quantized.py), and the adapter changes the
    base's answer. (B is drawn from N(0, 0.01): from N(0, 0.025) the adapter moved the
    logits so far that the int8-rounded activations flipped a 3.4% gap, in the layer path
    as in the fused step.)"""
    from peft import PeftModel

    from tests.helpers.hf_reference import default_model_hf

    path = save_adapter(None, "llama", tmp_path / "a", r=8, alpha=16, targets=ALL_TARGETS,
                        base=default_model_hf(), scale=0.02)
    llm = LLM(enable_lora=True)
    prompts = [llm.engine.tokenizer.encode(p) for p in
               ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    lora = LoRARequest("a", 1, str(path))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = [o.token_ids for o in llm.generate(prompts, params, lora_request=lora)]
    base = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs != base
    ref = PeftModel.from_pretrained(default_model_hf(), str(path)).eval()
    assert near_greedy_misses(ref, prompts, outs) == []
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_fp16_adapters_hold_half_the_bytes_and_stay_near_pefts_greedy(tiny_llama_dir, adapters):
    """``lora_dtype="float16"``: each adapter weight rounded once to fp16 and read as such;
    the tokens are peft's (fp32) greedy choices up to near-ties (tests/helpers/quantized.py);
    an unknown dtype is refused."""
    from peft import PeftModel

    from tests.helpers.tiny_models import load_hf

    prompts = random_prompts(seed=13, count=4, max_len=16)
    reqs = _requests(adapters)
    half = LLM(str(tiny_llama_dir), enable_lora=True, lora_dtype="float16", block_size=4)
    full = LLM(str(tiny_llama_dir), enable_lora=True, block_size=4)
    outs = [o.token_ids for o in half.generate(prompts, GREEDY, lora_request=reqs["all"])]
    assert half.engine.load_lora(reqs["all"]).nbytes * 2 == full.engine.load_lora(
        reqs["all"]).nbytes
    ref = PeftModel.from_pretrained(load_hf(tiny_llama_dir, "llama"), str(adapters["all"]))
    assert near_greedy_misses(ref.eval(), prompts, outs) == []
    with pytest.raises(ValueError, match="lora_dtype must be one of auto, float32, float16, "
                                         "int8, got 'bfloat16'"):
        LLM(str(tiny_llama_dir), enable_lora=True, lora_dtype="bfloat16")


def _dequantized_peft(ref, held) -> None:
    """Set ``ref``'s (a ``PeftModel``) A and B to what ``held`` (an int8 ``LoRAAdapter``)
    multiplies: A's rows times their scale, B as held over the adapter's scaling."""
    from engine.lora.peft_format import TARGETS, b_matrix

    def linear(layer, module):
        return getattr(layer.mlp if module in ("gate_proj", "up_proj", "down_proj")
                       else layer.self_attn, module)

    for i, layer in enumerate(ref.base_model.model.model.layers):
        for module, (proj, at) in TARGETS.items():
            p, lin = held.layers[i].get(proj), linear(layer, module)
            if p is None or not hasattr(lin, "lora_A"):
                continue
            # the part whose outputs start where this module's do in the fused projection
            col = sum(linear(layer, m).base_layer.out_features
                      for m, (pj, j) in TARGETS.items() if pj == proj and j < at)
            _, _, r0, r1, _ = part = next(q for q in p.parts if q[0] == col)
            with torch.no_grad():
                lin.lora_A["default"].weight.copy_(p.a[r0:r1].float() * p.scale[r0:r1, None])
                lin.lora_B["default"].weight.copy_(b_matrix(part).float() / held.scaling)


def test_int8_adapters_hold_a_quarter_of_the_bytes_and_give_the_dequantized_adapters_tokens(
        tiny_llama_dir, adapters):
    """``lora_dtype="int8"``: A and B rounded to int8 (a scale per rank row: A's row scale
    times B's, 4 bytes beside the quarter). The tokens are peft's greedy choices, up to
    near-ties (tests/helpers/quantized.py), with the adapter's A and B replaced by the int8
    values it holds (the rounding is the only change: ~1% of each projection's added
    product, tests/unit/engine/lora/test_lora_rows.py), and differ from the base model's."""
    from peft import PeftModel

    from tests.helpers.tiny_models import load_hf

    prompts = random_prompts(seed=13, count=4, max_len=16)
    reqs = _requests(adapters)
    q8 = LLM(str(tiny_llama_dir), enable_lora=True, lora_dtype="int8", block_size=4)
    full = LLM(str(tiny_llama_dir), enable_lora=True, block_size=4)
    outs = [o.token_ids for o in q8.generate(prompts, GREEDY, lora_request=reqs["all"])]
    assert outs != [o.token_ids for o in q8.generate(prompts, GREEDY)]
    held, whole = q8.engine.load_lora(reqs["all"]), full.engine.load_lora(reqs["all"])
    scales = sum(p.scale.numel() * 4 for layer in held.layers for p in layer.values())
    assert held.nbytes - scales == whole.nbytes // 4
    ref = PeftModel.from_pretrained(load_hf(tiny_llama_dir, "llama"), str(adapters["all"]))
    _dequantized_peft(ref, held)
    assert near_greedy_misses(ref.eval(), prompts, outs) == []
