"""Weight-only quantization (engine.quant.layouts, ``--quantization``): the layouts, our C kernels and
every linear path against the dequantized reference, the tuning, and whole models — logits and
greedy tokens equal transformers' forward on the *dequantized* weights (the quantization error
itself is the bench's to state: ``pdcluster bench sweep --quantization none,int8,int4``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import CacheConfig, cdiv
from engine.executor.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM, QLinear
from engine.models.quantized import QEmbedding
from engine.ops import cpu_ops, quant_ops
from engine.ops.linear import INT_PATHS, QPATHS, quantized_linear_by_path
from engine.quant.layouts import (
    INT4_GROUP,
    QuantizedWeight,
    check_quantization,
    pack_int4,
    quantize,
    unpack_int4,
)
from engine.tuning.linear import time_choices
from engine.weights.loader import load_state_dict
from engine.weights.resolve import load_model_config
from tests.helpers.quantized import dequantized_hf, near_greedy_misses, quantized_runner
from tests.helpers.tiny_models import VOCAB, load_hf, random_prompts
from tests.unit.engine.ops.test_int_products import rounded

BLOCK_SIZE = 4
# Every path computes with exactly the dequantized weights; only the order of the float sums
# differs (and a scale applied per group rather than per weight): relative 1e-5 of the output.
KERNEL_RTOL = 1e-5


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantizing_rounds_each_weight_to_its_nearest_level(kind):
    w = _rand(24, 128)
    q = quantize(w, kind)
    err = (q.dequantize() - w).abs()
    n, k = w.shape
    step = q.scale.float().repeat_interleave(q.group, dim=1)
    # half a level, plus the fp16 rounding of the scale (int8) or of the offset (int4)
    assert (err <= step * 0.5 + w.abs() * 2e-3 + 1e-3).all()
    assert q.shape == (n, k) and q.dequantize().shape == (n, k)
    if kind == "int8":
        assert q.group == 32 and q.data.dtype == torch.int8  # GGUF Q8_0's blocks
        assert q.nbytes == n * k + n * (k // 32) * 2
    else:
        assert q.group == INT4_GROUP and q.data.shape == (n, k // 2)
        assert q.nbytes == n * k // 2 + 2 * n * (k // INT4_GROUP) * 2


def test_int4_packing_puts_runs_of_8_weights_in_each_half_of_a_block():
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_int4(q)
    assert torch.equal(unpack_int4(packed), q)
    # byte 8 h + j of a 32-weight block: weights 16 h + j (low nibble) and 16 h + 8 + j (high)
    assert int(packed[0, 0]) == int(q[0, 0]) | int(q[0, 8]) << 4
    assert int(packed[0, 9]) == int(q[0, 17]) | int(q[0, 25]) << 4
    assert int(packed[1, 17]) == int(q[1, 33]) | int(q[1, 41]) << 4  # the second block


def test_a_layout_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(_rand(4, 48), "int4")
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        quantize(_rand(4, 64), "int3")
    good = quantize(_rand(4, 64), "int4")
    with pytest.raises(ValueError, match="one scale per 32"):
        QuantizedWeight("int4", good.data, good.scale[:, :1], good.offset, 32)


@pytest.mark.skipif(not cpu_ops.enabled(), reason="needs the C kernels (built on every test host)")
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("with_bias", [False, True])
def test_c_kernel_equals_the_dequantized_weight(kind, m, with_bias):
    # 37 rows: the 4- and 2-row tiles and a leftover row; K = 160: five 32-weight blocks
    w, x = _rand(37, 160, seed=m), _rand(m, 160, seed=100 + m)
    bias = _rand(37, seed=7) if with_bias else None
    q = quantize(w, kind)
    got = quant_ops.quantized_linear(x, q, bias)
    ref = F.linear(x, q.dequantize(), bias)
    assert got is not None
    assert (got - ref).abs().max() <= KERNEL_RTOL * ref.abs().max()


@pytest.mark.skipif(not cpu_ops.enabled(), reason="needs the C kernels")
def test_int8_with_one_scale_per_row_runs_too():
    # The layout takes any group that is a multiple of 16 dividing K (e.g. a whole row).
    w = _rand(9, 96)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).half()
    data = torch.round(w / scale.float()).clamp(-127, 127).to(torch.int8)
    per_row = QuantizedWeight("int8", data, scale, None, 96)
    x = _rand(3, 96, seed=2)
    ref = F.linear(x, per_row.dequantize())
    got = quant_ops.quantized_linear(x, per_row, None)
    assert (got - ref).abs().max() <= KERNEL_RTOL * ref.abs().max()
    # groups of 32 (what --quantization int8 makes) follow the weights more closely
    grouped = quantize(w, "int8")
    assert (grouped.dequantize() - w).abs().mean() < (per_row.dequantize() - w).abs().mean()


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("path", QPATHS)
def test_every_linear_path_equals_the_dequantized_weight(kind, path):
    w, x = _rand(40, 64), _rand(6, 64, seed=1)
    q = quantize(w, kind)
    if path in INT_PATHS:  # they round x first (test_int_products); x on that grid stays
        x = rounded(x)
    ref = F.linear(x, q.dequantize())
    got = quantized_linear_by_path(path, x, q, None)
    assert (got - ref).abs().max() <= KERNEL_RTOL * ref.abs().max()
    assert got.dtype == torch.float32  # an fp32 model's activations are never rounded to bf16


def test_bf16_models_take_the_dequantizing_path():
    q = quantize(_rand(40, 64).bfloat16(), "int8")
    x = _rand(6, 64, seed=1).bfloat16()
    got = quantized_linear_by_path("cquant", x, q, None)  # the C kernel is fp32 only
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(x, q.dequantize(torch.bfloat16)))


def test_tuning_times_the_quantized_paths_per_kind():
    # 768 x 512 int8 is 408 KiB with its scales: above the size worth timing
    weights = [quantize(_rand(768, 512, seed=i), "int8") for i in range(2)]
    weights.append(quantize(_rand(2048, 512), "int4"))
    timings = time_choices(weights, buckets=(1, 128), repeats=1)
    keys = {(t.n, t.k, t.kind, t.m) for t in timings}
    assert keys == {(768, 512, "int8", 1), (768, 512, "int8", 128), (2048, 512, "int4", 1),
                    (2048, 512, "int4", 128)}
    for t in timings:
        assert set(t.seconds) <= set(QPATHS) and t.best in t.seconds


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral",
                                  "qwen2_moe"])
def test_quantized_logits_equal_transformers_on_the_dequantized_weights(arch, kind, request,
                                                                         tmp_path):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    runner = quantized_runner(model_dir, kind)
    for lay in runner.model.layers:
        assert all(isinstance(getattr(lay, n), QLinear) for n in (
            ("qkv", "o_proj") if lay.moe is not None else ("qkv", "o_proj", "gate_up", "down")))
        if lay.moe is not None:  # every expert, and the shared one, held quantized
            assert all(isinstance(w, QuantizedWeight) and w.kind == kind
                       for w in [*lay.moe.gate_up, *lay.moe.down]
                       + ([lay.moe.shared["gate_up"], lay.moe.shared["down"]]
                          if lay.moe.shared is not None else []))
    hf = dequantized_hf(model_dir, arch, kind, tmp_path / "deq")
    plain = load_hf(model_dir, arch)
    gen = torch.Generator().manual_seed(1)
    for length in (1, 9, 40):
        ids = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
        blocks = torch.randperm(64, generator=gen)[: cdiv(length, 8)].tolist()
        ours = runner.compute_logits_for_prompt(ids, blocks)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
            unquantized = plain(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max() / ref.abs().max() < 1e-4
        # ...and the quantization did change the model (the comparison is not fp vs fp)
        assert (ours - unquantized).abs().max() / ref.abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_engine_generates_transformers_greedy_tokens(tiny_llama_dir, kind, tmp_path):
    """The embedded engine (scheduler, paged KV, the tuned decode paths at several batch
    sizes) with ``quantization=kind`` generates transformers' greedy tokens on the
    dequantized weights, up to near-ties (the host's plan may round activations to int8:
    ``NEAR_GREEDY_TOL``)."""
    from engine import LLM, SamplingParams

    hf = dequantized_hf(tiny_llama_dir, "llama", kind, tmp_path / "deq")
    prompts = random_prompts(seed=5, count=5, max_len=30)
    llm = LLM(str(tiny_llama_dir), quantization=kind, kv_cache_memory_bytes=8 << 20,
              max_num_seqs=4)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                    ignore_eos=True))
        tokens = [o.token_ids for o in outs]
        assert near_greedy_misses(hf, prompts, tokens) == []
        # and the check can fail: the same tokens shifted by one are far from greedy
        assert near_greedy_misses(hf, prompts, [t[1:] + t[:1] for t in tokens])
        assert llm.engine.model.quantization == kind
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    finally:
        llm.close()


def test_quantization_is_refused_where_it_cannot_be_honoured(tiny_qwen3_moe_dir):
    from engine import LLM

    # The tiny Qwen3-MoE's experts are 48 wide: their down projection's rows do not split
    # into 32-weight groups (real checkpoints' do: 768, 14336, ...).
    with pytest.raises(ValueError, match=r"multiple of 32; a weight \[64, 48\] is not"):
        LLM(str(tiny_qwen3_moe_dir), quantization="int4", kv_cache_memory_bytes=4 << 20)
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4, gguf"):
        check_quantization("int3", torch.device("cpu"))
    # on CUDA: int4 in bf16 only (tinygemm); int8 / gguf have no grouped kernel there
    for kind in ("int8", "gguf"):
        with pytest.raises(ValueError, match=rf"'{kind}' on cuda: .*one scale per row"):
            check_quantization(kind, torch.device("cuda"))
    with pytest.raises(ValueError, match="multiplies bf16 activations.*'float32'"):
        check_quantization("int4", torch.device("cuda"), dtype="float32")
    check_quantization("int4", torch.device("cuda"), dtype="bfloat16")
    check_quantization("none", torch.device("cuda"))


def test_the_quantization_choices_are_auto_none_the_layouts_kinds_and_gguf():
    # engine.config spells them (torch-free, for the router); the layouts define the kinds.
    from engine.config import QUANTIZATION_CHOICES
    from engine.quant.layouts import KINDS

    assert ("auto", "none", *KINDS, "gguf") == QUANTIZATION_CHOICES


def test_auto_serves_a_ggufs_blocks_where_gguf_runs_and_fp_elsewhere():
    from engine.config import resolve_quantization

    assert resolve_quantization("auto", True, "cpu") == "gguf"
    assert resolve_quantization("auto", False, "cpu") == "none"  # not a GGUF
    assert resolve_quantization("auto", True, "cuda") == "none"  # no GGUF kernels on GPU
    assert resolve_quantization("int4", True, "cpu") == "int4"  # asked for: as it is


def test_an_hf_model_under_the_default_is_served_in_fp(tiny_llama_dir):
    from engine import LLM

    with LLM(str(tiny_llama_dir), kv_cache_memory_bytes=4 << 20) as llm:  # quantization auto
        assert llm.engine.model.quantization is None


def test_serve_refuses_a_bad_quantization_and_passes_a_good_one():
    from router.cli.serve_config import ServeConfig

    with pytest.raises(ValueError, match="--quantization must be one of"):
        ServeConfig(quantization="fp4")
    with pytest.raises(ValueError, match="not with --device cuda"):
        ServeConfig(quantization="int8", device="cuda")
    cluster = ServeConfig(quantization="int4").cluster_config()
    assert cluster.prefill_engine.quantization == cluster.decode_engine.quantization == "int4"


@pytest.mark.skipif(not cpu_ops.enabled(), reason="needs the C kernels")
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("lengths", [[9], [4, 1, 13, 8, 30], [(7 * i) % 23 + 1 for i in range(13)]],
                         ids=["batch1", "batch5", "batch13"])
@pytest.mark.parametrize("wide_from", [cpu_ops.NEVER_WIDE, 1], ids=["dot", "wide"])
def test_fused_decode_steps_of_a_quantized_model_match_transformers(arch, kind, lengths,
                                                                    wide_from, request,
                                                                    tmp_path):
    """The whole-step decode kernel reading int8 / int4 projections (decode_layers' quantized
    dot-product tiles, or the wide tiles on each tile of weight rows expanded: the "qwide"
    step): three steps of every sequence equal transformers' forward on the dequantized
    weights. Qwen2: the QKV bias; Qwen3: the per-head norms."""
    from tests.unit.engine.executor.test_fused_decode import BLOCK, fused_steps_match

    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    model = LlamaForCausalLM(load_model_config(model_dir))
    model.load_hf_state_dict(load_state_dict(model_dir, torch.float32))
    model.quantize(kind)
    runner = ModelRunner(model, CacheConfig(block_size=BLOCK), 256)
    hf = dequantized_hf(model_dir, arch, kind, tmp_path / "deq")
    fused_steps_match(runner, hf, lengths, wide_from, f"{arch} {kind}")


def test_fused_decode_declines_projections_in_mixed_layouts(tiny_llama_dir):
    cfg = load_model_config(tiny_llama_dir)
    model = LlamaForCausalLM(cfg)
    model.load_hf_state_dict(load_state_dict(tiny_llama_dir, torch.float32))
    assert model._projection_layout() == (0, 0)
    fp_down = model.layers[1].down.weight
    model.quantize("int4")
    assert model._projection_layout() == (2, 32)
    model.layers[1].down = QLinear(quantize(fp_down, "int8"), None)  # one int8 among int4
    assert model._projection_layout() is None
    assert model.decode_fused(torch.tensor([5]), torch.tensor([0]), [], torch.zeros(1, 1),
                              torch.ones(1), BLOCK_SIZE) is None


@pytest.mark.skipif(not cpu_ops.enabled(), reason="needs the C kernels")
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_c_expansion_equals_the_reference_expansion(kind):
    q = quantize(_rand(37, 160), kind)
    assert torch.equal(quant_ops.dequantize(q), q.dequantize())


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_a_quantized_embedding_lookup_equals_the_dequantized_tables_rows(kind, rows):
    # a decode step's few rows (one thread) and a prompt's many, repeats included; the C
    # expansion where it runs, torch's elsewhere: the same floats either way
    table = quantize(_rand(301, 96), kind)
    ids = torch.randint(301, (rows,), generator=torch.Generator().manual_seed(rows))
    got = QEmbedding(table)(ids)
    assert torch.equal(got, table.dequantize()[ids])
