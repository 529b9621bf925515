"""The linear kernel is chosen per host: every path computes the same product, the choice is
timed, cached per host key, and followed per weight shape and batch size."""

from __future__ import annotations

import pytest
import torch

import engine.ops.linear as linear_ops
import engine.tuning.linear as tuning
from engine.ops import cpu_ops
from engine.ops.linear import LINEAR_BUCKETS, PREFILL_ROWS, LinearPlan, linear, set_linear_plan
from engine.tuning.cache import Timing, host_key
from engine.tuning.linear import model_linear_weights, tune_linear


@pytest.fixture(autouse=True)
def _restore_plan():
    before = linear_ops.linear_plan()
    yield
    set_linear_plan(before)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 33, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_every_path_computes_the_same_product(m, bias):
    assert "onednn" in linear_ops.available_paths()  # torch's CPU wheels ship oneDNN
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 96, generator=g), torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    want = torch.nn.functional.linear(x, w, b)
    for path in linear_ops.PATHS:
        set_linear_plan(LinearPlan.from_timings(
            [Timing(160, 96, bk, {path: 0.0, "other": 1.0}) for bk in LINEAR_BUCKETS]))
        assert linear_ops.linear_plan().path(160, 96, m) == path
        got = linear(x, w, b)
        assert got.shape == (m, 160) and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 15, 16, 17, 33, 70])
def test_wide_linear_matches_f_linear_on_ragged_shapes(m):
    """The wide tiles with every remainder: 29 output rows (two 12-row tiles with AVX-512,
    four 6-row ones without; then 4, then 1), 37 inputs, lanes padded to 16 and taken 32
    then 16 at a time (AVX-512) or 16 at a time (two ymm vectors)."""
    g = torch.Generator().manual_seed(m)
    x, w, b = torch.randn(m, 37, generator=g), torch.randn(29, 37, generator=g), torch.randn(29, generator=g)
    got = cpu_ops.wide_linear(x, w, b)
    assert got is not None and got.shape == (m, 29)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert cpu_ops.wide_linear(torch.randn(m, 74)[:, ::2], w, b) is None  # strided: declined


def test_plan_follows_the_bucket_and_leaves_untuned_buckets_and_shapes_to_f_linear():
    t = [Timing(8, 4, 1, {"linear": 2.0, "mm_t": 1.0}), Timing(8, 4, 2, {"linear": 1.0, "mm_t": 2.0}),
         Timing(8, 4, 4, {"linear": 3.0, "mm_t": 1.0})]
    plan = LinearPlan.from_timings(t)
    assert [plan.path(8, 4, m) for m in (1, 2, 3, 4, 7, 127)] == ["mm_t", "linear", "linear", "mm_t",
                                                                  "mm_t", "linear"]
    assert plan.path(8, 4, PREFILL_ROWS) == "linear"  # the prefill bucket was not tuned
    assert plan.path(16, 4, 1) == "linear"  # never tuned
    assert plan.summary() == ["W[8x4] M=1: mm_t (2.00x), M=2: linear (2.00x), M=4: mm_t (3.00x)"]
    prefill = LinearPlan.from_timings([Timing(8, 4, PREFILL_ROWS, {"linear": 2.0, "onednn": 1.0})])
    assert prefill.path(8, 4, 500) == "onednn" and prefill.path(8, 4, 127) == "linear"


def test_a_quantized_weights_prompt_bucket_expands_even_where_reading_in_place_timed_faster():
    """At PREFILL_ROWS rows a quantized weight takes an expanding path or an integer product,
    never ``cquant`` / ``cqwide``, whose cost grows with the rows past the 128 timed (a
    2,048-row prompt step took 1.9x fp32's time on them); decode buckets keep the fastest,
    and an untimed quantized weight expands past 32 rows."""
    plan = LinearPlan.from_timings([
        Timing(8, 4, PREFILL_ROWS, {"cquant": 1.0, "cqwide": 1.1, "dequant": 1.3,
                                    "dequant_onednn": 1.2}, kind="int4"),
        Timing(8, 4, 32, {"cquant": 1.0, "dequant": 1.3}, kind="int4"),
        Timing(16, 4, PREFILL_ROWS, {"cquant": 1.0, "cqint": 1.1, "dequant": 1.3}, kind="int8")])
    assert plan.path(8, 4, 2048, "int4") == "dequant_onednn"
    assert plan.exact_path(8, 4, 2048, "int4") == "dequant_onednn"
    assert plan.path(8, 4, 32, "int4") == "cquant"
    assert plan.path(16, 4, 500, "int8") == "cqint"  # an integer product stays eligible
    assert plan.exact_path(16, 4, 500, "int8") == "dequant"  # and a prompt expands
    assert plan.path(24, 4, 32, "int4") == "cquant" and plan.path(24, 4, 33, "int4") == "dequant"
    assert "M=128: dequant_onednn" in plan.summary()[0]  # the log names the path that runs


def test_linear_dispatches_on_the_plan(monkeypatch):
    calls = []
    real = linear_ops._mm_t
    monkeypatch.setattr(linear_ops, "_mm_t", lambda *a: calls.append("mm_t") or real(*a))
    set_linear_plan(LinearPlan.from_timings([Timing(32, 16, 1, {"linear": 2.0, "mm_t": 1.0})]))
    linear(torch.randn(1, 16), torch.randn(32, 16))
    linear(torch.randn(2, 16), torch.randn(32, 16))  # bucket 2 was not tuned: F.linear
    assert calls == ["mm_t"]


def _weights(*shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=g) for n, k in shapes]


def test_tuning_times_whole_passes_and_is_cached_per_host_key(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "LINEAR_BUCKETS", (1, 4))
    # two "layers" of two tuned shapes, and one under MIN_TUNED_BYTES
    weights = _weights((512, 256), (256, 512), (512, 256), (256, 512), (16, 16))
    plan = tune_linear(weights, cache_dir=tmp_path)
    assert not plan.from_cache
    assert {(t.n, t.k, t.m) for t in plan.timings} == {(512, 256, 1), (512, 256, 4),
                                                       (256, 512, 1), (256, 512, 4)}
    for t in plan.timings:
        assert set(t.seconds) == set(linear_ops.PATHS) and all(v > 0 for v in t.seconds.values())
        assert plan.path(t.n, t.k, t.m) == min(t.seconds, key=t.seconds.get)
    assert plan.path(16, 16, 1) == "linear"  # too small to time
    again = tune_linear(weights, cache_dir=tmp_path)
    assert again.from_cache and again.choices == plan.choices
    files = list((tmp_path / "kernels").glob("linear-*.json"))
    assert [f.name for f in files] == [f"linear-{plan.key}.json"]
    # Another thread count is another host key: tuned afresh, in its own file.
    threads = torch.get_num_threads()
    assert host_key([(16, 16, "fp"), (256, 512, "fp"), (512, 256, "fp")], torch.float32,
                    f"cpu_ops {cpu_ops.build_id()}") == plan.key
    try:
        torch.set_num_threads(threads + 1)
        assert host_key([(16, 16, "fp"), (256, 512, "fp"), (512, 256, "fp")], torch.float32,
                        f"cpu_ops {cpu_ops.build_id()}") != plan.key
        assert not tune_linear(weights, cache_dir=tmp_path).from_cache
    finally:
        torch.set_num_threads(threads)
    assert len(list((tmp_path / "kernels").glob("linear-*.json"))) == 2


def test_a_change_is_kept_only_when_the_whole_pass_gets_faster(monkeypatch):
    """Greedy per bucket: from the fastest uniform pass (mm_t here), each shape moves to
    another path when that makes the pass faster; the recorded times are the ones the
    decision was made on."""
    monkeypatch.setattr(linear_ops, "_available", ("linear", "mm_t", "onednn"))
    cost = {(512, 256, "fp"): {"linear": 1.0, "mm_t": 1.5, "onednn": 3.0},  # F.linear wins here only
            (256, 512, "fp"): {"linear": 2.0, "mm_t": 1.4, "onednn": 1.6}}

    def fake_pass(weights, m, choice, repeats=3, warm_up=False):
        return sum(cost[s][choice[s]] for s in choice)

    monkeypatch.setattr(tuning, "time_passes", fake_pass)
    timings = tuning.time_choices(_weights((512, 256), (256, 512)), buckets=(1,))
    plan = LinearPlan.from_timings(timings)
    assert plan.path(512, 256, 1) == "linear" and plan.path(256, 512, 1) == "mm_t"
    first = next(t for t in timings if (t.n, t.k) == (512, 256))
    assert first.seconds == pytest.approx({"mm_t": 2.9, "linear": 2.4, "onednn": 4.4})


def test_a_corrupt_cache_file_is_tuned_again(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "LINEAR_BUCKETS", (1,))
    weights = _weights((512, 256))
    key = host_key([(512, 256, "fp")], torch.float32)  # what tune_linear keys this weight by
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / f"linear-{key}.json").write_text("{not json")
    plan = tune_linear(weights, cache_dir=tmp_path)
    assert not plan.from_cache and len(plan.timings) == 1


def test_model_weights_in_step_order_with_the_lm_head_last(tiny_llama_dir):
    from engine import LLM

    model = LLM(str(tiny_llama_dir)).engine.model
    cfg = model.cfg
    weights = model_linear_weights(model)
    assert len(weights) == 4 * cfg.num_layers + 1
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert [tuple(w.shape) for w in weights[:4]] == [
        (q + 2 * kv, cfg.hidden_size), (cfg.hidden_size, q),
        (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]
    assert tuple(weights[-1].shape) == (cfg.vocab_size, cfg.hidden_size)  # lm_head or tied embedding
