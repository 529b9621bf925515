"""Cluster-wide cumulative counters of prefix reuse and decode steps, summed from the workers'
load reports.

A worker's report carries its own totals since its process started; a restarted worker
starts again from zero. These counters add each report's increase over the last one seen
from the same incarnation, so the sums only ever grow (Prometheus counters) however often
workers restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.step_times import merge_rows
from worker_protocol import WorkerLoad

StepTotals = dict[int, tuple[int, float]]  # batch size -> (steps, seconds)


@dataclass
class UsageCounters:
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)  # role -> tokens
    prefill_computed_tokens: int = 0  # prompt (and recomputed) tokens run, every worker
    # Engine steps, every worker: pure decode by batch size, and mixed (decode rows beside
    # prefill chunks) by decode rows.
    decode_steps: StepTotals = field(default_factory=dict)
    mixed_steps: StepTotals = field(default_factory=dict)
    # worker id -> (incarnation, prefix hits, prefill computed, decode rows, mixed rows)
    _last: dict[str, tuple[str, int, int, StepTotals, StepTotals]] = field(
        default_factory=dict, repr=False)

    def note(self, load: WorkerLoad) -> None:
        """Fold in one load report."""
        inc, hits, computed, decode, mixed = self._last.get(
            load.worker_id, (load.incarnation, 0, 0, {}, {}))
        if inc != load.incarnation:
            hits = computed = 0
            decode, mixed = {}, {}
        self.prefix_hit_tokens[load.role] = (self.prefix_hit_tokens.get(load.role, 0)
                                             + max(0, load.prefix_hit_tokens - hits))
        self.prefill_computed_tokens += max(0, load.prefill_tokens_computed - computed)
        decode_now = _add_increase(self.decode_steps, decode, load.decode_steps)
        mixed_now = _add_increase(self.mixed_steps, mixed, load.mixed_steps)
        self._last[load.worker_id] = (load.incarnation, load.prefix_hit_tokens,
                                      load.prefill_tokens_computed, decode_now, mixed_now)


def _add_increase(total: StepTotals, before: StepTotals, rows) -> StepTotals:
    """Add to ``total`` what ``rows`` (one incarnation's cumulative report) grew by since
    ``before``; returns the report's totals, the next ``before``."""
    now = merge_rows([rows])
    for b, (n, sec) in now.items():
        n0, s0 = before.get(b, (0, 0.0))
        if n > n0:
            total_n, total_s = total.get(b, (0, 0.0))
            total[b] = (total_n + n - n0, total_s + max(0.0, sec - s0))
    return now
