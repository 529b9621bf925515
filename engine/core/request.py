"""A request's engine-internal state, owned by the scheduler.

A ``Request`` is the engine's per-sequence state; its id is the router's global request id
(workers never invent their own). The scheduler's one rule reads two numbers:
``num_computed_tokens`` (KV already in the cache) and ``num_tokens`` (prompt + generated).
What callers hand in and get back (``SamplingParams``, ``RequestOutput``) is in
``engine/contract.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.contract import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.core.grammar import GrammarState
    from engine.lora.request import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # this request alone failed inside a step

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort",
                RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass(eq=False)  # identity equality: `req in running` must not compare token lists
class Request:
    """One sequence inside an engine. Mutable; owned by the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens whose KV came from the prefix cache at the last admission (metrics only).
    num_cached_tokens: int = 0
    # Prefill-only request: stop after the first token and hand the KV to the caller.
    export_kv: bool = False
    # Exported KV starts at this prompt position: the receiver already holds the tokens
    # before it (a decode-side prefix hit), so they are neither read nor sent.
    export_from: int = 0
    # Admitted ahead of every waiting request of lower priority (FIFO among equals). The
    # router raises it for a migrated stream's re-prefill: its client is already mid-stream.
    priority: int = 0
    # The LoRA adapter it runs under (engine.lora; None: the base model) and that adapter's
    # key, the root of its block hashes: no KV is shared across adapters.
    lora_request: LoRARequest | None = None
    hash_root: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # the first step that computed any of it
    # When it last entered the running batch (a preemption sends it back to the queue): a
    # router's token timeout counts from here, never from time spent queued.
    running_since: float | None = None
    num_prompt_chunks: int = 0  # steps that computed part of its prompt (traces)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    stop_reason: int | str | None = None
    error: str | None = None  # why it failed (status FINISHED_ERROR)
    # One per sampled output token when SamplingParams.logprobs is set (a prefill worker's
    # first token brings its own along).
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: position i's log-probability given the tokens
    # before it (position 0's is NaN: nothing comes before it; None until computed), filled
    # chunk by chunk as the prompt computes.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With SamplingParams.pooling: its pooled hidden states, one part per step that computed
    # some of its prompt (engine.executor.pooling.PooledPart); a preemption starts them over.
    pooled: list = field(default_factory=list)
    # Where the output stands in its grammar (SamplingParams.structured); set by the
    # scheduler when the request enters, fed every token the request outputs.
    grammar: GrammarState | None = None
    # Speculative decoding (engine.spec): the drafts the next step verifies after the last
    # token, set before each step's schedule; never part of the sequence until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    # Of them, over the request's life: drafts verified, and accepted (traces, outputs).
    spec_proposed: int = 0
    spec_accepted: int = 0

    @property
    def lora_name(self) -> str | None:
        """The name of the LoRA adapter it runs under (None: the base model)."""
        return self.lora_request.lora_name if self.lora_request is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (per-step hot path)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def check_stop(self, token: int, max_model_len: int) -> None:
        """Finish it if output ``token`` (already appended) ends it: its grammar is complete,
        a stop token (after ``min_tokens``), ``max_tokens`` or the model's length."""
        sp = self.sampling_params
        n = len(self.output_token_ids)
        if self.grammar is not None and self.grammar.stopped:  # complete: nothing may follow
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = token
            return
        is_stop = (not sp.ignore_eos and token in self.eos_token_ids) or token in sp.stop_token_ids
        if is_stop and n >= sp.min_tokens:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = token
            return
        if n >= sp.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
