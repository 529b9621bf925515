"""Model loading: default GGUF conversion (checked against transformers' own GGUF loader),
the conversion cache, tiny Hugging Face dirs of every supported family, and clear errors."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine.weights.loader import load_state_dict
from engine.weights.resolve import (
    default_gguf_path,
    gguf_content_key,
    load_model_config,
    resolve_model,
)


def shared_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Same path in test_tokenizer.py: the default model is converted once per pytest session.
    return tmp_path_factory.getbasetemp() / "pdcluster-model-cache"


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    return resolve_model(None, cache_dir=shared_model_cache(tmp_path_factory))


def test_default_gguf_converts_to_hf_dir(default_model):
    d = default_model.model_dir
    assert default_model.source == "gguf"
    assert default_model.model_id == "SmolLM2-135M-Instruct.Q4_1"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (d / name).is_file(), name
    cfg = load_model_config(d, model_id=default_model.model_id)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
        "llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert cfg.max_position_embeddings == 8192 and cfg.eos_token_ids == (2,)
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9
    assert cfg.model_id == "SmolLM2-135M-Instruct.Q4_1"
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]


@pytest.mark.slow
def test_dequantized_weights_equal_transformers_gguf_load(default_model):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = load_state_dict(default_model.model_dir, torch.float32)
    # transformers' own GGUF path (dequantize + reverse Q/K permutation); from_pretrained(gguf_file=)
    # needs accelerate, so call its loader directly with a meta-device model for the name map.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(default_model.model_dir))
    gguf_file = default_gguf_path()
    ref = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(ours) == set(ref)
    assert "lm_head.weight" not in ours  # tied to the embedding
    for name, t in ours.items():
        assert t.dtype == torch.float32
        torch.testing.assert_close(t, torch.as_tensor(ref[name]), rtol=0, atol=1e-6, msg=name)

    # The permutation is real: the raw GGUF rows of q/k differ from the HF-ordered ones.
    reader = gguf.GGUFReader(str(gguf_file))
    raw = {t.name: t for t in reader.tensors}
    for gname, hname in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                         ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight")):
        t = raw[gname]
        raw_rows = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        assert raw_rows.shape == ours[hname].shape
        assert not torch.equal(raw_rows, ours[hname])


def test_conversion_cache_is_reused(default_model, tmp_path_factory):
    weights = default_model.model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = resolve_model(None, cache_dir=shared_model_cache(tmp_path_factory))
    assert again.model_dir == default_model.model_dir
    assert weights.stat().st_mtime_ns == mtime
    # A .gguf path, or a directory holding exactly one .gguf, hit the same cache entry.
    assert resolve_model(default_gguf_path(), shared_model_cache(tmp_path_factory)) == again
    holder = tmp_path_factory.mktemp("holder")
    os.symlink(default_gguf_path(), holder / "model.gguf")
    assert resolve_model(holder, shared_model_cache(tmp_path_factory)).model_dir == again.model_dir
    assert weights.stat().st_mtime_ns == mtime
    # No temp dirs are left behind next to the converted model.
    assert [p.name for p in again.model_dir.parent.iterdir()] == [again.model_dir.name]


def test_conversion_is_keyed_by_content_not_path_or_mtime(tmp_path):
    """Each venv installs the default model at its own path with its own mtime: the same bytes
    must map to the same converted directory (else every clean clone writes another 538 MB
    copy), and a changed byte in the weights to another."""
    original = default_gguf_path()
    copy = tmp_path / "elsewhere" / original.name
    copy.parent.mkdir()
    shutil.copyfile(original, copy)
    os.utime(copy, ns=(1, 1))
    assert gguf_content_key(copy) == gguf_content_key(original)
    size = copy.stat().st_size
    with open(copy, "r+b") as f:  # one byte of the last tensor's data
        f.seek(size - 100)
        byte = f.read(1)
        f.seek(size - 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert gguf_content_key(copy) != gguf_content_key(original)


def _tiny(family: str):
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  eos_token_id=3, bos_token_id=1)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, rope_theta=5000.0, tie_word_embeddings=False))
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8))
    return MistralForCausalLM(MistralConfig(**common, sliding_window=32))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_tiny_hf_dirs_load(family, tmp_path):
    torch.manual_seed(0)
    model = _tiny(family)
    model.save_pretrained(tmp_path)
    resolved = resolve_model(str(tmp_path))
    assert resolved.source == "hf_dir" and resolved.model_dir == tmp_path.resolve()
    cfg = load_model_config(resolved.model_dir, model_id="tiny")
    assert cfg.architecture == family and cfg.model_id == "tiny"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 8)
    assert cfg.eos_token_ids == (3,)
    assert cfg.attention_bias == (family == "qwen2")
    assert cfg.qk_norm == (family == "qwen3")
    if family == "llama":
        assert cfg.rope_theta == 5000.0 and not cfg.tie_word_embeddings
    if family == "mistral":
        assert cfg.sliding_window == 32

    state = load_state_dict(resolved.model_dir, torch.bfloat16)
    ref = {k: v for k, v in model.state_dict().items()
           if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert set(state) == set(ref)
    assert ("model.layers.0.self_attn.q_proj.bias" in state) == (family == "qwen2")
    for name, t in state.items():
        assert t.dtype == torch.bfloat16
        torch.testing.assert_close(t, ref[name].to(torch.bfloat16), msg=name)


def test_sharded_checkpoint_loads_every_shard(tmp_path):
    torch.manual_seed(0)
    model = _tiny("llama")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    state = load_state_dict(tmp_path, torch.float32)
    assert set(state) == set(model.state_dict())


def test_missing_weights_raise(tmp_path):
    _tiny("llama").config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_state_dict(tmp_path, torch.float32)


def test_unknown_paths_raise(tmp_path):
    with pytest.raises(ValueError, match="model path not found"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(tmp_path)  # empty directory


def test_unsupported_hf_architecture_raises(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    resolved = resolve_model(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model_config(resolved.model_dir)


def test_moe_configs_read_their_expert_fields_and_refuse_mixed_layers():
    from engine.models.config import ModelConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    mixtral = ModelConfig.from_hf_config({**base, "architectures": ["MixtralForCausalLM"],
                                          "num_local_experts": 8, "num_experts_per_tok": 2})
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob,
            mixtral.intermediate_size) == (8, 2, True, 64)
    qwen = {**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": False}
    cfg = ModelConfig.from_hf_config(qwen)
    assert (cfg.num_experts, cfg.norm_topk_prob, cfg.intermediate_size, cfg.qk_norm) == (
        8, False, 16, True)
    with pytest.raises(ValueError, match="mlp_only_layers=\\[1\\]"):
        ModelConfig.from_hf_config({**qwen, "mlp_only_layers": [1]})
    with pytest.raises(ValueError, match="num_experts_per_tok \\(9\\) must be in 1..num_experts"):
        ModelConfig.from_hf_config({**qwen, "num_experts_per_tok": 9})


def test_rope_variants_we_do_not_compute_are_refused_by_name():
    """Phi-4-mini's partial rotary and YaRN would load and run with the wrong rotation:
    refused at start-up, naming the field; LongRoPE's factors must fit the heads."""
    from engine.models.config import ModelConfig

    base = dict(architectures=["Phi3ForCausalLM"], vocab_size=64, hidden_size=32,
                intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=131072, original_max_position_embeddings=4096)
    assert ModelConfig.from_hf_config(base).architecture == "phi3"
    longrope = ModelConfig.from_hf_config({**base, "rope_scaling": {
        "type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}}).rope_scaling
    assert (longrope.kind, longrope.factor, longrope.original_max_position_embeddings) == (
        "longrope", 32.0, 4096)
    assert longrope.attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    with pytest.raises(ValueError, match="need head_dim / 2 = 4 values, got 3 / 4"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {
            "type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 4}})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75"):
        ModelConfig.from_hf_config({**base, "rope_parameters": {
            "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}})


def test_a_quantized_checkpoint_is_refused_by_name(tmp_path):
    """An AWQ / GPTQ / FP8 checkpoint keeps Llama's tensor names with packed or fp8 data:
    refused at start-up, naming the method, rather than loaded wrong."""
    model = _tiny("llama")
    model.config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3"}
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="quantized checkpoints are not supported yet .*'fp8'"):
        load_model_config(resolve_model(tmp_path).model_dir)


def test_unsupported_gguf_architecture_raises(tmp_path):
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="'gpt2'"):
        resolve_model(path, cache_dir=cache)
    # The failed conversion leaves nothing half-written in the cache.
    assert list(cache.iterdir()) == []
