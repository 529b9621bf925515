"""The batched LoRA of one step (engine.lora.rows): the C kernel (``lora_apply``, one call per
projection for every adapter's rows) against the torch twin and against the plain formula
``y + s B A x``, with rows of three adapters and of the base interleaved."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import engine.lora.rows as lora_rows
from engine.lora.peft_format import b_matrix, load_adapter
from engine.lora.request import LoRARequest
from engine.ops import cpu_ops
from engine.weights.resolve import load_model_config
from tests.helpers.decode_step import BLOCK, five_rows
from tests.helpers.lora import ALL_TARGETS, save_adapter


@pytest.fixture(scope="module", params=["float32", "float16", "int8"])
def three(tiny_llama_dir, tmp_path_factory, request):
    """Three adapters held in fp32, fp16 or int8 (``lora_dtype``: the kernel converts as it
    reads; int8 with a scale per rank row)."""
    d = tmp_path_factory.mktemp("rows")
    cfg = load_model_config(tiny_llama_dir)
    dtype = getattr(torch, request.param)
    specs = [dict(r=4, targets=["q_proj", "v_proj"]), dict(r=8, targets=ALL_TARGETS,
                                                          use_rslora=True),
             dict(r=2, targets=["k_proj", "up_proj", "down_proj"])]
    out = []
    for i, spec in enumerate(specs):
        path = save_adapter(tiny_llama_dir, "llama", d / f"a{i}", seed=i, **spec)
        out.append(load_adapter(LoRARequest(f"a{i}", i + 1, str(path)), cfg, 16, dtype))
    return cfg, out


class _Chunk:
    def __init__(self, name, n):
        self.lora_name, self.num_tokens = name, n


def _formula(adapters, chunks, layer, proj, x, y):
    """``y + s B A x`` row by row (each chunk's adapter ``a<i>`` is ``adapters[i]``)."""
    want = y.clone()
    at = 0
    for c in chunks:
        for i in range(at, at + c.num_tokens):
            if c.lora_name is None:
                continue
            p = adapters[int(c.lora_name[1:])].layers[layer].get(proj)
            if p is None:
                continue
            t = p.a.float() @ x[i]
            if p.scale is not None:  # int8: A's row scale times B's
                t = t * p.scale
            for part in p.parts:
                o0, o1, r0, r1, _ = part
                want[i, o0:o1] += b_matrix(part).float() @ t[r0:r1]
        at += c.num_tokens
    return want


def _shapes(cfg, proj):
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (cfg.hidden_size, q + 2 * kv), "o_proj": (q, cfg.hidden_size),
            "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size),
            "down": (cfg.intermediate_size, cfg.hidden_size)}[proj]


@pytest.fixture(scope="module")
def six(three, tiny_llama_dir, tmp_path_factory):
    """``three``'s adapters and three more of other ranks and targets, in ``three``'s dtype:
    enough groups that each of 2 or 3 threads takes whole adapters (``lora_groups_``)."""
    cfg, adapters = three
    d = tmp_path_factory.mktemp("six")
    dtype = adapters[0].layers[0]["qkv"].a.dtype
    specs = [dict(r=16, targets=ALL_TARGETS), dict(r=3, targets=["o_proj", "gate_proj"]),
             dict(r=5, targets=["q_proj", "down_proj", "up_proj"])]
    more = []
    for i, spec in enumerate(specs, start=3):
        path = save_adapter(tiny_llama_dir, "llama", d / f"a{i}", seed=i, **spec)
        more.append(load_adapter(LoRARequest(f"a{i}", i + 1, str(path)), cfg, 16, dtype))
    return cfg, [*adapters, *more]


def test_an_unloaded_or_evicted_adapter_is_not_kept_alive_by_a_remembered_grouping(
        tiny_llama_dir, tmp_path):
    """The grouping a thread remembers for its next step (``of_layout``) holds its adapters:
    an unload or an LRU eviction drops it, so an idle engine (or a follower rank whose next
    steps run no adapter) holds no adapter past ``max_cpu_loras``."""
    import gc
    import weakref

    from engine.lora.registry import LoRARegistry

    cfg = load_model_config(tiny_llama_dir)
    reqs = [LoRARequest(f"b{i}", i + 1, str(save_adapter(
        tiny_llama_dir, "llama", tmp_path / f"b{i}", seed=i, r=4, targets=["q_proj"])))
        for i in range(2)]
    reg = LoRARegistry(cfg, max_loras=1, max_lora_rank=8)
    for leave in ("unload", "evict"):
        first = weakref.ref(reg.load(reqs[0]))
        assert lora_rows.LoRARows.of([_Chunk("b0", 1)], reg.get) is not None  # remembered
        if leave == "unload":
            reg.unload("b0")
        else:
            reg.load(reqs[1])  # max_cpu_loras 1: b0 is evicted
            reg.unload("b1")
        gc.collect()
        assert first() is None, leave


@pytest.mark.skipif(not cpu_ops.enabled(), reason="needs the C kernels")
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("proj", ["qkv", "o_proj", "gate_up", "down"])
def test_many_adapters_split_by_adapter_among_threads_equal_the_formula(six, proj, threads):
    """Six adapters on 2 or 3 threads: each thread shrinks and expands whole adapters (no
    barrier between the phases), some adapters not adapting the projection; equal to the
    formula within fp32 rounding (1e-5), base rows untouched."""
    cfg, adapters = six
    chunks = [_Chunk("a5", 2), _Chunk("a1", 3), _Chunk(None, 1), _Chunk("a3", 2),
              _Chunk("a0", 1), _Chunk("a4", 2), _Chunk("a2", 1), _Chunk("a3", 1),
              _Chunk(None, 2)]
    rows = lora_rows.LoRARows.of(chunks, {a.name: a for a in adapters}.__getitem__)
    k, n = _shapes(cfg, proj)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(15, k, generator=g), torch.randn(15, n, generator=g)
    want = _formula(adapters, chunks, 1, proj, x, y)
    assert not torch.equal(want, y)
    held = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernel runs on torch's thread count
    try:
        got = y.clone()
        rows.add(1, proj, x, got)
    finally:
        torch.set_num_threads(held)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[[5, 13, 14]], y[[5, 13, 14]])


def test_a_repeated_layout_reuses_its_grouping_until_an_adapter_changes(three):
    """Decode steps repeat their layout: the same grouping comes back while every adapter
    is the same object; a reloaded adapter (a new object of the same name) makes a new one."""
    _, adapters = three
    held = {a.name: a for a in adapters}
    chunks = [_Chunk("a1", 1), _Chunk(None, 1), _Chunk("a0", 1)]
    first = lora_rows.LoRARows.of(chunks, held.__getitem__)
    assert lora_rows.LoRARows.of(chunks, held.__getitem__) is first
    other = [_Chunk("a0", 1), _Chunk(None, 1), _Chunk("a1", 1)]
    assert lora_rows.LoRARows.of(other, held.__getitem__) is not first
    again = lora_rows.LoRARows.of(other, held.__getitem__)
    held["a0"] = dataclasses.replace(held["a0"])  # reloaded: same name, another object
    renewed = lora_rows.LoRARows.of(other, held.__getitem__)
    assert renewed is not again
    assert [a for _, a in renewed.groups] == [held["a0"], held["a1"]]


@pytest.mark.skipif(not cpu_ops.enabled(), reason="needs the C kernels")
@pytest.mark.parametrize("proj", ["qkv", "o_proj", "gate_up", "down"])
def test_the_kernel_equals_the_torch_twin_and_the_formula(three, proj, monkeypatch):
    cfg, adapters = three
    chunks = [_Chunk("a1", 3), _Chunk(None, 2), _Chunk("a0", 1), _Chunk("a2", 4),
              _Chunk("a1", 1), _Chunk(None, 1)]
    rows = lora_rows.LoRARows.of(chunks, {a.name: a for a in adapters}.__getitem__)
    k, n = _shapes(cfg, proj)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, k, generator=g), torch.randn(12, n, generator=g)
    layer = 1
    want = _formula(adapters, chunks, layer, proj, x, y)  # the plain formula, row by row
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


@pytest.mark.skipif(not cpu_ops.enabled(), reason="needs the C kernels")
@pytest.mark.parametrize("step", ["fused", "wide", "qint", "qpanel", "qint4", "qpanel4"])
def test_the_fused_decode_step_adds_the_adapters_as_the_layer_path_does(tiny_llama_dir, three,
                                                                       step):
    """A pure-decode step of five sequences (two adapters, the base, a third adapter) as one
    ``decode_layers`` call with the step's LoRA rows equals the layer path under the same
    rows: the hidden states and the new K/V. Wide tiles asked for: the kernel takes the dot
    tiles (LoRA reads row layouts). int8 and int4 weights (``...4``): the integer products
    (row tiles, panels)."""
    from engine.attention.torch_paged import TorchPagedBackend, decode_tables
    from engine.models.llama import LlamaForCausalLM
    from engine.weights.loader import load_state_dict

    kind = "int4" if step.endswith("4") else "int8"
    step = step.rstrip("4")
    if step == "qpanel" and not cpu_ops.panels_built():
        pytest.skip("this host's build has no panels (AVX-512 VNNI only)")
    cfg, adapters = three
    model = LlamaForCausalLM(cfg)
    model.load_hf_state_dict(load_state_dict(tiny_llama_dir, torch.float32))
    ints = step in ("qint", "qpanel")
    if ints:
        model.quantize(kind)
    step_in = five_rows(cfg)
    block, caches, fused_caches = BLOCK, step_in.caches, step_in.fused_caches
    meta, ids = step_in.meta, step_in.ids
    chunks = [_Chunk(n, 1) for n in ("a1", "a0", None, "a2", "a1")]
    rows = lora_rows.LoRARows.of(chunks, {a.name: a for a in adapters}.__getitem__)
    backend = TorchPagedBackend()
    with torch.inference_mode():
        backend.plan(meta)
        if ints:  # the layer path on the same integer products
            from engine.ops.linear import (
                LINEAR_BUCKETS,
                LinearPlan,
                linear_plan,
                set_linear_plan,
                weight_key,
            )
            from engine.tuning.linear import model_linear_weights
            held = linear_plan()
            path = "cqpanel" if step == "qpanel" else "cqint"
            set_linear_plan(LinearPlan({(*weight_key(w)[:2], b, weight_key(w)[2]): path
                                        for w in model_linear_weights(model)
                                        for b in LINEAR_BUCKETS}))
        try:
            with lora_rows.using(rows):
                ref = model(ids, meta.positions, caches, backend)
        finally:
            if ints:
                set_linear_plan(held)
        base = model.decode_fused(ids, meta.positions, [c.clone() for c in caches],
                                  *decode_tables(meta), block,
                                  1 if step == "wide" else cpu_ops.NEVER_WIDE, ints,
                                  panels=step == "qpanel")
        got = model.decode_fused(ids, meta.positions, fused_caches, *decode_tables(meta), block,
                                 1 if step == "wide" else cpu_ops.NEVER_WIDE, ints,
                                 panels=step == "qpanel", lora=rows)
    assert got is not None and base is not None
    assert not torch.allclose(base[[0, 1, 3, 4]], got[[0, 1, 3, 4]], atol=1e-3)  # adapted
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[2], base[2], rtol=1e-5, atol=1e-5)  # the base's row
    slots = step_in.slots
    for a, b in zip(fused_caches, caches, strict=True):
        torch.testing.assert_close(a[slots[0], :, slots[1]], b[slots[0], :, slots[1]],
                                   rtol=1e-4, atol=1e-4)


def test_int8_rounding_keeps_each_projections_lora_within_two_percent(tiny_llama_dir, tmp_path):
    """int8 adapters (a scale per rank row of A and of B) against the same adapter in fp32:
    each projection's added product ``s B A x`` within 2% (relative, over the rows; 0.8-1.2%
    seen); each value is rounded to half of 1/127 of its row's largest."""
    cfg = load_model_config(tiny_llama_dir)
    path = save_adapter(tiny_llama_dir, "llama", tmp_path / "a", seed=7, r=8,
                        targets=ALL_TARGETS)
    req = LoRARequest("a0", 1, str(path))
    full, q8 = (load_adapter(req, cfg, 16, dtype) for dtype in (torch.float32, torch.int8))
    chunks = [_Chunk("a0", 6)]
    g = torch.Generator().manual_seed(2)
    for proj in ("qkv", "o_proj", "gate_up", "down"):
        k, n = _shapes(cfg, proj)
        x, y = torch.randn(6, k, generator=g), torch.zeros(6, n)
        want = _formula([full], chunks, 0, proj, x, y)
        got = y.clone()
        lora_rows.LoRARows.of(chunks, {"a0": q8}.__getitem__).add(0, proj, x, got)
        assert (got - want).norm() <= 0.02 * want.norm(), proj
