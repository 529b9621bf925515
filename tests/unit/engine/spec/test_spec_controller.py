"""The adaptive controller's choice of k (engine/spec/controller.py) on synthetic measured
costs: a small simulated engine feeds it step times from a cost formula and acceptances from
a fixed pattern, deterministic, no clock. What a user would notice is the tokens per second
against plain decode, so most tests compare the simulated run's rate with plain decode's:
never lower (within exploration's small, bounded share) where speculating cannot pay, and
well above where it can."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec.controller import (
    _CATCH_UP_GUESS,
    DISTURBED_RUN,
    EXPLORE_SHARE,
    FIRST_PROBE,
    SpecController,
)


@dataclass
class Sim:
    """B sequences decoding: a target step costs ``base`` plus ``row`` per verification row;
    a draft model ``dpass`` a pass, ``per_token`` a catch-up token, each sequence needing
    ``prompt`` of them at first and one more per step it decoded without drafts; each
    sequence accepts its first ``accept`` drafts; ``length`` tokens a request, then a new
    one takes its place (its prompt to catch up again)."""

    b: int = 4
    base: float = 0.030
    row: float = 0.0
    accept: int = 4
    dpass: float = 0.0
    per_token: float = 0.0
    prompt: int = 0
    length: int = 10**9
    spec_steps: int = 0
    probe_steps: list[int] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0

    def run(self, c: SpecController, steps: int) -> float:
        """Tokens per second over plain decode's after ``steps`` steps."""
        drafter = self.dpass > 0
        backlog = {f"r{i}": self.prompt for i in range(self.b)}
        made = dict.fromkeys(backlog, 0)
        for step in range(steps):
            left = {r: self.length - made[r] for r in made}
            if drafter:
                k = c.choose({r: 4 for r in made}, {r: backlog[r] for r in made}, left)
            else:
                k = c.choose({r: 4 for r in made})
            if c.last_probe:
                self.probe_steps.append(step)
            acc = min(k, self.accept)
            catch = sum(backlog.values()) if k else 0
            draft_s = k * self.dpass + catch * self.per_token
            t = self.base + self.row * k * self.b + draft_s
            for r in list(made):
                if k:
                    c.observe(r, k, acc)
                    backlog[r] = 0
                else:
                    backlog[r] += 1
                made[r] += 1 + acc
                if made[r] >= self.length:  # a new request in its place
                    c.forget(r)
                    made[r], backlog[r] = 0, self.prompt
            if k:
                self.spec_steps += 1
                for _ in range(k):
                    c.observe_draft(self.b, self.dpass)
                c.observe_catch_up(catch, catch * self.per_token)
            c.observe_step(self.b, self.b * (1 + k), t, self.b * (1 + acc), draft_s,
                           catch * self.per_token)
            self.seconds += t
            self.tokens += self.b * (1 + acc)
        return self.tokens / self.seconds / (self.b / self.base)


def test_costly_verification_rows_never_make_decode_slower():
    """An fp32-like target: each verification row costs what a sequence's step does (the
    step compute-bound), so 5 tokens cost 5 steps' time plus the draft's: speculating loses
    whatever is accepted. The probes that find it out cost at most exploration's share."""
    for b in (1, 4, 16, 32):
        sim = Sim(b=b, row=0.030 / b, dpass=0.005)
        rate = sim.run(SpecController(4, draft_cost=0.17), 400)
        assert rate >= 1.0 - EXPLORE_SHARE, (b, rate)
        assert sim.spec_steps <= 6, (b, sim.spec_steps)


def test_losing_probes_back_off_exponentially():
    """Each losing probe doubles the budget the next one needs, so the gaps between probes
    grow about twofold: in a long run a bucket where speculating loses is rarely tried."""
    sim = Sim(b=4, row=0.030, accept=1)  # rows dear: one draft held does not pay them
    rate = sim.run(SpecController(4), 3000)
    gaps = [y - x for x, y in zip(sim.probe_steps, sim.probe_steps[1:], strict=False)]
    assert len(gaps) >= 3 and gaps == sorted(gaps) and gaps[-1] >= 3 * gaps[0], gaps
    assert rate >= 1.0 - EXPLORE_SHARE


def test_a_probe_waits_until_the_budget_covers_its_catch_up():
    """A draft model whose prompt catch-up is dear: the first probe waits until plain decode
    earned its worst case (FIRST_PROBE steps, then EXPLORE_SHARE of each plain step): a
    draft pass guessed from the bytes, a row priced as a whole step, and the catch-up (at
    most one step's, 256 tokens) at a share of that draft pass (decode rows, many a pass)."""
    base, per_token = 0.030, 0.0015
    sim = Sim(b=1, base=base, row=0.002, dpass=0.003, per_token=per_token, prompt=100)
    rate = sim.run(SpecController(4, draft_cost=0.1), 800)
    step = 1  # the first plain step measures the base; the budget starts at the second
    while (FIRST_PROBE + EXPLORE_SHARE * (step - 1)) * base < (
            0.1 * base + base + min(100 + step, 256) * _CATCH_UP_GUESS * 0.1 * base):
        step += 1
    assert abs(sim.probe_steps[0] - step) <= 1, (sim.probe_steps, step)
    assert rate > 1.5  # ... which found that speculating pays here


def test_a_catch_up_repaid_by_long_answers_is_worth_it():
    """The same draft, cheap in steady state, accepting everything: over long answers its
    catch-up is repaid, and the controller speculates (well above plain decode); over
    4-token answers it never is, and it decodes plainly (no slower than plain decode)."""
    costs = dict(b=1, base=0.030, row=0.002, dpass=0.003, per_token=0.001, prompt=60)
    long = Sim(**costs, length=400)
    assert long.run(SpecController(4, draft_cost=0.1), 2000) > 1.5
    short = Sim(**costs, length=4)
    assert short.run(SpecController(4, draft_cost=0.1), 2000) >= 1.0 - EXPLORE_SHARE


def test_a_step_that_lost_to_its_catch_up_is_followed_by_a_caught_up_probe():
    """A step whose drafts all held but whose catch-up made it slower than plain decode
    spent the budget, yet says little of the steady gain: the next step, caught up, probes
    one draft anyway (the catch-up is paid), and what it gains decides (here: all 4)."""
    c = SpecController(4, draft_cost=0.1)
    c.choose({"a": 4})
    c.observe_step(1, 1, 0.030)  # base
    c.observe_draft(1, 0.003)
    c.observe("a", 4, 4)
    # 4 drafts held, rows cheap; 0.2 s of its 0.25 s the draft's catch-up of a prompt
    c.observe_step(1, 5, 0.25, emitted=5, draft_seconds=0.212, catch_up_seconds=0.2)
    assert c.choose({"a": 4}, {"a": 60}, {"a": 100}) == 0  # not caught up: nothing free
    assert c.choose({"a": 4}, {"a": 0}, {"a": 100}) == 1 and c.last_probe
    c.observe("a", 1, 1)
    c.observe_step(1, 2, 0.036, emitted=2, draft_seconds=0.003)  # 2 tokens in 1.2 steps' time
    assert c.choose({"a": 4}, {"a": 0}, {"a": 100}) == 4 and not c.last_probe


def test_a_draft_model_as_costly_as_the_target_is_never_tried():
    """A draft pass guessed from the two models' bytes: one the target's size (a 4-bit
    self-draft of a 4-bit target) could never pay, so it is not even probed; a draft a tenth
    of the target's bytes is, and then its measured passes decide."""
    same = SpecController(4, draft_cost=1.0)
    cheap = SpecController(4, draft_cost=0.1)
    for c in (same, cheap):
        c.choose({"a": 4})
        c.observe_step(1, 1, 0.010)  # base
    assert [same.choose({"a": 4}) for _ in range(100)] == [0] * 100
    assert cheap.choose({"a": 4}) == 1 and cheap.last_probe
    cheap.observe_draft(1, 0.011)  # ... which found the draft pass dearer than a decode step
    cheap.observe_step(1, 2, 0.011 + 0.012, emitted=2, draft_seconds=0.011)
    assert [cheap.choose({"a": 4}) for _ in range(30)] == [0] * 30


def test_controller_without_adaptation_verifies_every_draft():
    c = SpecController(4, adaptive=False)
    assert c.choose({"a": 3, "b": 0}) == 3
    assert c.choose({"a": 0}) == 0


def test_controller_stops_speculating_where_it_does_not_pay():
    """Drafts cost three decode steps each and none is accepted: after its probe, plain."""
    sim = Sim(b=1, base=0.010, row=0.030, accept=0)
    c = SpecController(4)
    sim.run(c, 40)
    assert sim.spec_steps <= 2
    assert [c.choose({"r0": 4}) for _ in range(10)] == [0] * 10


def test_controller_speculates_where_drafts_hold_and_rows_are_cheap():
    """Prompt lookup on a rewrite: every draft held, rows nearly free: all 4 drafts from the
    third step on (a plain step measures the base, one probe the rows)."""
    sim = Sim(b=2, base=0.010, row=0.0005)
    c = SpecController(4)
    assert sim.run(c, 40) > 3.0
    assert c.choose({"r0": 4, "r1": 4}) == 4
    s = c.stats
    assert s.acceptance_rate == 1.0 and 4.5 < s.mean_accepted_length <= 5.0
    assert s.proposed_by_position == s.accepted_by_position and len(s.proposed_by_position) == 4


def test_batch_sizes_in_a_new_bucket_probe_before_trusting_the_model():
    """Rows measured cheap at batch 2 say nothing of batch 16 (compute-bound there): batch 16
    probes one draft a sequence first, and at its own dear rows decodes plainly."""
    c = SpecController(4)
    Sim(b=2, base=0.010, row=0.0005).run(c, 20)
    big = Sim(b=16, base=0.050, row=0.050 / 8)
    big.run(c, 200)
    assert big.spec_steps <= 2 and big.probe_steps[:1] == [1]


def test_a_catch_up_without_drafts_is_charged_to_the_budget():
    """A probe whose sequences had too much to catch up to draft yet is a plain step for
    the target plus the draft's catch-up: the catch-up is charged to the budget (no more
    probes for a long while), and the plain step's base leaves it out."""
    c = SpecController(4, draft_cost=0.1)
    c.choose({"a": 4}, {"a": 0}, {"a": 100})
    c.observe_step(1, 1, 0.030)  # base
    assert c.choose({"a": 4}, {"a": 0}, {"a": 100}) == 1 and c.last_probe
    c.observe_step(1, 1, 0.030 + 0.5, draft_seconds=0.5, catch_up_seconds=0.5)
    assert [c.choose({"a": 4}, {"a": 0}, {"a": 100}) for _ in range(100)] == [0] * 100
    sim = Sim(b=1, base=0.030, accept=4, dpass=0.003, row=0.0005)  # cheap drafts, all held
    assert sim.run(c, 1200) > 1.5  # once the budget is earned back: the base was not inflated


def test_a_disturbed_step_spends_no_budget_and_moves_no_figure():
    """A neighbour's burst on a shared host: a probe that took ten times its shape's cost
    is no evidence against speculating, so it spends no budget, counts no loss and leaves
    the base alone (the next probe comes as soon as if it had not run); a plain step as
    slow moves no base. ``DISTURBED_RUN`` of them in a row are believed: a slower host."""
    def fresh():
        c = SpecController(4)
        c.choose({"a": 4})
        c.observe_step(1, 1, 0.010)  # base
        return c

    calm, noisy = fresh(), fresh()
    for c in (calm, noisy):
        assert c.choose({"a": 4}) == 1 and c.last_probe
        c.observe("a", 1, 0)
    calm.observe_step(1, 2, 0.012, emitted=1)
    noisy.observe_step(1, 2, 0.120, emitted=1)  # the same probe, ten times slower
    assert noisy.disturbed_steps == 1
    assert noisy._buckets[1].budget > calm._buckets[1].budget  # not charged at all
    noisy.observe_step(1, 1, 0.010)  # a calm step ends the run of disturbed ones
    for _ in range(DISTURBED_RUN - 1):  # slow plain steps: the base stays, until believed
        noisy.observe_step(1, 1, 0.100)
        assert noisy._base[1][0] == 0.010
    noisy.observe_step(1, 1, 0.100)
    assert noisy._base[1][0] > 0.010


def test_a_bucket_that_gained_speculates_again_after_other_batch_sizes_ran():
    """Batch 1 gained (prompt lookup on a rewrite); then the engine ran batch 16 for a long
    while. Back at batch 1, with its probe budget spent meanwhile, it trusts what it measured
    (one plain step re-measures the base) instead of waiting for a budget-gated probe."""
    c = SpecController(4)
    Sim(b=1, base=0.010, row=0.0005).run(c, 40)
    Sim(b=16, base=0.050, row=0.050 / 8).run(c, 200)
    c._buckets[1].budget = -1.0  # spent by catch-ups of sequences left alone in a batch
    assert c.choose({"r0": 4}) == 0  # the base, 200 steps old: measured again first
    c.observe_step(1, 1, 0.010)
    assert c.choose({"r0": 4}) == 4 and not c.last_probe
