"""`bench prefix --sweep` without a cluster: the grid, the floor, the cells' requests, the checks
and the report built from synthetic runs."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from bench.cli import add_bench_subcommands
from bench.cluster.prefix import sweep as ps
from bench.cluster.prefix.sweep import Cell, Lengths, Sizing


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_subcommands(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "prefix", *flags])


# ---- the grid -----------------------------------------------------------------------------------
def test_grid_is_every_combination_with_the_pool_varying_fastest():
    cells = ps.expand_grid([4, 16], [2, 4], [1, 4], [0.5, 1.0])
    assert len(cells) == 16 == len(set(cells))
    assert cells[:3] == [Cell(4, 2, 1, 0.5), Cell(4, 2, 1, 1.0), Cell(4, 2, 4, 0.5)]
    assert cells[-1] == Cell(16, 4, 4, 1.0)
    assert cells[-1].users == 64
    assert cells[0].name == "P4xR2/C1/pool0.5"


def test_flags_resolve_to_the_full_quick_and_given_grids():
    full = ps.sweep_config(_args("--sweep"))
    assert len(full.cells) == 8
    assert full.tiers == ("off", "on")
    assert full.policies == ("kv_aware", "load", "round_robin")
    assert full.lens == Lengths(256, 16, 4)
    assert full.tier_size == 2.0

    quick = ps.sweep_config(_args("--sweep", "--quick"))
    assert quick.cells == (Cell(4, 2, 4, 0.5),)
    assert quick.lens == Lengths(128, 16, 4)

    given = ps.sweep_config(_args(
        "--sweep", "--sweep-prefixes", "4,16", "--sweep-reuse", "2,4", "--sweep-concurrency",
        "1,4", "--sweep-pool", "0.5,1.0", "--sweep-tier", "on", "--sweep-tier-size", "3",
        "--policies", "kv_aware,round_robin", "--system-len", "460", "--question-len", "12",
        "--seed", "7"))
    assert len(given.cells) == 16
    assert given.tiers == ("on",)
    assert given.policies == ("kv_aware", "round_robin")
    assert given.lens == Lengths(460, 12, 4)
    assert (given.tier_size, given.seed) == (3.0, 7)
    assert (full.repeats, full.prefill_chunk) == (1, None)
    assert ps.sweep_config(_args("--sweep", "--sweep-repeats", "3", "--prefill-chunk",
                                 "64")).repeats == 3


@pytest.mark.parametrize("flags", [
    ("--sweep-pool", "0,1"), ("--sweep-pool", "5"), ("--sweep-reuse", "2,2"),
    ("--sweep-prefixes", "four"), ("--sweep-tier", "maybe"), ("--sweep-concurrency", ""),
    ("--question-len", "0"), ("--sweep-tier-size", "0"), ("--policies", "fastest"),
    ("--sweep-repeats", "0"), ("--prefill-chunk", "0"),
])
def test_bad_sweep_flags_are_refused(flags):
    with pytest.raises(ValueError):
        ps.sweep_config(_args("--sweep", *flags))


def test_sweep_flags_without_sweep_are_refused_not_ignored():
    with pytest.raises(ValueError, match="--sweep-reuse, --sweep-tier-size need --sweep"):
        ps.refuse_sweep_flags(_args("--sweep-reuse", "2", "--sweep-tier-size", "1"))
    with pytest.raises(ValueError, match="--sweep-repeats needs --sweep"):
        ps.refuse_sweep_flags(_args("--sweep-repeats", "3"))
    ps.refuse_sweep_flags(_args("--users", "8"))  # plain `bench prefix` flags pass


# ---- floor and sizes ----------------------------------------------------------------------------
def test_floor_counts_each_system_prompts_full_blocks_once():
    # The issue's workload (docs/history/2026-12-03-wave-3-prefix-and-planner.md, "In-flight
    # affinity"): 16 system prompts of 460 tokens (28 full blocks = 448 tokens), 48 requests
    # with 12-token questions: 16 x 448 + 48 x (12 + 12).
    assert ps.floor_tokens(16, 48, 460, 12) == 16 * 448 + 48 * 24 == 8320
    assert ps.floor_tokens(16, 48, 460, 48) == 10048
    # 2 prompts of 40 tokens (2 full blocks), 6 requests of 8-token questions.
    assert ps.floor_tokens(2, 6, 40, 8) == 2 * 32 + 6 * (8 + 8) == 160
    # A system prompt of whole blocks: only the questions are computed per request.
    assert ps.floor_tokens(3, 9, 32, 5) == 3 * 32 + 9 * 5


def test_cell_sizing_reuses_bench_prefix_working_set_and_pool_guard():
    lens = Lengths(256, 16, 4)
    s = ps.cell_sizing(Cell(12, 4, 4, 0.5), lens, tier_size=2.0)
    assert s.working_set_tokens == 12 * 256 + 48 * 16 == 3840
    assert s.longest_tokens == 276
    assert s.pool_tokens == 1920
    assert s.tier_tokens == 7680
    assert s.floor_tokens == 3840  # 256 is whole blocks: the floor is the working set
    assert s.prompt_tokens == 48 * 272
    # A pool fraction below 2 longest requests is raised to them.
    small = ps.cell_sizing(Cell(2, 1, 1, 0.1), lens, tier_size=2.0)
    assert small.pool_tokens == 2 * 276


def test_the_tier_holds_the_working_set_only_when_on_and_big_enough():
    s = Sizing(working_set_tokens=1000, longest_tokens=100, pool_tokens=500, tier_tokens=500,
               floor_tokens=900, prompt_tokens=2000)
    assert s.tier_holds("on")
    assert not s.tier_holds("off")
    assert not Sizing(1000, 100, 500, 499, 900, 2000).tier_holds("on")


# ---- a cell's requests --------------------------------------------------------------------------
def test_cell_workload_uses_each_system_prompt_exactly_r_times_shuffled_and_seeded():
    cell, lens, vocab = Cell(6, 4, 2, 0.5), Lengths(40, 8, 4), 1000
    w = ps.cell_workload(cell, lens, vocab, seed=3)
    assert len(w.prompts) == cell.users == 24
    assert all(len(p) == 48 for p in w.prompts)
    assert all(3 <= t < vocab for p in w.prompts for t in p)
    prefixes = Counter(tuple(p[:40]) for p in w.prompts)
    assert len(prefixes) == 6 and set(prefixes.values()) == {4}
    assert Counter(w.system_ids) == {i: 4 for i in range(6)}
    # Requests opening with the same system id open with the same tokens.
    by_id = {i: tuple(p[:40]) for i, p in zip(w.system_ids, w.prompts, strict=True)}
    assert all(tuple(p[:40]) == by_id[i] for i, p in zip(w.system_ids, w.prompts, strict=True))
    assert len({tuple(p[40:]) for p in w.prompts}) == 24  # every question its own
    assert w.system_ids != sorted(w.system_ids)  # shuffled, not grouped
    assert ps.cell_workload(cell, lens, vocab, seed=3) == w
    assert ps.cell_workload(cell, lens, vocab, seed=4).prompts != w.prompts


# ---- checks -------------------------------------------------------------------------------------
SIZING = Sizing(working_set_tokens=1000, longest_tokens=100, pool_tokens=500, tier_tokens=2000,
                floor_tokens=1000, prompt_tokens=3000)
CELL = Cell(4, 3, 4, 0.5)


def _run(ttft_p50_s: float, over_floor: float) -> dict:
    return {"ttft_p50_s": ttft_p50_s, "computed_over_floor": over_floor}


def _by_name(checks: list[dict]) -> dict[str, bool | None]:
    return {c["target"].split(": ", 1)[1].split(" (")[0]: c["met"] for c in checks}


def test_checks_tier_on_with_round_robin_far_above_the_floor():
    runs = {"kv_aware": _run(1.0, 1.10), "round_robin": _run(2.5, 1.8), "load": _run(2.0, 1.7)}
    checks = ps.cell_checks(CELL, SIZING, "on", runs)
    assert _by_name(checks) == {"TTFT p50 kv_aware / round_robin": True,
                                "kv_aware computed / floor": True,
                                "TTFT p50 round_robin / kv_aware": True}
    assert all(c["target"].startswith("P4xR3/C4/pool0.5 tier on: ") for c in checks)
    assert "1.80x the floor" in checks[2]["target"]
    assert checks[2]["measured"] == pytest.approx(2.5)


def test_checks_miss_when_kv_aware_is_slower_than_noise_or_far_from_the_floor():
    runs = {"kv_aware": _run(1.2, 1.2), "round_robin": _run(1.0, 1.6)}
    assert _by_name(ps.cell_checks(CELL, SIZING, "on", runs)) == {
        "TTFT p50 kv_aware / round_robin": False,  # 1.2 > 1.10
        "kv_aware computed / floor": False,  # 1.2 > 1.15
        "TTFT p50 round_robin / kv_aware": False}  # 0.83 < 2


def test_checks_within_noise_and_where_they_do_not_apply():
    # kv_aware 8% slower: within the 1.10 noise allowance. Tier off: no floor check;
    # round_robin below 1.5x the floor: no 2x TTFT check.
    runs = {"kv_aware": _run(1.08, 1.3), "round_robin": _run(1.0, 1.49)}
    checks = ps.cell_checks(CELL, SIZING, "off", runs)
    assert _by_name(checks) == {"TTFT p50 kv_aware / round_robin": True}
    assert checks[0]["measured"] == pytest.approx(1.08)
    assert checks[0]["comparison"] == "<="
    # Tier on but too small to hold the working set with the pool: no floor check either.
    small = Sizing(1000, 100, 500, 400, 1000, 3000)
    assert "kv_aware computed / floor" not in _by_name(ps.cell_checks(CELL, small, "on", runs))


def test_a_failed_run_leaves_its_checks_not_measured():
    runs = {"kv_aware": {"error": "RuntimeError: boom"}, "round_robin": _run(3.0, 2.0)}
    checks = ps.cell_checks(CELL, SIZING, "on", runs)
    assert [c["met"] for c in checks] == [None, None, None]
    assert all(c["reason"] for c in checks)
    assert ps._tally(checks) == {"met": 0, "missed": 0, "not_measured": 3}


def test_repeats_combine_to_medians_and_checks_pair_each_repeat():
    kv = [_run(1.0, 1.0) | {"computed_prompt_tokens": 100}, _run(3.0, 1.2) |
          {"computed_prompt_tokens": 120}, {"error": "RuntimeError: one lost"}]
    rr = [_run(2.0, 1.6), _run(2.0, 1.6), _run(9.0, 1.6)]
    k, r = ps.combine(kv), ps.combine(rr)
    # the median of the runs that ran; counts stay whole; every run kept, the lost one too
    assert k["ttft_p50_s"] == pytest.approx(2.0) and k["computed_prompt_tokens"] == 110
    assert k["ttft_p50_s_range"] == [1.0, 3.0] and len(k["repeats"]) == 3
    # kv / rr per repeat: 0.5, 1.5 (the third has no kv run): median 1.0, not 2.0 / 2.0
    assert ps.paired_ratio(k, r, "ttft_p50_s") == pytest.approx(1.0)
    checks = ps.cell_checks(CELL, SIZING, "off", {"kv_aware": k, "round_robin": r})
    assert checks[0]["measured"] == pytest.approx(1.0)
    assert ps.combine([_run(1.0, 1.0)]) == _run(1.0, 1.0)  # one run: as measured
    assert ps.combine([{"error": "E: a"}, {"error": "E: b"}])["error"] == "E: a"


def test_phase_means_between_snapshots_and_their_median_over_repeats(capsys):
    from bench.cluster.prefix.runs import phase_means
    from router.control.phase_times import PhaseTimes
    from router.control.request_state import RequestTiming

    pt = PhaseTimes()
    pt.record("warm", RequestTiming(9.0, 9.0, 9.0, 1), 9.0)  # before the run: not counted
    before = pt.snapshot()
    pt.record("a", RequestTiming(0.01, 0.2, 0.002, 1), 0.05)
    pt.record("b", RequestTiming(0.03, 0.4, 0.004, 1), 0.07)
    means = phase_means(before, pt.snapshot())
    assert means == pytest.approx({"prefill_queue": 0.02, "prefill_compute": 0.3,
                                   "kv_transfer_tail": 0.003, "decode_commit": 0.06})
    assert phase_means(pt.snapshot(), pt.snapshot()) == {}  # nothing between: nothing
    runs = [_run(1.0, 1.0) | {"phase_mean_s": {"prefill_queue": q, "prefill_compute": 0.3,
                                                "kv_transfer_tail": 0.0, "decode_commit": 0.1}}
            for q in (0.01, 0.05, 0.02)]
    combined = ps.combine(runs)
    assert combined["phase_mean_s"]["prefill_queue"] == pytest.approx(0.02)
    assert ps._phases(combined) == ("  first token: queue 20 + compute 300 + tail 0 + "
                                    "commit 100 ms")
    assert ps._phases(_run(1.0, 1.0)) == ""


def test_measured_adds_the_floor_ratio():
    m = ps.measured({"computed_prompt_tokens": 1150, "ttft_p50_s": 1.0}, SIZING)
    assert m["floor_tokens"] == 1000
    assert m["computed_over_floor"] == pytest.approx(1.15)


# ---- the report, from synthetic runs -------------------------------------------------------------
def test_table_and_plot_from_synthetic_cells(tmp_path, capsys):
    summary = {"ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "computed_prompt_tokens": 1100,
               "prompt_tokens": 3000, "kv_bytes_moved": 5e6, "decode_hit_rate": 0.5,
               "prefill_hit_rate": 0.4}
    cells_out = [{"cell": c.name, "sizing": {"floor_tokens": 1000},
                  "runs": {"off": {"kv_aware": ps.measured(summary, SIZING),
                                   "round_robin": {"error": "TypeError: x"}},
                           "on": {"kv_aware": ps.measured(summary, SIZING)}}}
                 for c in (CELL, Cell(8, 3, 4, 0.5))]
    ps._print_table(cells_out)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6
    assert "1.10x floor 1000" in lines[0] and "FAILED TypeError: x" in lines[1]
    ps._plot(cells_out, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_tier_runs_pass_the_host_tier_to_prefill_and_decode_engines():
    from bench.cluster.prefix.runs import cluster_config

    cfg = cluster_config(None, "kv_aware", 1 << 20, 300, {"kv_offload_memory_bytes": 4096})
    assert cfg.prefill_engine.kv_offload_memory_bytes == 4096
    assert cfg.decode_engine.kv_offload_memory_bytes == 4096
    assert cfg.prefill_engine.kv_cache_memory_bytes == 1 << 20
    assert cluster_config(None, "kv_aware", 1 << 20, 300).decode_engine.kv_offload_memory_bytes == 0
