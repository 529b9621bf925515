"""LoRA adapters behind the embedded backend (one in-process engine: `pdcluster generate
--local` and the front doors' own tests): load, select by ``model``, list, unload, and the
errors a client sees, each adapter's tokens equal to ``peft``'s."""

from __future__ import annotations

import asyncio

import pytest

from engine import EngineArgs, SamplingParams
from router.contract import (
    AdapterInUseError,
    GenerateInput,
    InvalidRequestError,
    ModelNotFoundError,
)
from router.embedded import EngineBackend
from tests.helpers.lora import peft_greedy, save_adapter
from tests.helpers.tiny_models import VOCAB, random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


async def _tokens(backend, prompt, model=None, params=GREEDY) -> list[int]:
    toks: list[int] = []
    async for ch in backend.generate(GenerateInput(params, token_ids=prompt, model=model)):
        toks += ch.token_ids
    return toks


def test_adapters_load_serve_list_and_unload(tiny_llama_dir, tmp_path):
    a = save_adapter(tiny_llama_dir, "llama", tmp_path / "a", r=4, alpha=8, seed=31)
    prompts = random_prompts(seed=31, count=2, max_len=20, min_len=6)
    ref_a = peft_greedy(tiny_llama_dir, "llama", a, prompts, 8)
    ref_base = peft_greedy(tiny_llama_dir, "llama", None, prompts, 8)
    backend = EngineBackend(EngineArgs(model=str(tiny_llama_dir), enable_lora=True,
                                       block_size=4))
    base = backend.model_info().model_id

    async def body():
        await backend.load_lora_adapter("a", str(a))
        outs = await asyncio.gather(_tokens(backend, prompts[0], "a"),
                                    _tokens(backend, prompts[1]),
                                    _tokens(backend, prompts[1], "a"))
        served = [(m.id, m.parent, m.root) for m in backend.served_models()]
        for bad in (GenerateInput(GREEDY, token_ids=[VOCAB + 5], model="a"),  # the engine's
                    GenerateInput(GREEDY, token_ids=prompts[0], model="a", priority=5000)):
            with pytest.raises(InvalidRequestError):  # refused: not counted below
                async for _ in backend.generate(bad):
                    pass
        long = asyncio.ensure_future(_tokens(backend, prompts[0], "a", SamplingParams(
            max_tokens=400, temperature=0, ignore_eos=True)))
        while not backend.engine.scheduler.running:
            await asyncio.sleep(0.001)
        errors = []
        for call in (lambda: backend.unload_lora_adapter("a"),
                     lambda: backend.load_lora_adapter("a", str(a)),
                     lambda: backend.load_lora_adapter("b", str(tmp_path / "none"))):
            try:
                await call()
            except InvalidRequestError as e:
                errors.append((type(e), str(e)))
        await long
        await backend.unload_lora_adapter("a")
        for call in (lambda: _tokens(backend, prompts[0], "a"),
                     lambda: backend.unload_lora_adapter("a")):
            try:
                await call()
            except ModelNotFoundError as e:
                errors.append((type(e), str(e)))
        stats = await backend.stats()
        return outs, served, errors, stats

    try:
        outs, served, errors, stats = asyncio.run(body())
    finally:
        asyncio.run(backend.shutdown())
    assert outs == [ref_a[0], ref_base[1], ref_a[1]]
    assert served == [(base, None, None), ("a", base, str(a))]
    kinds = [k for k, _ in errors]
    assert kinds == [AdapterInUseError, InvalidRequestError, InvalidRequestError,
                     ModelNotFoundError, ModelNotFoundError], errors
    assert "in use" in errors[0][1] and "already served" in errors[1][1]
    assert "no such directory" in errors[2][1]
    # the three admitted requests under "a"; the two refused ones count nowhere
    assert stats.lora_adapters["a"] == (3, 8 * 2 + 400)
    assert stats.workers[0].lora_adapters == ()


def test_adapters_are_refused_when_lora_is_off(tiny_llama_dir, tmp_path):
    a = save_adapter(tiny_llama_dir, "llama", tmp_path / "a", r=4, alpha=8, seed=32)
    backend = EngineBackend(EngineArgs(model=str(tiny_llama_dir)))
    try:
        with pytest.raises(InvalidRequestError, match="--enable-lora"):
            asyncio.run(backend.load_lora_adapter("a", str(a)))
        assert [m.id for m in backend.served_models()] == [backend.model_info().model_id]
    finally:
        asyncio.run(backend.shutdown())


def test_embeddings_under_an_adapter_are_pefts_hidden_states(tiny_llama_dir, tmp_path):
    """``model`` names the adapter for /v1/embeddings too: the pooled final hidden states of
    transformers + peft's forward, not the base model's."""
    import torch
    from peft import PeftModel

    from router.contract import EmbedInput
    from tests.helpers.tiny_models import load_hf

    a = save_adapter(tiny_llama_dir, "llama", tmp_path / "a", r=4, alpha=8, seed=33,
                     targets=["q_proj", "v_proj", "down_proj"])
    prompt = random_prompts(seed=33, count=1, max_len=20, min_len=12)[0]
    with torch.no_grad():
        peft = PeftModel.from_pretrained(load_hf(tiny_llama_dir, "llama"), str(a)).eval()
        h = peft.base_model.model.model(input_ids=torch.tensor([prompt])).last_hidden_state
        ref = torch.nn.functional.normalize(h[0, -1], dim=0)
    backend = EngineBackend(EngineArgs(model=str(tiny_llama_dir), enable_lora=True))

    async def body():
        await backend.load_lora_adapter("a", str(a))
        return (await backend.embed(EmbedInput([prompt], "a"))).embeddings[0], \
            (await backend.embed(EmbedInput([prompt]))).embeddings[0]

    try:
        under_a, base = asyncio.run(body())
    finally:
        asyncio.run(backend.shutdown())
    cos = torch.nn.functional.cosine_similarity
    assert cos(torch.tensor(under_a), ref, dim=0).item() >= 0.9999
    assert cos(torch.tensor(base), ref, dim=0).item() < 0.999
