"""Decode padding for CUDA graphs, proven on CPU: bucket choice, padded batches give the
unpadded tokens, padded rows write only the scratch page (never handed out, no block leaks),
and prefill steps / oversized batches run eagerly at their real size."""

from __future__ import annotations

import functools

import pytest
import torch

import engine.runtime.build as engine_build
from engine import LLM, SamplingParams
from engine.attention.backend import SeqSlice, build_metadata
from engine.config import CacheConfig
from engine.core.scheduler import ScheduledChunk, SchedulerOutput
from engine.executor.cuda_graphs import PAD_TOKEN_ID, DecodePadding, decode_buckets
from engine.executor.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.weights.loader import load_state_dict
from engine.weights.resolve import load_model_config
from tests.helpers.tiny_models import random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("max_num_seqs, want", [
    (1, (1,)),
    (3, (1, 2, 4)),
    (5, (1, 2, 4, 8)),
    (8, (1, 2, 4, 8)),
    (32, (1, 2, 4, 8, 16, 24, 32)),
    (33, (1, 2, 4, 8, 16, 24, 32, 40)),
])
def test_buckets(max_num_seqs, want):
    assert decode_buckets(max_num_seqs) == want


def test_bad_max_num_seqs_is_refused():
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_buckets(0)


def _decodes(n):
    return [SeqSlice(block_ids=[i, 50 + i], start_pos=5 + i, num_new_tokens=1) for i in range(n)]


@pytest.mark.parametrize("n, bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16),
                                       (17, 24), (32, 32)])
def test_smallest_bucket_that_holds_the_batch(n, bucket):
    assert DecodePadding(decode_buckets(32), scratch_page=99).bucket_for(_decodes(n)) == bucket


def test_prefill_empty_and_oversized_steps_are_not_padded():
    padding = DecodePadding(decode_buckets(8), scratch_page=99)
    assert padding.bucket_for([]) is None
    assert padding.bucket_for(_decodes(9)) is None
    assert padding.bucket_for([*_decodes(2), SeqSlice([7], 0, 3)]) is None
    assert padding.bucket_for([SeqSlice([7], 0, 2)]) is None


def test_dummies_write_and_read_only_the_scratch_page():
    padding = DecodePadding(decode_buckets(8), scratch_page=99)
    real = _decodes(3)
    meta = build_metadata(padding.pad(real, 4), block_size=4)
    unpadded = build_metadata(real, block_size=4)
    assert meta.num_seqs == meta.num_decode == 4
    # The real rows' tables are untouched; the dummy is one token at position 0 of page 99.
    assert meta.kv_indices.tolist() == [*unpadded.kv_indices.tolist(), 99]
    assert meta.kv_last_page_len.tolist() == [*unpadded.kv_last_page_len.tolist(), 1]
    assert meta.write_page_ids.tolist() == [*unpadded.write_page_ids.tolist(), 99]
    assert meta.write_offsets.tolist()[-1] == 0 and meta.positions.tolist()[-1] == 0


def _padded_llm(monkeypatch, model_dir, max_num_seqs, **kwargs):
    """An LLM whose runner pads decode steps (what CUDA graphs do), run eagerly on CPU."""
    monkeypatch.setattr(engine_build, "ModelRunner", functools.partial(
        ModelRunner, pad_decode_batches=True, max_num_seqs=max_num_seqs))
    llm = LLM(str(model_dir), max_num_seqs=max_num_seqs, **kwargs)
    monkeypatch.undo()
    return llm


def _spy_steps(runner):
    """Record (scheduled chunks, StepInputs) of every step the runner prepares."""
    steps = []
    prepare = runner.prepare

    def spy(sched, *args, **kwargs):
        inp = prepare(sched, *args, **kwargs)
        steps.append((list(sched.chunks), inp))
        return inp

    runner.prepare = spy
    return steps


@pytest.mark.parametrize("setup", [
    dict(max_num_seqs=7, block_size=4),
    dict(max_num_seqs=6, block_size=8, max_num_batched_tokens=40),  # decode mixed with chunks
], ids=["whole-prompts", "chunked"])
def test_padded_decode_gives_unpadded_tokens_and_leaks_nothing(monkeypatch, tiny_llama_dir, setup):
    # 11 prompts through at most 6-7 slots: decode batches of many sizes as requests come and go.
    prompts = random_prompts(seed=4, count=11, max_len=40)
    plain = LLM(str(tiny_llama_dir), **setup)
    padded = _padded_llm(monkeypatch, tiny_llama_dir, **setup)
    runner, bm = padded.engine.runner, padded.engine.block_manager
    scratch = runner.decode_padding.scratch_page
    steps = _spy_steps(runner)

    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    got = [o.token_ids for o in padded.generate(prompts, GREEDY)]

    assert got == want
    # The scratch page is the one page past what the block manager knows, and nobody got it.
    assert scratch == bm.num_blocks == runner.num_blocks
    assert runner.kv_caches[0].shape[0] == bm.num_blocks + 1
    assert all(scratch not in c.block_ids for chunks, _ in steps for c in chunks)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    # Padding really happened, to the smallest bucket, and only on decode-only steps.
    buckets = runner.decode_padding.buckets
    padded_steps = [(chunks, inp) for chunks, inp in steps if inp.bucket is not None]
    assert any(inp.bucket > len(chunks) for chunks, inp in padded_steps)
    for chunks, inp in steps:
        decode_only = all(c.num_tokens == 1 for c in chunks)
        if decode_only:
            assert inp.bucket == min(b for b in buckets if b >= len(chunks))
            assert inp.meta.num_seqs == inp.bucket
            assert inp.input_ids.tolist()[len(chunks):] == [PAD_TOKEN_ID] * (inp.bucket - len(chunks))
        else:
            assert inp.bucket is None and inp.meta.num_seqs == len(chunks)
    assert any(inp.bucket is None for _, inp in steps)  # prefill steps ran eagerly
    # The dummies' K/V went to the scratch page (and only there: the tokens above are equal).
    assert runner.kv_caches[0][scratch, :, 0].abs().sum() > 0


def _runner(model_dir, **kwargs):
    cfg = load_model_config(model_dir)
    model = LlamaForCausalLM(cfg)
    model.load_hf_state_dict(load_state_dict(model_dir, torch.float32))
    return ModelRunner(model, CacheConfig(block_size=4), 32, **kwargs)


def _chunk(i, token_ids, start_pos, block_ids):
    return ScheduledChunk(request_id=f"r{i}", token_ids=token_ids, start_pos=start_pos,
                          block_ids=block_ids, sample=True, sampling_params=GREEDY,
                          num_output_tokens=0, output_token_ids=[])


def test_oversized_batch_runs_eagerly_at_its_real_size(tiny_llama_dir):
    # Buckets (1, 2): a 3-sequence decode step has no bucket.
    padded = _runner(tiny_llama_dir, pad_decode_batches=True, max_num_seqs=2)
    plain = _runner(tiny_llama_dir)
    prompts = random_prompts(seed=9, count=3, max_len=8, min_len=5)
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(3)]
    prefill = SchedulerOutput([_chunk(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))])
    first = plain.execute(prefill).sampled_token_ids
    assert padded.execute(prefill).sampled_token_ids == first
    decode = SchedulerOutput([_chunk(i, [first[f"r{i}"]], len(p), t)
                              for i, (p, t) in enumerate(zip(prompts, tables, strict=True))])
    assert padded.prepare(decode).bucket is None
    assert padded.prepare(decode).meta.num_seqs == 3
    assert padded.prepare(SchedulerOutput(decode.chunks[:2])).bucket == 2
    assert padded.execute(decode).sampled_token_ids == plain.execute(decode).sampled_token_ids


def test_layer_hook_steps_are_not_padded(tiny_llama_dir):
    # A KV-export hook runs between layers, which a replayed graph cannot: such steps run
    # eagerly at their real size.
    runner = _runner(tiny_llama_dir, pad_decode_batches=True, max_num_seqs=4)
    sched = SchedulerOutput([_chunk(i, [5 + i], 0, [i]) for i in range(3)])
    planned = []
    plan = runner.attn_backend.plan
    runner.attn_backend.plan = lambda meta: (planned.append(meta.num_seqs), plan(meta))
    seen = []
    hooked = runner.execute(sched, layer_hook=lambda i, _kv: seen.append(i)).sampled_token_ids
    assert runner.execute(sched).sampled_token_ids == hooked
    assert planned == [3, 4]
    assert seen == list(range(runner.cfg.num_layers))


def test_cuda_graphs_need_cuda(tiny_llama_dir):
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        _runner(tiny_llama_dir, cuda_graphs=True)
    runner = _runner(tiny_llama_dir)
    assert runner.decode_padding is None and runner.kv_caches[0].shape[0] == 32
