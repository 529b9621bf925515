"""One engine's speculative decoding: drafts before each step, statistics after it.

``propose`` runs before the scheduler: every running sequence whose next step is a decode
gets up to k drafts in ``Request.spec_token_ids`` (k chosen for the whole batch by
``engine.spec.controller``), which the scheduler puts after its last token in one chunk when
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
    """Drafts for an engine's running sequences and what became of them."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.controller = SpecController(config.num_speculative_tokens, config.adaptive)

    @property
    def stats(self) -> SpecStats:
        return self.controller.stats

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of each sequence in ``running`` whose next step decodes."""
        k_max = self.config.num_speculative_tokens
        drafts: dict[str, list[int]] = {}
        for req in running:
            req.spec_token_ids = []
            if req.num_computed_tokens != req.num_tokens - 1:
                continue  # its prompt is still being computed: no decode this step
            sp = req.sampling_params
            # The step also yields the target's own next token: room for drafts is one less.
            room = min(k_max, sp.max_tokens - len(req.output_token_ids) - 1,
                       self.max_model_len - req.num_tokens - 1)
            d = (self.proposer.propose(req.request_id, req.prompt_token_ids,
                                       req.output_token_ids, room) if room > 0 else [])
            if d and req.grammar is not None:
                d = d[:req.grammar.valid_prefix(d)]
            drafts[req.request_id] = d
        if not drafts:
            return
        k = self.controller.choose({rid: len(d) for rid, d in drafts.items()})
        if k:
            for req in running:
                d = drafts.get(req.request_id)
                if d:
                    req.spec_token_ids = d[:k]

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
        if not prompt and sched.chunks:
            self.controller.observe_step(len(sched.chunks), sched.num_batched_tokens,
                                         step_seconds, emitted)

    def forget(self, request_id: str) -> None:
        """A request finished (or left this engine): drop its index and history."""
        self.proposer.drop(request_id)
        self.controller.forget(request_id)
