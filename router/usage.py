"""Cluster-wide cumulative counters of prefix reuse, summed from the workers' load reports.

A worker's report carries its own totals since its process started; a restarted worker
starts again from zero. These counters add each report's increase over the last one seen
from the same incarnation, so the sums only ever grow (Prometheus counters) however often
workers restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker_protocol import WorkerLoad


@dataclass
class UsageCounters:
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)  # role -> tokens
    prefill_computed_tokens: int = 0  # prompt (and recomputed) tokens run, every worker
    _last: dict[str, tuple[str, int, int]] = field(default_factory=dict, repr=False)

    def note(self, load: WorkerLoad) -> None:
        """Fold in one load report."""
        inc, hits, computed = self._last.get(load.worker_id, (load.incarnation, 0, 0))
        if inc != load.incarnation:
            hits = computed = 0
        self.prefix_hit_tokens[load.role] = (self.prefix_hit_tokens.get(load.role, 0)
                                             + max(0, load.prefix_hit_tokens - hits))
        self.prefill_computed_tokens += max(0, load.prefill_tokens_computed - computed)
        self._last[load.worker_id] = (load.incarnation, load.prefix_hit_tokens,
                                      load.prefill_tokens_computed)
