"""Every model family served disaggregated over a real local Ray: the prompt's KV crosses from
the prefill worker to the decode worker (layer by layer, as for Llama), and greedy tokens equal
transformers' own ``generate`` for each family's tiny random checkpoint. Nothing is held after."""

from __future__ import annotations

import asyncio

import pytest

from engine import EngineArgs, SamplingParams
from router.cluster.ray_cluster import ClusterConfig
from router.contract import GenerateInput
from tests.helpers.async_util import assert_no_blocks_held, run_cluster
from tests.helpers.tiny_models import GEMMA_WINDOW, hf_greedy, random_prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


def _engine(**kw) -> EngineArgs:
    # One thread a worker (each holds one of Ray's CPUs): the kernel timing at start-up takes
    # ~0.5 s there, where on all of a busy 2-core host's threads it took 10-15 s. Small pools:
    # a worker's default 1 GiB of KV is memory four short prompts never use.
    return EngineArgs(num_threads=1, kv_cache_memory_bytes=8 << 20, **kw)


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
                                  "gemma3"])
def test_each_family_serves_transformers_tokens_disaggregated(loop, arch, request):
    """Gemma's prompts (12-40 tokens) all outgrow its sliding layer's window of 8: the decode
    worker's windowed attention over KV it received must equal transformers'."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = random_prompts(seed=31, count=4, max_len=40, min_len=5 if "gemma" not in arch
                             else GEMMA_WINDOW + 4)
    refs = hf_greedy(model_dir, arch, prompts, MAX_TOKENS)
    _serve_and_compare(loop, model_dir, prompts, refs)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_workers_serve_the_dequantized_models_tokens(loop, kind, tiny_qwen2_dir,
                                                              tmp_path):
    """Both workers quantize at load (``--quantization``); the KV they move is the model
    dtype's, as before: greedy tokens equal transformers' on the dequantized weights."""
    from tests.helpers.quantized import dequantized_hf

    dequantized_hf(tiny_qwen2_dir, "qwen2", kind, tmp_path / "deq")
    prompts = random_prompts(seed=37, count=4, max_len=40, min_len=5)
    refs = hf_greedy(tmp_path / "deq", "qwen2", prompts, MAX_TOKENS)
    _serve_and_compare(loop, tiny_qwen2_dir, prompts, refs, quantization=kind)


def _serve_and_compare(loop, model_dir, prompts, refs, **engine):
    config = ClusterConfig(model=str(model_dir), num_prefill_workers=1, num_decode_workers=1,
                           prefill_engine=_engine(block_size=16, **engine),
                           decode_engine=_engine(block_size=8, **engine), worker_num_cpus=1.0)

    async def collect(cluster, prompt):
        toks = []
        async for ch in cluster.generate(GenerateInput(GREEDY, token_ids=prompt)):
            toks += ch.token_ids
        return toks

    async def body(cluster):
        outs = await asyncio.gather(*[collect(cluster, p) for p in prompts])
        await assert_no_blocks_held(cluster)
        return outs, (await cluster.stats()).kv_transfer_bytes_total

    outs, kv_bytes = run_cluster(loop, config, body)
    assert outs == refs
    assert kv_bytes > 0  # the KV crossed workers
