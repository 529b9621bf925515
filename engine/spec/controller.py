"""How many drafts each step verifies (adaptive speculation), and the numbers behind the choice.

A verification step costs more than a decode step (more rows through every layer), and that
extra grows with the batch: at small batch the weights' bytes dominate and k more rows are
nearly free, at large batch the step is compute-bound and they are not. So each step the
controller chooses one k (0: plain decode) for the batch, maximising expected tokens per second:

    rate(k) = (B + sum_r sum_{i=1..min(k, d_r)} a_r^i) / (base_B + k * draft_B
                                                          + slope_B * sum_r min(k, d_r))

with ``d_r`` the drafts request r has, ``a_r`` its measured chance that a draft is accepted
given the one before it was (per request, pulled towards the engine-wide figure while it has
little history), ``base_B`` the measured time of a decode step of B sequences and ``slope_B``
what each extra row (a draft) added to it, both averages of recent steps without prompt chunks
(a step of B sequences and N tokens measures the slope as (t - base_B) / (N - B)), and
``draft_B`` a draft model's pass over B sequences (0 for prompt lookup; before it is measured,
the draft's weight bytes over the target's times base_B: a self-draft as large as the target is
never tried). A batch size whose base is unknown measures it first (a step at k = 0: what plain
decode costs anyway); one whose slope is unknown borrows the nearest batch size's, and only
when there is none, or it is ``REFRESH_STEPS`` steps old, measures it with one draft per
sequence (the cheapest probe), if drafts could pay at all with free verification rows. So a
figure taken in a noisy moment does not lock a choice in, and batch sizes changing as requests
finish cost no probes. And the model is checked against what speculating steps really gained
(tokens per second over a plain decode step's, averaged per batch-size bucket: 1, 2-3, 4-7,
...): a bucket where they lost lately decodes plainly, whatever the model says, until that
figure is ``REFRESH_STEPS`` steps old. Each speculating step that lost doubles how long its
bucket waits before measuring again (up to ``MAX_REFRESH_STEPS``; a step that gained resets
it): a probe can cost much more than a step (a draft model catching up on every token since its
last drafts), and where speculation keeps losing it should rarely be tried. Speculation must
beat plain decode by ``MARGIN``: at break-even it only adds risk. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REFRESH_STEPS = 64
MAX_REFRESH_STEPS = 4096  # the longest a losing batch size waits before trying again
MARGIN = 1.03  # speculation's expected rate over plain decode's, at least
_COST_WEIGHT = 0.25  # weight of a new step time in its average
_DECAY = 0.8  # per step, of a request's acceptance history
_PRIOR = 2.0  # positions of engine-wide acceptance each request's estimate starts with


@dataclass
class SpecStats:
    """Counters an operator reads (cumulative): drafts proposed and accepted, both by
    position (index i: the (i+1)-th draft of a step), verification steps and sequences."""

    proposed: int = 0
    accepted: int = 0
    verified_seqs: int = 0  # sequence-steps that verified at least one draft
    emitted: int = 0  # tokens those sequence-steps produced (accepted drafts + one each)
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying sequence-step (1 + accepted drafts): what speculation gains."""
        return self.emitted / self.verified_seqs if self.verified_seqs else 0.0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        self.proposed += num_drafts
        self.accepted += num_accepted
        self.verified_seqs += 1
        self.emitted += num_accepted + 1
        grow = num_drafts - len(self.proposed_by_position)
        if grow > 0:
            self.proposed_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for i in range(num_drafts):
            self.proposed_by_position[i] += 1
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1

    def snapshot(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted,
                "verified_seqs": self.verified_seqs, "emitted": self.emitted,
                "proposed_by_position": list(self.proposed_by_position),
                "accepted_by_position": list(self.accepted_by_position)}


def _bucket(b: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ...: one bucket each."""
    return b.bit_length()


class SpecController:
    """Chooses each step's k (module docstring) and keeps the statistics. ``adaptive=False``
    always verifies every draft (up to ``max_k``)."""

    def __init__(self, max_k: int, adaptive: bool = True, draft_cost: float = 0.0) -> None:
        """``draft_cost``: a draft model's pass over a target decode step, the two models'
        weight bytes as the first guess (0: drafts cost nothing to propose, n-gram lookup)."""
        self.max_k = max_k
        self.adaptive = adaptive
        self.draft_cost = draft_cost
        self._draft_pass: dict[int, float] = {}  # B -> seconds of a draft pass (measured)
        self.stats = SpecStats()
        self._acc: dict[str, list[float]] = {}  # request -> [accepted, tried], decayed
        self._base: dict[int, tuple[float, int]] = {}  # B -> (seconds, step measured)
        self._slope: dict[int, tuple[float, int]] = {}  # B -> (seconds per extra row, step)
        # by batch-size bucket (_bucket: a batch shrinking as requests finish stays in one):
        # tokens per sequence-second of speculating steps over plain decode's, and the step
        self._gain: dict[int, tuple[float, int]] = {}
        # ... and the steps between measurements of a slope (doubled each time speculating
        # there lost: a probe can cost much, e.g. a draft model's catch-up of every token since)
        self._every: dict[int, int] = {}
        self._steps = 0
        self._acc_all = self._tried_all = 0  # drafts accepted and judged, engine-wide
        self.last_k = 0

    # ---- the choice ----------------------------------------------------------------------
    def acceptance(self, request_id: str) -> float:
        """Request's chance that a draft is accepted given the one before it was."""
        # engine-wide: 0.7 before anything was verified (optimistic: it gets measured)
        engine_wide = self._acc_all / self._tried_all if self._tried_all else 0.7
        acc, tried = self._acc.get(request_id, (0.0, 0.0))
        return (acc + _PRIOR * engine_wide) / (tried + _PRIOR)

    def choose(self, drafts: dict[str, int]) -> int:
        """``drafts``: request id -> drafts it has, for each sequence of a pure decode step
        (the batch). Returns the k every sequence verifies at most this step."""
        self._steps += 1
        if not drafts or max(drafts.values()) == 0:
            self.last_k = 0
            return 0
        top = min(self.max_k, max(drafts.values()))
        self.last_k = top if not self.adaptive else self._adaptive(drafts, top)
        return self.last_k

    def _adaptive(self, drafts: dict[str, int], top: int) -> int:
        b = len(drafts)
        base = self._base.get(b)
        if base is None or self._steps - base[1] >= REFRESH_STEPS:
            return 0  # measure this batch size's decode step (what plain decode costs anyway)
        # a draft model's pass: measured, else guessed from the two models' bytes
        dpass = self._draft_pass.get(b, self.draft_cost * base[0])
        slope = self._slope.get(b) or self._nearest_slope(b)
        every = self._every.get(_bucket(b), REFRESH_STEPS)
        if slope is None or self._steps - slope[1] >= every:
            # measure what a draft per sequence adds (the cheapest probe), where drafts could
            # pay at all: free verification rows and the engine's acceptance
            a = self._acc_all / self._tried_all if self._tried_all else 0.7
            best = b * sum(a ** i for i in range(1, top + 1))
            return 1 if (b + best) / (base[0] + top * dpass) > b / base[0] * MARGIN else 0
        gain = self._gain.get(_bucket(b))
        if gain is not None and gain[0] < 1.0 and self._steps - gain[1] < every:
            return 0  # speculating at this batch size lost lately, whatever the model says
        alpha = {r: self.acceptance(r) for r, d in drafts.items() if d}
        best_k, best_rate = 0, float(b) / base[0] * MARGIN
        for k in range(1, top + 1):
            rows = 0
            expected = float(b)
            for r, d in drafts.items():
                m = min(k, d)
                rows += m
                a, p = alpha.get(r, 0.0), 1.0
                for _ in range(m):
                    p *= a
                    expected += p
            rate = expected / (base[0] + k * dpass + slope[0] * rows)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _nearest_slope(self, b: int) -> tuple[float, int] | None:
        """The slope measured at the batch size nearest ``b`` (a batch size the engine has
        not speculated at yet borrows it rather than paying a probe: the cost of a row
        changes slowly with the batch)."""
        if not self._slope:
            return None
        return self._slope[min(self._slope, key=lambda x: (abs(x - b), x))]

    # ---- what happened ---------------------------------------------------------------------
    def observe_draft(self, num_seqs: int, seconds_per_pass: float) -> None:
        """A draft model's pass over ``num_seqs`` sequences (one draft each) took this long."""
        old = self._draft_pass.get(num_seqs)
        self._draft_pass[num_seqs] = (seconds_per_pass if old is None else
                                      old + _COST_WEIGHT * (seconds_per_pass - old))

    def observe_step(self, num_seqs: int, num_tokens: int, seconds: float,
                     emitted: int | None = None, draft_seconds: float = 0.0) -> None:
        """A step without prompt chunks: ``num_seqs`` sequences, ``num_tokens`` tokens in all,
        ``emitted`` tokens produced (default: one per sequence), ``draft_seconds`` of its time
        a draft model's passes (the slope counts the verification rows only)."""
        b, extra = num_seqs, num_tokens - num_seqs
        if extra <= 0:
            old = self._base.get(b)
            avg = seconds if old is None else old[0] + _COST_WEIGHT * (seconds - old[0])
            self._base[b] = (avg, self._steps)
            return
        base = self._base.get(b)
        if base is None:
            return  # nothing to measure the extra against yet
        per_row = max(0.0, (seconds - draft_seconds - base[0]) / extra)
        old = self._slope.get(b)
        avg = per_row if old is None else old[0] + _COST_WEIGHT * (per_row - old[0])
        self._slope[b] = (avg, self._steps)
        # what the step really gained: tokens per second against a plain decode step's
        gain = ((emitted if emitted is not None else b) / seconds) / (b / base[0])
        g = _bucket(b)
        old = self._gain.get(g)
        avg = gain if old is None else old[0] + _COST_WEIGHT * (gain - old[0])
        self._gain[g] = (avg, self._steps)
        every = self._every.get(g, REFRESH_STEPS)
        self._every[g] = min(2 * every, MAX_REFRESH_STEPS) if gain < 1.0 else REFRESH_STEPS

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """One sequence's verification: ``num_accepted`` of its ``num_drafts`` drafts held."""
        if num_drafts <= 0:
            return
        self.stats.record(num_drafts, num_accepted)
        # tried: the drafts judged, i.e. up to and including the first rejected one
        tried = min(num_accepted + 1, num_drafts)
        self._acc_all += num_accepted
        self._tried_all += tried
        acc = self._acc.setdefault(request_id, [0.0, 0.0])
        acc[0] = acc[0] * _DECAY + num_accepted
        acc[1] = acc[1] * _DECAY + tried

    def forget(self, request_id: str) -> None:
        self._acc.pop(request_id, None)
