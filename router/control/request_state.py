"""What the orchestrator keeps per request and per worker, and the exceptions its lifecycle
uses to steer a request (retry elsewhere, migrate, abort). Plain data; the orchestrator owns
every instance."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from engine.contract import SamplingParams, TokenLogprob
from router.contract import WorkerUnavailableError
from router.routing.policy import WorkerView
from worker_protocol import TokenUpdate, WorkerInfo


class ClusterMisconfiguredError(RuntimeError):
    """Workers that cannot work together (KV handshake refused): an operator error (INTERNAL)."""


def cause_of(e: BaseException) -> BaseException:
    """A Ray task error's original exception (its str() is a remote traceback)."""
    return getattr(e, "cause", None) or e


@dataclass
class WorkerSlot:
    info: WorkerInfo
    handle: object  # Ray actor handle
    view: WorkerView


@dataclass
class StreamState:
    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    decode_id: str | None = None
    committed: bool = False  # the sequence lives on decode_id (its KV arrived, or submitted)
    decode_incarnation: str = ""  # ... in that process (Ray may restart a worker under its id)
    migrations: int = 0
    # Engine queue priority of its prefills: raised once it migrated (the client is waiting
    # mid-stream, so its re-prefill goes ahead of new prompts).
    priority: int = 0
    prefill_id: str | None = None
    # The worker the stream was moved off while that worker may still be running (a drain,
    # a silent worker): its late tokens are not this stream's any more (they would repeat
    # the migrated sequence's). Cleared when a later attempt chooses that worker again.
    abandoned: str | None = None
    aborted: bool = False  # Abort RPC: stop retrying, end with finish_reason "abort"
    # The aborts sent to workers the stream moved off (worker id -> the call), not awaited
    # then (a silent worker may never answer): see ``rejoin``.
    moved_off: dict[str, asyncio.Future] = field(default_factory=dict)
    # Calls that create the request on a worker (reserve, submit) and may still run there
    # after the router stopped waiting (a cancelled await does not cancel the Ray call). An
    # abort sent meanwhile can overtake them (it runs in the control concurrency group) and
    # find nothing, leaving what they create behind: the abort waits for them first.
    opening: list[asyncio.Future] = field(default_factory=list)
    # Its spans (router.control.request_trace.RequestTrace), or None: tracing off/unsampled.
    trace: Any = None
    # The LoRA adapter it runs under (router.control.adapters.Adapter), None: the base model.
    lora: Any = None
    # Its first token's prediction at admission (router.control.admission.Prediction), until
    # that token came (its error is then counted); None: none made.
    predicted: Any = None

    @property
    def lora_request(self):
        """What its worker calls carry: the adapter's ``LoRARequest`` (None: base model)."""
        return self.lora.request if self.lora is not None else None

    @property
    def root(self) -> int:
        """Its KV's block-hash root (the adapter's key; 0: base model)."""
        return self.lora.key if self.lora is not None else 0

    def open_call(self, ref) -> asyncio.Future:
        """Track ``ref`` (a call creating the request on a worker) until it completes; the
        returned future is shielded, so a cancelled caller leaves it running for the abort
        to wait on."""
        fut = asyncio.ensure_future(ref)
        # Its error is the awaiting caller's, or nobody's once the caller went away.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.opening = [f for f in self.opening if not f.done()] + [fut]
        return asyncio.shield(fut)

    async def next_update(self, timeout_s: float) -> TokenUpdate | BaseException:
        """The next item of its queue (a token update, a ``WorkerLost``, an error), or a
        ``WorkerLost`` (``token_timeout``) when none came within ``timeout_s``."""
        try:
            # Not wait_for: see WorkerCalls.call (a cancelled client's stream must end).
            async with asyncio.timeout(timeout_s):
                return await self.queue.get()
        except TimeoutError:
            return WorkerLost(f"decode worker {self.decode_id} sent no token for "
                              f"{self.request_id} in {timeout_s:g} s", "token_timeout")

    async def rejoin(self, worker_id: str, timeout_s: float) -> None:
        """Before an attempt on ``worker_id``: its late tokens count again (``abandoned``),
        and the abort sent there when the stream moved off it lands first (waiting at most
        ``timeout_s``): the same request id arriving before it is a duplicate there."""
        if self.abandoned == worker_id:
            self.abandoned = None
        leaving = self.moved_off.pop(worker_id, None)
        if leaving is not None and not leaving.done():
            await asyncio.wait({leaving}, timeout=timeout_s)

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for every call still creating the request."""
        running = [f for f in self.opening if not f.done()]
        if running:
            await asyncio.wait(running, timeout=timeout_s)


class Aborted(Exception):
    """Raised inside the lifecycle once the request was aborted by id."""


class WorkerLost(WorkerUnavailableError):
    """Queued on a stream whose decode worker died or went silent: the stream migrates (or,
    past the migration limit, ends with UNAVAILABLE). ``reason`` labels the migration."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        # worker_died | worker_silent | worker_restarted | stream_lost | token_timeout |
        # router_lost (continued for a router that died: router/control/orphans.py) |
        # drained (an operator drains the worker: router/control/drain.py)
        self.reason = reason


class RetryElsewhere(Exception):
    """One attempt failed: try the request again without the workers in ``exclude``.

    Every failure of an attempt (a worker died, refused, or lost the transfer) becomes this
    one shape, so the retry policy lives in ``_prefill`` alone."""

    def __init__(self, error: BaseException, exclude: list[WorkerSlot], worker_id: str) -> None:
        super().__init__(repr(error))
        self.error = error
        self.exclude = exclude
        self.worker_id = worker_id  # the worker that failed (journal)


@dataclass(frozen=True)
class FirstToken:
    """What a successful attempt hands the stream: the first token, and whether it ended it."""

    token_id: int
    finished: bool
    finish_reason: str | None
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # ... for prompt logprobs


@dataclass
class RequestTiming:
    """Router-side timings of one request, for metrics and the TTFT breakdown benchmark."""

    queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    transfer_tail_s: float = 0.0
    attempts: int = 0


def first_update(request_id: str, first: FirstToken) -> TokenUpdate:
    """The stream's update for the token a prefill worker sampled."""
    return TokenUpdate(request_id, [first.token_id],
                       first.finish_reason if first.finished else None,
                       logprobs=None if first.logprob is None else [first.logprob],
                       prompt_logprobs=first.prompt_logprobs)


def rest_of(params: SamplingParams, streamed: int) -> SamplingParams:
    """What is left of ``params`` once ``streamed`` tokens reached the client: a migrated
    stream's continuation (the sampler resumes at the same position; the client has the
    prompt's logprobs already)."""
    return dataclasses.replace(
        params, prompt_logprobs=None, max_tokens=params.max_tokens - streamed,
        min_tokens=max(0, params.min_tokens - streamed),
        sample_index_offset=params.sample_index_offset + streamed)
