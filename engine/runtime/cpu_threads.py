"""How many threads an engine's torch work runs on: the CPUs this process may use, and gets.

Why it matters: a CPU engine step is ~300 OpenMP parallel regions, each ending at a barrier
that waits for the team's slowest thread. When a neighbour process (a log shipper, a build,
another pod) takes a core from one member of a 2-thread team, every barrier waits for that
member's next time slice: the default model's decode step went from 17-28 ms to 60-100 ms
beside one busy loop (2 cores; docs/history/2026-12-06-wave-4.md, "Speed beside a neighbour"),
while one thread beside the same loop runs on the free core at 1.3-1.9x the quiet 2-thread
step. So:

- **Budget** (``cpu_budget``): at most as many threads as the CPUs this process may run on
  (its affinity mask) and is allowed (its cgroup's CPU quota: ``cpu.max`` on cgroup v2,
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` on v1, the tightest on the path to the root,
  as Kubernetes limits set it), rounded down, at least 1. Rounded down because a team that
  outruns its quota is stopped for the rest of the period, mid-step.
- **Stolen time** (``StolenTime``): how long this process's busy threads sat runnable but not
  running (``/proc/self/task/*/schedstat``, run_delay) plus the time its cgroup was throttled.
- **Governor** (``ThreadGovernor``, pure): per window of stepping, when the busy threads lost
  ``high_stolen`` of their time or more, a trial of fewer threads; below the budget, a trial of
  one more thread after a back-off (sooner once CPUs sit idle). A trial is kept only when the
  same kinds of step ran faster at its count: stolen time says a neighbour is there, not which
  count is faster (beside a nice-19 loop, or the router's own work, 2 threads that lose 10-25%
  still beat 1).
- ``EngineThreads`` drives these from the engine's step (on its compute thread: OpenMP's
  thread count is per calling thread) and applies the count with ``torch.set_num_threads``;
  the fused C kernels read it per call. Token output does not depend on the thread count
  (tests/unit/engine/runtime/test_cpu_threads.py).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["CpuBudget", "EngineThreads", "GovernorConfig", "StolenTime", "ThreadGovernor",
           "Window", "cgroup_quota_cpus", "cpu_budget"]


# ---- budget ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use: ``threads`` is what an engine runs at most."""

    affinity_cpus: int  # CPUs in the affinity mask
    quota_cpus: float | None  # the cgroup's CPU quota in CPUs (None: no limit)

    @property
    def threads(self) -> int:
        cap = self.affinity_cpus if self.quota_cpus is None else min(
            self.affinity_cpus, math.floor(self.quota_cpus + 1e-9))
        return max(1, cap)

    def describe(self) -> str:
        quota = "no quota" if self.quota_cpus is None else f"quota {self.quota_cpus:g} CPUs"
        return f"{self.affinity_cpus} CPUs in the affinity mask, {quota}"


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup path on v2 (the ``0::`` line) and on v1's cpu controller."""
    v2 = v1 = None
    try:
        text = proc_cgroup.read_text()
    except OSError:
        return None, None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ancestors(root: Path, rel: str) -> list[Path]:
    """``root/rel`` and each folder above it up to ``root``, deepest first."""
    parts = [p for p in rel.split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_quota_cpus(proc_cgroup: Path = Path("/proc/self/cgroup"),
                      cgroup_root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup path, v2 or v1; None when
    no cgroup on the path limits it (or none can be read)."""
    v2, v1 = _cgroup_paths(proc_cgroup)
    quotas: list[float] = []
    if v2 is not None:
        for d in _ancestors(cgroup_root, v2):
            text = _read(d / "cpu.max")
            if text and not text.startswith("max"):
                quota, _, period = text.partition(" ")
                quotas.append(int(quota) / int(period or 100000))
    if v1 is not None:
        for base in (cgroup_root / "cpu", cgroup_root / "cpu,cpuacct"):
            for d in _ancestors(base, v1):
                quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
                if quota and period and int(quota) > 0:
                    quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def cpu_budget(proc_cgroup: Path = Path("/proc/self/cgroup"),
               cgroup_root: Path = Path("/sys/fs/cgroup")) -> CpuBudget:
    """The CPUs this process may use now (affinity mask and cgroup quota)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    return CpuBudget(affinity, cgroup_quota_cpus(proc_cgroup, cgroup_root))


# ---- stolen time ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    """One decision window: its wall time, how much of it the engine spent stepping, and the
    busy threads' stolen seconds (waiting for a CPU, or throttled) in it; ``idle_cpus``: CPUs
    the whole machine left idle on average (a neighbour that left shows as idle CPUs);
    ``steps``: its engine steps by kind (any hashable key naming steps of comparable work,
    e.g. decode rows and bucketed prompt tokens) -> (count, seconds)."""

    wall_s: float
    busy_s: float
    stolen_s: float
    idle_cpus: float = 0.0
    steps: Mapping[Hashable, tuple[int, float]] = field(default_factory=dict)


def speed_ratio(before: Mapping[Hashable, tuple[int, float]],
                after: Mapping[Hashable, tuple[int, float]]) -> float | None:
    """How long ``after``'s steps took against ``before``'s, over the kinds both ran (each
    kind weighted by the fewer of its two counts): < 1 is faster. None: no kind in common."""
    num = den = 0.0
    for key, (n_a, s_a) in after.items():
        n_b, s_b = before.get(key, (0, 0.0))
        if n_a and n_b:
            w = min(n_a, n_b)
            num += w * s_a / n_a
            den += w * s_b / n_b
    return num / den if den > 0 else None


class StolenTime:
    """Reads what the process's busy threads lost to other processes since the last call.

    A thread counts as busy when it ran at least ``busy_fraction`` of the interval (the
    compute team; the mostly-sleeping I/O threads wait for a CPU behind our own team, which
    is not a neighbour's doing). Stolen = their run_delay growth + the cgroup's throttled
    time, added once (the quota itself is the budget's business: ``cpu_budget``)."""

    def __init__(self, task_dir: Path = Path("/proc/self/task"),
                 proc_stat: Path = Path("/proc/stat"), busy_fraction: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._task_dir, self._proc_stat = task_dir, proc_stat
        self._busy_fraction = busy_fraction
        self._clock = clock
        self._last = self._sample()

    def _sample(self) -> tuple[float, dict[str, tuple[int, int]], int, float]:
        threads: dict[str, tuple[int, int]] = {}
        try:
            tids = os.listdir(self._task_dir)
        except OSError:
            tids = []
        for tid in tids:
            text = _read(self._task_dir / tid / "schedstat")
            if text:
                run_ns, delay_ns, *_ = text.split()
                threads[tid] = (int(run_ns), int(delay_ns))
        return self._clock(), threads, _throttled_ns(), _idle_s(self._proc_stat)

    def read(self) -> tuple[float, float, float]:
        """(wall seconds, stolen seconds, idle CPUs on average) since the last read."""
        now, threads, throttled, idle = self._sample()
        t0, before, throttled0, idle0 = self._last
        self._last = (now, threads, throttled, idle)
        wall = max(now - t0, 1e-9)
        stolen = 0.0
        for tid, (run_ns, delay_ns) in threads.items():
            run0, delay0 = before.get(tid, (run_ns, delay_ns))
            if (run_ns - run0) / 1e9 >= self._busy_fraction * wall:
                stolen += (delay_ns - delay0) / 1e9
        stolen += max(0, throttled - throttled0) / 1e9
        return wall, stolen, max(0.0, idle - idle0) / wall


def _throttled_ns() -> int:
    """The cgroup's cumulative throttled time (ns), 0 when unknown."""
    v2, v1 = _cgroup_paths(Path("/proc/self/cgroup"))
    root = Path("/sys/fs/cgroup")
    if v2 is not None:
        text = _read(root / v2.lstrip("/") / "cpu.stat")
        for line in (text or "").splitlines():
            if line.startswith("throttled_usec "):
                return int(line.split()[1]) * 1000
    if v1 is not None:
        text = _read(root / "cpu" / v1.lstrip("/") / "cpu.stat")
        for line in (text or "").splitlines():
            if line.startswith("throttled_time "):
                return int(line.split()[1])
    return 0


_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def _idle_s(proc_stat: Path) -> float:
    """The machine's cumulative idle CPU seconds (all CPUs), 0 when unknown."""
    text = _read(proc_stat)
    if not text or not text.startswith("cpu "):
        return 0.0
    fields = text.split("\n", 1)[0].split()
    return (int(fields[4]) + int(fields[5])) * _TICK_S  # idle + iowait


# ---- governor -------------------------------------------------------------------------------

@dataclass(frozen=True)
class GovernorConfig:
    window_s: float = 0.25  # wall time per decision
    min_busy: float = 0.5  # windows stepping less than this fraction decide nothing
    # A busy thread losing this much of a window makes the governor try fewer threads. Only a
    # trial that runs the same kinds of step faster keeps them: stolen time alone does not say
    # which count is faster (2 cores, colocated serving at batch 8, 2 threads: quiet 8-25%
    # lost to the router and the load's client, beside a nice-19 loop 11-14%, and 2 threads
    # still beat 1 in both; beside a nice-0 loop 33-50%, where 1 thread runs 2x faster).
    high_stolen: float = 0.15
    keep_ratio: float = 0.95  # a trial's count is kept when its steps take <= this x before
    trial_windows: int = 3  # windows a trial may wait for steps comparable to before
    probe_after_s: float = 2.0  # first trial of the other direction after a change
    max_probe_after_s: float = 16.0  # back-off cap after failed trials
    idle_cpus_to_probe: float = 0.5  # probe sooner (after probe_after_s) once this idle


@dataclass
class _Trial:
    from_threads: int
    reference: Mapping[Hashable, tuple[int, float]]  # the last window at from_threads
    stolen: float  # the stolen fraction that started it
    windows: int = 0


class ThreadGovernor:
    """Pure: given windows of (wall, busy, stolen, idle, steps), the thread count to run. No
    clock of its own (``now`` comes with each window); tests feed it synthetic signals.

    Hill-climbing on measured speed, started by stolen time: a window whose busy threads lost
    ``high_stolen`` or more starts a trial of fewer threads (about the share the team got);
    below the budget, a trial of one more thread starts after a back-off (sooner once the
    machine shows idle CPUs). A trial's count is kept only when its window ran the same kinds
    of step in ``keep_ratio`` of the time the last window before it took; otherwise the count
    goes back and that direction's back-off doubles (to ``max_probe_after_s``)."""

    def __init__(self, max_threads: int, config: GovernorConfig | None = None,
                 now: float = 0.0) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.config = config or GovernorConfig()
        self.max_threads = self.threads = max_threads
        self.last_stolen = 0.0  # the last deciding window's stolen fraction per busy thread
        self.num_changes = 0
        self._trial: _Trial | None = None
        self._reference: Mapping[Hashable, tuple[int, float]] = {}
        self._backoff_s = {"up": self.config.probe_after_s, "down": self.config.probe_after_s}
        self._next = {"up": now, "down": now}
        self._last_change = now
        self._failed_down_stolen = 1.0  # the stolen fraction of the last slower down-trial

    @property
    def probing(self) -> bool:
        """A trial count is running (its verdict comes with the next windows)."""
        return self._trial is not None

    @property
    def window_s(self) -> float:
        return self.config.window_s

    def set_max(self, max_threads: int, now: float) -> int:
        """A new budget (affinity or quota changed): clamp to it; probe up soon if raised."""
        max_threads = max(1, max_threads)
        if max_threads != self.max_threads:
            self.max_threads = max_threads
            self._backoff_s["up"] = self.config.probe_after_s
            self._next["up"] = now
            self._trial = None  # a trial's fallback may be above the new budget
            self._reference = {}
            if self.threads > max_threads:
                self._change(max_threads, now)
        return self.threads

    def observe(self, w: Window, now: float) -> int:
        """The thread count after window ``w`` (ending at ``now``)."""
        cfg = self.config
        if w.wall_s <= 0 or w.busy_s < cfg.min_busy * w.wall_s:
            return self.threads
        f = w.stolen_s / (w.wall_s * self.threads)
        self.last_stolen = f
        if self._trial is not None:
            return self._judge(w, now)
        self._reference = w.steps
        # A neighbour clearly hungrier than at the last failed down-trial is news: try now.
        news = f >= self._failed_down_stolen + cfg.high_stolen
        if self.threads > 1 and f >= cfg.high_stolen and (now >= self._next["down"] or news):
            # What the team gets is (1 - f) of its threads' time: try about that many.
            self._start(max(1, min(self.threads - 1, round(self.threads * (1 - f)))), now)
        elif self.threads < self.max_threads and (
                now >= self._next["up"] or (w.idle_cpus >= cfg.idle_cpus_to_probe
                                            and now - self._last_change >= cfg.probe_after_s)):
            self._start(self.threads + 1, now)
        return self.threads

    def _start(self, threads: int, now: float) -> None:
        self._trial = _Trial(self.threads, self._reference, self.last_stolen)
        self._change(threads, now)

    def _judge(self, w: Window, now: float) -> int:
        cfg, trial = self.config, self._trial
        ratio = speed_ratio(trial.reference, w.steps)
        trial.windows += 1
        if ratio is None and trial.windows < cfg.trial_windows:
            return self.threads  # nothing comparable ran yet: wait another window
        self._trial = None
        direction = "up" if self.threads > trial.from_threads else "down"
        other = "down" if direction == "up" else "up"
        if ratio is not None and ratio <= cfg.keep_ratio:
            self._reference = w.steps
            self._backoff_s[direction] = cfg.probe_after_s
            self._next[direction] = now  # a further step the same way may pay too
            self._next[other] = now + self._backoff_s[other]
        else:
            if ratio is not None:  # slower: wait longer; nothing comparable ran: no evidence
                self._backoff_s[direction] = min(self._backoff_s[direction] * 2,
                                                 cfg.max_probe_after_s)
                if direction == "down":
                    self._failed_down_stolen = trial.stolen
            self._next[direction] = now + self._backoff_s[direction]
            self._change(trial.from_threads, now)
        return self.threads

    def _change(self, threads: int, now: float) -> None:
        if threads != self.threads:
            self.threads = threads
            self.num_changes += 1
            self._last_change = now


# ---- the engine's driver --------------------------------------------------------------------

class EngineThreads:
    """An engine's thread count: the budget at start, then the governor after each step.
    Call ``after_step`` on the engine's compute thread (torch's OpenMP thread count belongs
    to the thread that sets it)."""

    BUDGET_EVERY_S = 5.0  # the affinity and quota are read again this often

    def __init__(self, max_threads: int | None, adaptive: bool,
                 config: GovernorConfig | None = None,
                 budget: Callable[[], CpuBudget] = cpu_budget,
                 stolen: Callable[[], StolenTime] = StolenTime,
                 set_threads: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``max_threads``: the operator's count (kept as the most this engine runs), or None
        for the budget. ``adaptive`` False: that count, always."""
        self._explicit = max_threads
        self._budget_fn, self._clock = budget, clock
        self._set = set_threads or _torch_set_threads
        # Called with the new count after it is applied (the engine switches kernel plans).
        self.on_change: Callable[[int], None] | None = None
        self.budget = budget()
        now = clock()
        self.governor = ThreadGovernor(max_threads or self.budget.threads, config, now)
        self.adaptive = adaptive
        self._stolen = stolen() if adaptive else None
        self._busy_s = 0.0
        self._steps: dict[Hashable, tuple[int, float]] = {}
        self._window_start = self._budget_at = now
        self._set(self.governor.threads)

    @property
    def threads(self) -> int:
        return self.governor.threads

    def after_step(self, step_s: float, kind: Hashable = None) -> None:
        """Count ``step_s`` of stepping on a step of ``kind`` (steps of one kind do comparable
        work: the governor compares thread counts on them); at each window's end, decide and
        apply."""
        if not self.adaptive:
            return
        self._busy_s += step_s
        n, sec = self._steps.get(kind, (0, 0.0))
        self._steps[kind] = (n + 1, sec + step_s)
        now = self._clock()
        if now - self._window_start < self.governor.window_s:
            return
        before = self.governor.threads
        # The window is judged at the count it ran at, then a new budget clamps.
        wall, stolen, idle = self._stolen.read()
        self.governor.observe(Window(wall, self._busy_s, stolen, idle, self._steps), now)
        if self._explicit is None and now - self._budget_at >= self.BUDGET_EVERY_S:
            self._budget_at = now
            self.budget = self._budget_fn()
            self.governor.set_max(self.budget.threads, now)
        self._busy_s, self._window_start, self._steps = 0.0, now, {}
        if self.governor.threads != before:
            log.info("engine threads %d -> %d (busy threads lost %.0f%% of the last %.2f s to "
                     "other processes; budget %s)", before, self.governor.threads,
                     100 * self.governor.last_stolen, wall, self.budget.describe())
            self._set(self.governor.threads)
            if self.on_change is not None:
                self.on_change(self.governor.threads)

    def idle(self) -> None:
        """The engine waited for work: the next window starts now (idle time is not stolen)."""
        if self._stolen is not None:
            self._stolen.read()
            self._busy_s, self._window_start, self._steps = 0.0, self._clock(), {}


def _torch_set_threads(n: int) -> None:
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
