"""What callers of the engine see: sampling parameters and their limits, the outputs and
progress it reports, and the errors it raises."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.core.grammar import StructuredOutput


class RequestFailedError(RuntimeError):
    """The engine could not compute this request (it alone failed; its batch went on).
    gRPC INTERNAL / HTTP 500 with the reason."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the caller should retry later (gRPC RESOURCE_EXHAUSTED)."""


# Documented limits of SamplingParams (README, API docs). Seeds seed a 64-bit generator
# with seed * 1_000_003 + token index, so they must stay far below 2**63 / 1_000_003.
MAX_SEED = 2**32 - 1
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit)
POOLING_CHOICES = ("last", "mean", "cls")  # SamplingParams.pooling (embeddings)
# A request's ``priority`` as clients give it (vLLM's meaning: lower runs first).
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000


def check_priority(priority) -> int:
    """``priority`` if it is an integer in [MIN_PRIORITY, MAX_PRIORITY]; else ValueError."""
    if not _is_int(priority) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}] "
                         f"(lower runs first), got {priority!r}")
    return priority


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token_id_key(k: object) -> object:
    """A logit_bias key as an int when it spells one ("42" -> 42); anything else as it is, for
    validate() to refuse by name."""
    if isinstance(k, str) and k.strip().lstrip("-").isdigit():
        return int(k)
    return k


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Defaults follow vLLM's.

    ``temperature == 0`` is greedy. ``top_k`` 0 or -1 disables top-k; ``top_p == 1`` disables top-p.
    ``seed`` makes one request's samples reproducible regardless of what it is batched with.
    ``stop`` strings end generation when they appear in the detokenized text (the stop string is
    removed from ``text`` unless ``include_stop_str_in_output``). ``min_tokens`` suppresses EOS and
    stop token ids until that many tokens were generated.

    Logit adjustments, in the order the sampler applies them (vLLM's), before temperature:
    ``logit_bias`` (token id -> value added to its logit, in [-100, 100]; ids as ints, or as
    the decimal strings JSON makes of them), then ``repetition_penalty`` (> 0; 1 = off: a
    token seen in the prompt or the output has a positive logit divided by it, a negative one
    multiplied), ``frequency_penalty`` and ``presence_penalty`` (in [-2, 2]; OpenAI's:
    subtract ``frequency * count + presence * (count > 0)`` over the generated tokens). They
    apply to greedy requests too. ``min_p`` (in [0, 1]) drops tokens whose probability after
    temperature is below ``min_p`` times the most likely one's.

    ``logprobs``: None (off) or how many top alternatives (0-20) to report with each
    generated token's log-probability; taken from the model's raw logits, before any of the
    adjustments above (vLLM's default), so they describe the model, not the sampler.

    ``prompt_logprobs``: None (off) or how many alternatives (0-20) to report with each
    prompt token's log-probability given the tokens before it (the first's is NaN); the
    prompt is then computed whole, not taken from the prefix cache.

    ``structured``: the output must match a grammar (``engine.core.grammar.StructuredOutput``:
    a JSON schema, any JSON object, a regex, a choice of strings, an EBNF / GBNF grammar);
    tokens the grammar does not allow next are masked before every adjustment above, and the
    request ends (finish reason "stop") as soon as the grammar is complete. A spec that does
    not compile is a ValueError here.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    # Set by the router when a request migrates: how many tokens it generated elsewhere
    # before. Seeded sampling continues from that position, so the stream stays the one an
    # undisturbed run would have produced. Clients leave it 0.
    sample_index_offset: int = 0
    # An embedding request (engine.executor.pooling): the prompt's final hidden states
    # pooled, "last" | "mean" | "cls", L2-normalized unless ``normalize`` is False; it ends
    # once its prompt is computed (max_tokens 1), its output carrying ``embedding``.
    pooling: str | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.logit_bias, dict):  # JSON (stream logs, HTTP) keys ids as strings
            self.logit_bias = {_token_id_key(k): v for k, v in self.logit_bias.items()}
        if isinstance(self.structured, dict):  # as JSON (stream logs) spells it
            self.structured = StructuredOutput(**self.structured)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field. Everything the sampler and the stop
        checks later rely on is checked here, so a bad value is refused at the door instead
        of raising inside an engine step (which would take its whole batch down)."""
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) \
                or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], "
                             f"got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:  # -1: vLLM's spelling of "disabled"
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), "
                             f"got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        long = [s for s in self.stop if len(s) > MAX_STOP_STRING_CHARS]
        if long:
            raise ValueError(f"stop: each string at most {MAX_STOP_STRING_CHARS} characters, "
                             f"got one of {len(long[0])}")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(ids)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not math.isfinite(rp) or not rp > 0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {rp!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        bias = self.logit_bias
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                             f"got {len(bias)}")
        for tok, v in bias.items():
            if not _is_int(tok) or tok < 0:
                raise ValueError(f"logit_bias: keys must be token ids >= 0, got {tok!r}")
            if not _is_number(v) or not -100 <= v <= 100:
                raise ValueError(f"logit_bias: values must be numbers in [-100, 100], "
                                 f"got {v!r} for token {tok}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or unset, "
                             f"got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs)
                or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or "
                             f"unset, got {self.prompt_logprobs!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {self.structured!r}")
        if self.pooling is not None:
            if self.pooling not in POOLING_CHOICES:
                raise ValueError(f"pooling must be one of {', '.join(POOLING_CHOICES)}, "
                                 f"got {self.pooling!r}")
            if self.max_tokens != 1 or self.structured is not None or self.logprobs is not None:
                raise ValueError("pooling (an embedding request): max_tokens must be 1, "
                                 "without structured outputs or logprobs")
        if self.normalize not in (True, False):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if not _is_int(self.sample_index_offset) or self.sample_index_offset < 0:
            raise ValueError(f"sample_index_offset must be an integer >= 0, "
                             f"got {self.sample_index_offset!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Any of logit_bias / the three penalties is set (the sampler skips the rest)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1 \
            or self.frequency_penalty != 0 or self.presence_penalty != 0


@dataclass(frozen=True)
class RequestProgress:
    """Where a request stands in its engine (``LLMEngine.request_progress``): ``queued`` (waiting
    for a slot, for its prompt's KV, or preempted), ``running`` (in the batch for
    ``running_s`` seconds of the engine's clock) or ``unknown`` (never added, or ended).
    ``stalled_s``: how long the engine's loop has been inside one step (a worker fills it in;
    a loop that stops coming round is stuck, not busy)."""

    state: str
    running_s: float = 0.0
    stalled_s: float = 0.0

    QUEUED = "queued"
    RUNNING = "running"
    UNKNOWN = "unknown"


@dataclass
class RequestMetrics:
    """Timings of one request (seconds, engine clock)."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float]
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    num_prompt_chunks: int = 0  # steps that computed part of the prompt
    # Speculative decoding (docs/speculative-decoding.md): drafts verified for it, accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

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


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (log-softmax of the raw logits),
    its rank in the vocabulary (1 = most likely), and the ``SamplingParams.logprobs`` most
    likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


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
    error: str | None = None  # finish_reason "error": why this request failed
    # With SamplingParams.logprobs: every generated token's so far, and this update's.
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs: one per prompt token (the first's logprob NaN).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With SamplingParams.pooling, on the finished output: the prompt's embedding.
    embedding: list[float] | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.metrics.ttft_s

    @property
    def token_times_s(self) -> list[float]:
        return self.metrics.token_times
