"""The CPUs an engine may use (engine.runtime.cpu_threads.cpu_budget: the affinity mask and the
cgroup quota, v1 and v2) and what other processes take of its threads' time (StolenTime, on
files laid out as /proc and /sys/fs/cgroup lay them out)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.runtime.cpu_threads import (
    CpuBudget,
    GovernorConfig,
    StolenTime,
    cgroup_quota_cpus,
    cpu_budget,
)
from tests.helpers.cpu_fakes import FakeClock

REPO = Path(__file__).resolve().parents[4]
CFG = GovernorConfig()  # the defaults the tests' numbers are written against



def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _affinity() -> int:
    return len(os.sched_getaffinity(0))


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
