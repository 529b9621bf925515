"""The batched LoRA of one step (engine.lora.rows): the C kernel (``lora_apply``, one call per
projection for every adapter's rows) against the torch twin and against the plain formula
``y + s B A x``, with rows of three adapters and of the base interleaved."""

from __future__ import annotations

import pytest
import torch

import engine.lora.rows as lora_rows
from engine.lora.peft_format import load_adapter
from engine.lora.request import LoRARequest
from engine.ops import cpu_ops
from engine.weights.resolve import load_model_config
from tests.helpers.lora import ALL_TARGETS, save_adapter


@pytest.fixture(scope="module")
def three(tiny_llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("rows")
    cfg = load_model_config(tiny_llama_dir)
    specs = [dict(r=4, targets=["q_proj", "v_proj"]), dict(r=8, targets=ALL_TARGETS,
                                                          use_rslora=True),
             dict(r=2, targets=["k_proj", "up_proj", "down_proj"])]
    out = []
    for i, spec in enumerate(specs):
        path = save_adapter(tiny_llama_dir, "llama", d / f"a{i}", seed=i, **spec)
        out.append(load_adapter(LoRARequest(f"a{i}", i + 1, str(path)), cfg, 16))
    return cfg, out


class _Chunk:
    def __init__(self, name, n):
        self.lora_name, self.num_tokens = name, n


@pytest.mark.skipif(not cpu_ops.enabled(), reason="needs the C kernels")
@pytest.mark.parametrize("proj", ["qkv", "o_proj", "gate_up", "down"])
def test_the_kernel_equals_the_torch_twin_and_the_formula(three, proj, monkeypatch):
    cfg, adapters = three
    chunks = [_Chunk("a1", 3), _Chunk(None, 2), _Chunk("a0", 1), _Chunk("a2", 4),
              _Chunk("a1", 1), _Chunk(None, 1)]
    rows = lora_rows.LoRARows.of(chunks, {a.name: a for a in adapters}.__getitem__)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    k, n = {"qkv": (cfg.hidden_size, q + 2 * kv), "o_proj": (q, cfg.hidden_size),
            "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size),
            "down": (cfg.intermediate_size, cfg.hidden_size)}[proj]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, k, generator=g), torch.randn(12, n, generator=g)
    layer = 1
    # the plain formula, row by row
    want = y.clone()
    at = 0
    for c in chunks:
        for i in range(at, at + c.num_tokens):
            if c.lora_name is None:
                continue
            p = adapters[int(c.lora_name[1])].layers[layer].get(proj)
            if p is None:
                continue
            t = p.a @ x[i]
            for o0, o1, r0, r1, b in p.parts:
                want[i, o0:o1] += b @ t[r0:r1]
        at += c.num_tokens
    assert not torch.equal(want, y)  # something was added
    got_c = y.clone()
    rows.add(layer, proj, x, got_c)
    monkeypatch.setattr(lora_rows, "library", lambda: None)  # the torch twin
    got_torch = y.clone()
    rows.add(layer, proj, x, got_torch)
    torch.testing.assert_close(got_c, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_torch, want, rtol=1e-5, atol=1e-5)
    base_rows = [3, 4, 11]  # the base model's rows are untouched
    assert torch.equal(got_c[base_rows], y[base_rows])
