"""`bench neighbour` without a server or a model: targets and verdicts, the table (a MISSED
and an unavailable cell included), the flags, per-token timing from SSE chunk times, the
process-group reader and the cgroup-path parser."""

from __future__ import annotations

import argparse
import os

import pytest

from bench.cli import add_bench_subcommands
from bench.cluster import neighbour as nb
from bench.cluster import neighbour_loads as nl
from bench.cluster import neighbour_table as nt


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_subcommands(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "neighbour", *flags])


# ---- flags -----------------------------------------------------------------------------------
def test_defaults_cover_every_system_load_and_both_batches():
    args = _args()
    assert args.func is nb.run
    s = nb.settings(args)
    assert s.systems == ("offline", "colocated", "colocated-t2", "disaggregated", "transformers")
    assert s.loads == ("quiet", "nice19", "nice0", "quota1")
    assert (s.batches, s.rounds, s.input_len, s.output_len) == ((1, 8), 2, 64, 64)
    assert s.startup_timeout_s > 0 and s.settle_s == 1.0


def test_quick_means_one_round_16_tokens_batch_1_unless_given():
    s = nb.settings(_args("--quick"))
    assert (s.batches, s.rounds, s.output_len) == ((1,), 1, 16)
    s = nb.settings(_args("--quick", "--batches", "1,8", "--rounds", "3", "--output-len", "32"))
    assert (s.batches, s.rounds, s.output_len) == ((1, 8), 3, 32)


def test_lists_are_parsed_and_checked():
    s = nb.settings(_args("--systems", "offline, colocated", "--loads", "quiet,nice0",
                          "--batches", "8,1,8", "--startup-timeout-s", "60"))
    assert s.systems == ("offline", "colocated") and s.loads == ("quiet", "nice0")
    assert s.batches == (8, 1) and s.startup_timeout_s == 60
    for flags in (("--systems", "vllm"), ("--loads", "nice5"), ("--batches", "0"),
                  ("--batches", "x"), ("--output-len", "1"), ("--systems", ",")):
        with pytest.raises(ValueError):
            nb.settings(_args(*flags))


# ---- targets, verdicts, table ----------------------------------------------------------------
def test_goals_follow_the_issue():
    assert nt.goal_for("offline", "nice0") == 2.0
    for served in ("colocated", "colocated-t2", "disaggregated"):
        assert nt.goal_for(served, "nice0") == 2.5
        assert nt.goal_for(served, "nice19") == 1.3
    assert nt.goal_for("offline", "nice19") == 1.3
    assert nt.goal_for("transformers", "nice0") is None
    assert nt.goal_for("offline", "quota1") is None and nt.goal_for("offline", "quiet") is None


def test_verdicts():
    assert nt.verdict("nice0", 1.9, 2.0, 30.0) == "met"
    assert nt.verdict("nice0", 2.0, 2.0, 30.0) == "met"  # at the goal counts
    assert nt.verdict("nice0", 2.6, 2.5, 30.0) == "MISSED"
    assert nt.verdict("quiet", 1.0, None, 15.0) == "baseline"
    assert nt.verdict("quota1", 1.4, None, 20.0) == "no target"
    assert nt.verdict("nice0", None, 2.0, 20.0) == "no quiet baseline"
    assert nt.verdict("nice0", None, 2.0, None) == "not measured"
    assert nt.verdict("quota1", None, None, None, unavailable="no cgroup") == \
        "unavailable: no cgroup"
    assert nt.verdict("nice0", None, 2.0, None, error="boom") == "error: boom"


def _cells() -> list[nt.Cell]:
    return [nt.Cell("offline", "quiet", 1, 20.0, 2, 20.0, 2),
            nt.Cell("offline", "nice19", 1, 24.0, 2, 24.0, 2),
            nt.Cell("offline", "nice0", 1, 50.0, 2, 50.0, 1),  # 2.5x > 2.0: MISSED
            nt.Cell("offline", "quota1", 1, unavailable="cannot create a cgroup (EACCES)"),
            nt.Cell("colocated", "quiet", 1, 25.0, 4, 21.0, {"colocated-0": 2.0}),
            nt.Cell("colocated", "nice0", 1, 50.0, 4, 40.0, {"colocated-0": 1.0}),  # 2.0x: met
            nt.Cell("transformers", "quiet", 1, 30.0, 2),
            nt.Cell("transformers", "nice0", 1, 90.0, 2)]


def test_rows_ratio_to_quiet_of_the_same_system_and_batch():
    table = {(r["system"], r["load"]): r for r in nt.rows(_cells())}
    assert table[("offline", "nice0")]["ratio_to_quiet"] == pytest.approx(2.5)
    assert table[("offline", "nice0")]["verdict"] == "MISSED"
    assert table[("offline", "nice0")]["met"] is False
    assert table[("offline", "nice19")]["verdict"] == "met"
    assert table[("colocated", "nice0")]["ratio_to_quiet"] == pytest.approx(2.0)
    assert table[("colocated", "nice0")]["met"] is True
    assert table[("offline", "quota1")]["verdict"].startswith("unavailable: cannot create")
    assert table[("offline", "quota1")]["ratio_to_quiet"] is None
    assert table[("transformers", "nice0")]["verdict"] == "no target"
    assert table[("transformers", "nice0")]["ratio_to_quiet"] == pytest.approx(3.0)


def test_targets_list_every_cell_with_a_goal():
    tg = nt.targets(nt.rows(_cells()))
    by = {t["target"]: t for t in tg}
    assert len(tg) == 3  # offline nice19, offline nice0, colocated nice0
    miss = by["offline batch 1 nice0 / quiet ms per token"]
    assert miss["met"] is False and miss["goal"] == 2.0 and miss["comparison"] == "<="
    assert by["colocated batch 1 nice0 / quiet ms per token"]["met"] is True


def test_table_shows_every_cell_missed_and_unavailable_included():
    text = nt.render_table(nt.rows(_cells()))
    lines = text.splitlines()
    assert len(lines) == 1 + len(_cells())
    assert lines[0].split()[:3] == ["system", "batch", "load"]
    nice0 = next(line for line in lines if line.startswith("offline") and " nice0 " in line)
    assert "50.0" in nice0 and "20.0" in nice0 and "2.50x" in nice0 and "<=2.0x" in nice0
    assert nice0.rstrip().endswith("MISSED")
    quota = next(line for line in lines if " quota1 " in line)
    assert quota.rstrip().endswith("unavailable: cannot create a cgroup (EACCES)")
    colo = next(line for line in lines if line.startswith("colocated") and " nice0 " in line)
    assert colo.rstrip().endswith("met") and "<=2.5x" in colo and " 1 " in colo
    assert sum(line.rstrip().endswith("baseline") for line in lines) == 3


# ---- SSE timing, metrics, processes ----------------------------------------------------------
def test_per_token_time_from_chunk_times():
    assert nt.per_token_s([]) is None and nt.per_token_s([5.0]) is None
    assert nt.per_token_s([10.0, 10.02]) == pytest.approx(0.02)
    # First chunk after prefill; 4 gaps over 0.1 s: 25 ms per token, whatever the gaps' shape.
    assert nt.per_token_s([1.0, 1.01, 1.05, 1.06, 1.1]) == pytest.approx(0.025)


def test_threads_gauge_is_parsed_and_its_absence_tolerated():
    page = ('# HELP pdcluster_engine_threads Torch threads\n'
            '# TYPE pdcluster_engine_threads gauge\n'
            'pdcluster_engine_threads{worker="decode-0",role="decode"} 2.0\n'
            'pdcluster_engine_threads{worker="prefill-0",role="prefill"} 1.0\n'
            'pdcluster_engine_threads_other 5\n')
    assert nt.parse_threads(page) == {"decode-0": 2.0, "prefill-0": 1.0}
    assert nt.parse_threads("pdcluster_engine_threads 3\n") == {"": 3.0}
    assert nt.parse_threads('pdcluster_engine_decode_steps_total{batch="1"} 4\n') is None


def test_pgrp_of_this_process_and_its_group():
    assert nl.read_pgrp(os.getpid()) == os.getpgrp()
    assert os.getpid() in nl.pgroup_pids(os.getpgrp())
    assert nl.read_pgrp(2 ** 22 + 12345) is None  # above pid_max: no such process


def _stat(pid: int, comm: str, ppid: int, pgrp: int, start: int) -> str:
    # Fields 3..22: state ppid pgrp session tty tpgid flags 4 x faults 4 x times prio nice
    # threads itrealvalue starttime.
    rest = ["S", ppid, pgrp, pgrp, 0, -1, 4194560, 0, 0, 0, 0, 1, 2, 0, 0, 20, 0, 1, 0, start]
    return f"{pid} ({comm}) " + " ".join(map(str, rest)) + " 1000 200\n"


def _fake_proc(tmp_path, procs):
    for pid, comm, ppid, pgrp, start in procs:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_stat(pid, comm, ppid, pgrp, start))
    (tmp_path / "self").mkdir()
    return tmp_path


def test_pgrp_survives_odd_command_names(tmp_path):
    proc = _fake_proc(tmp_path, [(42, "a b) c)", 1, 777, 5000), (43, "x", 42, 778, 5001)])
    assert nl.read_pgrp(42, proc) == 777
    assert nl.read_stat(42, proc) == nl.ProcStat(1, 777, 5000)
    assert nl.pgroup_pids(777, proc) == [42]
    (proc / "44").mkdir()
    (proc / "44" / "stat").write_text("44 (short) S 1 779\n")  # no start time: still read
    assert nl.read_stat(44, proc) == nl.ProcStat(1, 779, None)


def test_a_system_is_its_group_and_every_descendant(tmp_path):
    # 100 the server (group leader), 101 raylet in its group, 102 a Ray worker in a group of
    # its own under the raylet, 103 the worker's child; 200 and 201 unrelated.
    proc = _fake_proc(tmp_path, [(100, "pdcluster", 1, 100, 10), (101, "raylet", 100, 100, 11),
                                 (102, "ray::DecodeWorker", 101, 102, 12),
                                 (103, "helper", 102, 102, 13), (200, "bash", 1, 200, 14),
                                 (201, "neighbour", 200, 200, 15)])
    assert nl.pgroup_pids(100, proc) == [100, 101]
    assert nl.system_pids(100, proc) == {100: 10, 101: 11, 102: 12, 103: 13}
    assert nl.system_pids(999, proc) == {}


def test_this_process_is_in_its_own_groups_system():
    assert os.getpid() in nl.system_pids(os.getpgrp())


def test_cgroup_path_of_v1_and_v2_texts():
    v1 = "9:memory:/m\n2:cpu,cpuacct:/kubepods/pod1\n0::/\n"
    assert nl.cgroup_path(v1, v2=False) == "/kubepods/pod1"
    assert nl.cgroup_path("0::/user.slice/session-1.scope\n", v2=True) == \
        "/user.slice/session-1.scope"
    assert nl.cgroup_path("1:cpuset:/\n", v2=False) is None
