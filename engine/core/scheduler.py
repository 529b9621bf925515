"""Iteration-level scheduler: decides, every step, which tokens of which requests to compute.

One rule (vLLM v1's): each request has ``num_computed_tokens`` and ``num_tokens``; each step
hands out tokens until they meet, within ``max_num_batched_tokens`` and ``max_num_seqs`` (and,
when set, ``max_prefill_chunk`` prompt tokens to one request, ``max_step_prefill_tokens`` to
all, ``yield_step_prefill_tokens`` to those below a priority seen lately:
``engine.core.prompt_budget``). That single rule covers prefill, chunked prefill, decode, prefix-cache hits and recompute
after preemption. ``schedule`` and ``update_from_output`` are pure: no I/O, no torch, a clock.

Priorities (``Request.priority``; a migrated stream's re-prefill is 1, new prompts 0): a
request waits behind every waiting one of its priority or higher, and a step that admits
requests of some priority admits none of a lower one, so the first token of a higher-priority
request waits for its own compute only, not for lower-priority prompts batched beside it.
(Chunks of requests already running still share its step: they hold pages and a place.)
The running batch is kept in priority order too: when blocks run short, the lowest-priority
running request (the latest among equals) is the one preempted, and a waiting request of a
strictly higher priority that finds no room preempts it (``engine.core.priority_room``).

First token first (``SchedulerConfig.first_token_first``, continuous batching): when the
prompt at the head of the queue fits one step, that step leaves the running decodes out, so
its first token waits for its own compute only, not for the decode rows beside it. The
decodes run in the next step, alone (nothing is admitted beside them): a decode's gap is one
prompt step plus its own, what a step mixing the prompt in would have cost it, and a prompt
arriving meanwhile waits one decode step.

Batching policies differ only in *when waiting requests may join*:
continuous (any step), static (only when nothing runs), dynamic (only when nothing runs and
the batch is full or the oldest request has waited ``dynamic_window_s``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from itertools import islice

from engine.config import SchedulerConfig
from engine.contract import MAX_PRIORITY, QueueFullError, TokenLogprob
from engine.core.block_manager import BlockManager
from engine.core.grammar import Grammars
from engine.core.priority_room import make_room
from engine.core.prompt_budget import PromptBudget
from engine.core.request import Request, RequestStatus
from engine.core.step_io import ModelRunnerOutput, ScheduledChunk, SchedulerOutput, StepUpdate

__all__ = ["ModelRunnerOutput", "ScheduledChunk", "Scheduler", "SchedulerOutput", "StepUpdate"]


class Scheduler:
    """Owns the waiting queue, the running batch and (through BlockManager) their KV blocks."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic,
                 grammars: Grammars | None = None) -> None:
        self.config = config
        # Grammar states for SamplingParams.structured (None: a tokenizer-less model refuses it).
        self.grammars = grammars
        self.blocks = block_manager
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Decode side of disaggregation: blocks reserved, KV in flight from a prefill worker.
        self.remote: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_preemptions = 0
        # admissions deferred because a running request was computing the prompt's next
        # block (``_admit``): each is one step a duplicate computation was avoided
        self.num_prefix_waits = 0
        # static/dynamic: ids of the batch launched when nothing ran. Members the token budget
        # (chunked prefill) or a preemption kept out may still join it; nobody else may.
        self._batch: set[str] = set()
        # Prompt tokens one request may take in a step (SchedulerConfig.max_prefill_chunk).
        self._chunk_cap = config.max_prefill_chunk or config.max_num_batched_tokens
        # Prompt tokens (a request's chunk of more than the one token a decode computes) of
        # a step, and of the lower priorities' prompts while priorities are mixed (continuous
        # batching with chunked prefill only: elsewhere a prompt cannot be cut or join later).
        yield_cap = (config.yield_step_prefill_tokens or None if config.policy == "continuous"
                     and config.enable_chunked_prefill else None)
        self._prompt = PromptBudget(config.max_step_prefill_tokens
                                    or config.max_num_batched_tokens, yield_cap)
        # first_token_first: the last step left the decodes out (the next one is theirs)
        self._skipped_decodes = False

    # ---- request intake ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request behind every waiting one of its priority or higher.
        Raises QueueFullError past ``max_waiting``."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        self._start_grammar(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if request.priority <= MAX_PRIORITY:  # a client's; a migrated stream's re-prefill
            self._prompt.saw(request.priority, self.clock())  # is above them and says nothing
        ahead = next((i for i, r in enumerate(self.waiting) if r.priority < request.priority),
                     None)
        if ahead is None:
            self.waiting.append(request)
        else:
            self.waiting.insert(ahead, request)

    def add_remote_request(self, request: Request) -> bool:
        """Reserve blocks for a prompt whose KV will arrive from a prefill worker, reusing
        the longest cached prefix (``request.num_cached_tokens`` says how long: only the
        tokens after it must arrive).

        Returns False (nothing reserved) when the pool is too small right now.
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self._start_grammar(request)
        # The leading blocks our own prefix cache already holds are pinned, not received:
        # the prefill worker sends only the tokens after them (``num_cached_tokens``).
        computed = self.blocks.get_computed_blocks(request.prompt_token_ids, request.hash_root)
        # +1: room for the first generated token, which the prefill worker sends with the KV.
        if not self.blocks.allocate_slots(request.request_id, request.num_prompt_tokens + 1,
                                          computed):
            return False
        # Pool hits and blocks restored from a second tier (fewer if a restore failed).
        request.num_cached_tokens = self.blocks.adopted_tokens(request.request_id)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.remote[request.request_id] = request
        return True

    def finish_remote_kv(self, request_id: str, first_token_id: int,
                         first_logprob: TokenLogprob | None = None) -> StepUpdate:
        """The prompt's KV is in our pages: the request joins the batch with its first token
        (ahead of new arrivals), or finishes at once if that token already stops it.
        ``first_logprob`` keeps ``output_logprobs`` one per output token."""
        req = self.remote.pop(request_id)
        req.num_computed_tokens = req.num_prompt_tokens
        # The arrived prompt is a prefix like any computed one: the next turn of this
        # conversation routed here reuses it instead of receiving it again.
        self.blocks.cache_full_blocks(request_id, req.all_token_ids, req.num_computed_tokens,
                                      req.hash_root)
        now = self.clock()
        req.output_token_ids.append(first_token_id)
        if first_logprob is not None:
            req.output_logprobs.append(first_logprob)
        req.first_token_time = req.first_token_time or now
        req.token_times.append(now)
        req.status = RequestStatus.WAITING
        if req.grammar is not None and not req.grammar.accept(first_token_id):
            req.error = f"structured output: {req.grammar.error}"
            req.status = RequestStatus.FINISHED_ERROR
        else:
            req.check_stop(first_token_id, self.config.max_model_len)
        if req.is_finished:
            self._free(req)
        else:  # its KV is here: ahead of every waiting request but those of a higher priority
            i = next((i for i, r in enumerate(self.waiting) if r.priority <= req.priority),
                     len(self.waiting))
            self.waiting.insert(i, req)
        return StepUpdate(req, [first_token_id])

    def abort_request(self, request_id: str) -> bool:
        """Finish a request as aborted, freeing its blocks. False if unknown or already done."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return True

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop string found by the detokenizer, abort, ...)."""
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req.request_id in self.remote:
            del self.remote[req.request_id]
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self._free(req)

    def _free(self, req: Request) -> None:
        self.blocks.free(req.request_id)
        self.requests.pop(req.request_id, None)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.remote)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.remote)

    # ---- the step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. Running requests first (oldest first), then admissions;
        under ``first_token_first``, a step that can finish a waiting prompt leaves the
        decodes out (module docstring)."""
        cfg = self.config
        out = SchedulerOutput()
        decodes_turn = self._skipped_decodes  # the last step left them out: theirs alone
        self._prompt.start_step(self.clock())  # first: the first-token check reads its caps
        first_token_step = self._first_token_step()
        budget = self._schedule_running(out, cfg.max_num_batched_tokens, first_token_step)
        if not out.preempted_ids and self._may_admit() and not (decodes_turn and out.chunks):
            self._admit(out, budget)
        if first_token_step and not out.chunks:  # nothing could be admitted after all
            self._skipped_decodes = False
            out.held_decodes = 0
            self._schedule_running(out, cfg.max_num_batched_tokens, False)
        self.num_steps += 1
        return out

    def _first_token_step(self) -> bool:
        """Whether this step leaves the running decodes out so that the prompt at the head of
        the queue gets its first token after its own compute alone. Only when that prompt
        fits the step whole (its first token comes out of it), some decode runs, and the
        last step did not already leave them out: a decode waits at most one step."""
        cfg = self.config
        skipped, self._skipped_decodes = self._skipped_decodes, False
        if not cfg.first_token_first or cfg.policy != "continuous" or skipped:
            return False
        if not self._may_admit() or not any(self._decoding(r) for r in self.running):
            return False
        head = self.waiting[0]
        if head.num_tokens - head.num_computed_tokens > min(self._chunk_cap,
                                                            self._prompt.cap(head.priority)):
            return False  # its first token is steps away: no reason to hold the decodes
        self._skipped_decodes = True
        return True

    @staticmethod
    def _decoding(req: Request) -> bool:
        return req.num_computed_tokens >= req.num_prompt_tokens

    def _schedule_running(self, out: SchedulerOutput, budget: int, skip_decodes: bool) -> int:
        """Chunks for the running requests (oldest first; ``skip_decodes``: prompt chunks
        only), preempting from the back when blocks run out. Returns the budget left."""
        scheduled: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if skip_decodes and self._decoding(req):
                out.held_decodes += 1
                i += 1
                continue
            left = req.num_tokens - req.num_computed_tokens
            num_new = min(left, budget, self._chunk_cap,
                          self._prompt.allow(req.priority) if left > 1 else 1)
            if left == 1 and req.spec_token_ids:  # and its drafts, as the budget allows
                num_new = min(1 + len(req.spec_token_ids), budget)
            if num_new <= 0:  # nothing to compute, or no prompt tokens left in this step
                i += 1
                continue
            while not self.blocks.allocate_slots(req.request_id, req.num_computed_tokens + num_new):
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req preempted itself: nothing behind it remains either
            scheduled.append(req)
            out.chunks.append(self._chunk(req, num_new))
            budget -= num_new
            self._prompt.take(req.priority, num_new if left > 1 else 0)
            i += 1
        return budget

    def _may_admit(self) -> bool:
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        policy = self.config.policy
        if policy == "continuous":
            return True
        if self.running:  # static/dynamic: a batch runs to completion before the next forms
            return self.waiting[0].request_id in self._batch
        # dynamic: launch when full, or when the oldest has waited long enough
        if (policy == "dynamic" and len(self.waiting) < self.config.max_num_seqs
                and self.clock() - self.waiting[0].arrival_time < self.config.dynamic_window_s):
            return False
        self._batch = {r.request_id for r in islice(self.waiting, self.config.max_num_seqs)}
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        cfg = self.config
        deferred: list[Request] = []  # waiting for a prefix another request is computing
        top = self.waiting[0].priority if self.waiting else 0  # the queue is in priority order
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if cfg.policy != "continuous" and req.request_id not in self._batch:
                break
            if req.priority < top:  # not beside higher-priority admissions (module docstring)
                break
            if (req.lora_name is not None and req.lora_name not in adapters
                    and len(adapters) >= cfg.max_loras):
                # a step runs at most max_loras adapters: this one waits for a running one to
                # finish, and later requests (of running adapters, or none) may go first
                deferred.append(self.waiting.popleft())
                continue
            computed = None
            if req.num_computed_tokens == 0:
                # Prompt logprobs need every prompt position computed: no prefix-cache hit.
                # prompt logprobs, and mean / cls pooling, need every prompt row computed
                wants_all = req.sampling_params.prompt_logprobs is not None \
                    or req.sampling_params.pooling in ("mean", "cls")
                computed = self.blocks.get_computed_blocks([] if wants_all else req.all_token_ids,
                                                           req.hash_root)
                if (cfg.policy == "continuous" and not wants_all
                        and self.blocks.in_progress(req.all_token_ids, computed, req.hash_root)):
                    # A running request is computing the next block of this prompt (the
                    # second of two requests with one new prefix): it is cached within that
                    # request's next chunks, so waiting for it costs no more than computing
                    # it again here, which would also slow every request of those steps
                    # (a step's cost grows with its tokens). Later requests may go first.
                    # Continuous batching only: under static / dynamic ones it could not
                    # join until the whole batch had finished.
                    deferred.append(self.waiting.popleft())
                    self.num_prefix_waits += 1
                    continue
                num_computed = computed.num_tokens(self.blocks.block_size)
            else:  # remote KV already in our pages
                num_computed = req.num_computed_tokens
            remaining = req.num_tokens - num_computed
            num_new = min(remaining, budget, self._chunk_cap,
                          self._prompt.allow(req.priority) if remaining > 1 else 1)
            if num_new <= 0 or (num_new < remaining and not cfg.enable_chunked_prefill):
                break
            need = num_computed + num_new
            if not (self.blocks.allocate_slots(req.request_id, need, computed)
                    or make_room(self, out, req, need, computed)):
                break
            self.waiting.popleft()
            if computed is not None:
                # A second-tier block that could not be read is recomputed in this chunk
                # (the allocation already covers it: it ends where it would have).
                adopted = self.blocks.adopted_tokens(req.request_id)
                num_new += num_computed - adopted
                num_computed = adopted
                req.num_computed_tokens = num_computed
                req.num_cached_tokens = num_computed
                if not wants_all:
                    self.blocks.note_computing(req.request_id, req.all_token_ids, computed,
                                               req.hash_root)
            req.status = RequestStatus.RUNNING
            req.running_since = self.clock()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = req.running_since
            self._add_running(req)
            if req.lora_name is not None:
                adapters.add(req.lora_name)
            out.chunks.append(self._chunk(req, num_new))
            budget -= num_new
            self._prompt.take(req.priority, num_new if remaining > 1 else 0)
        self.waiting.extendleft(reversed(deferred))  # back at the front, in their order

    def _chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        # past the sequence's end: drafts (a decode's only; consumed by this step)
        num_draft = max(0, start + num_new - req.num_tokens)
        toks = req.token_slice(start, start + num_new - num_draft)
        toks += req.spec_token_ids[:num_draft]
        req.spec_token_ids = []
        if start < req.num_prompt_tokens:
            req.num_prompt_chunks += 1
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=toks,
            start_pos=start,
            block_ids=self.blocks.block_ids(req.request_id),
            sample=start + num_new - num_draft == req.num_tokens,
            sampling_params=req.sampling_params,
            num_output_tokens=len(req.output_token_ids),
            output_token_ids=req.output_token_ids,
            prompt_token_ids=req.prompt_token_ids,
            export_kv=req.export_kv,
            export_from=req.export_from,
            grammar=req.grammar,
            num_draft=num_draft,
            lora_name=req.lora_name,
        )

    def _add_running(self, req: Request) -> None:
        """Into the batch behind every running request of its priority or higher: the list
        stays in priority order, so preemption (from the back) takes the lowest priority, the
        latest admitted among equals."""
        i = next((i for i, r in enumerate(self.running) if r.priority < req.priority),
                 len(self.running))
        self.running.insert(i, req)

    def preempt(self, req: Request) -> None:
        """Recompute preemption of running ``req``: free its blocks, keep its generated tokens,
        requeue it ahead of the waiting requests of its priority or lower (behind higher ones:
        it cannot take back the room it gave one)."""
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.pooled = []  # recomputed from the start: its parts come again
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(next((i for i, r in enumerate(self.waiting)
                                  if r.priority <= req.priority), len(self.waiting)), req)

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[StepUpdate]:
        """Advance computed counts, append sampled tokens (a verifying chunk's accepted
        drafts and next token, its rejected drafts' slots given back), finish requests that
        stopped: a stop or a grammar's end drops the tokens after it."""
        now = self.clock()
        updates: list[StepUpdate] = []
        for chunk in sched.chunks:
            rid = chunk.request_id
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            before = req.num_computed_tokens
            if not chunk.num_draft:
                req.num_computed_tokens += chunk.num_tokens
                self._cache_filled(req, before)
            if rid in result.prompt_logprobs:
                first, lps = result.prompt_logprobs[rid]
                if req.prompt_logprobs is None:  # the first token has no logprob: NaN
                    req.prompt_logprobs = [TokenLogprob(req.prompt_token_ids[0], math.nan, 0)]
                    req.prompt_logprobs += [None] * (req.num_prompt_tokens - 1)
                req.prompt_logprobs[first:first + len(lps)] = lps
            if rid in result.pooled:
                req.pooled.append(result.pooled[rid])
            if not chunk.sample:
                continue
            if rid in result.failed:
                req.error = result.failed[rid]
                self.finish_request(req, RequestStatus.FINISHED_ERROR)
                updates.append(StepUpdate(req, []))
                continue
            tokens = result.spec_token_ids.get(rid) or [result.sampled_token_ids[rid]]
            if chunk.num_draft:
                req.spec_proposed += chunk.num_draft
                req.spec_accepted += len(tokens) - 1
            lps = result.spec_logprobs.get(rid) or (
                [result.logprobs[rid]] if rid in result.logprobs else [])
            new: list[int] = []
            for i, token in enumerate(tokens):
                if req.grammar is not None and not req.grammar.accept(token):
                    # The mask allowed only what the grammar allows: the grammar's fault.
                    req.error = f"structured output: {req.grammar.error}"
                    self.finish_request(req, RequestStatus.FINISHED_ERROR)
                    break
                req.output_token_ids.append(token)
                if i < len(lps):
                    req.output_logprobs.append(lps[i])
                if req.first_token_time is None:
                    req.first_token_time = now
                req.token_times.append(now)
                new.append(token)
                req.check_stop(token, self.config.max_model_len)
                if req.is_finished:
                    break
            if chunk.num_draft and req.status is RequestStatus.RUNNING:
                # The KV of the last token and of each accepted draft holds; the rejected
                # drafts' slots are rewritten by later steps, and whole blocks past the
                # sequence go back to the pool now.
                req.num_computed_tokens = before + len(new)
                self._cache_filled(req, before)
                self.blocks.trim(rid, req.num_tokens)
            if req.is_finished and req in self.running:
                self.running.remove(req)
                self._free(req)
            updates.append(StepUpdate(req, new))
        return updates

    def _cache_filled(self, req: Request, before: int) -> None:
        """Register the blocks the request's computed tokens filled since ``before``."""
        bs = self.blocks.block_size
        if req.num_computed_tokens // bs > before // bs:
            self.blocks.cache_full_blocks(req.request_id, req.all_token_ids,
                                          req.num_computed_tokens, req.hash_root)

    def _start_grammar(self, req: Request) -> None:
        """Give a constrained request its grammar state, after the tokens it generated
        elsewhere (the last ``sample_index_offset`` of its prompt). Raises ValueError."""
        structured = req.sampling_params.structured
        if structured is None:
            return
        if self.grammars is None:
            raise ValueError("structured output: this model has no tokenizer to build a grammar")
        moved = req.sampling_params.sample_index_offset
        req.grammar = self.grammars.start(
            structured, req.prompt_token_ids[len(req.prompt_token_ids) - moved:] if moved else ())
