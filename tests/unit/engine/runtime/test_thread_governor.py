"""The thread governor (engine.runtime.cpu_threads.ThreadGovernor) on synthetic windows of stolen
time and step times."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.runtime.cpu_threads import (
    CpuBudget,
    EngineThreads,
    GovernorConfig,
    ThreadGovernor,
    Window,
    speed_ratio,
)

REPO = Path(__file__).resolve().parents[4]
CFG = GovernorConfig()  # the defaults the tests' numbers are written against



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
