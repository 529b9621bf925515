"""Build tiny random Llama / Qwen2 / Qwen3 / Mistral / Phi-3 / Mixtral / Qwen2-MoE / Qwen3-MoE /
Gemma 2 / Gemma 3 checkpoints (GQA) with transformers' own classes."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256
GEMMA_WINDOW = 8  # the tiny Gemma fixtures' sliding window (tests/conftest.py)


def hf_model_classes(arch: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        # image+text Gemma 3 (4B-27B): save_tiny_gemma3_image_text_model builds its config
        "gemma3_image_text": (tf.Gemma3Config, tf.Gemma3ForConditionalGeneration),
    }[arch]


def save_tiny_model(arch: str, out: Path, seed: int = 0, **overrides) -> Path:
    """Save a 2-layer model with 4 query heads over 2 KV heads; returns the directory."""
    config_cls, model_cls = hf_model_classes(arch)
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    _randomize(model)
    model.save_pretrained(out, safe_serialization=True)
    return Path(out)


def save_tiny_gemma3_image_text_model(out: Path, text_config: dict, seed: int = 0) -> Path:
    """A ``Gemma3ForConditionalGeneration`` (the 4B-27B checkpoints' class): ``text_config``'s
    language model beside a one-layer SigLIP vision tower and its projector."""
    import transformers as tf

    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=text_config, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)).eval()
    _randomize(model)
    model.save_pretrained(out, safe_serialization=True)
    return Path(out)


def _randomize(model) -> None:
    # Random init gives near-uniform logits: scale up so greedy argmax has clear winners and
    # token-for-token comparisons are meaningful rather than tie-breaking noise.
    # Biases and norm weights start at 0 / 1: randomize them so a loader that drops them fails.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.add_(torch.randn_like(p) * 0.1)


def load_hf(model_dir: Path, arch: str):
    _, model_cls = hf_model_classes(arch)
    return model_cls.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def random_prompts(seed: int, count: int, max_len: int, min_len: int = 2) -> list[list[int]]:
    """Seeded token-id prompts of mixed lengths (ids 3.. avoid the tiny config's bos/eos)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(count)]


def hf_greedy(model_dir: Path, arch: str, prompts: list[list[int]], max_new_tokens: int,
              **generate_kwargs) -> list[list[int]]:
    """transformers' own greedy ``generate`` per prompt (no EOS stop): the reference tokens.
    ``generate_kwargs``: its logits processors' arguments (``repetition_penalty``, ...)."""
    hf = load_hf(model_dir, arch)
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0, **generate_kwargs)
        refs.append(out[0, len(p):].tolist())
    return refs


def serve_in_turn(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """Run ``prompts`` through an ``LLMEngine`` one after another (each finishes, and frees
    its blocks, before the next arrives); returns each one's generated tokens."""
    outs = []
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"q{i}")
        toks: list[int] = []
        while engine.has_unfinished_requests:
            for o in engine.step():
                toks.extend(o.new_token_ids)
        outs.append(toks)
    return outs
