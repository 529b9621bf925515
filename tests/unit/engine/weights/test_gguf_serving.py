"""``--quantization gguf``: the default model's own Q4_1 / Q8_0 blocks served as they are —
loaded into ``engine.quant.layouts``'s layouts with no fp32 copy read or held, computing with exactly
the weights the fp32 conversion holds, so its greedy tokens are transformers' fp32 ones."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.models.llama import LlamaForCausalLM, QEmbedding, QLinear
from engine.quant.layouts import check_quantization
from engine.weights.converted import QUANTIZED_FILE
from engine.weights.loader import load_quantized_state_dict, load_state_dict, load_weights
from engine.weights.resolve import load_model_config, resolve_model
from tests.unit.engine.weights.test_weights import shared_model_cache

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three colors:"]


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    return resolve_model(None, cache_dir=shared_model_cache(tmp_path_factory))


def test_the_conversion_keeps_the_gguf_blocks(default_model):
    d = default_model.model_dir
    quantized = load_quantized_state_dict(d)
    # 30 layers x 7 projections in Q4_1, the token embedding in Q8_0 (the file's own types)
    assert len(quantized) == 30 * 7 + 1
    assert quantized["model.embed_tokens.weight"].kind == "int8"
    assert quantized["model.embed_tokens.weight"].group == 32
    assert {q.kind for n, q in quantized.items() if n.startswith("model.layers.")} == {"int4"}
    # The fp32 weights of the same names equal the blocks dequantized (q/k rows un-permuted
    # alike), and reading the fp32 file skips what is kept quantized.
    fp = load_state_dict(d, torch.float32)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.7.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(quantized[name].dequantize(), fp[name]), name
    rest = load_state_dict(d, torch.float32, skip=set(quantized))
    assert set(rest) == set(fp) - set(quantized)
    assert all(not n.endswith((".qdata", ".qscale", ".qoffset")) for n in fp)  # not a shard
    assert (d / QUANTIZED_FILE).stat().st_size < (d / "model.safetensors").stat().st_size / 5


def test_gguf_layouts_serve_every_linear_layer_with_the_fp32_weights(default_model):
    cfg = load_model_config(default_model.model_dir, model_id=default_model.model_id)
    model = LlamaForCausalLM(cfg)
    load_weights(model, default_model.model_dir, "gguf")
    assert model.quantization == "int4+int8"
    assert isinstance(model.embed, QEmbedding) and model.lm_head is None  # tied: the Q8_0 table
    fp = load_state_dict(default_model.model_dir, torch.float32)
    for i in (0, 15, 29):
        lay, p = model.layers[i], f"model.layers.{i}."
        assert all(isinstance(getattr(lay, n), QLinear) for n in ("qkv", "o_proj", "gate_up", "down"))
        qkv = torch.cat([fp[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(lay.qkv.weight.dequantize(), qkv)
        gate_up = torch.cat([fp[p + "mlp.gate_proj.weight"], fp[p + "mlp.up_proj.weight"]])
        assert torch.equal(lay.gate_up.weight.dequantize(), gate_up)
        assert torch.equal(lay.input_norm, fp[p + "input_layernorm.weight"])
    # No fp copy of a linear weight is held: what is left in fp32 is norms only.
    assert sum(t.numel() for t in model.parameters()) == 576 * (2 * 30 + 1)


def test_gguf_serving_generates_transformers_fp32_greedy_tokens(default_model):
    """Same weights as the fp32 reference, other kernels: token for token over 4 prompts."""
    from engine import LLM, SamplingParams
    from tests.helpers.hf_reference import greedy_logprobs

    # Untuned (the layer path, cquant everywhere): the fused quantized step is compared with
    # transformers in test_quant; timing the plans here would cost the suite ~40 s.
    llm = LLM(str(default_model.model_dir), quantization="gguf", kv_cache_memory_bytes=16 << 20,
              max_num_seqs=4, tune_kernels=False)
    try:
        prompts = [llm.engine.tokenizer.encode(p) for p in PROMPTS]
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0,
                                                    ignore_eos=True))
        got = [list(o.token_ids) for o in outs]
    finally:
        llm.close()
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == greedy_logprobs(prompt, 16)["tokens"]


def test_gguf_load_holds_no_fp32_copy_of_the_weights(tmp_path):
    """Peak RSS of a fresh process loading the default model (bench.studies.quant_memory):
    with gguf it grows by about the quantized weights (~92 MiB), where the fp32 linear weights
    alone are 513 MiB; with none it holds them (twice, at the peak)."""
    out = subprocess.run([sys.executable, "-m", "bench.studies.quant_memory", "--layouts",
                          "none,gguf", "--json", str(tmp_path / "rows.json")],
                         capture_output=True, text=True, check=True, timeout=600)
    rows = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in ("none", "gguf"):
            rows[parts[0]] = [float(x) for x in parts[2:]]
    quant_mib, _, peak_gguf, _, before_gguf = rows["gguf"]
    _, fp_mib, peak_none, _, _ = rows["none"]
    assert 80 < quant_mib < 110 and fp_mib > 500
    assert peak_gguf - before_gguf < quant_mib + 150  # the blocks, a little slack, no fp32 copy
    assert peak_none - peak_gguf > 400
    saved = {r["quantization"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert saved["gguf"]["layouts"] == "int4+int8" and saved["none"]["layouts"] == "fp32"


def test_gguf_is_refused_where_it_cannot_be_honoured(tiny_llama_dir):
    cfg = load_model_config(tiny_llama_dir)
    with pytest.raises(ValueError, match="holds no GGUF tensors"):
        load_weights(LlamaForCausalLM(cfg), tiny_llama_dir, "gguf")
    check_quantization("gguf", torch.device("cpu"), tp=2)  # each rank reads its blocks
    check_quantization("int4", torch.device("cpu"), tp=2)  # each rank quantizes its shard
