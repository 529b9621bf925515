"""The autoscaler's control loop (``pdcluster serve --autoscale``): measure, decide, act.

Every ``policy.interval_s`` it measures each in-service worker's utilization from what the
router already knows (the last load reports and its own in-flight counters), asks the
decision rule (``router.control.autoscaler``) per role, and acts:

- **up**: ``Cluster.add_worker`` through Ray (on a Ray cluster with an autoscaler, such as
  KubeRay, a worker no node has room for makes Ray ask for a node). A worker that is not
  up within ``ready_timeout_s`` (no room, or it failed to start) is reported, counted
  (``reason="unplaceable"``), removed, and the rule asks again after its cooldown;
- **down**: drains the least busy worker of the role (``router.control.drain``): nothing is
  lost, its streams finish or migrate, then its process exits.

Utilization, 0..1 (above 1 when work queues):

- decode (and colocated) worker: the larger of its KV pool's use and its sequences (running
  + waiting) over ``max_num_seqs``: it is full when either is;
- prefill worker: seconds of prompt compute per second, from the prompt tokens it computed
  since the last tick plus the tokens routed to it and not yet done, at its measured
  prefill rate (``PrefixPulls.prefill_rate``; until there is one, a profile's,
  ``--autoscale-profile``).

Decisions are logged and exported (``pdcluster_autoscaler_desired_workers{role}``,
``pdcluster_autoscaler_decisions_total{role,direction,reason}``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.control.autoscaler import Decision, ScaleController, ScalePolicy

__all__ = ["AutoscaleConfig", "Autoscaler"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoscaleConfig:
    policy: ScalePolicy = field(default_factory=ScalePolicy)
    # An added worker must be up within this (model loaded, Ray placed it); else it is
    # removed and the add retried after the cooldown.
    ready_timeout_s: float = 300.0
    # A drained decode worker's streams still running after this move elsewhere.
    drain_migrate_after_s: float = 30.0
    # Prompt tokens/s a prefill worker computes, from a profile (--autoscale-profile): used
    # until the router has measured the worker's own rate. None: the router's prior.
    prefill_tokens_s: float | None = None


@dataclass
class _PrefillMark:
    at: float
    computed: int


class Autoscaler:
    """Owned by the ``Cluster`` (``cluster`` below); runs on the router's event loop."""

    def __init__(self, cluster: Any, config: AutoscaleConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.config = config
        self.clock = clock
        self.controller = ScaleController(config.policy)
        self.decisions: Counter = Counter()  # (role, direction, reason) -> count
        self._adding: dict[str, int] = {"prefill": 0, "decode": 0}  # adds in progress
        self._tasks: set[asyncio.Task] = set()
        self._marks: dict[str, _PrefillMark] = {}  # prefill worker -> its last computed count
        self._loop_task: asyncio.Task | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def desired(self) -> dict[str, int]:
        return {role: self.controller.desired(role) for role in self._roles()}

    # ---- the loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.policy.interval_s)
            try:
                self.tick()
            except Exception:  # one bad tick must not end autoscaling
                log.exception("autoscaler tick failed")

    def _roles(self) -> tuple[str, ...]:
        return (("prefill", "decode") if self.cluster.config.mode == "disaggregated"
                else ("decode",))

    def in_service(self, role: str) -> list:
        """The role's workers that take new work or will (alive, not draining)."""
        orch = self.cluster.orchestrator
        slots = orch.prefill if role == "prefill" else orch.decode
        return [s for s in slots.values() if s.view.alive and not s.view.draining]

    def tick(self) -> list[Decision]:
        """Measure, decide, start acting (adds and drains run on as tasks); the decisions."""
        now = self.clock()
        made = []
        for role in self._roles():
            slots = self.in_service(role)
            utils = [u for s in slots if (u := self.utilization(role, s, now)) is not None]
            d = self.controller.observe(now, role, len(slots) + self._adding[role], utils)
            if d is None:
                continue
            made.append(d)
            self.decisions[(role, d.direction, d.reason)] += 1
            log.warning("autoscaler: %s %s %d -> %d (%s; mean utilization %.2f)", role,
                        d.direction, d.current, d.desired, d.reason, d.mean_utilization)
            if d.direction == "up":
                for _ in range(d.desired - d.current):
                    self._spawn(self._add(role))
            else:
                for slot in self._victims(role, slots, d.current - d.desired):
                    self._spawn(self._drain(slot))
        return made

    def utilization(self, role: str, slot, now: float) -> float | None:
        """See the module docstring; None until the worker has reported."""
        view, load = slot.view, slot.view.load
        if load is None:
            return None
        if role != "prefill":
            seqs = self.cluster.config.decode_engine.max_num_seqs
            kv = load.kv_blocks_used / max(load.kv_blocks_total, 1)
            return max(kv, (load.requests_running + load.requests_waiting) / max(seqs, 1))
        wid = slot.info.worker_id
        mark = self._marks.get(wid)
        self._marks[wid] = _PrefillMark(now, load.prefill_tokens_computed)
        rate = self.prefill_rate(wid)
        queued_s = view.inflight_prefill_tokens / rate
        interval = self.config.policy.interval_s
        if mark is None or now <= mark.at:
            return queued_s / interval
        done = max(load.prefill_tokens_computed - mark.computed, 0)
        return (done / rate + queued_s) / (now - mark.at)

    def prefill_rate(self, worker_id: str) -> float:
        """Prompt tokens/s ``worker_id`` computes: as the router measured it, else the
        profile's, else the router's prior."""
        pulls = self.cluster.orchestrator.pulls
        measured = pulls.measured_prefill_rate(worker_id)
        if measured is not None:
            return measured
        return self.config.prefill_tokens_s or pulls.prefill_rate(worker_id)

    def _victims(self, role: str, slots: list, count: int) -> list:
        """The least busy workers (fewest of this router's streams, then the least KV used);
        never the last one."""
        orch = self.cluster.orchestrator
        ranked = sorted(slots, key=lambda s: (len(orch.streams_on(s.info.worker_id)),
                                              s.view.kv_blocks_used, s.info.worker_id))
        return ranked[:max(0, min(count, len(slots) - 1))]

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _add(self, role: str) -> None:
        self._adding[role] += 1
        try:
            await self.cluster.add_worker(role, self.config.ready_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # reported and retried (the rule asks again after cooldown)
            self.decisions[(role, "up", "unplaceable")] += 1
            log.error("autoscaler: could not add a %s worker: %s", role, e)
        finally:
            self._adding[role] -= 1

    async def _drain(self, slot) -> None:
        from router.contract import InvalidRequestError

        wid = slot.info.worker_id
        try:
            await self.cluster.drain_worker(wid, self.config.drain_migrate_after_s, wait=True)
        except asyncio.CancelledError:
            raise
        except InvalidRequestError as e:  # e.g. the others died meanwhile: it stays
            log.warning("autoscaler: not draining %s: %s", wid, e)
        except Exception as e:
            log.error("autoscaler: drain of %s failed: %s", wid, e)
