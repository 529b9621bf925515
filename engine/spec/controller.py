"""How many drafts each step verifies (adaptive speculation), and the numbers behind the choice.

A verification step costs more than a decode step (more rows through every layer), and that
extra grows with the batch: at small batch the weights' bytes dominate and k more rows are
nearly free, at large batch the step is compute-bound and they are not. A draft model also
costs its passes, and a catch-up of every token it has not seen (a new request's prompt, the
tokens of plain steps since its last drafts). So each step the controller chooses one k
(0: plain decode) for the batch from what the engine measured, in one of two modes.

**Trusted** (this batch-size bucket, 1, 2-3, 4-7, ..., has a verification cost measured (a
step of it re-measures an old one), a measured draft pass, and its speculating steps gained
lately): the k of the highest expected tokens per second,

    rate(k) = (B + sum_r sum_{i=1..min(k, d_r)} a_r^i) / (base_B + k * draft_B
                                  + slope_B * sum_r min(k, d_r) + catch_up_cost / steps_left)

with ``d_r`` the drafts request r has, ``a_r`` its measured chance that a draft is accepted
given the one before it was (per request, pulled towards the engine-wide figure while it has
little history), ``base_B`` the measured time of a decode step of B sequences, ``slope_B``
what each extra row (a draft) added to it (averages of recent steps without prompt chunks; a
step of B sequences and N tokens measures the slope as (t - draft - base_B) / (N - B)),
``draft_B`` a draft model's pass over B sequences (0 for prompt lookup), and the catch-up
(tokens x the draft's measured seconds per catch-up token) spread over the steps the
requests have left at that rate (half their ``max_tokens`` left: answers stop early). k must
beat plain decode by ``MARGIN``: at break-even it only adds risk.

**Probe** (anything else: a new bucket, an old measurement, or a bucket whose speculating
steps lost lately): one draft per sequence, the cheapest try, and only if drafts could pay
at all (free verification rows at the engine's acceptance; a draft as costly as the target
never could, nor a catch-up more than the requests' answers left could repay at that rate)
and its worst case, every draft rejected (the draft pass, each row priced as a
whole sequence's until measured, one step's catch-up: a catch-up token priced at the
draft's measured one, else at a share of a draft pass: decode rows), times 2^(losses in a
row) fits the bucket's **budget**. The budget starts at ``FIRST_PROBE`` plain steps, earns
``EXPLORE_SHARE`` of every plain step's time, and each speculating step adds what it saved
(its tokens at plain decode's pace less its time, catch-up included): a loss in full, a
saving at ``PROBE_SHARE``. So exploration costs at most a few percent of plain decode plus a
part of what speculation saved, and a bucket where probes keep losing probes ever more rarely.
A probe that paid a catch-up is followed by one more, budget or not, once the batch is
caught up: the catch-up is spent, and only a caught-up step measures the steady gain.

What counts as a win: the steady gain, what speculating steps' tokens would have taken at
plain decode's pace over what the steps took, a ratio of sums decayed by ``_GAIN_DECAY`` per
step (one step's drafts are all held or none: its own ratio swings far either way), steps
with a catch-up left out (an investment the budget pays, not a sign that speculation loses
here); it decides trusted against probe.

**A disturbed step counts for nothing**: one whose time is over ``DISTURBED`` times what its
shape measured lately (a decode step against its base; a verifying step's target part against
base plus its rows; a draft pass or a catch-up token against its own average) is a
neighbour's burst on a shared host, not evidence against speculation: it moves no average, no
budget and no gain. ``DISTURBED_RUN`` such in a row are taken as they are (the host changed,
and the figures must follow it). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REFRESH_STEPS = 64  # steps a measured cost (base, verification rows) is trusted for
MARGIN = 1.03  # speculation's expected rate over plain decode's, at least
# a bucket's budget to start with, in plain steps of its batch size: a probe's worst case at
# batch 1 (its row priced as a whole step, the draft pass, a 70-token prompt's catch-up as
# rows) is about three plain steps, and with 1.5 a 32-token answer ended before one was tried
FIRST_PROBE = 3.0
EXPLORE_SHARE = 0.03  # of each plain step's time, added to its bucket's budget
PROBE_SHARE = 0.25  # of each speculating step's saving, added to its bucket's budget
_HORIZON = 0.5  # of the tokens requests may still produce, expected (a catch-up's payback)
# a catch-up of fewer tokens is not priced: a few more rows in a draft pass, whose share
# pro rata says little of what a prompt's catch-up costs a token
_CATCH_UP_MIN = 8
# a catch-up token's price until one is timed, in draft passes: the catch-up runs as decode
# rows, up to 32 a pass (engine/executor/draft.py), and a pass of 24 such rows took ~3.4
# single-row passes (7.7 against 2.3 ms, the default model's int4 self-draft): ~1/7 a row
_CATCH_UP_GUESS = 0.15
_COST_WEIGHT = 0.25  # weight of a new step time in its average
_GAIN_DECAY = 0.8  # per speculating step, of a bucket's sums behind its steady gain
_DECAY = 0.8  # per step, of a request's acceptance history
_PRIOR = 2.0  # positions of engine-wide acceptance each request's estimate starts with
# A figure this many times its recent average is a neighbour's burst, not the step's own
# cost (this project's hosts are shared: a 2-vCPU host's steps went 20 -> 100-300 ms for
# whole seconds); charged, one such step spent a bucket's probe budget for the rest of a run.
DISTURBED = 2.0
DISTURBED_RUN = 4  # disturbed figures in a row after which they are believed (a slower host)


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


def _in_bucket(by_batch: dict, b: int):
    """The value measured at the batch size nearest ``b`` in its bucket, or None (a batch
    shrinking as requests finish costs no probes; another bucket's is not trusted: a row's
    cost changes as the step turns compute-bound)."""
    mine = [x for x in by_batch if _bucket(x) == _bucket(b)]
    return by_batch[min(mine, key=lambda x: (abs(x - b), x))] if mine else None


@dataclass
class _Bucket:
    """What the controller knows of speculating at a bucket's batch sizes."""

    budget: float  # seconds a probe may still risk here (module docstring)
    # speculating steps (without a catch-up), decayed sums: what their tokens would have
    # taken at plain decode's pace, and what they took
    plain_s: float = 0.0
    spec_s: float = 0.0
    losses: int = 0  # speculating steps in a row after which the steady gain was below 1
    follow_up: bool = False  # the last probe paid a catch-up: the next one is free

    @property
    def gain(self) -> float | None:
        """Speculating steps' steady gain over plain decode (tokens per second over a plain
        step's), time-weighted over the last several; None before any."""
        return self.plain_s / self.spec_s if self.spec_s else None


class SpecController:
    """Chooses each step's k (module docstring) and keeps the statistics. ``adaptive=False``
    always verifies every draft (up to ``max_k``)."""

    def __init__(self, max_k: int, adaptive: bool = True, draft_cost: float = 0.0,
                 catch_up_per_step: int = 256) -> None:
        """``draft_cost``: a draft model's pass over a target decode step, the two models'
        weight bytes as the first guess (0: drafts cost nothing to propose, n-gram lookup);
        ``catch_up_per_step``: the most catch-up tokens the draft computes in one step (what
        one probe can spend on it)."""
        self.max_k = max_k
        self.adaptive = adaptive
        self.draft_cost = draft_cost
        self.catch_up_per_step = catch_up_per_step
        self.stats = SpecStats()
        self._acc: dict[str, list[float]] = {}  # request -> [accepted, tried], decayed
        self._acc_all = self._tried_all = 0  # drafts accepted and judged, engine-wide
        self._draft_pass: dict[int, float] = {}  # B -> seconds of a draft pass (measured)
        self._catch_up: float | None = None  # seconds per catch-up token of the draft
        self._base: dict[int, tuple[float, int]] = {}  # B -> (seconds, step measured)
        self._slope: dict[int, tuple[float, int]] = {}  # B -> (seconds per extra row, step)
        self._buckets: dict[int, _Bucket] = {}  # by _bucket(B)
        self._noise: dict[tuple, int] = {}  # figure -> disturbed ones in a row
        self._steps = 0
        self.disturbed_steps = 0  # steps left out as disturbed (tests and A/B scripts read it)
        self.last_k = 0
        self.last_probe = False  # whether the last choice was a probe (budget-gated)

    # ---- the choice ----------------------------------------------------------------------
    def acceptance(self, request_id: str) -> float:
        """Request's chance that a draft is accepted given the one before it was."""
        acc, tried = self._acc.get(request_id, (0.0, 0.0))
        return (acc + _PRIOR * self._engine_acceptance()) / (tried + _PRIOR)

    def _engine_acceptance(self) -> float:
        # 0.7 before anything was verified (optimistic: a probe measures it)
        return self._acc_all / self._tried_all if self._tried_all else 0.7

    def choose(self, drafts: dict[str, int], catch_up: dict[str, int] | None = None,
               left: dict[str, int] | None = None) -> int:
        """``drafts``: request id -> drafts it has (or could have, for a draft model), for
        each sequence of a pure decode step (the batch). ``catch_up``: tokens a draft model
        must compute for a sequence before drafting, beyond a speculating step's usual one
        or two (its prompt, the tokens of plain steps since its last drafts); ``left``:
        tokens each request may still produce (what a catch-up is repaid over). Returns
        the k every sequence verifies at most this step."""
        self._steps += 1
        self.last_probe = False
        if not drafts or max(drafts.values()) == 0:
            self.last_k = 0
            return 0
        top = min(self.max_k, max(drafts.values()))
        self.last_k = (top if not self.adaptive else
                       self._adaptive(drafts, top, catch_up or {}, left or {}))
        return self.last_k

    def _adaptive(self, drafts: dict[str, int], top: int, catch_up: dict[str, int],
                  left: dict[str, int]) -> int:
        b = len(drafts)
        base = self._base.get(b)
        if base is None or self._steps - base[1] >= REFRESH_STEPS:
            return 0  # measure this batch size's decode step (what plain decode costs anyway)
        t0 = base[0]
        bk = self._buckets.get(_bucket(b))
        if bk is None:
            bk = self._buckets[_bucket(b)] = _Bucket(budget=FIRST_PROBE * t0)
        # a draft model's pass: measured (in this bucket), else guessed from the two models'
        # bytes
        measured = _in_bucket(self._draft_pass, b)
        measured_pass = measured is not None or not self.draft_cost
        dpass = measured if measured is not None else self.draft_cost * t0
        backlog = sum(catch_up.get(r, 0) for r in drafts)
        per_token = self._catch_up_price(dpass)
        slope = _in_bucket(self._slope, b)
        # a slope measured long ago (the engine ran other batch sizes since) is trusted
        # where this bucket's speculating steps gained: its next step measures it again,
        # and a loss there sends the bucket back to probing (a budget-gated probe instead
        # left a bucket that won off whenever other buckets' probes had spent its budget)
        if (slope is not None and measured_pass and bk.gain is not None
                and bk.gain >= 1.0):
            # costs measured here lately, and speculating here gained: the model decides,
            # a catch-up repaid over what the requests have left
            tokens_left = _HORIZON * sum(left.get(r, 1) for r in drafts) / b
            return self._best_k(drafts, top, t0, dpass, slope[0], backlog * per_token,
                                tokens_left)
        # a probe: one draft per sequence (the cheapest) where drafts could pay at all
        # (free verification rows, the engine's acceptance) ...
        a = self._engine_acceptance()
        best = b * sum(a ** i for i in range(1, top + 1))
        if (b + best) / (t0 + top * dpass) <= b / t0 * MARGIN:
            return 0
        # ... whose answers could repay the batch's whole catch-up at that best (a batch of
        # 16 new 70-token prompts owes ~0.3 s to an fp32 target's int4 self-draft, more than
        # 16 answers of 96 tokens could save: a probe there only starts an unpaid catch-up)
        tokens_left = _HORIZON * sum(left.get(r, 1) for r in drafts)
        if backlog * per_token > tokens_left * (t0 / b - (t0 + top * dpass) / (b + best)):
            return 0
        # ... and what it costs if no draft holds (a row priced as a whole sequence's while
        # unmeasured: a compute-bound step) fits this bucket's budget, doubled per loss
        row = slope[0] if slope is not None else t0 / b
        worst = dpass + b * row + min(backlog, self.catch_up_per_step) * per_token
        if worst * 2 ** bk.losses > bk.budget and not (bk.follow_up and backlog == 0):
            return 0
        self.last_probe = True
        return 1

    def _best_k(self, drafts: dict[str, int], top: int, t0: float, dpass: float,
                slope: float, catch_up_s: float, tokens_left: float) -> int:
        """The k of the highest expected tokens per second, 0 unless it beats plain decode's
        by ``MARGIN``; ``catch_up_s`` spread over the steps ``tokens_left`` (per sequence)
        take at k's pace."""
        b = len(drafts)
        alpha = {r: self.acceptance(r) for r, d in drafts.items() if d}
        best_k, best_rate = 0, float(b) / t0 * MARGIN
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
            steps_left = max(1.0, tokens_left * b / expected)
            rate = expected / (t0 + k * dpass + slope * rows + catch_up_s / steps_left)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _catch_up_price(self, dpass: float) -> float:
        """Seconds a draft's catch-up token costs: measured, else ``_CATCH_UP_GUESS`` of a
        draft pass (``dpass``; the catch-up runs as decode rows, many a pass)."""
        return self._catch_up if self._catch_up is not None else _CATCH_UP_GUESS * dpass

    # ---- what happened ---------------------------------------------------------------------
    def _disturbed(self, key: tuple, value: float, usual: float | None) -> bool:
        """Whether ``value`` of the figure ``key`` is a disturbance to leave out: over
        ``DISTURBED`` times ``usual`` (its recent average), unless ``DISTURBED_RUN`` were in
        a row (then this one is believed, and the run starts over)."""
        if usual is None or value <= DISTURBED * usual:
            self._noise.pop(key, None)
            return False
        run = self._noise.get(key, 0) + 1
        if run >= DISTURBED_RUN:
            self._noise.pop(key, None)
            return False
        self._noise[key] = run
        return True

    def observe_draft(self, num_seqs: int, seconds_per_pass: float) -> None:
        """A draft model's pass over ``num_seqs`` sequences (one draft each) took this long."""
        old = self._draft_pass.get(num_seqs)
        if self._disturbed(("draft", num_seqs), seconds_per_pass, old):
            return
        self._draft_pass[num_seqs] = (seconds_per_pass if old is None else
                                      old + _COST_WEIGHT * (seconds_per_pass - old))

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A draft model computed ``tokens`` catch-up tokens (beyond a step's usual ones) in
        about ``seconds``."""
        if tokens < _CATCH_UP_MIN:
            return
        per = seconds / tokens
        old = self._catch_up
        if self._disturbed(("catch_up",), per, old):
            return
        self._catch_up = per if old is None else old + _COST_WEIGHT * (per - old)

    def observe_step(self, num_seqs: int, num_tokens: int, seconds: float,
                     emitted: int | None = None, draft_seconds: float = 0.0,
                     catch_up_seconds: float = 0.0) -> None:
        """A step without prompt chunks: ``num_seqs`` sequences, ``num_tokens`` tokens in all,
        ``emitted`` tokens produced (default: one per sequence), ``draft_seconds`` of its time
        a draft model's passes (the slope counts the verification rows only), and
        ``catch_up_seconds`` of those its catch-up (an investment: the steady gain leaves it
        out, the budget does not)."""
        b, extra = num_seqs, num_tokens - num_seqs
        base = self._base.get(b)
        bk = self._buckets.get(_bucket(b))
        if extra <= 0:
            # a plain step, but a draft may have computed part of a catch-up in it (a probe
            # whose sequences had too much to catch up to draft yet): the base leaves it
            # out, the budget pays it
            plain = seconds - draft_seconds
            if self._disturbed(("step", b), plain, base[0] if base else None):
                self.disturbed_steps += 1
                return
            avg = plain if base is None else base[0] + _COST_WEIGHT * (plain - base[0])
            self._base[b] = (avg, self._steps)
            if bk is not None:  # plain decode earns exploration time
                bk.budget += EXPLORE_SHARE * plain - draft_seconds
            return
        if base is None:
            return  # nothing to measure the extra against yet
        # the target's part against base and rows (a row priced as a whole sequence's while
        # unmeasured: the most it costs)
        old = self._slope.get(b)
        expected = base[0] + (old[0] if old is not None else base[0] / b) * extra
        if self._disturbed(("step", b), seconds - draft_seconds, expected):
            self.disturbed_steps += 1
            return
        per_row = max(0.0, (seconds - draft_seconds - base[0]) / extra)
        avg = per_row if old is None else old[0] + _COST_WEIGHT * (per_row - old[0])
        self._slope[b] = (avg, self._steps)
        made = emitted if emitted is not None else b
        if bk is None:
            bk = self._buckets[_bucket(b)] = _Bucket(budget=FIRST_PROBE * base[0])
        # the budget: what the step saved (its tokens at plain decode's pace, less its time;
        # a loss in full, a saving a share: a probe risks a part of what speculating saved)
        saved = made * base[0] / b - seconds
        bk.budget += saved if saved < 0 else PROBE_SHARE * saved
        bk.follow_up = catch_up_seconds > 0
        if bk.follow_up:
            # a catch-up's step says little of the steady gain (its draft pass is a prompt
            # chunk's, its time split pro rata): the next step, caught up, measures it
            return
        # the steady gain: a ratio of sums (one step's drafts are all held or none: a
        # step's own ratio swings far either way)
        bk.plain_s = bk.plain_s * _GAIN_DECAY + made * base[0] / b
        bk.spec_s = bk.spec_s * _GAIN_DECAY + seconds
        bk.losses = bk.losses + 1 if bk.gain < 1.0 else 0

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
