"""Cluster-wide cumulative counters of prefix reuse and decode steps, summed from the workers'
load reports.

A worker's report carries its own totals since its process started; a restarted worker
starts again from zero. These counters add each report's increase over the last one seen
from the same incarnation, so the sums only ever grow (Prometheus counters) however often
workers restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.step_times import merge_rows
from worker_protocol import WorkerLoad


@dataclass
class UsageCounters:
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)  # role -> tokens
    prefill_computed_tokens: int = 0  # prompt (and recomputed) tokens run, every worker
    # Pure-decode engine steps, every worker: batch size -> (steps, seconds).
    decode_steps: dict[int, tuple[int, float]] = field(default_factory=dict)
    _last: dict[str, tuple[str, int, int, dict]] = field(default_factory=dict, repr=False)

    def note(self, load: WorkerLoad) -> None:
        """Fold in one load report."""
        inc, hits, computed, steps = self._last.get(load.worker_id, (load.incarnation, 0, 0, {}))
        if inc != load.incarnation:
            hits = computed = 0
            steps = {}
        self.prefix_hit_tokens[load.role] = (self.prefix_hit_tokens.get(load.role, 0)
                                             + max(0, load.prefix_hit_tokens - hits))
        self.prefill_computed_tokens += max(0, load.prefill_tokens_computed - computed)
        now = merge_rows([load.decode_steps])
        for b, (n, sec) in now.items():
            n0, s0 = steps.get(b, (0, 0.0))
            if n > n0:
                total_n, total_s = self.decode_steps.get(b, (0, 0.0))
                self.decode_steps[b] = (total_n + n - n0, total_s + max(0.0, sec - s0))
        self._last[load.worker_id] = (load.incarnation, load.prefix_hit_tokens,
                                      load.prefill_tokens_computed, now)
