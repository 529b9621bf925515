"""Tensor parallelism on GPUs: two ranks, one GPU each, NCCL between them (skipped with fewer
than two GPUs; ``bash bench/gpu_check.sh`` runs it first on a lent machine)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers.tiny_models import hf_greedy, random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def test_tp2_on_two_gpus_gives_transformers_tokens(tiny_llama_dir):
    prompts = random_prompts(seed=5, count=4, max_len=30)
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, 8)
    with LLM(str(tiny_llama_dir), device="cuda", dtype="float32", attention_backend="torch",
             tensor_parallel_size=2, kv_cache_memory_bytes=64 << 20) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                    ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
