"""`pdcluster plan` (router/planning/): the simulator against hand-computed timelines on a
synthetic profile (a lone request, a batched prefill step, cores shared, a full KV pool, the
colocated path), the search's ranking, SLO and trace parsing, and the command's table."""

from __future__ import annotations

import json

import pytest

from engine.tuning.profile import EngineProfile
from router.planning.plan import parse_slo, search
from router.planning.simulator import ClusterShape, simulate
from router.planning.workload import TraceRequest, load_workload, named_workload, read_trace

OVERHEAD = 0.03


def _profile(kv_bytes: int = 1000, bw: float = 1e9) -> EngineProfile:
    # Prefill: 1 ms a token, 10 ms fixed; decode: 20 ms + 5 ms a sequence, context-free.
    pre = [(1, n, 0.01 + n * 0.001) for n in (10, 100, 1000, 10000)]
    dec = [(b, c, 0.02 + 0.005 * b) for b in (1, 2, 4, 8, 16, 32) for c in (10, 10000)]
    return EngineProfile("m", 1, "cpu", 2048, kv_bytes, pre, dec, bw)


def test_a_lone_request_takes_its_prefill_the_exposed_transfer_and_one_step_per_token():
    # 100 prompt tokens x 1 MB of KV each = 100 MB at 1 GB/s = 0.1 s, of which the 0.11 s
    # prefill hides all: TTFT = 0.11 + 0.03.
    r = simulate(_profile(kv_bytes=10**6), ClusterShape(1, 1), [TraceRequest(0.0, 100, 5)],
                 1.0, 1.0)
    assert r.ttft_s == pytest.approx([0.11 + OVERHEAD])
    assert r.tpot_s == pytest.approx([0.025])
    # With 10 MB a token the transfer (1 s) outlasts the step: 0.89 s of it is exposed.
    r = simulate(_profile(kv_bytes=10**7), ClusterShape(1, 1), [TraceRequest(0.0, 100, 5)],
                 1.0, 1.0)
    assert r.ttft_s == pytest.approx([1.0 + OVERHEAD])


def test_prompts_queued_together_share_a_step_and_later_ones_wait():
    reqs = [TraceRequest(0.0, 100, 2), TraceRequest(0.0, 100, 2), TraceRequest(0.05, 100, 2)]
    r = simulate(_profile(), ClusterShape(1, 1, max_num_batched_tokens=300), reqs, 9, 9)
    # The first starts a step of its own at once (0.11 s); the second and the third (which
    # arrived meanwhile) wait for it, then share one step of 200 tokens (0.21 s).
    assert r.ttft_s == pytest.approx([0.11 + OVERHEAD, 0.11 + 0.21 + OVERHEAD,
                                      0.11 + 0.21 - 0.05 + OVERHEAD])
    assert r.completed == 3


def test_workers_sharing_cores_slow_each_other_down():
    reqs = [TraceRequest(0.0, 100, 1), TraceRequest(0.0, 100, 1)]
    alone = simulate(_profile(), ClusterShape(2, 1), reqs, 9, 9)
    shared = simulate(_profile(), ClusterShape(2, 1, cores=1), reqs, 9, 9)
    assert alone.ttft_s == pytest.approx([0.11 + OVERHEAD] * 2)
    # Both prefill workers compute from t=0 on 1 core: each at half speed, both done at 0.22.
    assert shared.ttft_s == pytest.approx([0.22 + OVERHEAD] * 2)
    # Staggered: the second starts at 0.05, when the first has 0.06 s of work left. Shared
    # from then, the first ends at 0.05 + 0.12 = 0.17; the second has 0.11 - 0.06 = 0.05 s
    # left then, alone: done at 0.22 (steps are re-rated as others start and end).
    reqs = [TraceRequest(0.0, 100, 1), TraceRequest(0.05, 100, 1)]
    shared = simulate(_profile(), ClusterShape(2, 1, cores=1), reqs, 9, 9)
    assert shared.ttft_s == pytest.approx([0.17 + OVERHEAD, 0.22 - 0.05 + OVERHEAD])


def test_measured_interference_slows_a_prefill_beside_decoding_and_the_reverse():
    """A served profile's pairwise factors: a prefill that runs while the decode worker
    steps takes ``prefill_beside_decode`` times longer, the decode steps beside it
    ``decode_beside_prefill``; on 2 cores for 2 workers the plain sharing says no slowdown.
    A first token whose decode worker is busy waits ``busy_overhead_steps`` of its step."""
    reqs = [TraceRequest(0.0, 10, 200), TraceRequest(0.5, 100, 1)]
    prof = _profile()
    plain = simulate(prof, ClusterShape(1, 1, cores=2), reqs, 9, 9)
    assert plain.ttft_s[1] == pytest.approx(0.11 + OVERHEAD)
    prof.prefill_beside_decode, prof.decode_beside_prefill = 1.5, 1.2
    slowed = simulate(prof, ClusterShape(1, 1, cores=2), reqs, 9, 9)
    assert slowed.ttft_s[1] == pytest.approx(0.11 * 1.5 + OVERHEAD)
    # The decode steps beside the prefill (0.165 s of them) ran 1.2x slower: the 200-token
    # stream's TPOT grows by (1.2 - 1) x 0.165 s / 199 tokens, within a step's rounding.
    extra = (slowed.tpot_s[0] - plain.tpot_s[0]) * 199
    assert 0.2 * 0.165 - 0.025 <= extra <= 0.2 * 0.165 + 0.025
    # On devices (cores inf) nothing is shared: the factors do not apply.
    assert simulate(prof, ClusterShape(1, 1), reqs, 9, 9).ttft_s[1] == pytest.approx(
        0.11 + OVERHEAD)
    # The busy decode worker (1 sequence: 25 ms steps) answers between steps.
    prof.prefill_beside_decode, prof.decode_beside_prefill = 1.0, 1.0
    prof.busy_overhead_steps = 2.0
    busy = simulate(prof, ClusterShape(1, 1, cores=2), reqs, 9, 9)
    assert busy.ttft_s[1] == pytest.approx(0.11 + OVERHEAD + 2 * 0.025)
    assert busy.ttft_s[0] == pytest.approx(plain.ttft_s[0])  # idle then: no wait


def test_a_full_kv_pool_makes_requests_wait_and_an_oversized_one_is_refused():
    reqs = [TraceRequest(0.0, 50, 50), TraceRequest(0.0, 50, 50), TraceRequest(0.0, 500, 1)]
    r = simulate(_profile(), ClusterShape(1, 1, kv_tokens=150), reqs, 99, 99)
    assert (r.completed, r.rejected) == (2, 1)
    first, second = sorted(r.ttft_s)
    # The second prompt waits at the router until the first request frees its KV.
    assert second > first + 49 * 0.025


def test_colocated_computes_the_prompt_inside_its_steps():
    r = simulate(_profile(), ClusterShape(0, 1, mode="colocated"), [TraceRequest(0, 100, 3)],
                 9, 9)
    assert r.ttft_s == pytest.approx([0.11 + OVERHEAD])
    assert r.tpot_s == pytest.approx([(0.025 * 2 - OVERHEAD) / 2])


def test_search_ranks_by_goodput_per_worker():
    reqs = named_workload("chat", 2.0, 60, seed=1)
    rows = search(_profile(), reqs, (1.0, 0.1), 2, 2, [8, 32], ["disaggregated"], 10**6)
    assert len(rows) == 2 * 2 * 2
    per = [r.result.goodput_per_worker() for r in rows]
    assert per == sorted(per, reverse=True)
    assert all(0 <= r.slo_attainment <= 1 for r in rows)


def test_slo_and_trace_parsing(tmp_path):
    assert parse_slo("ttft=2,tpot=0.1") == (2.0, 0.1)
    for bad in ("ttft=2", "ttft=0,tpot=1", "ttft=x,tpot=1", "itl=1,tpot=1"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 5000, "input_length": 10, "output_length": 3, '
                     '"hash_ids": [1]}\n\n{"arrival_s": 1.0, "prompt_tokens": 7, '
                     '"output_tokens": 2}\n')
    assert read_trace(trace) == [TraceRequest(0.0, 7, 2), TraceRequest(4.0, 10, 3)]
    trace.write_text('{"timestamp": 1, "input_length": 0, "output_length": 3}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        read_trace(trace)
    with pytest.raises(ValueError, match="no such file"):
        load_workload(str(tmp_path / "missing.jsonl"), 1, 1)
    a, b = named_workload("rag", 1, 100, seed=3), named_workload("rag", 1, 100, seed=3)
    assert a == b and all(512 <= r.prompt_tokens <= 1536 for r in a)


def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys):
    from router.cli.main import build_parser

    prof = tmp_path / "p.json"
    prof.write_text(_profile().to_json())
    out = tmp_path / "plan.json"
    args = build_parser().parse_args([
        "plan", "--profile", str(prof), "--workload", "chat", "--rate", "1", "--duration", "30",
        "--slo", "ttft=1,tpot=0.1", "--max-prefill-workers", "2", "--max-decode-workers", "1",
        "--max-num-seqs", "8", "--mode", "both", "--json", str(out)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "<- best" in text and "27 requests over" in text
    rows = json.loads(out.read_text())
    assert len(rows) == 3 and {r["mode"] for r in rows} == {"disaggregated", "colocated"}
    bad = build_parser().parse_args(["plan", "--profile", str(prof), "--workload", "chat",
                                     "--slo", "ttft=1"])
    assert bad.func(bad) == 2


def test_bench_plan_splits_parse_and_bad_ones_are_named():
    from bench.cluster.plan_check import _splits

    assert _splits("1x1,1x2, 2x1") == [(1, 1), (1, 2), (2, 1)]
    for bad in ("1x0", "2", "ax1"):
        with pytest.raises(ValueError, match="--splits"):
            _splits(bad)


def test_the_router_streaming_tokens_takes_cores_from_the_workers():
    """With a served profile's router CPU per token, a prefill that starts while a decode
    step streams tokens on a shared host gets fewer cores: 1 decode sequence at 25 ms a
    step is 40 tokens/s, x 10 ms of router CPU each = 0.4 of 2 cores; two workers computing
    on the 1.6 left: 1.25x slower. Without the router's CPU, or on devices, no change."""
    reqs = [TraceRequest(0.0, 10, 60), TraceRequest(0.5, 100, 1)]
    prof = _profile()
    prof.router_cpu_s_per_token = 0.01
    shared = simulate(prof, ClusterShape(1, 1, cores=2), reqs, 9, 9)
    assert shared.ttft_s[1] == pytest.approx(0.11 * 1.25 + OVERHEAD)
    on_devices = simulate(prof, ClusterShape(1, 1), reqs, 9, 9)
    assert on_devices.ttft_s[1] == pytest.approx(0.11 + OVERHEAD)
    prof.router_cpu_s_per_token = 0.0
    assert simulate(prof, ClusterShape(1, 1, cores=2), reqs, 9, 9).ttft_s[1] == pytest.approx(
        0.11 + OVERHEAD)
