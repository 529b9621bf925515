"""Room for a waiting request of a higher priority (``engine.core.scheduler``'s admission).

When the pool cannot hold the next chunk of the request at the head of the queue, running
requests of a strictly lower priority are preempted for it: the lowest first (the back of the
batch, which is kept in priority order: the latest admitted among equals), as few as free
enough blocks, and none at all when even every one of them would not (then it waits, as
before, for room that finishing requests give back). Equal priorities never preempt each
other. A preempted request gives up its chunk of this step and requeues by its priority,
behind the one it made room for, so it cannot take the room back before that one is admitted:
no request is preempted twice for one admission. Continuous batching only (a static or
dynamic batch runs to its end)."""

from __future__ import annotations

from typing import Protocol

from engine.config import SchedulerConfig
from engine.core.block_manager import BlockManager, ComputedBlocks
from engine.core.request import Request
from engine.core.step_io import SchedulerOutput

__all__ = ["Batch", "make_room"]


class Batch(Protocol):
    """What of the scheduler this needs: its running batch (in priority order) and pool."""

    config: SchedulerConfig
    blocks: BlockManager
    running: list[Request]

    def preempt(self, req: Request) -> None: ...


def make_room(sched: Batch, out: SchedulerOutput, req: Request, num_tokens: int,
              computed: ComputedBlocks | None) -> bool:
    """Preempt running requests of a lower priority than waiting ``req`` until
    ``allocate_slots(req, num_tokens, computed)`` succeeds, and make that allocation; False
    (nobody preempted, nothing allocated) when they cannot free enough. The victims' chunks
    leave ``out`` and their ids join ``out.preempted_ids``."""
    if sched.config.policy != "continuous":
        return False
    short = sched.blocks.shortfall(req.request_id, num_tokens, computed)
    victims: list[Request] = []
    for r in reversed(sched.running):
        if short <= 0 or r.priority >= req.priority:
            break
        victims.append(r)
        short -= sched.blocks.freeable(r.request_id, computed)
    if not victims or short > 0:
        return False
    for v in victims:
        _unschedule(out, v)
        sched.preempt(v)
        out.preempted_ids.append(v.request_id)
    return sched.blocks.allocate_slots(req.request_id, num_tokens, computed)


def _unschedule(out: SchedulerOutput, req: Request) -> None:
    """Take ``req``'s chunk back out of this step (its blocks are about to be freed)."""
    for i, chunk in enumerate(out.chunks):
        if chunk.request_id == req.request_id:
            del out.chunks[i]
            if chunk.start_pos < req.num_prompt_tokens:
                req.num_prompt_chunks -= 1  # counted when the chunk was made
            return
