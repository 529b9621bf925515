"""transformers' own forward on the served (default) model's weights, as a reference for
what the server reports about tokens (logprobs, prompt logprobs)."""

from __future__ import annotations

import gc


def default_model_hf():
    """transformers' model of the default model on the fp32 conversion's weights (the GGUF's
    blocks dequantized), in eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.weights.loader import load_state_dict
    from engine.weights.resolve import resolve_model

    model_dir = resolve_model(None).model_dir
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    missing, unexpected = hf.load_state_dict(load_state_dict(model_dir, torch.float32),
                                             strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    hf.tie_weights()
    return hf.eval()


def greedy_logprobs(prompt: list[int], new_tokens: int, top: int = 5) -> dict:
    """The greedy continuation of ``prompt`` (``new_tokens`` ids) under transformers'
    forward on the default model, with: per generated token its log-softmax value and the
    ``top`` most likely (ids, values); per prompt token after the first, its log-softmax
    value given the tokens before it. The model is freed before returning (the suite keeps
    its memory lean)."""
    import torch

    hf = default_model_hf()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        every = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    ref = every[len(prompt) - 1:-1]
    tokens = ids[len(prompt):]
    best = torch.topk(ref, top)
    out = {"prompt": list(prompt), "tokens": tokens,
           "logprobs": [ref[i, t].item() for i, t in enumerate(tokens)],
           "top_ids": best.indices.tolist(), "top_values": best.values.tolist(),
           "prompt_logprobs": [every[i - 1, prompt[i]].item() for i in range(1, len(prompt))]}
    del hf, ref, best, every
    gc.collect()
    return out


def default_model_embeddings(prompts: list[list[int]], pooling: str = "last") -> list:
    """transformers' final hidden states (the last norm applied) of each prompt on the
    default model, pooled (``last`` | ``mean`` | ``cls``) and L2-normalized: what
    ``/v1/embeddings`` must return. The model is freed before returning."""
    import torch

    hf = default_model_hf()
    out = []
    with torch.no_grad():
        for p in prompts:
            h = hf.model(input_ids=torch.tensor([p])).last_hidden_state[0]
            v = {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0]}[pooling]
            out.append(torch.nn.functional.normalize(v, dim=0))
    del hf
    gc.collect()
    return out
