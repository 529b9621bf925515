"""Embeddings (``LLM.embed``, ``SamplingParams.pooling``): each pooling of the prompt's final
hidden states equals transformers' (``model.model(ids).last_hidden_state``, the last norm
applied) pooled the same way, cosine >= 0.9999 in fp32; prompts chunked over several steps,
taken partly from the prefix cache, and batched beside generating requests give the same
vectors; nothing is left held."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers.tiny_models import hf_greedy, load_hf, random_prompts


def _hf_embeddings(model_dir, arch: str, prompts, pooling: str, normalize: bool = True):
    model = load_hf(model_dir, arch)
    out = []
    with torch.no_grad():
        for p in prompts:
            h = model.model(input_ids=torch.tensor([p])).last_hidden_state[0]
            v = {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0]}[pooling]
            out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return out


def _cosines(got, refs):
    return [torch.nn.functional.cosine_similarity(torch.tensor(g), r, dim=0).item()
            for g, r in zip(got, refs, strict=True)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_each_pooling_equals_transformers_pooled_hidden_states(
        request, arch, pooling):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = random_prompts(seed=41, count=6, max_len=40, min_len=1)
    refs = _hf_embeddings(model_dir, arch, prompts, pooling)
    # max_num_batched_tokens=16: the longer prompts are computed over several steps, so
    # pooling joins parts (the default budget would hold these prompts whole)
    llm = LLM(str(model_dir), block_size=4, max_num_batched_tokens=16)
    got = llm.embed(prompts, pooling=pooling)
    assert min(_cosines(got, refs)) >= 0.9999
    assert all(abs(torch.tensor(g).norm().item() - 1) < 1e-5 for g in got)
    raw = llm.embed(prompts[:2], pooling=pooling, normalize=False)
    raw_refs = _hf_embeddings(model_dir, arch, prompts[:2], pooling, normalize=False)
    for g, r in zip(raw, raw_refs, strict=True):
        torch.testing.assert_close(torch.tensor(g), r, rtol=1e-4, atol=1e-4)
    again = llm.embed(prompts, pooling=pooling)  # the prompts are cached now
    assert min(_cosines(again, refs)) >= 0.9999
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_embeddings_batched_beside_generation_leave_its_tokens_alone(tiny_llama_dir):
    prompts = random_prompts(seed=42, count=8, max_len=30, min_len=4)
    refs_tokens = hf_greedy(tiny_llama_dir, "llama", prompts[:4], 10)
    refs_vec = _hf_embeddings(tiny_llama_dir, "llama", prompts[4:], "mean")
    llm = LLM(str(tiny_llama_dir), block_size=4)
    gen = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    emb = SamplingParams(max_tokens=1, temperature=0, pooling="mean")
    outs = llm.generate(prompts, [gen] * 4 + [emb] * 4)
    assert [o.token_ids for o in outs[:4]] == refs_tokens
    assert all(o.embedding is None for o in outs[:4])
    assert min(_cosines([o.embedding for o in outs[4:]], refs_vec)) >= 0.9999


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"pooling": "max"}, "pooling must be one of last, mean, cls"),
    ({"pooling": "last", "max_tokens": 4}, "max_tokens must be 1"),
    ({"pooling": "last", "logprobs": 2}, "without structured outputs or logprobs"),
    ({"normalize": "yes"}, "normalize must be true or false"),
])
def test_bad_pooling_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**({"max_tokens": 1} | kwargs))
