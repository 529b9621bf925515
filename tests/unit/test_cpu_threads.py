"""An engine's torch thread count (engine.cpu_threads): the CPU budget from the affinity mask
and the cgroup quota, the stolen-time reader, the governor's decisions on synthetic windows,
the engine's driver with injected fakes, and token output that does not depend on the count."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.cpu_threads import (
    CpuBudget,
    EngineThreads,
    GovernorConfig,
    StolenTime,
    ThreadGovernor,
    Window,
    cgroup_quota_cpus,
    cpu_budget,
    speed_ratio,
)

REPO = Path(__file__).resolve().parents[2]
CFG = GovernorConfig()  # the defaults the tests' numbers are written against


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _affinity() -> int:
    return len(os.sched_getaffinity(0))


@pytest.fixture
def torch_threads():
    """Tests that build engines set torch's thread count: give the next test the one found."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# ---- budget: affinity mask ------------------------------------------------------------------

_ONE_CPU_ENGINE = """
import json, os
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import torch
from engine import LLM, SamplingParams
from engine.cpu_threads import cpu_budget
budget = cpu_budget()
llm = LLM(max_num_seqs=2)
threads_built = torch.get_num_threads()
out = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]],
                   SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
print(json.dumps({"budget": budget.threads, "affinity": budget.affinity_cpus,
                  "threads_built": threads_built, "threads_after": torch.get_num_threads(),
                  "engine": llm.engine.threads.threads,
                  "max": llm.engine.threads.governor.max_threads,
                  "stats": llm.engine.stats().num_threads, "tokens": len(out.token_ids)}))
"""


def test_budget_and_engine_follow_a_one_cpu_affinity_mask():
    proc = subprocess.run([sys.executable, "-c", _ONE_CPU_ENGINE], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"budget": 1, "affinity": 1, "threads_built": 1, "threads_after": 1,
                   "engine": 1, "max": 1, "stats": 1, "tokens": 4}


# ---- budget: cgroup quota -------------------------------------------------------------------

def _v2(tmp_path: Path, cgroup: str, cpu_max: dict[str, str]) -> tuple[Path, Path]:
    """A fake /proc/self/cgroup (v2 only) and a cgroup tree with ``cpu.max`` per folder."""
    proc = _write(tmp_path / "proc-cgroup", f"0::{cgroup}\n")
    root = tmp_path / "cgroup"
    (root / cgroup.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for rel, text in cpu_max.items():
        _write(root / rel / "cpu.max", text + "\n")
    return proc, root


def test_cgroup_v2_quota_in_cpus(tmp_path):
    proc, root = _v2(tmp_path, "/kubepods/pod1/ctr", {"kubepods/pod1/ctr": "150000 100000"})
    assert cgroup_quota_cpus(proc_cgroup=proc, cgroup_root=root) == pytest.approx(1.5)
    budget = cpu_budget(proc_cgroup=proc, cgroup_root=root)
    assert budget.quota_cpus == pytest.approx(1.5)
    assert budget.affinity_cpus == _affinity()
    assert budget.threads == 1  # rounded down: a team that outruns its quota is stopped
    assert CpuBudget(2, 1.5).threads == 1 and CpuBudget(8, 1.5).threads == 1


def test_cgroup_v2_max_is_no_quota(tmp_path):
    proc, root = _v2(tmp_path, "/kubepods/pod1/ctr", {"kubepods/pod1/ctr": "max 100000"})
    assert cgroup_quota_cpus(proc_cgroup=proc, cgroup_root=root) is None
    budget = cpu_budget(proc_cgroup=proc, cgroup_root=root)
    assert budget.quota_cpus is None
    assert budget.threads == _affinity()


def test_cgroup_v2_tightest_ancestor_wins(tmp_path):
    proc, root = _v2(tmp_path, "/kubepods/pod1/ctr", {"kubepods/pod1": "100000 100000",
                                                       "kubepods/pod1/ctr": "max 100000"})
    assert cgroup_quota_cpus(proc_cgroup=proc, cgroup_root=root) == pytest.approx(1.0)
    assert cpu_budget(proc_cgroup=proc, cgroup_root=root).threads == 1
    # The child tighter than its parent, and a limit at the root of the tree too.
    proc, root = _v2(tmp_path / "b", "/a/b", {"": "400000 100000", "a": "300000 100000",
                                             "a/b": "50000 50000"})
    assert cgroup_quota_cpus(proc_cgroup=proc, cgroup_root=root) == pytest.approx(1.0)
    proc, root = _v2(tmp_path / "c", "/a/b", {"": "150000 100000", "a": "max 100000",
                                             "a/b": "300000 100000"})
    assert cgroup_quota_cpus(proc_cgroup=proc, cgroup_root=root) == pytest.approx(1.5)


def test_cgroup_v1_cfs_quota(tmp_path):
    proc = _write(tmp_path / "proc-cgroup",
                  "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/x\n")
    root = tmp_path / "cgroup"
    for rel, quota in (("", "-1"), ("docker", "250000"), ("docker/abc", "-1")):
        _write(root / "cpu" / rel / "cpu.cfs_quota_us", quota + "\n")
        _write(root / "cpu" / rel / "cpu.cfs_period_us", "100000\n")
    assert cgroup_quota_cpus(proc_cgroup=proc, cgroup_root=root) == pytest.approx(2.5)
    budget = cpu_budget(proc_cgroup=proc, cgroup_root=root)
    assert budget.threads == min(2, _affinity())
    # -1 everywhere: no quota.
    _write(root / "cpu" / "docker" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_quota_cpus(proc_cgroup=proc, cgroup_root=root) is None
    # The same hierarchy mounted as "cpu,cpuacct" (as some hosts name it).
    root2 = tmp_path / "cgroup2"
    _write(root2 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "50000\n")
    _write(root2 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_quota_cpus(proc_cgroup=proc, cgroup_root=root2) == pytest.approx(0.5)


def test_a_fraction_of_a_cpu_still_runs_one_thread(tmp_path):
    proc, root = _v2(tmp_path, "/slice", {"slice": "50000 100000"})
    budget = cpu_budget(proc_cgroup=proc, cgroup_root=root)
    assert budget.quota_cpus == pytest.approx(0.5)
    assert budget.threads == 1
    assert CpuBudget(4, 0.5).threads == 1


def test_budget_threads_are_the_smaller_of_mask_and_quota():
    assert CpuBudget(4, 2.0).threads == 2
    assert CpuBudget(2, None).threads == 2
    assert CpuBudget(2, 3.0).threads == 2  # the mask is the tighter
    assert CpuBudget(8, 2.999).threads == 2
    assert "no quota" in CpuBudget(2, None).describe()
    assert "quota 1.5 CPUs" in CpuBudget(4, 1.5).describe()


def test_no_cgroup_file_or_no_limit_is_no_quota(tmp_path):
    root = tmp_path / "cgroup"
    root.mkdir()
    assert cgroup_quota_cpus(proc_cgroup=tmp_path / "missing", cgroup_root=root) is None
    proc, root = _v2(tmp_path / "b", "/a", {})
    assert cgroup_quota_cpus(proc_cgroup=proc, cgroup_root=root) is None


# ---- the governor ---------------------------------------------------------------------------

# A window's steps by kind (here one kind: decode steps of 8 rows) -> (count, seconds).
# 2 cores; beside the router's own work (or a nice-19 loop) 2 threads lose 10-25% of their
# time and still beat 1:
ROUTER_2 = {8: (10, 0.35)}  # 35 ms a step at 2 threads
ROUTER_1 = {8: (5, 0.27)}  # 54 ms at 1
# Beside a busy nice-0 loop 2 threads lose ~40%, and 1 thread on the free core is faster:
NEIGHBOUR_2 = {8: (4, 0.40)}  # 100 ms a step at 2 threads
NEIGHBOUR_1 = {8: (9, 0.48)}  # 53 ms at 1
# Nobody else: 2 threads beat 1.
ALONE_1 = {8: (6, 0.27)}  # 45 ms a step at 1 thread
ALONE_2 = {8: (10, 0.25)}  # 25 ms at 2


def _quiet(idle: float = 0.0, wall: float = CFG.window_s) -> Window:
    return Window(wall, wall, 0.0, idle)


def _contended(threads: int, fraction: float, wall: float = CFG.window_s) -> Window:
    """A fully busy window in which each of ``threads`` lost ``fraction`` of its time."""
    return Window(wall, wall, fraction * wall * threads)


def _stepping(steps, threads: int = 1, fraction: float = 0.0, idle: float = 0.0) -> Window:
    """A fully busy window that ran ``steps``, in which each of ``threads`` lost ``fraction``
    of its time."""
    wall = sum(seconds for _, seconds in steps.values())
    return Window(wall, wall, fraction * wall * threads, idle, steps)


def test_quiet_windows_keep_every_thread():
    g = ThreadGovernor(4)
    for i in range(1, 100):
        assert g.observe(_quiet(idle=1.0), now=i * 0.25) == 4
    assert (g.threads, g.num_changes, g.probing) == (4, 0, False)
    assert g.window_s == CFG.window_s


def test_stolen_time_starts_a_trial_of_fewer_threads():
    g = ThreadGovernor(2)
    assert g.observe(_contended(2, 0.1), now=0.25) == 2  # below high_stolen: kept
    assert g.last_stolen == pytest.approx(0.1) and not g.probing
    assert g.observe(_contended(2, CFG.high_stolen), now=0.5) == 1
    assert g.num_changes == 1 and g.probing  # a trial: the next window's speed decides
    assert g.window_s == CFG.window_s  # over a window as long as any other
    g = ThreadGovernor(8)
    assert g.observe(_contended(8, 0.5), now=0.25) == 4  # tries what the team gets
    assert g.last_stolen == pytest.approx(0.5) and g.probing
    g = ThreadGovernor(8)
    assert g.observe(_contended(8, 0.3), now=0.25) == 6  # round(8 * 0.7) = round(5.6)
    g = ThreadGovernor(3)
    assert g.observe(_contended(3, 0.26), now=0.25) == 2  # round(2.22) = 2
    g = ThreadGovernor(3)
    assert g.observe(_contended(3, 0.16), now=0.25) == 2  # round(2.52) = 3: one fewer anyway
    g = ThreadGovernor(4)
    assert g.observe(_contended(4, 0.26), now=0.25) == 3  # round(2.96) = 3
    g = ThreadGovernor(1)
    assert g.observe(_contended(1, 0.9), now=0.25) == 1  # never below 1
    assert (g.num_changes, g.probing) == (0, False)


def test_a_window_with_little_stepping_decides_nothing():
    g = ThreadGovernor(2)
    w = Window(1.0, CFG.min_busy * 1.0 - 0.01, 2.0)  # all stolen, but the engine barely ran
    assert g.observe(w, now=1.0) == 2
    assert g.last_stolen == 0.0 and g.num_changes == 0
    assert g.observe(Window(0.0, 0.0, 1.0), now=1.0) == 2
    assert g.observe(Window(1.0, CFG.min_busy, 1.0), now=2.0) == 1  # busy enough: decides


def test_speed_ratio_compares_the_kinds_both_windows_ran():
    # < 1: the second window's steps ran faster.
    assert speed_ratio(NEIGHBOUR_2, NEIGHBOUR_1) == pytest.approx((0.48 / 9) / 0.1)
    assert speed_ratio(NEIGHBOUR_2, NEIGHBOUR_1) < CFG.keep_ratio
    assert speed_ratio(ROUTER_2, ROUTER_1) == pytest.approx(0.054 / 0.035)
    assert speed_ratio({8: (2, 0.2)}, {8: (5, 0.5)}) == pytest.approx(1.0)  # same per step
    # Each kind weighted by the fewer of its two counts: "a" by 2, "b" by 4 (not by either
    # window's counts, nor equally: those give 0.93, 1.75, 1.25).
    before = {"a": (2, 0.2), "b": (10, 1.0)}  # 100 ms a step, both kinds
    after = {"a": (10, 0.5), "b": (4, 0.8)}  # "a" 50 ms, "b" 200 ms
    assert speed_ratio(before, after) == pytest.approx((2 * 0.05 + 4 * 0.2) / (2 * 0.1 + 4 * 0.1))
    assert speed_ratio(before, after) == pytest.approx(1.5)
    assert speed_ratio(after, before) == pytest.approx(1 / 1.5)
    # Kinds only one window ran are left out.
    assert speed_ratio({"a": (2, 0.2), "c": (5, 9.0)},
                       {"a": (2, 0.1), ("prefill", 64): (1, 5.0)}) == pytest.approx(0.5)
    # No kind in common: no verdict.
    assert speed_ratio({8: (3, 0.3)}, {16: (3, 0.3)}) is None
    assert speed_ratio({}, NEIGHBOUR_1) is None and speed_ratio(NEIGHBOUR_2, {}) is None
    assert speed_ratio({8: (0, 0.0)}, {8: (3, 0.3)}) is None


def test_a_slower_down_trial_is_reverted_and_the_next_waits_twice_as_long():
    """Beside the router's own work (or a nice-19 loop) 2 threads lose 20% and still beat 1:
    stolen time starts a trial of 1 thread, its slower steps send it back to 2 (though it
    lost nothing), and each failed trial doubles the wait for the next, up to the cap."""
    g = ThreadGovernor(2)
    t = 0.25
    assert g.observe(_stepping(ROUTER_2, threads=2, fraction=0.2), now=t) == 1  # round(1.6)
    assert g.probing and g.last_stolen == pytest.approx(0.2)
    t += 0.25
    assert g.observe(_stepping(ROUTER_1), now=t) == 2  # 54 ms against 35
    assert not g.probing and g.num_changes == 2
    backoff = 2 * CFG.probe_after_s
    for _ in range(5):
        assert g.observe(_stepping(ROUTER_2, threads=2, fraction=0.2), now=t + backoff - 0.25) == 2
        assert not g.probing
        t += backoff
        assert g.observe(_stepping(ROUTER_2, threads=2, fraction=0.2), now=t) == 1
        assert g.probing
        t += 0.25
        assert g.observe(_stepping(ROUTER_1), now=t) == 2 and not g.probing
        backoff = min(2 * backoff, CFG.max_probe_after_s)
    assert backoff == CFG.max_probe_after_s  # 4, 8, 16, then capped at 16
    assert g.observe(_stepping(ROUTER_2, threads=2, fraction=0.2), now=t + backoff - 0.25) == 2
    assert g.observe(_stepping(ROUTER_2, threads=2, fraction=0.2), now=t + backoff) == 1
    assert g.num_changes == 2 + 2 * 5 + 1


def test_a_trial_without_comparable_steps_reverts_after_trial_windows():
    g = ThreadGovernor(2)
    t = 0.25
    assert g.observe(_stepping(NEIGHBOUR_2, threads=2, fraction=0.4), now=t) == 1
    # Windows of other kinds of step (prefills of 64 tokens), or of none, give no verdict: the
    # trial waits ...
    others = [{("prefill", 64): (2, 0.25)}, {}]
    for i in range(CFG.trial_windows - 1):
        t += 0.25
        assert g.observe(Window(0.25, 0.25, 0.0, 0.0, others[i % 2]), now=t) == 1
        assert g.probing
    # ... a window that barely stepped is not one of its windows ...
    assert g.observe(Window(0.25, 0.1, 0.0, 0.0, NEIGHBOUR_1), now=t + 0.125) == 1
    assert g.probing
    # ... and after trial_windows of them, back to 2: no evidence either way.
    t += 0.25
    assert g.observe(_stepping({16: (5, 0.25)}), now=t) == 2 and not g.probing
    assert g.num_changes == 2
    # The next trial waits the same back-off, not twice it (nothing showed the trial slower);
    # a comparable window within trial_windows decides.
    w2 = _stepping(NEIGHBOUR_2, threads=2, fraction=0.4)
    assert g.observe(w2, now=t + CFG.probe_after_s - 0.25) == 2 and not g.probing
    t += CFG.probe_after_s
    assert g.observe(w2, now=t) == 1 and g.probing
    assert g.observe(_stepping({16: (5, 0.25)}), now=t + 0.25) == 1 and g.probing
    assert g.observe(_stepping(NEIGHBOUR_1), now=t + 0.5) == 1 and not g.probing  # kept
    assert g.num_changes == 3


def test_a_kept_down_trial_then_up_trials_decided_by_speed():
    """Beside a busy loop 1 thread is kept; trials of 2 lose while the loop runs (each doubling
    the wait for the next) and win once it has gone: the count returns to the budget."""
    g = ThreadGovernor(2)
    assert g.observe(_stepping(NEIGHBOUR_2, threads=2, fraction=0.4), now=10.0) == 1
    assert g.probing
    assert g.observe(_stepping(NEIGHBOUR_1), now=10.5) == 1  # 53 ms against 100: kept
    assert not g.probing and g.num_changes == 1
    # A trial of 2 after the up back-off ...
    assert g.observe(_stepping(NEIGHBOUR_1), now=12.25) == 1 and not g.probing
    assert g.observe(_stepping(NEIGHBOUR_1), now=12.5) == 2 and g.probing
    # ... runs at 100 ms against 53 (the loop is still there): back to 1.
    assert g.observe(_stepping(NEIGHBOUR_2, threads=2, fraction=0.4), now=12.75) == 1
    assert not g.probing and g.num_changes == 3
    # The next trial waits twice the back-off (4 s from 12.75).
    assert g.observe(_stepping(NEIGHBOUR_1), now=14.75) == 1
    assert g.observe(_stepping(NEIGHBOUR_1), now=16.5) == 1 and not g.probing
    # The loop has gone (45 ms steps at 1 thread): 2 threads run 25 ms steps, losing 20% to the
    # router's own work, which does not matter: faster, kept, the budget again.
    assert g.observe(_stepping(ALONE_1), now=16.75) == 2 and g.probing
    assert g.observe(_stepping(ALONE_2, threads=2, fraction=0.2), now=17.0) == 2
    assert not g.probing and g.num_changes == 4
    # Fewer threads wait their back-off from that verdict (2 s: the last down-trial was kept).
    assert g.observe(_stepping(ROUTER_2, threads=2, fraction=0.2), now=18.75) == 2
    assert not g.probing
    assert g.observe(_stepping(ROUTER_2, threads=2, fraction=0.2), now=19.0) == 1
    assert g.observe(_stepping(ROUTER_1), now=19.25) == 2  # 54 ms against 35: back to 2
    assert (g.threads, g.num_changes, g.probing) == (2, 6, False)


def test_failed_up_trials_double_the_back_off_up_to_the_cap():
    g = ThreadGovernor(2)
    t = 10.0
    assert g.observe(_stepping(NEIGHBOUR_2, threads=2, fraction=0.4), now=t) == 1
    t += 0.25
    assert g.observe(_stepping(NEIGHBOUR_1), now=t) == 1 and not g.probing  # kept
    backoff = CFG.probe_after_s
    for _ in range(6):
        # No trial of 2 before the back-off has passed since the last verdict ...
        assert g.observe(_stepping(NEIGHBOUR_1), now=t + backoff - 0.25) == 1
        assert not g.probing
        # ... then one, over a window as long as any other.
        t += backoff
        assert g.observe(_stepping(NEIGHBOUR_1), now=t) == 2
        assert g.probing and g.window_s == CFG.window_s
        # Slower (the loop is still there): back to 1, and the next trial waits twice as long.
        t += 0.25
        assert g.observe(_stepping(NEIGHBOUR_2, threads=2, fraction=0.4), now=t) == 1
        assert not g.probing and g.window_s == CFG.window_s
        backoff = min(2 * backoff, CFG.max_probe_after_s)
    assert backoff == CFG.max_probe_after_s  # 4, 8, 16, then capped at 16
    assert g.observe(_stepping(NEIGHBOUR_1), now=t + CFG.max_probe_after_s - 0.25) == 1
    assert g.observe(_stepping(NEIGHBOUR_1), now=t + CFG.max_probe_after_s) == 2
    assert g.num_changes == 1 + 2 * 6 + 1


def test_a_kept_up_trial_resets_its_back_off_and_the_other_direction_waits():
    g = ThreadGovernor(3)
    beside_3, beside_2 = {8: (3, 0.30)}, {8: (5, 0.30)}  # 100 ms a step at 3 threads, 60 at 2
    alone_2, alone_3 = {8: (8, 0.28)}, {8: (10, 0.25)}  # 35 ms at 2, 25 at 3
    assert g.observe(_stepping(beside_3, threads=3, fraction=0.5), now=0.0) == 2  # round(1.5)
    assert g.observe(_stepping(beside_2), now=0.25) == 2 and not g.probing  # kept
    assert g.observe(_stepping(beside_2), now=2.25) == 3 and g.probing
    assert g.observe(_stepping(beside_3, threads=3, fraction=0.5), now=2.5) == 2  # failed
    assert g.observe(_stepping(alone_2), now=2.5 + 2 * CFG.probe_after_s - 0.25) == 2
    assert g.observe(_stepping(alone_2), now=2.5 + 2 * CFG.probe_after_s) == 3  # trial
    t = 2.5 + 2 * CFG.probe_after_s + 0.25
    assert g.observe(_stepping(alone_3), now=t) == 3  # 25 ms against 35: kept
    assert not g.probing and g.num_changes == 4
    # Fewer threads wait their back-off from this verdict ...
    w3 = _stepping(beside_3, threads=3, fraction=0.5)
    assert g.observe(w3, now=t + CFG.probe_after_s - 0.25) == 3 and not g.probing
    assert g.observe(w3, now=t + CFG.probe_after_s) == 2 and g.probing
    t += CFG.probe_after_s + 0.25
    assert g.observe(_stepping(beside_2), now=t) == 2 and not g.probing  # kept
    # ... and the up back-off is the first one again, not the doubled one.
    assert g.observe(_stepping(beside_2), now=t + CFG.probe_after_s - 0.25) == 2
    assert not g.probing
    assert g.observe(_stepping(beside_2), now=t + CFG.probe_after_s) == 3 and g.probing


def test_threads_return_to_the_budget_when_the_neighbour_leaves():
    """4 CPUs, a neighbour on about 2 of them: 2 threads run fastest beside it, 4 without it
    (one kind of step; more steps in a 0.25 s window, faster)."""
    beside = {4: (2, 0.5), 3: (3, 0.3), 2: (6, 0.05), 1: (4, 0.0)}  # steps, stolen fraction
    alone = {4: 12, 3: 10, 2: 8, 1: 4}  # steps; the CPUs the team leaves sit idle

    def window(threads: int, neighbour: bool) -> Window:
        if neighbour:
            n, f = beside[threads]
            return Window(0.25, 0.25, f * 0.25 * threads, 0.0, {8: (n, 0.25)})
        return Window(0.25, 0.25, 0.0, 4 - threads, {8: (alone[threads], 0.25)})

    g = ThreadGovernor(4)
    t, seen = 0.0, []
    for _ in range(40):  # 10 s beside the neighbour
        t += 0.25
        seen.append(g.observe(window(g.threads, True), now=t))
    # A trial of 2 (what the team got), kept; trials of 3 at 2.5 s and 6.75 s, both slower.
    assert seen == [2] * 9 + [3] + [2] * 16 + [3] + [2] * 13
    assert (g.threads, g.num_changes, g.probing) == (2, 5, False)
    seen = []
    for _ in range(20):  # it has left
        t += 0.25
        seen.append(g.observe(window(g.threads, False), now=t))
    # Idle CPUs start a trial of 3 at once (its back-off runs to 15 s), kept; then one of 4.
    assert seen == [3, 3] + [4] * 18
    assert (g.threads, g.num_changes, g.probing) == (4, 7, False)
    # ... and it stays there.
    for _ in range(20):
        t += 0.25
        g.observe(_quiet(idle=2.0), now=t)
    assert (g.threads, g.num_changes, g.probing) == (4, 7, False)


def test_idle_cpus_start_an_up_trial_before_the_back_off_ends():
    g = ThreadGovernor(2)
    assert g.observe(_stepping(NEIGHBOUR_2, threads=2, fraction=0.4), now=0.0) == 1
    assert g.observe(_stepping(NEIGHBOUR_1), now=0.25) == 1  # kept
    assert g.observe(_stepping(NEIGHBOUR_1), now=2.25) == 2  # a trial of 2 ...
    assert g.observe(_stepping(NEIGHBOUR_2, threads=2, fraction=0.4), now=2.5) == 1  # ... failed
    # The next at 6.5; idle CPUs, but not yet probe_after_s since the last change (2.5).
    assert g.observe(_stepping(ALONE_1, idle=1.0), now=4.25) == 1 and not g.probing
    # probe_after_s since the change, but too few idle CPUs.
    assert g.observe(_stepping(ALONE_1, idle=CFG.idle_cpus_to_probe - 0.01), now=4.5) == 1
    assert not g.probing
    # Both: a trial, well before 6.5; its steps are faster (the loop left): kept.
    assert g.observe(_stepping(ALONE_1, idle=CFG.idle_cpus_to_probe), now=4.75) == 2
    assert g.probing
    assert g.observe(_stepping(ALONE_2, threads=2), now=5.0) == 2 and not g.probing


def test_set_max_clamps_at_once_and_a_raise_allows_an_up_trial_at_once():
    g = ThreadGovernor(4)
    assert g.set_max(2, now=1.0) == 2
    assert (g.threads, g.max_threads, g.num_changes) == (2, 2, 1)
    assert g.observe(_quiet(idle=3.0), now=1.25) == 2  # at its max: no trial
    assert g.set_max(0, now=1.5) == 1 and g.max_threads == 1  # at least one
    assert g.set_max(1, now=1.5) == 1 and g.num_changes == 2  # unchanged: nothing
    # Raised: not at once (a trial decides), but the trial does not wait for a back-off.
    g = ThreadGovernor(2)
    assert g.observe(_stepping(NEIGHBOUR_2, threads=2, fraction=0.4), now=10.0) == 1
    assert g.observe(_stepping(NEIGHBOUR_1), now=10.25) == 1  # kept: up back-off to 12.25
    assert g.set_max(3, now=10.5) == 1 and not g.probing
    assert g.observe(_stepping(ALONE_1), now=10.75) == 2 and g.probing
    assert g.observe(_stepping(ALONE_2, threads=2), now=11.0) == 2 and not g.probing  # kept
    assert g.observe(_stepping(ALONE_2, threads=2), now=11.25) == 3 and g.probing  # on up
    # Lowered during that trial: clamped at once, the trial dropped.
    assert g.set_max(2, now=11.375) == 2 and not g.probing
    assert (g.threads, g.max_threads, g.num_changes) == (2, 2, 4)


def test_num_changes_counts_every_change():
    g = ThreadGovernor(2)
    assert g.num_changes == 0
    g.observe(_stepping(NEIGHBOUR_2, threads=2, fraction=0.4), now=0.0)  # trial 2 -> 1
    g.observe(_stepping(NEIGHBOUR_1), now=0.25)  # kept: no change
    g.observe(_stepping(NEIGHBOUR_1), now=2.25)  # trial 1 -> 2
    g.observe(_stepping(NEIGHBOUR_2, threads=2, fraction=0.4), now=2.5)  # slower: 2 -> 1
    g.observe(_stepping(ALONE_1, idle=1.0), now=4.5)  # idle CPUs: trial 1 -> 2
    g.observe(_stepping(ALONE_2, threads=2), now=4.75)  # kept: no change
    g.set_max(2, now=5.0)  # the same max: no change
    g.set_max(1, now=5.0)  # 2 -> 1
    assert (g.threads, g.num_changes) == (1, 5)


@pytest.mark.parametrize("n", [0, -1])
def test_governor_needs_a_thread(n):
    with pytest.raises(ValueError, match="max_threads"):
        ThreadGovernor(n)


# ---- the engine's driver --------------------------------------------------------------------

class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeStolen:
    """StolenTime's read(): scripted (wall, stolen, idle) tuples, then quiet ones."""

    def __init__(self) -> None:
        self.script: list[tuple[float, float, float]] = []
        self.reads = 0

    def read(self) -> tuple[float, float, float]:
        self.reads += 1
        return self.script.pop(0) if self.script else (CFG.window_s, 0.0, 0.0)


def _driver(max_threads=None, adaptive=True, budget=CpuBudget(2, None)):
    clock, stolen, applied, changed = FakeClock(), FakeStolen(), [], []
    et = EngineThreads(max_threads, adaptive, budget=lambda: budget, stolen=lambda: stolen,
                       set_threads=applied.append, clock=clock)
    et.on_change = changed.append
    return et, clock, stolen, applied, changed


def test_engine_threads_decide_at_each_window_end():
    et, clock, stolen, applied, changed = _driver()
    assert (et.threads, applied, et.budget) == (2, [2], CpuBudget(2, None))
    # Within the window: counted, nothing decided.
    clock.t += 0.125
    et.after_step(0.125, 8)
    assert (stolen.reads, applied, changed) == (0, [2], [])
    # The window ends: both threads lost half their time -> a trial of 1, applied, announced.
    clock.t += 0.125
    stolen.script.append((0.25, 0.25, 0.0))
    et.after_step(0.125, 8)
    assert stolen.reads == 1
    assert (et.threads, applied, changed) == (1, [2, 1], [1])
    assert et.governor.last_stolen == pytest.approx(0.5)
    assert et.governor.probing and et.governor.window_s == CFG.window_s
    # Its window: the same kind of step in 62.5 ms against 125: kept, nothing to apply.
    for _ in range(4):
        clock.t += 0.0625
        et.after_step(0.0625, 8)
    assert stolen.reads == 2 and not et.governor.probing
    assert (et.threads, applied, changed) == (1, [2, 1], [1])
    # Windows before the up back-off: nothing changes.
    for _ in range(7 * 4):
        clock.t += 0.0625
        et.after_step(0.0625, 8)
    assert stolen.reads == 9
    assert (et.threads, applied, changed) == (1, [2, 1], [1])
    # After it: a trial of 2 ...
    for _ in range(4):
        clock.t += 0.0625
        et.after_step(0.0625, 8)
    assert (et.threads, applied, changed) == (2, [2, 1, 2], [1, 2])
    assert et.governor.probing
    # ... whose steps take 125 ms against 62.5 (the neighbour is still there): back to 1.
    for _ in range(2):
        clock.t += 0.125
        et.after_step(0.125, 8)
    assert (et.threads, applied, changed) == (1, [2, 1, 2, 1], [1, 2, 1])
    assert not et.governor.probing


def test_engine_threads_pass_each_steps_kind_into_the_window():
    et, clock, stolen, applied, changed = _driver()
    windows: list[Window] = []
    observe = et.governor.observe

    def spy(w: Window, now: float) -> int:
        windows.append(w)
        return observe(w, now)

    et.governor.observe = spy
    # One window of two kinds of step: decodes of 8 rows and a prefill of 64 tokens; both
    # threads lost half of it: a trial of 1.
    stolen.script.append((0.25, 0.25, 0.0))
    for step_s, kind in ((0.0625, "decode8"), (0.0625, "decode8"), (0.125, ("prefill", 64))):
        clock.t += step_s
        et.after_step(step_s, kind)
    assert windows[0].steps == {"decode8": (2, 0.125), ("prefill", 64): (1, 0.125)}
    assert windows[0].busy_s == 0.25
    assert et.threads == 1 and et.governor.probing
    # Only another kind of step at the trial's count: nothing to compare, the trial waits.
    clock.t += 0.25
    et.after_step(0.25, "decode4")
    assert windows[1].steps == {"decode4": (1, 0.25)}
    assert et.threads == 1 and et.governor.probing
    # The reference's decodes of 8 rows, 31.25 ms a step against 62.5: kept.
    for _ in range(8):
        clock.t += 0.03125
        et.after_step(0.03125, "decode8")
    assert windows[2].steps == {"decode8": (8, 0.25)}
    assert not et.governor.probing and (et.threads, applied, changed) == (1, [2, 1], [1])
    # A step before an idle wait belongs to no window; a step without a kind is of kind None.
    clock.t += 0.125
    et.after_step(0.125, "decode8")
    clock.t += 5.0
    et.idle()
    clock.t += 0.25
    et.after_step(0.25)
    assert windows[3].steps == {None: (1, 0.25)} and len(windows) == 4
    # Each window has its own mapping: later steps never change one the governor holds.
    assert windows[0].steps == {"decode8": (2, 0.125), ("prefill", 64): (1, 0.125)}


def test_engine_threads_idle_time_starts_a_new_window():
    et, clock, stolen, applied, _ = _driver()
    clock.t += 10.0  # waited for work
    et.idle()
    assert stolen.reads == 1
    clock.t += 0.125
    et.after_step(0.125)
    assert stolen.reads == 1  # the window began at the idle() call, 0.125 s ago
    clock.t += 0.125
    et.after_step(0.125)
    assert stolen.reads == 2 and applied == [2]


def test_engine_threads_follow_a_new_budget():
    budgets = [CpuBudget(4, None)]
    clock, stolen, applied = FakeClock(), FakeStolen(), []
    et = EngineThreads(None, True, budget=lambda: budgets[-1], stolen=lambda: stolen,
                       set_threads=applied.append, clock=clock)
    assert applied == [4]
    budgets.append(CpuBudget(4, 2.0))  # a quota arrived
    clock.t += EngineThreads.BUDGET_EVERY_S - 0.25
    et.after_step(EngineThreads.BUDGET_EVERY_S - 0.25)
    assert et.threads == 4  # not read again yet
    clock.t += 0.25
    et.after_step(0.25)
    assert (et.threads, applied, et.budget) == (2, [4, 2], CpuBudget(4, 2.0))


def test_engine_threads_not_adaptive_never_change():
    made = []
    clock, applied = FakeClock(), []
    et = EngineThreads(None, False, budget=lambda: CpuBudget(2, None),
                       stolen=lambda: made.append(1), set_threads=applied.append, clock=clock)
    et.on_change = applied.append
    assert made == []  # no stolen-time reader at all
    for _ in range(20):
        clock.t += 1.0
        et.after_step(1.0)
        et.idle()
    assert (et.threads, applied) == (2, [2])


def test_engine_threads_explicit_count():
    et, clock, stolen, applied, changed = _driver(max_threads=1, budget=CpuBudget(4, None))
    assert (et.threads, et.governor.max_threads, applied) == (1, 1, [1])
    for _ in range(40):  # idle CPUs, quiet windows, budget re-reads: still the operator's 1
        clock.t += 0.5
        stolen.script.append((0.5, 0.0, 3.0))
        et.after_step(0.5)
    assert (et.threads, applied, changed) == (1, [1], [])
    # An explicit count above 1 is the most the governor runs, whatever the budget says.
    et, *_ = _driver(max_threads=3, budget=CpuBudget(1, None))
    assert (et.threads, et.governor.max_threads) == (3, 3)


# ---- stolen time ----------------------------------------------------------------------------

def _schedstat(task: Path, tid: str, run_ns: int, delay_ns: int) -> None:
    _write(task / tid / "schedstat", f"{run_ns} {delay_ns} 7\n")


def _proc_stat(path: Path, idle: int, iowait: int) -> None:
    _write(path, f"cpu  1000 20 300 {idle} {iowait} 0 5 0 0 0\n"
                 f"cpu0 500 10 150 {idle // 2} {iowait // 2} 0 5 0 0 0\nintr 12345\n")


def test_stolen_time_counts_only_busy_threads_delay(tmp_path):
    tck = os.sysconf("SC_CLK_TCK")
    task, stat = tmp_path / "task", tmp_path / "stat"
    _schedstat(task, "100", 5_000_000_000, 1_000_000_000)  # the compute team
    _schedstat(task, "101", 6_000_000_000, 2_000_000_000)
    _schedstat(task, "102", 1_000_000, 9_000_000)  # an I/O thread, mostly asleep
    _proc_stat(stat, idle=50_000, iowait=1_000)
    clock = FakeClock(50.0)
    st = StolenTime(task_dir=task, proc_stat=stat, busy_fraction=0.2, clock=clock)

    clock.t += 2.0
    _schedstat(task, "100", 6_500_000_000, 1_300_000_000)  # ran 1.5 s, waited 0.3 s
    _schedstat(task, "101", 6_400_000_000, 2_250_000_000)  # ran 0.4 s = 0.2 * wall: busy
    _schedstat(task, "102", 300_000_000, 900_000_000)  # ran 0.299 s < 0.4 s: not counted
    _schedstat(task, "103", 9_000_000_000, 5_000_000_000)  # new: nothing to compare with
    _proc_stat(stat, idle=50_000 + 2 * tck, iowait=1_000 + tck)  # 3 idle CPU-seconds
    wall, stolen, idle = st.read()
    assert wall == pytest.approx(2.0)
    assert stolen == pytest.approx(0.3 + 0.25)
    assert idle == pytest.approx(1.5)

    # The next read compares with the last one; a thread that exited is dropped.
    clock.t += 1.0
    (task / "100" / "schedstat").unlink()
    (task / "100").rmdir()
    _schedstat(task, "101", 6_500_000_000, 2_950_000_000)  # ran 0.1 s < 0.2 s: not busy
    _schedstat(task, "103", 9_900_000_000, 5_100_000_000)  # ran 0.9 s, waited 0.1 s
    wall, stolen, idle = st.read()
    assert (wall, idle) == (pytest.approx(1.0), 0.0)
    assert stolen == pytest.approx(0.1)


def test_stolen_time_without_readable_files_is_zero(tmp_path):
    clock = FakeClock()
    st = StolenTime(task_dir=tmp_path / "none", proc_stat=tmp_path / "nostat", clock=clock)
    clock.t += 1.0
    assert st.read() == (pytest.approx(1.0), 0.0, 0.0)


# ---- token output does not depend on the thread count ---------------------------------------

_TEXTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type with an oil-based ink and a screw press adapted "
    "from the ones used to make wine. Within fifty years presses were running in more than "
    "two hundred cities.",
    "To bake a simple loaf of bread, mix flour, water, salt and yeast into a dough, knead it "
    "for about ten minutes until it is smooth, and let it rise in a warm place until doubled.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])\n# The output of this program is",
)
PROMPT_TOKENS = 40


def _tokens(outs) -> list[list[int]]:
    return [list(o.token_ids) for o in outs]


def _differences(runs: dict[str, list]) -> str:
    """Where the runs' tokens part, with each run's top-2 logprob gap there."""
    lines = []
    names = list(runs)
    ref = runs[names[0]]
    for name in names[1:]:
        for p, (a, b) in enumerate(zip(ref, runs[name], strict=True)):
            ta, tb = list(a.token_ids), list(b.token_ids)
            if ta == tb:
                continue
            i = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)

            def gap(o, i=i):
                lp = o.logprobs[i]
                return f"{lp.token_id} ({lp.top[0][1] - lp.top[1][1]:.4f} over the 2nd)"

            lines.append(f"prompt {p} position {i}: {names[0]} {gap(a)} vs {name} {gap(b)}")
    return "; ".join(lines)


def test_greedy_tokens_do_not_depend_on_the_thread_count(torch_threads):
    from engine import LLM, SamplingParams

    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24, logprobs=2)
    runs = {}

    llm = LLM(max_num_seqs=4, num_threads=2, adaptive_threads=False)
    prompts = [llm.tokenizer.encode(t)[:PROMPT_TOKENS] for t in _TEXTS]
    assert all(len(p) == PROMPT_TOKENS for p in prompts)
    assert llm.engine.threads.threads == 2
    runs["2 threads"] = llm.generate(prompts, sp)
    assert torch.get_num_threads() == 2 and llm.engine.stats().num_threads == 2
    del llm
    gc.collect()

    llm = LLM(max_num_seqs=4, num_threads=1, adaptive_threads=False)
    runs["1 thread"] = llm.generate(prompts, sp)
    assert torch.get_num_threads() == 1 and llm.engine.stats().num_threads == 1
    del llm
    gc.collect()

    # A 2-thread engine that its governor drops to 1 thread in the middle of the requests.
    llm = LLM(max_num_seqs=4, num_threads=2, adaptive_threads=True)
    threads = llm.engine.threads
    assert threads.adaptive and threads.on_change is not None and threads.threads == 2
    # The fake clock goes on from the real one the governor was built on (its back-offs).
    clock, stolen = FakeClock(time.monotonic() + 1.0), FakeStolen()
    threads._clock, threads._stolen = clock, stolen  # no window ends until the test says so
    threads.idle()
    final, switched_at = {}, None
    for out in llm.stream(prompts, sp):
        if out.finished:
            final[out.request_id] = out
        if switched_at is None and len(out.token_ids) >= 8:
            assert torch.get_num_threads() == 2
            clock.t += 1.0
            stolen.script.append((1.0, 1.0, 0.0))  # each of 2 threads lost half the window
            threads.after_step(1.0)
            assert threads.threads == 1 and torch.get_num_threads() == 1
            assert llm.engine.stats().num_threads == 1
            assert llm.engine.stats().cpu_stolen == pytest.approx(0.5)
            switched_at = len(out.token_ids)
    assert switched_at is not None and switched_at < sp.max_tokens
    assert torch.get_num_threads() == 1 and threads.governor.num_changes == 1
    runs["2 -> 1 threads mid-run"] = sorted(final.values(),
                                            key=lambda o: prompts.index(o.prompt_token_ids))
    del llm, threads
    gc.collect()

    tokens = {name: _tokens(outs) for name, outs in runs.items()}
    assert all(len(t) == sp.max_tokens for ts in tokens.values() for t in ts)
    assert len({json.dumps(t) for t in tokens.values()}) == 1, _differences(runs)


def test_a_budget_lowered_during_a_trial_is_never_exceeded():
    """A trial's fallback count may be above a budget lowered meanwhile: the trial is dropped."""
    g = ThreadGovernor(4)
    assert g.observe(Window(1.0, 1.0, 1.0, 0.0, {8: (10, 1.0)}), 1.0) == 3  # round(3.0)
    assert g.observe(Window(1.0, 1.0, 0.0, 0.0, {8: (20, 1.0)}), 2.0) == 3  # faster: kept
    assert g.observe(Window(1.0, 1.0, 0.0, 0.0, {8: (20, 1.0)}), 4.0) == 4 and g.probing
    assert g.set_max(2, 4.05) == 2 and not g.probing
    # A slower window would have sent the trial back to 3: no verdict comes.
    assert g.observe(Window(1.0, 1.0, 0.0, 0.0, {8: (5, 1.0)}), 5.0) == 2
    # A contended window then starts a trial from the budget; slower, it goes back to the
    # budget, never above it.
    assert g.observe(Window(0.1, 0.1, 0.1, 0.0, {8: (2, 0.1)}), 5.1) == 1 and g.probing
    assert g.observe(Window(0.1, 0.1, 0.0, 0.0, {8: (1, 0.1)}), 5.2) == 2 and not g.probing
    assert g.max_threads == 2
    # Lowered during a down-trial from above it: the trial's count stays, and the next window
    # tries one more thread at once, up to the new budget (not the 4 it came from).
    g = ThreadGovernor(4)
    assert g.observe(_contended(4, 0.5), now=1.0) == 2 and g.probing
    assert g.set_max(3, now=1.125) == 2 and not g.probing
    assert g.observe(Window(0.25, 0.25, 0.0, 0.0, {8: (1, 0.25)}), now=1.25) == 3
    assert g.probing and g.max_threads == 3


def test_a_window_is_judged_at_the_count_it_ran_at_before_a_new_budget():
    """4 threads each losing 10% (below high_stolen) keep 4; the budget of 2 then clamps to 2."""
    clock = [0.0]
    applied: list[int] = []
    budgets = iter([CpuBudget(4, None), CpuBudget(4, 2.0)])

    class Stolen:
        def read(self):
            return 1.0, 0.4, 0.0  # 4 threads x 10% of 1 s

    t = EngineThreads(None, True, budget=lambda: next(budgets), stolen=Stolen,
                      set_threads=applied.append, clock=lambda: clock[0])
    clock[0] = EngineThreads.BUDGET_EVERY_S + 1.0
    t.after_step(1.0)
    assert t.governor.last_stolen == pytest.approx(0.1)
    assert applied == [4, 2]


def test_a_hungrier_neighbour_starts_a_down_trial_before_the_back_off():
    """After a slower down-trial at 20% stolen (the router's own work), a neighbour taking
    40% is news: a down-trial starts at once instead of after the doubled back-off."""
    g = ThreadGovernor(2)
    assert g.observe(_stepping(ROUTER_2, threads=2, fraction=0.2), now=1.0) == 1
    assert g.observe(_stepping(ROUTER_1), now=1.25) == 2  # slower at 1: back to 2
    assert g.observe(_stepping(ROUTER_2, threads=2, fraction=0.2), now=1.5) == 2  # waits
    assert g.observe(_stepping(NEIGHBOUR_2, threads=2, fraction=0.4), now=1.75) == 1
    assert g.probing
