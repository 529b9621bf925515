"""Config and SamplingParams validation: every bad value is a ValueError naming the field."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig, num_blocks_for_budget
from engine.contract import SamplingParams
from engine.models.config import ModelConfig

_LLAMA_HF = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "rope_theta": 500000.0, "eos_token_id": [2, 3], "bos_token_id": 1,
}


def _model(**over) -> ModelConfig:
    kw = dict(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
              max_position_embeddings=512)
    kw.update(over)
    return ModelConfig(**kw)


# ---- SamplingParams ---------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(stop=["ok", ""]), "stop"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_validate_catches_fields_changed_after_construction():
    sp = SamplingParams()
    sp.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens"):
        sp.validate()


@pytest.mark.parametrize("kwargs", [
    dict(top_p=1.0), dict(top_p=1e-9), dict(temperature=0.0), dict(top_k=0), dict(top_k=-1),
    dict(max_tokens=1, min_tokens=1),
])
def test_boundary_sampling_params_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


# ---- SchedulerConfig / CacheConfig ----------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(policy="round-robin"), "policy"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(dynamic_window_s=-1.0), "dynamic_window_s"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=2048),
     "max_num_batched_tokens"),
])
def test_bad_scheduler_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize("policy", ["continuous", "static", "dynamic"])
def test_every_policy_is_accepted(policy):
    assert SchedulerConfig(policy=policy).policy == policy


@pytest.mark.parametrize("block_size", [0, -16, 3, 12, 24])
def test_block_size_must_be_power_of_two(block_size):
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=block_size)


def test_cache_memory_must_be_positive():
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        CacheConfig(kv_cache_memory_bytes=0)


# ---- ModelConfig ----------------------------------------------------------------------------
@pytest.mark.parametrize("over, field", [
    (dict(architecture="gpt2"), "architecture"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(dtype="int8"), "dtype"),
])
def test_bad_model_config_names_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        _model(**over)


def test_from_hf_config_rejects_unsupported_architecture():
    cfg = dict(_LLAMA_HF, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="architecture.*GPT2LMHeadModel"):
        ModelConfig.from_hf_config(cfg)


def test_from_hf_config_rejects_unknown_rope_scaling():
    cfg = dict(_LLAMA_HF, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig.from_hf_config(cfg)


def test_from_hf_config_reads_a_llama_config():
    m = ModelConfig.from_hf_config(_LLAMA_HF, model_id="tiny")
    assert (m.architecture, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (
        "llama", 2, 4, 2, 16)
    assert m.eos_token_ids == (2, 3) and m.rope_theta == 500000.0 and m.model_id == "tiny"
    # falls back to model_type when architectures is missing
    no_arch = {k: v for k, v in _LLAMA_HF.items() if k != "architectures"}
    assert ModelConfig.from_hf_config(dict(no_arch, model_type="qwen2")).architecture == "qwen2"


def test_kv_bytes_and_block_budget():
    m = _model(dtype="bfloat16")
    assert m.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert num_blocks_for_budget(m, 16, 10 * 16 * m.kv_bytes_per_token + 5) == 10


def test_sliding_window_no_longer_caps_max_model_len():
    """Windowed layers attend to their window past it
    (tests/unit/engine/models/test_gemma.py proves the tokens), so the context stays the
    model's own."""
    m = _model(sliding_window=128)
    assert m.max_model_len == 512 and m.layer_windows == (128, 128)
    assert _model().max_model_len == 512 and _model().layer_windows == (None, None)
    mixed = _model(sliding_window=128, layer_types=("full_attention", "sliding_attention"))
    assert mixed.layer_windows == (None, 128)
    with pytest.raises(ValueError, match="layer_types names 1 layers"):
        _model(sliding_window=128, layer_types=("full_attention",))


# ---- `pdcluster serve` device flags -> both engines' EngineArgs ------------------------------
def _serve(*argv, yaml_text: str | None = None, tmp_path=None):
    from router.cli.main import build_parser
    from router.cli.serve_config import serve_config_from_args

    if yaml_text is not None:
        f = tmp_path / "serve.yaml"
        f.write_text(yaml_text)
        argv = ("--config", str(f), *argv)
    return serve_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_serve_device_defaults_leave_every_choice_to_the_engine():
    cc = _serve().cluster_config()
    assert cc.use_gpus is None  # GPUs when the Ray cluster has them
    for args in (cc.prefill_engine, cc.decode_engine):
        assert (args.dtype, args.attention_backend, args.cuda_graphs) == ("auto", "auto", None)
        assert args.gpu_memory_utilization == 0.9
        assert args.kv_cache_memory_bytes is None  # 1 GiB on CPU, from GPU memory on GPU


def test_serve_device_flags_reach_both_engines():
    cc = _serve("--device", "cuda", "--dtype", "float16", "--attention-backend", "torch",
                "--no-cuda-graphs", "--gpu-memory-utilization", "0.6",
                "--kv-cache-memory", "2GiB").cluster_config()
    assert cc.use_gpus is True
    for args in (cc.prefill_engine, cc.decode_engine):
        assert (args.dtype, args.attention_backend, args.cuda_graphs) == ("float16", "torch", False)
        assert (args.gpu_memory_utilization, args.kv_cache_memory_bytes) == (0.6, 2 << 30)
    assert _serve("--device", "cpu").cluster_config().use_gpus is False
    assert _serve("--cuda-graphs").cluster_config().decode_engine.cuda_graphs is True


def test_serve_device_settings_from_yaml(tmp_path):
    cfg = _serve("--dtype", "bfloat16", tmp_path=tmp_path, yaml_text=(
        "device: cuda\ndtype: float32\ngpu-memory-utilization: 0.5\ncuda-graphs: false\n"
        "attention_backend: flashinfer\nkv-cache-memory: 512MiB\n"))
    assert (cfg.device, cfg.dtype, cfg.gpu_memory_utilization) == ("cuda", "bfloat16", 0.5)
    assert cfg.cuda_graphs is False and cfg.attention_backend == "flashinfer"
    assert cfg.cluster_config().decode_engine.kv_cache_memory_bytes == 512 << 20


@pytest.mark.parametrize("kwargs, flag", [
    (dict(device="tpu"), "--device"),
    (dict(dtype="int8"), "--dtype"),
    (dict(attention_backend="xformers"), "--attention-backend"),
    (dict(cuda_graphs="yes"), "--cuda-graphs"),
    (dict(gpu_memory_utilization=0.0), "--gpu-memory-utilization"),
    (dict(gpu_memory_utilization=1.2), "--gpu-memory-utilization"),
    (dict(gpu_memory_utilization="most"), "--gpu-memory-utilization"),
    (dict(kv_cache_memory="0"), "--kv-cache-memory"),
    (dict(kv_cache_memory="lots"), "--kv-cache-memory"),
    (dict(device="cpu", attention_backend="flashinfer"), "--attention-backend"),
    (dict(device="cpu", cuda_graphs=True), "--cuda-graphs"),
])
def test_bad_serve_device_settings_name_the_flag(kwargs, flag):
    from router.cli.serve_config import ServeConfig

    with pytest.raises(ValueError, match=flag):
        ServeConfig(**kwargs)


def test_serve_gpu_memory_utilization_of_one_is_allowed():
    from router.cli.serve_config import ServeConfig

    assert ServeConfig(gpu_memory_utilization=1).cluster_config().decode_engine.gpu_memory_utilization == 1.0
