"""Cumulative decode-step times by batch size: what a serving layer is measured against.

The engine times every step that is pure decode (each scheduled sequence computes one new
token) from ``schedule`` to its outputs (sampling and detokenization included), and adds it
to the count and seconds of that step's batch size. Workers report the totals in their load
reports, the router exports them (``pdcluster_engine_decode_steps_total{batch}``,
``pdcluster_engine_decode_step_seconds_total{batch}``), and ``pdcluster bench serve`` reads
them before and after each rate, so the served time per output token can be set beside the
engine's own step at the batch sizes it actually ran.

Steps that also run prefill chunks (a colocated worker taking in new prompts) are timed
apart, by their decode rows (``..._mixed_steps_total{batch}``): they produce decode tokens
too, more slowly, and without them a colocated server's served TPOT could not be split into
the engine's decode step, what prefill interleaving adds, and what the serving path adds.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

# One row per batch size: (batch size, steps, seconds). Plain tuples: they travel in load
# reports through Ray and as JSON through Redis (where they come back as lists).
StepRow = tuple[int, int, float]


@dataclass
class DecodeStepTimes:
    """Counts and seconds of pure-decode steps per exact batch size (at most
    ``max_num_seqs`` sizes), cumulative since the engine started."""

    _steps: dict[int, list] = field(default_factory=dict)  # batch -> [count, seconds]

    def record(self, batch: int, seconds: float) -> None:
        row = self._steps.get(batch)
        if row is None:
            self._steps[batch] = [1, seconds]
        else:
            row[0] += 1
            row[1] += seconds

    def rows(self) -> tuple[StepRow, ...]:
        """A snapshot, by batch size (safe to call from another thread: a step may land in it
        or not)."""
        return tuple((b, n, s) for b, (n, s) in sorted(self._steps.copy().items()))


def merge_rows(parts: Iterable[Iterable[StepRow]]) -> dict[int, tuple[int, float]]:
    """Sum rows from several sources by batch size: ``{batch: (steps, seconds)}``."""
    out: dict[int, tuple[int, float]] = {}
    for rows in parts:
        for b, n, s in rows:
            n0, s0 = out.get(int(b), (0, 0.0))
            out[int(b)] = (n0 + int(n), s0 + float(s))
    return out


# Seconds: a decode step of milliseconds on a GPU to a long prefill step on a loaded CPU.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class StepHistogram:
    """Every engine step's time (schedule to outputs, whatever it ran: prefill, decode or
    both), in ``STEP_BUCKETS``, cumulative since the engine started: what
    ``pdcluster_engine_step_seconds{worker}`` shows."""

    _counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    _seconds: float = 0.0

    def record(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        self._seconds += seconds

    def snapshot(self) -> tuple:
        """``(count per bucket ..., count above the last, seconds)``: a plain tuple, as load
        reports carry it (``step_histogram`` reads it back)."""
        return (*self._counts, self._seconds)


def step_histogram(snapshot: Iterable) -> tuple[list[tuple[str, int]], float] | None:
    """A ``StepHistogram.snapshot`` as Prometheus buckets ((``le``, cumulative count) ending
    with ``+Inf``) and the sum; None for an empty or foreign-shaped one."""
    values = list(snapshot)
    if len(values) != len(STEP_BUCKETS) + 2:
        return None
    out, total = [], 0
    for le, n in zip((*STEP_BUCKETS, float("inf")), values[:-1], strict=True):
        total += int(n)
        out.append(("+Inf" if le == float("inf") else repr(le), total))
    return out, float(values[-1])


@dataclass
class StepTimes:
    """One engine's step timings by kind: pure-decode steps and mixed steps (decode rows beside
    prefill chunks), by decode rows, and every step in the histogram.

    A step that held the decodes back for a prompt's first token (``first_token_first``)
    produced no decode token: it is counted with the decodes' own step that follows, as one
    mixed step of the two steps' time, which is what their tokens waited for."""

    decode: DecodeStepTimes = field(default_factory=DecodeStepTimes)
    mixed: DecodeStepTimes = field(default_factory=DecodeStepTimes)
    histogram: StepHistogram = field(default_factory=StepHistogram)
    _held_s: float = 0.0  # the last step held the decodes back: its time

    def record(self, seconds: float, decode_rows: int, prefill_tokens: int,
               held_decodes: int) -> None:
        self.histogram.record(seconds)
        held, self._held_s = self._held_s, (seconds if held_decodes else 0.0)
        if held_decodes:
            return
        if not (prefill_tokens or held):
            self.decode.record(decode_rows, seconds)
        elif decode_rows:
            self.mixed.record(decode_rows, seconds + held)
