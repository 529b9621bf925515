"""The engine on CUDA gives the CPU engine's tokens: exactly in float32 (torch backend), and
mostly in bfloat16 (FlashInfer, CUDA graphs); graphs on and off agree; the KV pool is sized
from the GPU's memory.

Skipped cleanly without CUDA (all CI machines): run these on a GPU machine
(``bash bench/gpu_check.sh`` runs them first).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from bench.gpu_check import CPU_REFERENCE, match_fraction
from engine import LLM, SamplingParams
from engine.executor.cuda_graphs import decode_buckets
from engine.executor.device import resolve_device
from tests.gpu.marks import needs_flashinfer
from tests.helpers.tiny_models import VOCAB

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
EXACT = dict(dtype="float32", attention_backend="torch")  # the CPU engine's math, on the GPU
BF16_MIN_MATCH = 0.6  # bf16 vs fp32 greedy: tokens reproduced before each first divergence
GRAPHS_MIN_MATCH = 0.9  # bf16 graphs on vs off: only GEMM shapes (padding) differ
SMALL_POOL = 256 << 20  # most tests need no 100 GB pool (and its million-block manager)


def _prompts(n=12, vocab=VOCAB):
    rng = random.Random(3)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 60))] for _ in range(n)]


def _tokens(llm, prompts, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params)]


def _release(llm):
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_cuda_greedy_tokens_equal_cpu(tiny_llama_dir):
    prompts = _prompts()
    # Untuned: the CPU run is only the reference, and timing its kernels on every thread of
    # the host takes seconds (10-15 s seen on a busy 2-core one) of a lent GPU's time.
    cpu = LLM(str(tiny_llama_dir), tune_kernels=False).generate(prompts, GREEDY)
    gpu_llm = LLM(str(tiny_llama_dir), device="cuda", max_num_seqs=5, max_num_batched_tokens=32,
                  kv_cache_memory_bytes=SMALL_POOL, **EXACT)
    gpu = gpu_llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    assert gpu_llm.engine.runner.kv_caches[0].is_cuda
    assert gpu_llm.engine.block_manager.num_used_blocks == 0


def test_cuda_seeded_sampling_is_reproducible(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cuda", kv_cache_memory_bytes=SMALL_POOL, **EXACT)
    sp = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    p = _prompts(1)[0]
    assert llm.generate([p], sp)[0].token_ids == llm.generate([p] * 3, sp)[1].token_ids


def test_resolve_device():
    assert resolve_device("auto").type == "cuda"


@pytest.mark.slow
def test_default_model_fp32_equals_cpu():
    cpu = LLM(**CPU_REFERENCE)
    prompts = _prompts(6, cpu.engine.model_config.vocab_size)
    want = _tokens(cpu, prompts)
    gpu = LLM(device="cuda", kv_cache_memory_bytes=1 << 30, **EXACT)
    assert _tokens(gpu, prompts) == want
    assert gpu.engine.block_manager.num_used_blocks == 0


@needs_flashinfer
@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "default"])
def test_bf16_flashinfer_mostly_matches_cpu_fp32(model, tiny_llama_hd64_dir, record_property):
    path = str(tiny_llama_hd64_dir) if model == "tiny" else None
    cpu = LLM(path, **CPU_REFERENCE)
    prompts = _prompts(8, cpu.engine.model_config.vocab_size)
    want = _tokens(cpu, prompts)
    gpu = LLM(path, device="cuda", kv_cache_memory_bytes=1 << 30)  # bf16, flashinfer, graphs
    runner = gpu.engine.runner
    assert (runner.attn_backend.name, runner.use_cuda_graphs) == ("flashinfer", True)
    frac = match_fraction(_tokens(gpu, prompts), want)
    record_property("bf16_match_fraction", frac)
    print(f"{model}: bf16 FlashInfer vs CPU fp32 greedy match fraction {frac:.3f}")
    assert frac >= BF16_MIN_MATCH
    assert gpu.engine.block_manager.num_used_blocks == 0


@needs_flashinfer
@pytest.mark.parametrize("model", ["tiny", "default"])
def test_cuda_graphs_on_and_off_agree(model, tiny_llama_hd64_dir, record_property):
    path = str(tiny_llama_hd64_dir) if model == "tiny" else None
    tokens, replays = {}, {}
    for graphs in (True, False):
        llm = LLM(path, device="cuda", cuda_graphs=graphs, max_num_seqs=12,
                  kv_cache_memory_bytes=1 << 30)
        runner = llm.engine.runner
        prompts = _prompts(11, llm.engine.model_config.vocab_size)
        replays[graphs] = 0
        if runner.graph_runner is not None:
            run = runner.graph_runner.run

            def counted(*args, _run=run, _graphs=graphs):
                replays[_graphs] += 1
                return _run(*args)

            runner.graph_runner.run = counted
        tokens[graphs] = _tokens(llm, prompts)
        assert llm.engine.block_manager.num_used_blocks == 0
        if graphs:
            want = decode_buckets(llm.engine.scheduler_config.max_num_seqs)
            assert runner.graph_runner.captured_buckets == want
        _release(llm)
    assert replays[True] > 0 and replays[False] == 0
    frac = match_fraction(tokens[True], tokens[False])
    record_property("graphs_on_off_match_fraction", frac)
    print(f"{model}: CUDA graphs on vs off greedy match fraction {frac:.3f}")
    assert frac >= GRAPHS_MIN_MATCH


def test_torch_backend_turns_graphs_off(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cuda", attention_backend="torch", cuda_graphs=True,
              kv_cache_memory_bytes=SMALL_POOL)
    runner = llm.engine.runner
    assert (runner.use_cuda_graphs, runner.graph_runner, runner.decode_padding) == (False, None, None)
    assert len(_tokens(llm, _prompts(2))[1]) == GREEDY.max_tokens


@pytest.mark.slow
def test_kv_pool_is_sized_from_gpu_memory():
    total = torch.cuda.get_device_properties(0).total_memory
    if total < 40 << 30:
        pytest.skip(f"a big GPU is needed to expect > 1 GiB at 0.2 ({total / 2**30:.0f} GiB)")
    pools = {}
    for util in (0.5, 0.2):
        llm = LLM(device="cuda", gpu_memory_utilization=util, cuda_graphs=False,
                  attention_backend="torch")
        pools[util] = llm.engine.runner.kv_cache_bytes
        assert llm.engine.block_manager.num_blocks == llm.engine.runner.num_blocks
        _release(llm)
    assert pools[0.5] > 1 << 30
    assert 1 << 30 < pools[0.2] < pools[0.5]
    # Each pool is its share of the device less the weights (~0.3 GB here), within 10%.
    assert pools[0.5] == pytest.approx(0.5 * total, rel=0.1)
    assert pools[0.2] == pytest.approx(0.2 * total, rel=0.1)
