"""``--quantization int4`` on CUDA: every projection packed for PyTorch's tinygemm kernel
(``engine.quant.gpu``), multiplying as our int4 weights do (to bf16), and the default model's
greedy tokens mostly those of the CPU engine's int4 (fp32 activations there, bf16 here).

Skipped cleanly without CUDA (all CI machines): ``bash bench/gpu_check.sh`` runs them.
"""

from __future__ import annotations

import pytest
import torch

from bench.gpu_check import CPU_REFERENCE, match_fraction
from engine import LLM, SamplingParams
from engine.quant.gpu import TinyGemmWeight, to_cuda
from engine.quant.layouts import quantize
from tests.helpers.tiny_models import random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
BF16_MIN_MATCH = 0.6  # bf16 vs fp32 activations: the same bar as the unquantized engine's


@pytest.mark.parametrize("n,k", [(576, 576), (1536, 576), (576, 1536), (49152, 576)])
def test_tinygemm_weight_multiplies_as_the_dequantized_int4_weight(n, k):
    torch.manual_seed(0)
    w = quantize(torch.randn(n, k) * 0.05, "int4")
    packed = to_cuda(w, torch.device("cuda"))
    assert isinstance(packed, TinyGemmWeight)
    for m in (1, 7, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ w.dequantize().cuda().T
        got = packed.linear(x, None).float()
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


def test_default_model_int4_on_cuda_mostly_matches_cpu_int4(record_property):
    cpu = LLM(**CPU_REFERENCE, quantization="int4")
    prompts = random_prompts(seed=4, count=8, max_len=60)
    want = [o.token_ids for o in cpu.generate(prompts, GREEDY)]
    gpu = LLM(device="cuda", dtype="bfloat16", quantization="int4",
              kv_cache_memory_bytes=1 << 30)
    model = gpu.engine.runner.model
    assert isinstance(model.layers[0].qkv.weight, TinyGemmWeight)
    assert model._tied_head is not None  # the tied head multiplies packed, not dequantized
    frac = match_fraction([o.token_ids for o in gpu.generate(prompts, GREEDY)], want)
    record_property("int4_cuda_match_fraction", frac)
    print(f"int4 CUDA (bf16) vs CPU int4 (fp32) greedy match fraction {frac:.3f}")
    assert frac >= BF16_MIN_MATCH
    assert gpu.engine.block_manager.num_used_blocks == 0
