"""How many prompt tokens a step may compute (``engine.core.scheduler``): the step's budget
(``max_step_prefill_tokens``, else the whole ``max_num_batched_tokens``), and a smaller one,
``yield_step_prefill_tokens``, for prompts of a lower priority than one seen lately.

Why the second: a step cannot be interrupted, so a high-priority prompt that arrives while a
step runs waits for that step, then for its own. Without priorities in use, a long step of
many batched prompts is the cheapest way through a queue. Once requests of some priority
have been queued within the last ``PRIORITY_MEMORY_S``, more of them may arrive at any
moment, so the prompts of every lower priority are computed at most
``yield_step_prefill_tokens`` a step (chunked when longer): the step a newcomer of the higher
priority finds running is short, and the next step is its own (the queue is in priority
order). The cost falls on the lower priorities only, and only while priorities are mixed:
more, shorter steps for their prompts (docs/benchmarks.md, Overload, has the measured cost).

Decode tokens never count (a decode computes one token; drafts are not prompt tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PRIORITY_MEMORY_S", "PromptBudget"]

# How long a queued request of some priority keeps the prompts of lower ones to the yield
# budget: long enough to span the gaps between one class's arrivals under any load that
# needs it (a class seen once a minute gains little from shorter steps), short enough that
# one burst of a higher class does not slow the lower ones for long. A migrated stream's
# re-prefill, queued above every client priority, is not a class arriving: the scheduler does
# not report it (``Scheduler.add_request``), so a migration alone never turns the yield on.
PRIORITY_MEMORY_S = 60.0


@dataclass
class PromptBudget:
    """One scheduler's prompt-token budgets: ``start_step`` at each step, ``allow`` before
    and ``take`` after each prompt chunk, ``saw`` for every request queued."""

    step_cap: int  # prompt tokens of all requests in a step
    # prompt tokens a step of requests below the top recent priority (None: no such limit)
    yield_cap: int | None = None
    left: int = 0  # of step_cap, in this step
    low_left: int = 0  # of yield_cap, in this step
    top: int | None = None  # the highest priority queued within PRIORITY_MEMORY_S
    _seen: dict[int, float] = field(default_factory=dict)  # priority -> when last queued

    def saw(self, priority: int, now: float) -> None:
        """A request of ``priority`` was queued at ``now``."""
        self._seen[priority] = now

    def start_step(self, now: float) -> None:
        """A new step: full budgets, and the priorities of the last ``PRIORITY_MEMORY_S``."""
        self._seen = {p: t for p, t in self._seen.items() if now - t <= PRIORITY_MEMORY_S}
        self.top = max(self._seen) if self._seen else None
        self.left = self.step_cap
        self.low_left = self.yield_cap if self.yield_cap is not None else self.step_cap

    def yields(self, priority: int) -> bool:
        """Whether prompts of ``priority`` are held to the yield budget this step."""
        return self.yield_cap is not None and self.top is not None and priority < self.top

    def cap(self, priority: int) -> int:
        """The most prompt tokens one request of ``priority`` may get in a whole step."""
        return min(self.step_cap, self.yield_cap) if self.yields(priority) else self.step_cap

    def allow(self, priority: int) -> int:
        """Prompt tokens a request of ``priority`` may still get in this step."""
        return min(self.left, self.low_left) if self.yields(priority) else self.left

    def take(self, priority: int, num_tokens: int) -> None:
        """A prompt chunk of ``num_tokens`` of a request of ``priority`` joined the step."""
        self.left -= num_tokens
        if self.yields(priority):
            self.low_left -= num_tokens
