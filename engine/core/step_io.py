"""What one step carries between the scheduler, the model runner and the engine: the chunks
the scheduler hands out (``SchedulerOutput``), what the runner gives back
(``ModelRunnerOutput``) and what the step did to each request (``StepUpdate``). Plain data, no
torch; ``engine.core.scheduler`` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.contract import SamplingParams, TokenLogprob
from engine.core.grammar import GrammarState
from engine.core.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one request to compute this step.

    ``token_ids`` are positions ``[start_pos, start_pos + len)``; ``sample`` is True when the
    chunk reaches the end of the request's known tokens, so the step produces its next token.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int  # tokens generated before this step (seeds per-token sampling)
    output_token_ids: list[int]  # generated so far (for min_tokens / penalties); do not mutate
    prompt_token_ids: list[int] = field(default_factory=list)  # (repetition penalty); do not mutate
    export_kv: bool = False
    export_from: int = 0  # first prompt position whose KV leaves (Request.export_from)
    grammar: GrammarState | None = None  # the request's (SamplingParams.structured)
    # Speculative decoding: the last ``num_draft`` of ``token_ids`` are drafts this step
    # verifies (its rows are each sampled: ``engine.executor.model_runner``).
    num_draft: int = 0
    # Run as decode rows, one per token (each attending to the slots before it), sampling the
    # last only: a draft model's few missing tokens (engine.executor.draft).
    as_rows: bool = False
    # The LoRA adapter its rows run under (Request.lora_name; None: the base model).
    lora_name: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    held_decodes: int = 0  # decodes left out of this step (first_token_first): they wait it

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class ModelRunnerOutput:
    """Sampled token per request id (only for chunks with ``sample=True``)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Chunks that verified drafts: every token the step produced for them (the accepted
    # drafts, then the target's own next token), with their logprobs where asked.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Requests whose row raised (request id -> why): they fail alone, the batch goes on.
    failed: dict[str, str] = field(default_factory=dict)
    # The sampled token's log-probability, for requests that asked (SamplingParams.logprobs).
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: request id -> (first prompt position, its logprobs).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # SamplingParams.pooling: request id -> this step's part of its pooled hidden states.
    pooled: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StepUpdate:
    """What one step did to one request: its new token (if any) and whether it finished."""

    request: Request
    new_token_ids: list[int]

    @property
    def request_id(self) -> str:
        return self.request.request_id
