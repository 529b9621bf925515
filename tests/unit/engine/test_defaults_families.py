"""Every model family the engine serves, started exactly as a user starts it (``LLM(dir)``,
no overrides: kernel timing at start-up included), gives transformers' greedy tokens.

Why this file exists: the other family tests used to pass ``tune_kernels=False``, and with
the default a Mixtral or Qwen3-MoE directory crashed at start (the kernel tuner listed a dense
MLP's weights, which routed-experts layers do not have). The tiny models' weights are below
the size the linear tuner times, so the last test here forces each linear path onto the
experts' weights instead.
"""

from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM, SamplingParams
from engine.executor.fused_decode import FusedDecodePlan
from engine.ops.linear import (
    FP,
    LINEAR_BUCKETS,
    LinearPlan,
    available_paths,
    linear_plan,
    set_linear_plan,
    weight_key,
)
from engine.runtime.llm_engine import EngineArgs
from engine.tuning.linear import model_linear_weights
from tests.helpers.tiny_models import hf_greedy, load_hf, random_prompts

# Every family with a tiny fixture in tests/conftest.py (Phi-3's LongRoPE variant and Gemma 3's
# image+text packaging have tests of their own).
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen2_moe", "qwen3_moe",
            "gemma2", "gemma3"]
MOE = {"mixtral", "qwen2_moe", "qwen3_moe"}
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def test_the_defaults_time_kernels_at_start():
    """The tests below run the defaults: they mean something while the default tunes."""
    assert EngineArgs().tune_kernels is True


@pytest.mark.parametrize("arch", FAMILIES)
def test_default_engine_matches_transformers_greedy(arch, request):
    """Four prompts at once (batched decode steps; some outgrow Gemma's window of 8): the
    tokens equal transformers' ``generate``. Then the whole-step decode kernel is forced on
    for every batch: it runs the dense families and declines the routed-experts and Gemma
    layers it does not implement (the layer path runs), the same tokens either way."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = random_prompts(seed=11, count=4, max_len=20, min_len=2)
    refs = hf_greedy(model_dir, arch, prompts, MAX_TOKENS)
    llm = LLM(str(model_dir))
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == refs
        runner = llm.engine.runner
        if arch in MOE:
            assert runner.fused_decode.choices == {}  # the tuner declined: nothing timed
        runner.fused_decode = FusedDecodePlan.everywhere("fused")
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == refs
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.close()
        del llm
        gc.collect()


@pytest.mark.parametrize("arch", sorted(MOE))
def test_every_linear_path_serves_the_experts(arch, request):
    """The tuner lists each expert's projections (and the router and shared expert) in step
    order, and whichever path it may choose for them computes transformers' logits: each
    path on every weight shape the list names, every bucket."""
    from engine.config import CacheConfig
    from engine.executor.model_runner import ModelRunner
    from engine.models.llama import LlamaForCausalLM
    from engine.weights.loader import load_state_dict
    from engine.weights.resolve import load_model_config

    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    model = LlamaForCausalLM(load_model_config(model_dir))
    model.load_hf_state_dict(load_state_dict(model_dir, torch.float32))
    cfg = model.cfg
    weights = model_linear_weights(model)
    moe = model.layers[0].moe
    per_layer = 2 + 1 + 2 * cfg.num_experts + (3 if moe.shared is not None else 0)
    assert len(weights) == per_layer * cfg.num_layers + 1
    layer0 = weights[:per_layer]
    assert torch.equal(layer0[2], moe.router)
    for e in range(cfg.num_experts):  # expert e's gate/up, then its down
        assert torch.equal(layer0[3 + 2 * e], moe.gate_up[e])
        assert torch.equal(layer0[4 + 2 * e], moe.down[e])

    runner = ModelRunner(model, CacheConfig(block_size=8), 16)
    hf = load_hf(model_dir, arch)
    # 1 token: one or two rows per expert (the small-M paths); 40: ~20 rows per expert.
    prompts = [random_prompts(seed=4, count=1, max_len=n, min_len=n)[0] for n in (1, 40)]
    with torch.no_grad():
        refs = [hf(torch.tensor([ids])).logits[0] for ids in prompts]
    keys = {weight_key(w) for w in weights}
    before = linear_plan()
    try:
        for path in available_paths():
            set_linear_plan(LinearPlan({(n, k, m, FP): path for n, k, _ in keys
                                        for m in LINEAR_BUCKETS}))
            for ids, ref in zip(prompts, refs, strict=True):
                ours = runner.compute_logits_for_prompt(ids, list(range(5)))
                rel = (ours - ref).abs().max() / ref.abs().max()
                assert rel < 1e-4, f"{arch} by {path}, {len(ids)} tokens: error {rel:.2e}"
    finally:
        set_linear_plan(before)
