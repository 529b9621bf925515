"""The benchmark harness's arithmetic: slot utilization, percentiles, knee, roofline, workloads."""

from __future__ import annotations

import math

import pytest

from bench.harness.batching import simulate_batching, slot_utilization
from bench.harness.report import target, to_jsonable
from bench.harness.roofline import find_knee, roofline_step_time, roofline_workload_throughput
from bench.harness.stats import percentile, summarize
from bench.harness.workload import heavy_tailed_lengths, make_prompts, poisson_arrivals


# ---- slot utilization ------------------------------------------------------------------------
def test_head_of_line_example_static_is_1060_of_3000():
    sim = simulate_batching([10, 50, 1000], 3, "static")
    assert sim.num_steps == 1000
    assert sim.useful_token_steps == 1060
    assert sim.utilization == pytest.approx(1060 / 3000)
    assert round(sim.utilization * 100, 1) == 35.3


def test_continuous_refills_freed_slots_from_the_queue():
    # Slots 3, queue [10, 50, 1000, 10, 10]: the two short ones take the slot freed at step 10,
    # so the whole queue finishes with the 1000-token request.
    lens = [10, 50, 1000, 10, 10]
    cont = simulate_batching(lens, 3, "continuous")
    assert cont.num_steps == 1000
    assert cont.useful_token_steps == 1080
    assert cont.utilization == pytest.approx(1080 / 3000)
    # Static must run the two short ones as a second batch after the 1000-token one.
    static = simulate_batching(lens, 3, "static")
    assert static.num_steps == 1010
    assert static.utilization < cont.utilization


def test_continuous_is_fully_utilized_when_the_queue_never_drains_early():
    # 6 equal requests in 3 slots: two full waves, every slot busy every step.
    sim = simulate_batching([7] * 6, 3, "continuous")
    assert (sim.num_steps, sim.utilization) == (14, 1.0)


def test_dynamic_with_everyone_queued_equals_static():
    lens = [5, 9, 2, 30, 4]
    assert simulate_batching(lens, 2, "dynamic").num_steps == simulate_batching(
        lens, 2, "static").num_steps == 9 + 30 + 4


def test_slot_utilization_rejects_impossible_counts():
    assert slot_utilization(1060, 3, 1000) == pytest.approx(0.35333, abs=1e-5)
    assert slot_utilization(0, 3, 0) == 0.0
    with pytest.raises(ValueError, match="cannot fit"):
        slot_utilization(3001, 3, 1000)
    with pytest.raises(ValueError, match="slots > 0"):
        slot_utilization(1, 0, 1)
    with pytest.raises(ValueError, match="unknown policy"):
        simulate_batching([1], 1, "fifo")


# ---- percentiles -----------------------------------------------------------------------------
def test_percentile_interpolates_linearly_like_numpy():
    xs = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_summarize_mean_and_tail():
    s = summarize([0.1] * 99 + [1.0])
    assert s.mean == pytest.approx(0.109)
    assert s.p50 == pytest.approx(0.1)
    assert s.p99 == pytest.approx(0.109)
    assert s.count == 100
    assert math.isnan(summarize([]).mean)


# ---- knee ------------------------------------------------------------------------------------
def test_knee_is_last_size_before_gains_fall_under_threshold():
    bs = [1, 4, 8, 16, 32]
    tput = [10.0, 36.0, 64.0, 76.8, 84.0]  # gains per doubling: 1.9, 1.78, 1.2, 1.09
    itl = [0.040, 0.045, 0.050, 0.080, 0.150]
    knee = find_knee(bs, tput, itl)
    assert knee.batch_size == 8
    assert knee.gains_per_doubling[0] == pytest.approx(3.6 ** 0.5)
    assert knee.gains_per_doubling[2] == pytest.approx(1.2)


def test_knee_needs_latency_growth_and_defaults_to_largest():
    # Gains collapse, but latency per token did not grow: not a knee.
    assert find_knee([1, 2, 4], [10.0, 11.0, 11.5], [0.05, 0.05, 0.05]).batch_size == 4
    # Every doubling pays: the knee is the largest measured size.
    assert find_knee([1, 2, 4], [10.0, 19.0, 36.0], [0.05, 0.052, 0.055]).batch_size == 4
    with pytest.raises(ValueError, match="increasing"):
        find_knee([4, 2], [1.0, 2.0], [1.0, 1.0])


# ---- roofline --------------------------------------------------------------------------------
def test_roofline_memory_bound_at_batch_1_compute_bound_at_large_batch():
    params, wbytes = 134_515_008, 538_060_032  # SmolLM2-135M fp32
    one = roofline_step_time(wbytes, params, 1, 13.5e9, 100e9)
    assert one.bound == "memory"
    assert one.step_s == pytest.approx(wbytes / 13.5e9)  # ~39.9 ms
    assert one.throughput_tok_s == pytest.approx(1 / one.step_s)
    big = roofline_step_time(wbytes, params, 64, 13.5e9, 100e9)
    assert big.bound == "compute"
    assert big.step_s == pytest.approx(2 * params * 64 / 100e9)  # ~172 ms
    # The crossover batch: 2 * params * b / F == W / B  ->  b = W * F / (2 * params * B)
    crossover = wbytes * 100e9 / (2 * params * 13.5e9)
    assert roofline_step_time(wbytes, params, math.floor(crossover), 13.5e9, 100e9).bound == "memory"
    assert roofline_step_time(wbytes, params, math.ceil(crossover), 13.5e9, 100e9).bound == "compute"


def test_workload_roofline_counts_prefill_and_caps_the_batching_gain():
    params, wbytes, embed = 134_515_008, 538_060_032, 49152 * 576  # SmolLM2-135M fp32
    bw, flops = 38.3e9, 445e9  # a 2-vCPU AVX-512 EPYC's roofs (bench ceilings)
    one = roofline_workload_throughput(wbytes, params, embed, 1, 64, 32, bw, flops)
    # By hand: 64 prompt tokens through the non-embedding weights, the LM head once, then
    # 31 memory-bound decode steps.
    prefill_s = (2 * (params - embed) * 64 + 2 * embed) / flops
    assert one == pytest.approx(32 / (prefill_s + 31 * wbytes / bw))
    b32 = roofline_workload_throughput(wbytes, params, embed, 32, 64, 32, bw, flops)
    step32 = roofline_step_time(wbytes, params, 32, bw, flops).step_s
    assert b32 == pytest.approx(32 * 32 / (32 * prefill_s + 31 * step32))
    # At the roofs, decode steps alone scale ~11x from batch 1 to 32; with the prompts'
    # compute-bound prefill counted, under 10x.
    assert 32 * (wbytes / bw) / step32 > 10 > b32 / one > 9
    with pytest.raises(ValueError):
        roofline_workload_throughput(wbytes, params, embed, 0, 64, 32, bw, flops)


# ---- workloads and output ----------------------------------------------------------------------
def test_workloads_are_seeded_and_exact():
    a = make_prompts(4, 64, 1000, seed=3)
    assert a == make_prompts(4, 64, 1000, seed=3)
    assert a != make_prompts(4, 64, 1000, seed=4)
    assert all(len(p) == 64 and all(10 <= t < 1000 for t in p) for p in a)
    lens = heavy_tailed_lengths(500, seed=1, low=8, high=512)
    assert lens == heavy_tailed_lengths(500, seed=1, low=8, high=512)
    assert min(lens) >= 8 and max(lens) <= 512
    assert sorted(lens)[len(lens) // 2] < sum(lens) / len(lens)  # heavy tail: median < mean
    arr = poisson_arrivals(10, 5.0, seed=0)
    assert arr[0] == 0.0 and arr == sorted(arr)
    assert poisson_arrivals(3, None) == [0.0, 0.0, 0.0]


def test_targets_and_json_conversion():
    assert target("x", 1.6, 1.5)["met"] is True
    assert target("x", 1.6, 1.5, higher_is_better=False)["met"] is False
    assert target("x", None, 1.5)["met"] is None
    sim = simulate_batching([1, 2], 2, "static")
    assert to_jsonable({"s": sim, "n": float("nan")}) == {
        "s": {"policy": "static", "num_slots": 2, "num_steps": 2, "useful_token_steps": 3,
              "utilization": 0.75}, "n": None}


# ---- bench serve --target and bench compare ----------------------------------------------------
def _serve_json(label, rates, **config):
    """A minimal `bench serve` result: one record per (rate, ttft_p50_s, output tok/s)."""
    return {"benchmark": "serve", "server": {"label": label}, "slo_s": {"ttft": 1.0},
            "config": {"input_len": 8, "output_len": 4, "num_prompts": 3, **config},
            "rates": [{"request_rate": r, "ttft_p50_s": ttft, "output_throughput_tok_s": tput,
                       "goodput_fraction": 0.5} for r, ttft, tput in rates]}


def test_base_url_strips_v1_and_adds_the_scheme():
    from bench.server.serve_target import base_url

    for given in ("http://h:8001", "http://h:8001/", "http://h:8001/v1", "http://h:8001/v1/",
                  "h:8001"):
        assert base_url(given) == "http://h:8001", given
    assert base_url("https://gw.example/llm/v1") == "https://gw.example/llm"
    for bad in ("grpc://h:1", "http://", "ftp://h/v1"):
        with pytest.raises(ValueError, match="URL"):
            base_url(bad)


def test_output_warnings_flag_short_outputs_and_missing_usage():
    from bench.server.serve_load import RequestResult, output_warnings

    full = RequestResult(True, 8, output_tokens=4)
    short = RequestResult(True, 8, output_tokens=2)
    failed = RequestResult(False, 8)  # failures are errors, not ignore_eos evidence
    assert output_warnings([full, full, failed], 4) == []
    [w] = output_warnings([full, short, failed], 4)
    assert "1 of 2 completed" in w and "ignore_eos" in w and "min 2" in w
    no_usage = RequestResult(True, 8, output_tokens=4, usage_reported=False)
    [w] = output_warnings([full, no_usage], 4)
    assert "1 of 2" in w and "usage" in w


def test_compare_matches_rates_in_every_file_and_takes_ratios_to_the_first():
    from bench.server.compare import build_tables, format_table, parse_run

    a = parse_run("a.json", _serve_json("ours", [(1, 0.1, 100.0), (2.0, 0.2, 150.0),
                                                 ("inf", 0.4, 200.0)]))
    b = parse_run("b.json", _serve_json("vllm", [(2, 0.1, 300.0), ("inf", None, 0.0),
                                                 (4, 0.5, 310.0)]))
    tables = build_tables([a, b])
    assert [t.request_rate for t in tables] == [2.0, math.inf]  # 2 == 2.0; 1 and 4 not shared
    rows = {r.metric: r for r in tables[0].rows}
    assert rows["ttft_p50_s"].values == pytest.approx([200.0, 100.0])  # ms
    assert rows["ttft_p50_s"].ratios_to_first == pytest.approx([0.5])
    assert rows["output_throughput_tok_s"].ratios_to_first == pytest.approx([2.0])
    assert rows["goodput_fraction"].values == [50.0, 50.0]  # %
    assert rows["tpot_p50_s"].values == [None, None]  # absent field: n/a, no ratio
    assert rows["tpot_p50_s"].ratios_to_first == [None]
    inf = {r.metric: r for r in tables[1].rows}
    assert inf["ttft_p50_s"].values == [pytest.approx(400.0), None]
    assert inf["ttft_p50_s"].ratios_to_first == [None]
    text = format_table(["ours", "vllm"], tables[0])
    header, *lines = text.splitlines()
    assert header.split() == ["rate", "2", "req/s", "ours", "vllm", "vllm", "/", "ours"]
    assert any(line.startswith("TTFT p50 (ms)") and line.endswith("0.50x") for line in lines)


def test_compare_refuses_foreign_files_and_disjoint_rates():
    from bench.server.compare import build_tables, mismatches, parse_run, unique_labels

    for bad in ({"benchmark": "sweep", "points": []}, [1, 2], {"benchmark": "serve"}):
        with pytest.raises(ValueError, match="x.json is not a `pdcluster bench serve` result"):
            parse_run("x.json", bad)
    a = parse_run("a.json", _serve_json("ours", [(1, 0.1, 1.0)]))
    b = parse_run("b.json", _serve_json("ours", [(2, 0.1, 1.0)], output_len=64))
    with pytest.raises(ValueError, match=r"no request rate is in every file \(a.json: 1; b.json: 2\)"):
        build_tables([a, b])
    assert unique_labels(["ours", "vllm", "ours", "ours"]) == ["ours", "vllm", "ours (2)", "ours (3)"]
    [m] = mismatches([a, b])
    assert "output_len 64 vs 4" in m


# ---- bench serve: the engine's own decode steps beside the served TPOT ---------------------------
METRICS_PAGE = """# HELP pdcluster_engine_decode_steps_total Pure-decode engine steps
# TYPE pdcluster_engine_decode_steps_total counter
pdcluster_engine_decode_steps_total{batch="1"} 10.0
pdcluster_engine_decode_steps_total{batch="4"} 5.0
pdcluster_engine_decode_step_seconds_total{batch="1"} 0.2
pdcluster_engine_decode_step_seconds_total{batch="4"} 0.15
pdcluster_engine_mixed_steps_total{batch="3"} 2.0
pdcluster_engine_mixed_step_seconds_total{batch="3"} 0.3
pdcluster_generation_tokens_total 99.0
"""


def test_engine_steps_between_two_scrapes_and_the_serving_overhead():
    from bench.server.serve_engine import engine_steps, parse_metrics, serving_overhead

    before = parse_metrics(METRICS_PAGE)
    assert before == {"decode": {1: (10.0, 0.2), 4: (5.0, 0.15)}, "mixed": {3: (2.0, 0.3)}}
    after = {"decode": {1: (12.0, 0.24), 4: (9.0, 0.27), 8: (1.0, 0.05)},
             "mixed": {3: (2.0, 0.3)}}
    steps = engine_steps(before, after)
    # batch 1: 2 steps of 20 ms; batch 4: 4 steps of 30 ms; batch 8: 1 step of 50 ms.
    assert steps.by_batch == {1: {"steps": 2, "mean_s": pytest.approx(0.02)},
                              4: {"steps": 4, "mean_s": pytest.approx(0.03)},
                              8: {"steps": 1, "mean_s": pytest.approx(0.05)}}
    assert steps.steps == 7 and steps.mean_step_s == pytest.approx(0.21 / 7)
    # Token-weighted: 2 tokens at 20 ms, 16 at 30 ms, 8 at 50 ms.
    assert steps.token_mean_step_s == pytest.approx((2 * 0.02 + 16 * 0.03 + 8 * 0.05) / 26)
    assert steps.mean_batch == pytest.approx(26 / 7)
    assert steps.tokens == 26
    # No mixed step ran during the rate: the engine's time per token is its decode step.
    assert engine_steps(before, after, "mixed") is None
    over = serving_overhead(0.05, steps)
    assert over["serving_overhead_per_token_s"] == pytest.approx(0.05 - steps.token_mean_step_s)
    assert over["tpot_over_engine_step"] == pytest.approx(0.05 / steps.token_mean_step_s)
    assert over["prefill_share_per_token_s"] == 0.0
    # Mixed steps (decode rows beside prefill chunks): 2 more steps of 3 rows at 100 ms and
    # 1 of 2 rows at 130 ms; 8 tokens join the 26 at the mixed steps' pace.
    later = {"decode": after["decode"], "mixed": {3: (4.0, 0.5), 2: (1.0, 0.13)}}
    mixed = engine_steps(before, later, "mixed")
    assert mixed.by_batch == {2: {"steps": 1, "mean_s": pytest.approx(0.13)},
                              3: {"steps": 2, "mean_s": pytest.approx(0.1)}}
    assert mixed.tokens == 8
    split = serving_overhead(0.05, steps, mixed)
    per_token = (steps.token_mean_step_s * 26 + (2 * 0.13 + 6 * 0.1)) / 34
    assert split["engine_token_s"] == pytest.approx(per_token)
    assert split["prefill_share_per_token_s"] == pytest.approx(per_token - steps.token_mean_step_s)
    assert split["serving_overhead_per_token_s"] == pytest.approx(0.05 - per_token)
    assert split["tpot_over_engine_step"] == over["tpot_over_engine_step"]
    assert split["tpot_over_engine_token"] == pytest.approx(0.05 / per_token)
    # Another server's page, a missing scrape, a rate without decode steps: no figures.
    assert parse_metrics("vllm:num_requests_running 0.0\n") is None
    assert engine_steps(None, after) is None and engine_steps(after, after) is None
    assert serving_overhead(0.05, None)["engine_step_s"] is None
    assert serving_overhead(float("nan"), steps)["tpot_over_engine_step"] is None


def test_decode_step_counters_survive_worker_restarts():
    from router.control.usage import UsageCounters
    from worker_protocol import WorkerLoad

    def load(inc, rows, mixed=()):
        return WorkerLoad("d0", "decode", 0, 1, 0, 0, incarnation=inc, decode_steps=rows,
                          mixed_steps=mixed)

    u = UsageCounters()
    u.note(load("a", ((1, 3, 0.3),)))
    u.note(load("a", ((1, 5, 0.5), (2, 1, 0.2))))
    # Through Redis the rows come back as JSON lists: the same sums.
    u.note(load("a", [[1, 5, 0.5], [2, 2, 0.4]]))
    assert u.decode_steps == {1: (5, pytest.approx(0.5)), 2: (2, pytest.approx(0.4))}
    u.note(load("b", ((1, 1, 0.1),)))  # restarted: counts from zero again, sums keep growing
    assert u.decode_steps[1] == (6, pytest.approx(0.6))
    # Mixed steps are summed the same way, apart from the pure-decode ones.
    u.note(load("b", ((1, 1, 0.1),), [[3, 2, 0.4]]))
    u.note(load("c", ((1, 1, 0.1),), ((3, 1, 0.3),)))
    assert u.mixed_steps == {3: (3, pytest.approx(0.7))}
    assert u.decode_steps[1] == (7, pytest.approx(0.7))
    assert load("a", (), [[2, 1, 0.5]]).mixed_steps == ((2, 1, 0.5),)
