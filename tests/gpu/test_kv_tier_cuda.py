"""The second KV cache tier on CUDA: evicted pool blocks go to pinned host memory (and disk),
come back into the GPU pool on a hit, and the tokens equal the same engine's without a tier
(the CPU path is checked against transformers in tests/unit/engine/executor/test_kv_tier.py).

Skipped cleanly without CUDA (all CI machines): ``bash bench/gpu_check.sh`` runs them.
"""

from __future__ import annotations

import pytest
import torch

from engine import EngineArgs, LLMEngine, SamplingParams
from tests.helpers.tiny_models import random_prompts, serve_in_turn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
BLOCK = 8



@pytest.mark.parametrize("disk", [False, True])
def test_restored_blocks_on_cuda_serve_the_same_tokens(tiny_llama_dir, tmp_path, disk):
    base = random_prompts(seed=21, count=1, max_len=41, min_len=41)[0]
    others = random_prompts(seed=22, count=3, max_len=60, min_len=60)
    follow = base[:40] + random_prompts(seed=23, count=1, max_len=7, min_len=7)[0]
    prompts = [base, *others, follow]
    common = dict(model=str(tiny_llama_dir), device="cuda", dtype="float32",
                  block_size=BLOCK, detokenize=False, max_model_len=96)
    plain = LLMEngine(EngineArgs(**common))
    per_block = plain.model_config.kv_bytes_per_token * BLOCK
    want = serve_in_turn(plain, prompts, GREEDY)
    plain.close()
    engine = LLMEngine(EngineArgs(
        **common, kv_cache_memory_bytes=12 * per_block,
        kv_offload_memory_bytes=(1 if disk else 64) * per_block,
        kv_offload_dir=str(tmp_path) if disk else None,
        kv_offload_disk_bytes=128 * (per_block + 256) if disk else 0))
    try:
        assert engine.kv_tier._store.is_pinned()
        assert serve_in_turn(engine, prompts, GREEDY) == want
        assert engine.block_manager.num_restored_tokens >= 40
    finally:
        engine.close()
    assert list(tmp_path.iterdir()) == []
