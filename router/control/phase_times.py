"""Where a disaggregated request's time to first token went, per phase, for ``/metrics``.

One ``PhaseTimes`` per orchestrator. Each committed attempt records four durations:

- ``prefill_queue``: arrival at the prefill worker until its first step ran (worker clock);
- ``prefill_compute``: that step until the step that finished the prompt ended;
- ``kv_transfer_tail``: that step's end until every KV send completed: the part of the
  layer-wise transfer that compute did not hide;
- ``decode_commit``: the prefill call's return until the decode worker admitted the request
  (router clock): the KV's last layers landing, and the decode worker answering between its
  steps.

Histograms, cumulative since the router started (``snapshot`` for ``BackendStats``, and the
front door renders ``pdcluster_request_phase_seconds{phase}``); the last requests' timings are
kept by id for the planner's served profile (bounded).

Also every KV transfer's whole duration by the roles it ran between (``transfer``):
``prefill->decode`` for a prompt's KV (first layer posted to last send done, the part compute
hid included), ``<source role>->prefill`` for a prefix pull (``transfer_snapshot``, rendered as
``pdcluster_kv_transfer_seconds{pair}``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from router.control.request_state import RequestTiming

PHASES = ("prefill_queue", "prefill_compute", "kv_transfer_tail", "decode_commit")
# Seconds: a queue or tail of a millisecond on a GPU, prefills of seconds on a contended CPU.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
KEEP_TIMINGS = 10_000


@dataclass(frozen=True)
class PhaseHistogram:
    """One phase: ``counts[i]`` observations <= ``BUCKETS[i]`` (not cumulative; the last
    entry counts those above the last bound), their ``sum`` in seconds and ``count``."""

    counts: tuple[int, ...]
    sum: float
    count: int

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (``le``, observations <= it), ending with ``+Inf``."""
        out, total = [], 0
        for le, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if le == float("inf") else repr(le), total))
        return out


class PhaseTimes:
    """Phase histograms and the last requests' timings (see the module docstring)."""

    def __init__(self) -> None:
        self._counts = {p: [0] * (len(BUCKETS) + 1) for p in PHASES}
        self._sums = dict.fromkeys(PHASES, 0.0)
        self.timings: dict[str, RequestTiming] = {}  # by request id, the newest KEEP_TIMINGS
        self._transfers: dict[str, tuple[list[int], list[float]]] = {}  # pair -> counts, [sum]

    def transfer(self, pair: str, seconds: float) -> None:
        """One KV transfer between roles ``pair`` ("prefill->decode", "decode->prefill", ...)."""
        counts, total = self._transfers.setdefault(pair, ([0] * (len(BUCKETS) + 1), [0.0]))
        seconds = max(0.0, seconds)
        counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        total[0] += seconds

    def transfer_snapshot(self) -> dict[str, PhaseHistogram]:
        return {pair: PhaseHistogram(tuple(c), s[0], sum(c))
                for pair, (c, s) in sorted(self._transfers.items())}

    def record(self, request_id: str, timing: RequestTiming, decode_commit_s: float) -> None:
        """One committed attempt's phases."""
        for phase, s in zip(PHASES, (timing.queue_s, timing.prefill_compute_s,
                                     timing.transfer_tail_s, decode_commit_s), strict=True):
            s = max(0.0, s)  # two clocks: a negative rounding is no time
            self._counts[phase][bisect.bisect_left(BUCKETS, s)] += 1
            self._sums[phase] += s
        self.timings[request_id] = timing
        if len(self.timings) > KEEP_TIMINGS:
            self.timings.pop(next(iter(self.timings)))

    def snapshot(self) -> dict[str, PhaseHistogram]:
        return {p: PhaseHistogram(tuple(self._counts[p]), self._sums[p], sum(self._counts[p]))
                for p in PHASES}
