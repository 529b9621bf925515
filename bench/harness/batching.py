"""Batching arithmetic: ``slot_utilization`` and ``simulate_batching`` (static vs continuous
slot occupancy, the head-of-line blocking example). Pure arithmetic on plain numbers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def slot_utilization(useful_token_steps: int, num_slots: int, num_steps: int) -> float:
    """Fraction of batch slots that produced a token: useful / (slots x steps).

    A slot is one of ``max_num_seqs`` places in the running batch; each engine step every slot
    either produces a token for its request (useful) or idles (empty, or waiting for a longer
    batch-mate to finish under static batching).
    """
    if num_slots <= 0 or num_steps < 0 or useful_token_steps < 0:
        raise ValueError(f"need slots > 0, steps >= 0, useful >= 0; got "
                         f"{num_slots}, {num_steps}, {useful_token_steps}")
    if num_steps == 0:
        return 0.0
    if useful_token_steps > num_slots * num_steps:
        raise ValueError(f"{useful_token_steps} useful token-steps cannot fit in "
                         f"{num_slots} slots x {num_steps} steps")
    return useful_token_steps / (num_slots * num_steps)


@dataclass(frozen=True)
class BatchingSimulation:
    """Step count and occupancy of one policy on a list of output lengths (all queued at t=0)."""

    policy: str
    num_slots: int
    num_steps: int
    useful_token_steps: int
    utilization: float


def simulate_batching(output_lens: Sequence[int], num_slots: int,
                      policy: str) -> BatchingSimulation:
    """Idealized step count: every running request makes one token per step.

    ``static`` (and ``dynamic`` with everyone already queued) takes batches of ``num_slots`` in
    arrival order and each batch lasts as long as its longest member. ``continuous`` refills a
    slot the step after it frees, so a queue behind a long request keeps the other slots busy.
    """
    if any(n <= 0 for n in output_lens):
        raise ValueError("output lengths must be > 0")
    if num_slots <= 0:
        raise ValueError(f"num_slots must be > 0, got {num_slots}")
    useful = sum(output_lens)
    if policy in ("static", "dynamic"):
        steps = sum(max(output_lens[i:i + num_slots]) for i in range(0, len(output_lens), num_slots))
    elif policy == "continuous":
        queue = list(output_lens)
        running: list[int] = []  # tokens left per occupied slot
        steps = 0
        while queue or running:
            while queue and len(running) < num_slots:
                running.append(queue.pop(0))
            steps += 1
            running = [r - 1 for r in running if r > 1]
    else:
        raise ValueError(f"unknown policy {policy!r}; choose static, dynamic or continuous")
    return BatchingSimulation(policy, num_slots, steps, useful,
                              slot_utilization(useful, num_slots, steps))
