"""The contract between the front door (gRPC / HTTP servers) and whatever generates tokens.

``router.cluster.ray_cluster.Cluster`` (Ray prefill + decode workers) implements
``GenerationBackend``; so does ``router.embedded.EngineBackend`` (one in-process engine, for
embedded use and the front door's own tests). The front doors (``router/frontdoor/``) import only
this module of the router: they only ever see these types, and map the typed errors below to
status codes once (``router/frontdoor/errors.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from engine.contract import QueueFullError, SamplingParams, TokenLogprob
from worker_protocol import WorkerLoad

__all__ = [
    "AdapterInUseError", "BackendStats", "DeadlineExceededError", "DeadlineRefusedError",
    "DrainStatus", "EmbedInput",
    "EmbedOutput", "GenerateInput", "GenerationBackend", "GenerationChunk",
    "InvalidRequestError", "ModelInfo", "ModelNotFoundError", "QueueFullError",
    "ResponseNotFoundError", "ServedModel", "StreamNotFoundError", "Usage", "WORKER_STATES",
    "WorkerLoad", "WorkerNotFoundError", "WorkerStatus", "WorkerTimeoutError",
    "WorkerUnavailableError",
]


_T = TypeVar("_T")


class InvalidRequestError(ValueError):
    """Bad input (empty prompt, bad sampling params, too long): gRPC INVALID_ARGUMENT / HTTP 400."""


class AdapterInUseError(InvalidRequestError):
    """An unload of a LoRA adapter that requests still run under: refused (HTTP 400 /
    INVALID_ARGUMENT); the adapter stays served. Retry once they finish."""


class ModelNotFoundError(LookupError):
    """The request names a model this cluster does not serve: gRPC NOT_FOUND / HTTP 404."""


class StreamNotFoundError(LookupError):
    """Resume names a request whose stream log is unknown or expired: NOT_FOUND / 404."""


class ResponseNotFoundError(LookupError):
    """A Responses-API id (``previous_response_id``, a retrieval) that is unknown, expired,
    not stored or another tenant's: NOT_FOUND / 404."""


class WorkerNotFoundError(LookupError):
    """An operator's call names a worker this backend does not run: NOT_FOUND / 404."""


class WorkerUnavailableError(RuntimeError):
    """No live worker can take the request: gRPC UNAVAILABLE / HTTP 503 (clients may retry)."""


class WorkerTimeoutError(WorkerUnavailableError, TimeoutError):
    """A worker did not answer a call within its deadline (its host may be cut off)."""


# QueueFullError (engine.contract) -> gRPC RESOURCE_EXHAUSTED / HTTP 429.


class DeadlineRefusedError(QueueFullError):
    """The request's first token is predicted after its deadline (router.control.admission):
    refused at once, 429 + Retry-After / RESOURCE_EXHAUSTED; ``retry_after_s`` is the
    predicted wait."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceededError(TimeoutError):
    """The caller's deadline (HTTP ``x-request-timeout``) passed while its request ran: the
    request was aborted on every worker and its KV freed; HTTP 504 / DEADLINE_EXCEEDED."""


@dataclass(frozen=True)
class ModelInfo:
    model_id: str  # the name clients pass as "model"
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    mode: str = "disaggregated"  # or "colocated" / "embedded"
    # The model's tool-call format, read off its chat template (engine.text.tokenizer
    # Tokenizer.tool_call_format): "hermes" | "llama3_json" | None.
    tool_call_parser: str | None = None


@dataclass(frozen=True)
class ServedModel:
    """A name clients may put in ``model`` (``/v1/models``): the base model, or a LoRA adapter
    of it (``parent``: the base model's id; ``root``: the folder it was read from)."""

    id: str
    parent: str | None = None
    root: str | None = None
    created: int = 0
    int_id: int | None = None  # an adapter's id among the backend's adapters


@dataclass(frozen=True)
class GenerateInput:
    """One generation request as the front door hands it over (already parsed, not validated).

    Exactly one of ``text``, ``token_ids``, ``messages`` is set. ``model`` (optional) must be
    ``ModelInfo.model_id`` or a LoRA adapter the backend serves (``served_models``), or the
    backend raises ModelNotFoundError.
    """

    sampling: SamplingParams
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None
    request_id: str | None = None
    model: str | None = None
    # The client may reconnect and resume: if it goes away, the request runs on into its
    # stream log instead of being aborted (router/state/stream_log.py).
    resumable: bool = False
    # The id the client knows the request by: request_id without its tenant's scope
    # (router/frontdoor/security.py). None: request_id itself.
    public_id: str | None = None
    # The tenant's concurrency permit (router/security.Permit), released when the generation
    # ends, however it ends (StreamLogger.keep); None: no cap.
    permit: Any = None
    # The client's W3C ``traceparent`` (HTTP header / gRPC metadata): with tracing on, the
    # request's trace continues the caller's. A malformed one starts a new trace (W3C).
    traceparent: str | None = None
    # OpenAI's ``user``: the caller's own name for its end user (unauthenticated, as the
    # client sent it). Recorded on the request's trace (``enduser.id``), never acted on.
    user: str | None = None
    # vLLM's ``priority``: lower runs first, in [engine.contract.MIN_PRIORITY,
    # MAX_PRIORITY] (the backend refuses others): ahead in every queue it waits in, and the
    # last preempted when KV runs short.
    priority: int = 0
    # How long the caller will wait for the request, seconds from its arrival (the gRPC
    # deadline, HTTP's ``x-request-timeout``); None: no deadline. A first token predicted
    # later is refused at once (router.control.admission).
    deadline_s: float | None = None

    @property
    def prompt(self) -> str | list[int] | list[dict]:
        if self.messages is not None:
            return self.messages
        if self.token_ids is not None:
            return self.token_ids
        return self.text if self.text is not None else ""


@dataclass(frozen=True)
class EmbedInput:
    """One embeddings call: ``inputs``, each a text or token ids (at least one), under
    ``model`` (the base model or a LoRA adapter; None: the base). How the hidden states are
    pooled is the server's setting (``pdcluster serve --pooling``), not the caller's."""

    inputs: list[str | list[int]]
    model: str | None = None
    request_id: str | None = None
    user: str | None = None


@dataclass(frozen=True)
class EmbedOutput:
    """One vector per input, in order, and the prompt tokens they took in all."""

    embeddings: list[list[float]]
    prompt_tokens: int


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerationChunk:
    """One streamed update: new token ids and the text they added.

    The last chunk has ``finished=True``, a ``finish_reason`` ("stop" | "length" | "abort")
    and ``usage``; ``ttft_s`` is set from the first chunk on (seconds since the backend
    accepted the request).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    ttft_s: float | None = None
    prompt_tokens: int = 0
    # One per token in ``token_ids`` when the request asked (SamplingParams.logprobs).
    logprobs: list[TokenLogprob] | None = None
    # On the first chunk when the request asked (SamplingParams.prompt_logprobs): one per
    # prompt token (the first's logprob NaN: nothing comes before it).
    prompt_logprobs: list[TokenLogprob | None] | None = None


WORKER_STATES = ("starting", "ready", "unreachable", "draining", "drained", "dead")


@dataclass(frozen=True)
class WorkerStatus:
    """One worker as an operator sees it (``GET /v1/cluster``, ``pdcluster status``).

    ``state``: starting (spawned, not up yet) | ready | unreachable (alive for Ray, but its
    last load report or KV address did not answer in time: no new requests are routed to it)
    | draining (the front door is draining, or an operator drains this worker: it takes no
    new work while what it holds finishes or migrates) | drained (a drain ended it: nothing
    was lost, its process exited) | dead (gone for good: out of restarts, or restarts
    disabled). A worker Ray is restarting is unreachable until it rejoins, then
    ready with ``restarts`` one higher. The load fields are the last report.
    """

    id: str
    role: str
    host: str  # the host it runs on (Ray node IP)
    pid: int
    state: str
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    running: int = 0
    waiting: int = 0
    kv_transfer_bytes: int = 0  # sent (prefill) or received (decode)
    kv_address: str = ""  # decode workers: HOST:PORT of their KV store
    restarts: int = 0  # how often Ray restarted it and it rejoined (a new pid, new KV port)
    tp: int = 1  # tensor-parallel ranks; ``pid`` is rank 0's
    rank_pids: tuple[int, ...] = ()  # ranks 1.., on ``host``
    # Torch threads its engine steps on now, and the share of their time other processes took
    # in its last window (engine.runtime.cpu_threads; 0 off the CPU).
    threads: int = 0
    cpu_stolen: float = 0.0
    # How its pool stores KV (``--kv-cache-dtype``) and what one block of it costs, every
    # layer, as stored (int8: values and scales): blocks x this = the pool's bytes.
    kv_cache_dtype: str = "auto"
    kv_block_bytes: int = 0


@dataclass(frozen=True)
class DrainStatus:
    """Where one worker's drain stands (``POST /v1/cluster/workers/{id}/drain``,
    ``pdcluster drain``).

    ``state``: draining (no new work goes there; its requests finish, and a decode worker's
    streams still running ``migrate_after_s`` after the start move to other workers, each
    continuing where it stood) | drained (nothing of this router's runs there any more,
    its own scheduler is empty, the process exited). ``streams_finished`` ended there,
    ``streams_migrated`` moved off; ``remaining`` still run there now."""

    worker_id: str
    role: str
    state: str
    elapsed_s: float
    migrate_after_s: float
    streams_finished: int = 0
    streams_migrated: int = 0
    remaining: int = 0


@dataclass(frozen=True)
class BackendStats:
    workers: list[WorkerLoad] = field(default_factory=list)
    kv_transfer_bytes_total: int = 0
    migrations: dict[str, int] = field(default_factory=dict)  # reason -> streams moved
    store_up: bool | None = None  # the cluster store answers (None: no store, embedded)
    # Cumulative: prompt tokens served from a prefix cache, per worker role, and prompt
    # (or recomputed) tokens run through a model (router.control.usage).
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)
    prefill_computed_tokens: int = 0
    # Cumulative pure-decode engine steps, every worker: batch size -> (steps, seconds); and
    # mixed steps (decode rows beside prefill chunks) by their decode rows.
    decode_steps: dict[int, tuple[int, float]] = field(default_factory=dict)
    mixed_steps: dict[int, tuple[int, float]] = field(default_factory=dict)
    # Cluster-wide reuse (router.control.prefix_pull), cumulative: prefix tokens pulled from
    # another worker instead of computed, and those held elsewhere but computed anyway.
    prefix_pulled_tokens: int = 0
    prefix_recomputed_tokens: int = 0
    # The autoscaler (``serve --autoscale``): the worker count it wants per role now, and its
    # decisions so far by (role, direction, reason). Empty without it.
    autoscaler_desired: dict[str, int] = field(default_factory=dict)
    autoscaler_decisions: dict[tuple[str, str, str], int] = field(default_factory=dict)
    # Where committed requests' first-token time went, per phase (router.control.phase_times:
    # PhaseHistogram by phase name), cumulative. Empty for the embedded backend.
    phase_seconds: dict = field(default_factory=dict)
    # Every KV transfer's duration by role pair ("prefill->decode", "decode->prefill" for a
    # prefix pull, ...): PhaseHistogram by pair, cumulative. Empty for the embedded backend.
    kv_transfer_seconds: dict = field(default_factory=dict)
    # Per LoRA adapter served (router.control.adapters), cumulative: name -> (requests
    # that named it, tokens generated under it).
    lora_adapters: dict[str, tuple[int, int]] = field(default_factory=dict)
    # First-token predictions at admission (router.control.admission), cumulative: how many
    # met their first token, the sum of |actual - predicted| and of actual - predicted (s).
    ttft_predictions: tuple[int, float, float] = (0, 0.0, 0.0)


@runtime_checkable
class GenerationBackend(Protocol):
    """What the servers call. Implementations are safe to call from one asyncio loop."""

    def model_info(self) -> ModelInfo: ...

    def generate(self, inp: GenerateInput) -> AsyncIterator[GenerationChunk]:
        """Stream chunks. Raises InvalidRequestError / ModelNotFoundError / QueueFullError
        before the first chunk. Closing the iterator early aborts the request (frees its KV)."""
        ...

    async def abort(self, request_id: str) -> bool: ...

    def resume(self, request_id: str, from_index: int = 0) -> AsyncIterator[GenerationChunk]:
        """The request's stream from token ``from_index`` on, followed until it ends.
        Raises StreamNotFoundError for an unknown or expired id."""
        ...

    async def stream_kind(self, request_id: str) -> str | None:
        """"chat" or "completion" (how it was asked for), None for an unknown stream."""
        ...

    async def stats(self) -> BackendStats: ...

    async def cluster_status(self) -> list[WorkerStatus]:
        """Every worker the backend started (dead ones included), for operators."""
        ...

    def tokenize(self, prompt: str | list[dict], tools: list[dict] | None = None,
                 add_special_tokens: bool | None = None,
                 chat_template_kwargs: dict | None = None) -> list[int]:
        """The token ids a generation of ``prompt`` runs on: a text, or chat messages through
        the model's chat template (generation prompt included; the template also sees
        ``tools``, OpenAI's tool definitions). ``add_special_tokens`` (vLLM's /tokenize flag):
        whether the tokenizer adds its special tokens (BOS, ...) to the text, or to the
        rendered messages on top of the template's; None: as a generation does (text: yes,
        messages: no); ``chat_template_kwargs``: more variables the template sees (e.g.
        ``enable_thinking``). InvalidRequestError for an empty or malformed prompt."""
        ...

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens kept). InvalidRequestError for an id
        outside the vocabulary."""
        ...

    async def drain_worker(self, worker_id: str, migrate_after_s: float | None = None,
                           wait: bool = False) -> DrainStatus:
        """Take ``worker_id`` out of service without losing anything (see DrainStatus);
        starting a drain that runs already returns its status. ``wait``: return once it is
        drained. Raises WorkerNotFoundError for an unknown worker, InvalidRequestError for
        one that is dead, or the last ready one of its role (nothing could take its work)."""
        ...

    async def embed(self, inp: EmbedInput) -> EmbedOutput:
        """Each input's pooled hidden states (prefill-only work: no decode KV is reserved).
        InvalidRequestError / ModelNotFoundError / QueueFullError /
        WorkerUnavailableError as for ``generate``."""
        ...

    def served_models(self) -> list[ServedModel]:
        """The base model, then every LoRA adapter served (``model`` may name any)."""
        ...

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serve the PEFT adapter at ``lora_path`` as model ``lora_name`` (every worker holds
        it first). InvalidRequestError: LoRA off, a name served already, a refused adapter
        (the message names why)."""
        ...

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving adapter ``lora_name``. ModelNotFoundError for a name not served;
        InvalidRequestError while requests run under it (refused: it stays served)."""
        ...

    async def shutdown(self) -> None: ...


def new_request_id() -> str:
    """The one global id a request carries through router, workers and KV transfer."""
    return f"req-{uuid.uuid4().hex}"


def as_invalid_request(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, its ValueError raised as InvalidRequestError (a 400 at the doors)."""
    try:
        return fn(*args)
    except InvalidRequestError:
        raise
    except ValueError as e:
        raise InvalidRequestError(str(e)) from e
