"""The whole-step decode kernel (engine/ops/csrc/cpu_ops.c ``decode_layers``, driven by
``LlamaForCausalLM.decode_fused``), on both sets of projection tiles (dot products and wide):
its logits equal transformers' forward pass, it writes the K/V the layer-by-layer path writes
and nothing else, the runner takes it exactly where the host's plan says, and the plan is
timed per bucket and cached."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import SeqSlice, build_metadata
from engine.attention.torch_paged import DecodePaths, TorchPagedBackend, decode_tables
from engine.config import CacheConfig, cdiv
from engine.executor.fused_decode import FUSED_BUCKETS, STEPS, FusedDecodePlan
from engine.executor.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.ops import cpu_ops
from engine.tuning.fused_decode import tune_fused_decode
from engine.tuning.linear import QWIDE_MIN_ROWS
from engine.weights.loader import load_state_dict
from engine.weights.resolve import load_model_config
from tests.helpers.tiny_models import VOCAB, hf_greedy, load_hf, random_prompts

BLOCK = 4
# decode_layers' wide_from per set of tiles: "wide" from the first row, "dot" never
WIDE_FROM = {"dot": cpu_ops.NEVER_WIDE, "wide": 1}


@pytest.fixture(autouse=True)
def kernels_on():
    assert cpu_ops.enabled(), "the fused CPU kernels did not build on this host (see the log)"
    yield
    cpu_ops.set_enabled(True)


def _model(model_dir) -> LlamaForCausalLM:
    model = LlamaForCausalLM(load_model_config(model_dir))
    model.load_hf_state_dict(load_state_dict(model_dir, torch.float32))
    return model


def _batch(lengths, gen):
    """Prompts of these lengths and shuffled, disjoint page lists with room for 4 more tokens."""
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    perm = torch.randperm(256, generator=gen).tolist()
    blocks, i = [], 0
    for n in lengths:
        k = cdiv(n + 4, BLOCK)
        blocks.append(perm[i:i + k])
        i += k
    return prompts, blocks


def _decode_meta(seqs_ids, blocks):
    return build_metadata([SeqSlice(b, len(ids) - 1, 1) for ids, b in zip(seqs_ids, blocks,
                                                                         strict=True)], BLOCK)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi3"])
@pytest.mark.parametrize("lengths", [[9], [4, 1, 13, 8, 30], [3, 17, 5, 8, 1, 22, 12, 4, 9, 40,
                                                                 2, 16, 7],
                                     [(7 * i) % 23 + 1 for i in range(37)]],
                         ids=["batch1", "batch5", "batch13", "batch37"])
@pytest.mark.parametrize("threads", [None, 3], ids=["threads-default", "threads-3"])
@pytest.mark.parametrize("tiles", ["dot", "wide"])
def test_fused_steps_match_transformers(arch, lengths, threads, tiles, request):
    """Prefill layer by layer, then three decode steps through ``decode_fused``: every
    sequence's logits equal transformers' full forward over its tokens so far. Dot tiles:
    batch 5, 13 and 37 run tiles of 4 input rows and a remainder, batch 1 the 2-row path, 3
    threads work blocks of an odd number of row pairs (the 4-row kernel's leftover pair). Wide
    tiles: one lane vector (batch 1-13, padding lanes), two, and two then one (batch 37: 48
    lanes); the tiny model's 128 / 64 / 128 output rows end in tiles of 4 after the 12-row
    ones. Qwen2: the QKV bias; Qwen3: the per-head q/k norms and heads wider than
    hidden / heads; contexts straddling pages."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        _fused_steps_match_transformers(arch, lengths, WIDE_FROM[tiles], request)
    finally:
        torch.set_num_threads(before)


def _fused_steps_match_transformers(arch, lengths, wide_from, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    runner = ModelRunner(_model(model_dir), CacheConfig(block_size=BLOCK), 256)
    fused_steps_match(runner, load_hf(model_dir, arch), lengths, wide_from, arch)


def fused_steps_match(runner, hf, lengths, wide_from, label):
    """Prefill ``lengths`` random prompts layer by layer, then three ``decode_fused`` steps:
    every sequence's logits within a relative 1e-4 of ``hf``'s full forward."""
    model = runner.model
    gen = torch.Generator().manual_seed(len(lengths))
    prompts, blocks = _batch(lengths, gen)
    for ids, b in zip(prompts, blocks, strict=True):
        runner.compute_logits_for_prompt(ids, b)
    seqs = [list(p) for p in prompts]
    for _step in range(3):
        new = torch.randint(3, VOCAB, (len(seqs),), generator=gen).tolist()
        for s, t in zip(seqs, new, strict=True):
            s.append(t)
        meta = _decode_meta(seqs, blocks)
        with torch.inference_mode():
            hidden = model.decode_fused(torch.tensor(new), meta.positions, runner.kv_caches,
                                        *decode_tables(meta), BLOCK, wide_from)
            assert hidden is not None, f"the kernel declined {label}"
            ours = model.compute_logits(hidden)
            for i, s in enumerate(seqs):
                ref = hf(torch.tensor([s])).logits[0, -1]
                rel = (ours[i] - ref).abs().max() / ref.abs().max()
                assert rel < 1e-4, f"{label} seq {i} (len {len(s)}): relative error {rel:.2e}"


@pytest.mark.parametrize("tiles", ["dot", "wide"])
def test_fused_step_writes_the_layers_kv_and_nothing_else(tiny_llama_dir, tiles):
    """The same decode step, layer by layer and fused, from the same caches: the new tokens'
    slots hold the same K/V, and every other slot is untouched (bit for bit)."""
    model = _model(tiny_llama_dir)
    cfg = model.cfg
    gen = torch.Generator().manual_seed(7)
    caches = [torch.randn(64, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim, generator=gen)
              for _ in range(cfg.num_layers)]
    fused_caches = [c.clone() for c in caches]
    before = [c.clone() for c in caches]
    seqs = [SeqSlice([5, 9, 2], 9, 1), SeqSlice([40], 0, 1), SeqSlice([7, 33], 4, 1)]
    meta = build_metadata(seqs, BLOCK)
    ids = torch.tensor([11, 12, 13])
    backend = TorchPagedBackend()
    with torch.inference_mode():
        backend.plan(meta)
        ref = model(ids, meta.positions, caches, backend)
        got = model.decode_fused(ids, meta.positions, fused_caches, *decode_tables(meta), BLOCK,
                                 WIDE_FROM[tiles])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    written = torch.zeros(64, BLOCK, dtype=torch.bool)
    for s in seqs:  # the new token's slot: position start_pos
        written[s.block_ids[s.start_pos // BLOCK], s.start_pos % BLOCK] = True
    for layer in range(cfg.num_layers):
        ref_c, got_c, old = caches[layer], fused_caches[layer], before[layer]
        torch.testing.assert_close(got_c.transpose(1, 2)[written],
                                   ref_c.transpose(1, 2)[written], atol=1e-5, rtol=1e-5)
        untouched = ~written
        assert torch.equal(got_c.transpose(1, 2)[untouched], old.transpose(1, 2)[untouched])
        assert not torch.equal(got_c, old), "the step wrote no K/V"


MAX_TOKENS = 10


@pytest.mark.parametrize("max_num_seqs,step", [(8, "fused"), (32, "fused"), (32, "wide")])
def test_engine_with_fused_steps_matches_transformers_greedy(tiny_llama_dir, max_num_seqs, step):
    """A whole engine run with the fused step (``step``'s tiles) planned at every bucket:
    greedy tokens equal transformers' ``generate``, the fused step really ran (pure-decode
    steps only) on the planned tiles, and every KV block comes back."""
    from engine import LLM, SamplingParams

    prompts = random_prompts(seed=4, count=20, max_len=40)
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)
    # adaptive_threads off: under CPU load the thread governor re-applies the host's plans,
    # replacing the plan this test sets (seen: the host's "wide" where "fused" was set)
    llm = LLM(str(tiny_llama_dir), max_num_seqs=max_num_seqs, block_size=BLOCK,
              adaptive_threads=False)
    runner = llm.engine.runner
    runner.fused_decode = FusedDecodePlan.everywhere(step)
    model = runner.model
    real = model.decode_fused
    calls = []

    def counted(input_ids, *args, panels=False, lora=None):
        out = real(input_ids, *args, panels=panels, lora=lora)
        calls.append((len(input_ids), out is not None))
        assert args[-3] == WIDE_FROM["wide" if step == "wide" else "dot"]
        # fp weights: no integer products
        assert args[-2] is False and args[-1] is False and panels is False
        return out

    model.decode_fused = counted
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert calls and all(ran for _, ran in calls)
    assert max(n for n, _ in calls) == min(max_num_seqs, len(prompts))
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # Off: the same engine never takes it.
    calls.clear()
    runner.fused_decode = FusedDecodePlan()
    again = llm.generate(prompts[:3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in again] == [r[:4] for r in refs[:3]]
    assert calls == []


def test_plan_buckets():
    plan = FusedDecodePlan({1: "fused", 2: "layers", 4: "fused", 8: "wide", 16: "layers",
                            32: "wide"})
    batches = (1, 2, 3, 4, 7, 8, 15, 16, 31, 32)
    assert [plan.step(b) for b in batches] == [
        "fused", "layers", "layers", "fused", "fused", "wide", "wide", "layers", "layers", "wide"]
    assert [plan.use(b) for b in batches] == [plan.step(b) != "layers" for b in batches]
    assert [plan.wide_from(b) for b in (1, 8, 15, 32)] == [cpu_ops.NEVER_WIDE, 1, 1, 1]
    assert plan.step(0) == plan.step(33) == "layers" and not plan.use(33)
    assert not FusedDecodePlan().use(1)  # untuned: never
    for step in ("fused", "wide"):
        assert {FusedDecodePlan.everywhere(step).step(b)
                for b in range(1, FUSED_BUCKETS[-1] + 1)} == {step}


def test_tuning_times_every_bucket_and_is_cached(tiny_llama_dir, tmp_path, request):
    model = _model(tiny_llama_dir)
    plan = tune_fused_decode(model, BLOCK, DecodePaths(), cache_dir=tmp_path)
    assert not plan.from_cache
    assert sorted(t.m for t in plan.timings) == list(FUSED_BUCKETS)
    assert all(set(t.seconds) == set(STEPS) - {"qint", "qamx", "qwide", "qpanel"}
               and min(t.seconds.values()) > 0
               for t in plan.timings)
    assert plan.choices == {t.m: min(t.seconds, key=t.seconds.get) for t in plan.timings}
    assert len(plan.summary()) == len(FUSED_BUCKETS)
    assert all(line.startswith(f"batch {t.m}: {t.best} step") and "wide tiles" in line
               for line, t in zip(plan.summary(), sorted(plan.timings, key=lambda t: t.m),
                                  strict=True))
    again = tune_fused_decode(model, BLOCK, DecodePaths(), cache_dir=tmp_path)
    assert again.from_cache and again.choices == plan.choices
    # Another attention plan is another key: timed afresh.
    other = tune_fused_decode(model, BLOCK, DecodePaths({(1, 128): "rows"}), cache_dir=tmp_path)
    assert not other.from_cache
    # The same model quantized is timed for itself (its kernels race the layer path
    # differently), and Gemma's layer, which the kernel does not run, is not timed at all.
    # Quantized, the wide tiles run on expanded weight tiles ("qwide") from the rows where
    # the expansion can pay, raced against the integer products.
    model.quantize("int8")
    quantized = tune_fused_decode(model, BLOCK, DecodePaths(), cache_dir=tmp_path)
    assert not quantized.from_cache
    assert all("wide" not in t.seconds and "qint" in t.seconds
               and ("qwide" in t.seconds) == (t.m >= QWIDE_MIN_ROWS)
               and ("qpanel" in t.seconds) == cpu_ops.panels_built() for t in quantized.timings)
    gemma = _model(request.getfixturevalue("tiny_gemma2_dir"))
    assert tune_fused_decode(gemma, BLOCK, DecodePaths(), cache_dir=tmp_path).choices == {}
    model = _model(tiny_llama_dir)
    # A model whose context is shorter than the timed one (an engine's max_model_len) is timed
    # within it (seen: a worker with max_model_len=66 failed to start on position 127).
    short = LlamaForCausalLM(model.cfg, max_len=20)
    short.load_hf_state_dict(load_state_dict(tiny_llama_dir, torch.float32))
    plan = tune_fused_decode(short, BLOCK, DecodePaths(), cache_dir=tmp_path)
    assert not plan.from_cache and {t.n for t in plan.timings} == {20}


def test_the_kernel_declines_what_it_does_not_take(tiny_llama_dir):
    model = _model(tiny_llama_dir)
    cfg = model.cfg
    caches = [torch.zeros(8, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim)
              for _ in range(cfg.num_layers)]
    meta = _decode_meta([[1, 2, 3]], [[3]])
    tables, lens = decode_tables(meta)
    h = torch.randn(1, cfg.hidden_size)
    ptrs = model._layer_pointers(caches)
    cos, sin = model.rope_cos[meta.positions], model.rope_sin[meta.positions]
    assert not cpu_ops.decode_layers(h.bfloat16(), ptrs, model.layer_shapes, cos, sin, tables,
                                     lens, BLOCK)
    assert not cpu_ops.decode_layers(h, ptrs, model.layer_shapes, cos, sin, tables.int(), lens,
                                     BLOCK)
    with pytest.raises(ValueError, match="contiguous fp32"):
        cpu_ops.layer_pointers([(torch.zeros(4, 4).t(),) + (None,) * 17])
    with pytest.raises(ValueError, match="takes 18 tensors a layer"):
        cpu_ops.layer_pointers([(torch.zeros(4),)])
    assert not cpu_ops.decode_layers_applies(model.layer_shapes, torch.bfloat16)
    assert tune_fused_decode(model.to(torch.bfloat16), BLOCK, DecodePaths()).choices == {}
    cpu_ops.set_enabled(False)  # no library: declined, and the model says so
    assert _model(tiny_llama_dir).decode_fused(torch.tensor([5]), meta.positions, caches,
                                               tables, lens, BLOCK) is None


def test_fused_step_follows_weights_replaced_after_its_first_call(tiny_llama_dir):
    """The kernel's address table is cached; a weight replaced by a new tensor (not copied
    into) after a fused step must not leave the kernel reading the old one: the next fused
    step equals the layer-by-layer step on the new weights."""
    model = _model(tiny_llama_dir)
    cfg = model.cfg
    caches = [torch.zeros(16, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim)
              for _ in range(cfg.num_layers)]
    seqs = [SeqSlice([3, 5], 5, 1), SeqSlice([9], 2, 1)]
    meta = build_metadata(seqs, BLOCK)
    ids = torch.tensor([11, 12])
    with torch.inference_mode():
        before = model.decode_fused(ids, meta.positions, caches, *decode_tables(meta), BLOCK)
        last = model.layers[-1]
        last.down.weight = torch.nn.Parameter(last.down.weight.detach() * 3)
        after = model.decode_fused(ids, meta.positions, caches, *decode_tables(meta), BLOCK)
        backend = TorchPagedBackend()
        backend.plan(meta)
        ref = model(ids, meta.positions, caches, backend)
    assert not torch.allclose(after, before, atol=1e-3)
    torch.testing.assert_close(after, ref, atol=1e-4, rtol=1e-4)
