"""One engine's speculative decoding: drafts before each step, statistics after it.

``propose`` runs before the scheduler: every running sequence whose next step is a decode
gets up to k drafts in ``Request.spec_token_ids`` (k chosen for the whole batch by
``engine.spec.controller``; prompt lookup here, a draft model's greedy tokens through the
drafter the engine gives it), which the scheduler puts after its last token in one chunk when
the token budget allows; the model runner scores every position of it and keeps the drafts the
target agrees with (``engine.executor.verify``); the scheduler appends them and gives back the
rejected ones' slots. ``observe`` then feeds the controller what the step cost and which drafts
held. A request's drafts never run past its ``max_tokens`` or the model's context, and a
constrained request's never past what its grammar accepts. Pure Python, no torch.
"""

from __future__ import annotations

from engine.core.request import Request
from engine.core.step_io import ModelRunnerOutput, SchedulerOutput
from engine.spec.config import SpeculativeConfig
from engine.spec.controller import SpecController, SpecStats
from engine.spec.ngram import NgramProposer


class SpecDecoder:
    """Drafts for an engine's running sequences and what became of them. ``drafter``: the
    draft model's proposer (``engine.executor.draft.DraftProposer``) for ``draft_model`` and
    ``self_draft``; None for ``ngram`` (prompt lookup, here)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, drafter=None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.drafter = drafter
        if drafter is not None and not config.adaptive:
            drafter.min_confidence = 0.0  # every draft, every step: a hesitant one too
        self.controller = SpecController(
            config.num_speculative_tokens, config.adaptive,
            drafter.cost_ratio if drafter is not None else 0.0,
            drafter.catch_up_per_step if drafter is not None else 0)

    @property
    def stats(self) -> SpecStats:
        return self.controller.stats

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of each sequence in ``running`` whose next step decodes."""
        k_max = self.config.num_speculative_tokens
        decoding: list[Request] = []
        room: dict[str, int] = {}
        for req in running:
            req.spec_token_ids = []
            if req.num_computed_tokens != req.num_tokens - 1:
                continue  # its prompt is still being computed: no decode this step
            sp = req.sampling_params
            # The step also yields the target's own next token: room for drafts is one less.
            room[req.request_id] = max(0, min(k_max, sp.max_tokens - len(req.output_token_ids) - 1,
                                              self.max_model_len - req.num_tokens - 1))
            decoding.append(req)
        if not decoding:
            return
        if self.drafter is None:
            drafts = {r.request_id: self.proposer.propose(
                r.request_id, r.prompt_token_ids, r.output_token_ids, room[r.request_id])
                if room[r.request_id] else [] for r in decoding}
            self._fit_grammars(decoding, drafts)
            k = self.controller.choose({rid: len(d) for rid, d in drafts.items()})
        else:  # a draft model costs a pass a draft: k first, then only k drafts
            left = {r.request_id: min(r.sampling_params.max_tokens - len(r.output_token_ids),
                                      self.max_model_len - r.num_tokens)
                    for r in decoding}
            k = self.controller.choose(room, self.drafter.backlog(decoding), left)
            drafts = self.drafter.propose(decoding, {rid: min(k, r) for rid, r in room.items()})
            self._fit_grammars(decoding, drafts)
        if k:
            for req in decoding:
                d = drafts.get(req.request_id)
                if d:
                    req.spec_token_ids = d[:k]

    @staticmethod
    def _fit_grammars(reqs: list[Request], drafts: dict[str, list[int]]) -> None:
        """Cut each constrained request's drafts where its grammar would refuse one."""
        for req in reqs:
            d = drafts.get(req.request_id)
            if d and req.grammar is not None:
                drafts[req.request_id] = d[:req.grammar.valid_prefix(d)]

    def observe(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                step_seconds: float) -> None:
        """After the step: which drafts held, and what a step of this shape cost."""
        prompt = False
        emitted = 0
        for c in sched.chunks:
            if c.num_draft:
                toks = result.spec_token_ids.get(c.request_id)
                if toks is not None:
                    self.controller.observe(c.request_id, c.num_draft, len(toks) - 1)
                    emitted += len(toks)
            elif c.num_tokens > 1 or c.num_output_tokens == 0:
                prompt = True  # a prompt chunk's cost is not a decode step's
            else:
                emitted += 1
        draft_s = catch_up_s = 0.0
        if self.drafter is not None:
            times = self.drafter.take_times()
            for b, seconds in times.passes:
                self.controller.observe_draft(b, seconds)
            self.controller.observe_catch_up(times.catch_up_tokens, times.catch_up_seconds)
            draft_s, catch_up_s = times.seconds, times.catch_up_seconds
        if not prompt and sched.chunks:
            self.controller.observe_step(len(sched.chunks), sched.num_batched_tokens,
                                         step_seconds, emitted, draft_s, catch_up_s)

    def forget(self, request_id: str) -> None:
        """A request finished (or left this engine): drop its index and history."""
        self.proposer.drop(request_id)
        self.controller.forget(request_id)
        if self.drafter is not None:
            self.drafter.forget(request_id)
