"""The engine on CUDA gives the CPU engine's tokens (same code, torch backend on the GPU).

Skipped cleanly without CUDA (all CI machines): run these on a GPU machine.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.device import resolve_device
from tests.tiny_models import VOCAB

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _prompts(n=12):
    rng = random.Random(3)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 60))] for _ in range(n)]


def test_cuda_greedy_tokens_equal_cpu(tiny_llama_dir):
    prompts = _prompts()
    cpu = LLM(str(tiny_llama_dir)).generate(prompts, GREEDY)
    gpu_llm = LLM(str(tiny_llama_dir), device="cuda", max_num_seqs=5, max_num_batched_tokens=32)
    gpu = gpu_llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    assert gpu_llm.engine.runner.kv_caches[0].is_cuda
    assert gpu_llm.engine.block_manager.num_used_blocks == 0


def test_cuda_seeded_sampling_is_reproducible(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cuda")
    sp = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    p = _prompts(1)[0]
    assert llm.generate([p], sp)[0].token_ids == llm.generate([p] * 3, sp)[1].token_ids


def test_resolve_device():
    assert resolve_device("auto").type == "cuda"
