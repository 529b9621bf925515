"""How many prefill and decode workers the load asks for: the autoscaler's decisions.

Pure logic over samples (no clock, no Ray): the cluster's control loop
(``router.cluster.autoscale``) feeds it, every ``interval_s``, each role's worker count and
its workers' utilizations, and acts on what it answers (add a worker through Ray; drain one).

The rule is Kubernetes' HPA rule per role, with its stabilization:

- ``desired = ceil(sum(utilization) / target_utilization)``, clamped to ``[min, max]``; no
  change while the mean utilization is within ``tolerance`` of the target (a band, so a load
  sitting at the target does not flap);
- **up** once every sample of the last ``up_window_s`` asked for more: to the least of them;
- **down** once every sample of the last ``down_window_s`` asked for fewer: by one worker (a
  drain moves streams, so removal is gradual);
- after a change of a role, nothing more for that role for ``cooldown_s`` (the new worker's
  load, or the drained one's moved streams, must show first); the samples of the old size
  are dropped;
- a count outside ``[min, max]`` (a worker died, bounds changed) is brought back at once.

Under a constant load (a total utilization that the workers share) this moves once, in one
direction, to ``ceil(load / target)`` and stays:
``tests/unit/router/control/test_autoscaler.py`` checks that, and the bounds, over random loads
and starts.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["Decision", "ScalePolicy", "ScaleController"]

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class ScalePolicy:
    """The autoscaler's settings (``pdcluster serve --autoscale`` flags; defaults documented
    in docs/deployment.md)."""

    min_prefill: int = 1
    max_prefill: int = 1
    min_decode: int = 1
    max_decode: int = 1
    target_utilization: float = 0.7
    tolerance: float = 0.1
    interval_s: float = 5.0
    up_window_s: float = 15.0
    down_window_s: float = 60.0
    cooldown_s: float = 60.0

    def __post_init__(self) -> None:
        for role in ROLES:
            lo, hi = self.bounds(role)
            if lo < 1 or hi < lo:
                raise ValueError(f"--min-{role}-workers / --max-{role}-workers: need "
                                 f"1 <= min <= max, got {lo}..{hi}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"--autoscale-target must be in (0, 1], got "
                             f"{self.target_utilization:g}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"autoscale tolerance must be in [0, 1), got {self.tolerance:g}")
        for name in ("interval_s", "up_window_s", "down_window_s", "cooldown_s"):
            if getattr(self, name) < 0 or (name == "interval_s" and self.interval_s == 0):
                raise ValueError(f"autoscale {name} must be > 0, got {getattr(self, name):g}")

    def bounds(self, role: str) -> tuple[int, int]:
        return ((self.min_prefill, self.max_prefill) if role == "prefill"
                else (self.min_decode, self.max_decode))


@dataclass(frozen=True)
class Decision:
    """Change ``role`` from ``current`` to ``desired`` workers; ``reason``: "load" (the
    utilization asked for it), "below_min" / "above_max" (the bounds)."""

    role: str
    direction: str  # "up" | "down"
    current: int
    desired: int
    reason: str
    mean_utilization: float


@dataclass
class _RoleState:
    samples: deque = field(default_factory=deque)  # (time, desired), newest last
    changed_at: float = -math.inf
    desired: int = 0  # the last sample's answer (exported as the desired count)


class ScaleController:
    """One per router; ``observe`` once per interval per role."""

    def __init__(self, policy: ScalePolicy) -> None:
        self.policy = policy
        self._roles = {role: _RoleState() for role in ROLES}

    def desired(self, role: str) -> int:
        return self._roles[role].desired

    def observe(self, now: float, role: str, current: int,
                utilizations: list[float]) -> Decision | None:
        """One sample: ``current`` workers of ``role`` in service (added ones still starting
        included, draining ones not) and the utilization of each that reported (busy
        fraction of its capacity, 0..1 or above when queues build). The decision to act on,
        or None."""
        p, st = self.policy, self._roles[role]
        lo, hi = p.bounds(role)
        mean = sum(utilizations) / len(utilizations) if utilizations else 0.0
        if current < lo or current > hi:
            st.desired = min(max(current, lo), hi)
            return self._decide(now, role, current, st.desired,
                                "below_min" if current < lo else "above_max", mean)
        if not utilizations or abs(mean / p.target_utilization - 1) <= p.tolerance:
            want = current
        else:
            want = math.ceil(sum(utilizations) / p.target_utilization - 1e-9)
        want = min(max(want, lo), hi)
        st.desired = want
        st.samples.append((now, want))
        horizon = max(p.up_window_s, p.down_window_s)
        # Keep one sample at or before the longest window's start (see _held).
        while len(st.samples) >= 2 and st.samples[1][0] <= now - horizon:
            st.samples.popleft()
        if now - st.changed_at < p.cooldown_s:
            return None
        if want > current and self._held(st, now, p.up_window_s, lambda w: w > current):
            return self._decide(now, role, current,
                                min(w for t, w in st.samples if t >= now - p.up_window_s),
                                "load", mean)
        if want < current and self._held(st, now, p.down_window_s, lambda w: w < current):
            return self._decide(now, role, current, current - 1, "load", mean)
        return None

    def _held(self, st: _RoleState, now: float, window: float, ok) -> bool:
        """``ok`` held through the last ``window`` seconds: for every sample in it and for
        the last one before it (the state at its start; ticks drift, so no sample need fall
        exactly on the window's edge)."""
        inside = [w for t, w in st.samples if t > now - window]
        before = [w for t, w in st.samples if t <= now - window]
        if not before:  # not observed for the whole window yet (since the start or a change)
            return False
        return ok(before[-1]) and all(ok(w) for w in inside)

    def _decide(self, now: float, role: str, current: int, desired: int, reason: str,
                mean: float) -> Decision:
        st = self._roles[role]
        st.changed_at = now
        st.samples.clear()  # they were taken at the old size
        return Decision(role, "up" if desired > current else "down", current, desired, reason,
                        mean)
