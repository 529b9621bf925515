"""engine/tuning/pretune.py: the kernel plans `make setup` times ahead are the ones an engine starting
on this host then reads from the cache (same keys), and pre-tuning never fails the install."""

from __future__ import annotations

import torch

from engine.tuning import pretune


def test_default_thread_counts_are_one_and_every_core():
    assert pretune.default_thread_counts(1) == [1]
    assert pretune.default_thread_counts(2) == [1, 2]
    assert pretune.default_thread_counts(16) == [1, 16]


def test_pretuned_plans_are_the_ones_an_engine_starts_from(tiny_llama_dir, tmp_path):
    from engine import EngineArgs, LLMEngine
    from engine.ops.linear import linear_plan

    before = torch.get_num_threads()
    # Into a fresh cache: timed now; a second time: found.
    first = pretune.pretune(str(tiny_llama_dir), [1, 2], cache_dir=str(tmp_path))
    assert [(r.threads, r.linear_from_cache, r.decode_from_cache, r.fused_from_cache,
             r.prefill_from_cache) for r in first] == [(1, False, False, False, False),
                                                       (2, False, False, False, False)]
    again = pretune.pretune(str(tiny_llama_dir), [2], cache_dir=str(tmp_path))
    assert again[0].linear_from_cache and again[0].decode_from_cache and again[0].fused_from_cache
    assert again[0].prefill_from_cache
    assert torch.get_num_threads() == before

    # Into the engine's own cache, then an engine at that thread count finds both plans.
    pretune.pretune(str(tiny_llama_dir), [1])
    try:
        engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), num_threads=1))
        assert linear_plan().from_cache
        assert engine.runner.attn_backend.decode_paths.from_cache
        assert engine.runner.attn_backend.prefill_paths.from_cache
        assert engine.runner.fused_decode.from_cache  # timed against the same plans
    finally:
        torch.set_num_threads(before)


def test_the_command_times_into_the_cache_it_is_given(tiny_llama_dir, tmp_path, capsys):
    argv = ["--model", str(tiny_llama_dir), "--threads", "1", "--cache-dir", str(tmp_path)]
    assert pretune.main(argv) == 0
    assert "kernel plans for 1 thread(s), quantization none: timed in" in capsys.readouterr().out
    assert pretune.main(argv) == 0
    assert "kernel plans for 1 thread(s), quantization none: cached already" in capsys.readouterr().out


def test_a_model_that_cannot_load_does_not_fail_setup(tmp_path, capsys):
    assert pretune.main(["--model", str(tmp_path / "missing"), "--threads", "1"]) == 0
    assert "kernel plans" not in capsys.readouterr().out
