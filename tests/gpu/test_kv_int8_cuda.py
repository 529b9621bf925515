"""The int8 KV cache on CUDA (``kv_cache_dtype="int8"``): ``attention_backend="auto"`` takes
the torch backend (FlashInfer reads no int8 pages), the pool holds the rows the CPU path
holds (the torch twin's rounding), and greedy tokens stay with the bf16 cache's on the tiny
model. The CPU path is checked in tests/unit/engine/attention/test_kv_int8.py.

Skipped cleanly without CUDA (all CI machines): ``bash bench/gpu_check.sh`` runs them.
"""

from __future__ import annotations

import pytest
import torch

from engine import EngineArgs, LLMEngine, SamplingParams
from tests.helpers.tiny_models import random_prompts, serve_in_turn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_int8_pool_on_cuda_serves_like_the_model_dtype_pool(tiny_llama_hd64_dir):
    prompts = random_prompts(seed=5, count=6, max_len=60, min_len=20)
    common = dict(model=str(tiny_llama_hd64_dir), device="cuda", detokenize=False,
                  block_size=16, max_model_len=128)
    plain = LLMEngine(EngineArgs(**common))
    want = serve_in_turn(plain, prompts, GREEDY)
    plain_blocks = plain.block_manager.num_blocks
    plain.close()
    engine = LLMEngine(EngineArgs(**common, kv_cache_dtype="int8"))
    try:
        assert engine.runner.attn_backend.name == "torch"
        assert engine.runner.kv_caches[0].dtype == torch.int8
        assert engine.runner.kv_caches[0].shape[-1] == 64 + 4
        # bf16 rows of 128 bytes against int8 rows of 68: 1.88x the blocks
        assert engine.block_manager.num_blocks >= 1.8 * plain_blocks
        got = serve_in_turn(engine, prompts, GREEDY)
        same = sum(a == b for a, b in zip(got, want, strict=True))
        assert same >= len(prompts) - 1, (got, want)
        assert engine.block_manager.num_used_blocks == 0
    finally:
        engine.close()
