"""Requests, their sampling parameters and the outputs the engine hands back.

A ``Request`` is the engine's per-sequence state; its id is the router's global request id
(workers never invent their own). The scheduler's one rule reads two numbers:
``num_computed_tokens`` (KV already in the cache) and ``num_tokens`` (prompt + generated).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the caller should retry later (gRPC RESOURCE_EXHAUSTED)."""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Defaults follow vLLM's.

    ``temperature == 0`` is greedy. ``top_k`` 0 or -1 disables top-k; ``top_p == 1`` disables top-p.
    ``seed`` makes one request's samples reproducible regardless of what it is batched with.
    ``stop`` strings end generation when they appear in the detokenized text (the stop string is
    removed from ``text`` unless ``include_stop_str_in_output``). ``min_tokens`` suppresses EOS and
    stop token ids until that many tokens were generated.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:  # -1 is vLLM's (and its clients') spelling of "disabled"
            raise ValueError(f"top_k must be >= -1 (0 or -1 disables it), got {self.top_k}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # the first step that computed any of it
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    stop_reason: int | str | None = None

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


@dataclass
class RequestMetrics:
    """Timings of one request (seconds, engine clock)."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float]
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None

    @property
    def queue_s(self) -> float | None:
        """Arrival to the first step that computed any of the request."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def e2e_s(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt (and each streaming update carries).

    ``token_ids``/``text`` are everything generated so far; ``new_token_ids``/``delta_text`` are
    what this update added. ``finish_reason`` is "stop" | "length" | "abort" | None (running).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    new_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    prompt: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.metrics.ttft_s

    @property
    def token_times_s(self) -> list[float]:
        return self.metrics.token_times
