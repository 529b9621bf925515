"""What the SDK hands back (plain dataclasses, no protobuf), its error types, and the
conversions between them and the wire messages. Shared by ``Client`` and ``AsyncClient``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import grpc

from proto.pdcluster.v1 import generation_pb2 as pb

__all__ = [
    "Cancelled", "DeadlineExceeded", "GenerateResult", "Internal", "InvalidArgument", "ModelInfo",
    "NotFound", "PdclusterError", "ResourceExhausted", "RetryPolicy", "StreamChunk",
    "TokenLogprob", "ToolCall", "Unavailable", "Usage",
]

REQUEST_ID_METADATA_KEY = "x-request-id"
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                   "logit_bias", "logprobs", "structured")


# ---- errors ------------------------------------------------------------------------------
class PdclusterError(Exception):
    """A call failed. ``code`` is the gRPC status code, ``details`` the server's message."""

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"{code.name}: {details}" if code is not None else details)
        self.code = code
        self.details = details


class InvalidArgument(PdclusterError, ValueError):
    """Bad input: empty prompt, bad sampling params, prompt + max_tokens beyond the context."""


class NotFound(PdclusterError, LookupError):
    """The request named a model the server does not serve."""


class ResourceExhausted(PdclusterError):
    """The server's queue is full; retry later (not retried automatically)."""


class Unavailable(PdclusterError):
    """The server could not be reached (after the retries) or went away mid-stream."""


class DeadlineExceeded(PdclusterError, TimeoutError):
    """The call's ``timeout`` expired."""


class Cancelled(PdclusterError):
    """The call was cancelled (by this client or the server shutting down)."""


class Internal(PdclusterError):
    """The server failed; the message says how."""


class Unauthenticated(PdclusterError, PermissionError):
    """No API key, or one the server does not know (``api_key=`` / $PDCLUSTER_API_KEY)."""


_BY_CODE: dict[grpc.StatusCode, type[PdclusterError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def error_from_code(code: grpc.StatusCode, details: str) -> PdclusterError:
    return _BY_CODE.get(code, PdclusterError)(details, code)


def retry_after_of(e) -> float | None:
    """A failed call's ``retry-after`` trailing metadata in seconds (None: absent)."""
    try:
        md = e.trailing_metadata() or ()
    except Exception:  # an aio error whose call never reached the server
        return None
    for key, value in md:
        if key == "retry-after":
            try:
                return float(value)
            except ValueError:
                return None
    return None


def error_from_rpc(e: grpc.RpcError) -> PdclusterError:
    """Wrap a grpc.RpcError (sync or aio) in the matching PdclusterError subclass."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    return error_from_code(code, details)


# ---- results -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's raw logits, its rank in the
    vocabulary (1 = most likely) and the ``logprobs`` most likely (token id, logprob) pairs,
    most likely first. Sent when the request set ``logprobs``."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made: ``arguments`` is JSON text (``json.loads`` it)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class StreamChunk:
    """One streamed update. The last one has ``finished=True``, ``finish_reason``
    ("stop" | "length" | "abort", "tool_calls" when a request with tools ended in calls),
    ``usage`` and ``ttft_s``, and usually no tokens; for a request with tools also
    ``tool_calls`` (parsed from the whole output) and ``content`` (the text around them,
    None when the output was only calls).

    With the server's ``--reasoning-parser`` and a chat (messages) prompt, every chunk
    before the last has ``reasoning_content`` and ``content``: its ``text`` split into the
    model's reasoning and the rest (both may be empty while a tag is held back; one chunk
    may bring only what was held back); the last one has the whole output's
    (``reasoning_content`` None when it had none, ``content`` None when empty). Without a
    parser both are None on chunks before the last."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    ttft_s: float | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    index: int = 0  # the choice it belongs to (a request with n)
    tool_calls: list[ToolCall] | None = None
    content: str | None = None
    reasoning_content: str | None = None


@dataclass
class GenerateResult:
    """A whole generation: everything the stream carried, joined. ``text`` is the model's
    raw output; with tools, ``tool_calls`` are the calls parsed from it and ``content`` the
    text around them; with the server's ``--reasoning-parser`` (chat prompts),
    ``reasoning_content`` is the model's reasoning (None: it had none) and ``content`` the
    rest, as the HTTP door's ``message.reasoning_content`` / ``content``."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    ttft_s: float | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    tool_calls: list[ToolCall] | None = None
    content: str | None = None
    reasoning_content: str | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.request_id = chunk.request_id or self.request_id
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        self.text += chunk.text
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.usage = chunk.usage
            self.ttft_s = chunk.ttft_s
            self.tool_calls, self.content = chunk.tool_calls, chunk.content
            self.reasoning_content = chunk.reasoning_content


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    mode: str


@dataclass(frozen=True)
class ServedModel:
    """A name ``model`` may take (``Client.list_models``): the base model, or a LoRA adapter
    of it (``parent`` its base model, ``root`` its folder, ``lora_int_id`` its id)."""

    id: str
    parent: str | None = None
    root: str | None = None
    lora_int_id: int | None = None


@dataclass(frozen=True)
class RetryPolicy:
    """Retry UNAVAILABLE (server not reachable) with exponential backoff and jitter, and
    RESOURCE_EXHAUSTED after the server's ``retry-after`` (jittered), only before any token
    arrived: a generation that already streamed tokens is never replayed."""

    max_retries: int = 3
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    # A resumable stream (``stream(..., resume=True)``) that broke after its first token is
    # resumed up to this many times (backoff capped at 1 s: about a minute for a router to
    # come back), each from the last token received.
    max_resumes: int = 60

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff times must be >= 0")

    def backoff_s(self, attempt: int, retry_after_s: float | None = None) -> float:
        """Sleep before retry number ``attempt`` (0-based): exponential with jitter, or the
        server's ``retry-after`` (a refusal's: RESOURCE_EXHAUSTED) plus up to half again,
        so refused clients do not all come back at once."""
        if retry_after_s is not None:
            return retry_after_s * random.uniform(1, 1.5)
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** attempt) * random.uniform(0.5, 1)

    def should_retry(self, code: grpc.StatusCode, attempt: int, got_tokens: bool,
                     retry_after_s: float | None = None) -> bool:
        """UNAVAILABLE, or RESOURCE_EXHAUSTED that says when to come back (``retry-after``:
        a rate limit, a queue longer than the call's deadline), before any token."""
        retryable = code == grpc.StatusCode.UNAVAILABLE or (
            code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after_s is not None)
        return retryable and not got_tokens and attempt < self.max_retries

    def should_resume(self, code: grpc.StatusCode, resumes: int) -> bool:
        """A broken resumable stream: the router went away (UNAVAILABLE) or the call was
        cut (CANCELLED by a proxy, INTERNAL from a reset connection)."""
        return (code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
                and resumes < self.max_resumes)

    def resume_backoff_s(self, resumes: int) -> float:
        return min(1.0, self.initial_backoff_s * 2 ** resumes) * random.uniform(0.5, 1)


# ---- wire conversions ----------------------------------------------------------------------
def build_request(prompt: str | None, prompt_token_ids: list[int] | None,
                  messages: list[dict] | None, model: str | None, request_id: str | None,
                  sampling: dict, resumable: bool = False,
                  n: int | None = None, tools: list[dict] | None = None,
                  tool_choice: str | dict | None = None,
                  parallel_tool_calls: bool | None = None,
                  priority: int | None = None) -> pb.GenerateRequest:
    """Raises ValueError unless exactly one prompt form is given (or for a malformed tool),
    TypeError for an unknown sampling argument. Values themselves are validated by the server
    (INVALID_ARGUMENT)."""
    given = [name for name, v in (("prompt", prompt), ("prompt_token_ids", prompt_token_ids),
                                  ("messages", messages)) if v is not None]
    if len(given) != 1:
        raise ValueError("pass exactly one of prompt, prompt_token_ids, messages "
                         f"(got {', '.join(given) or 'none'})")
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}; "
                        f"expected some of {', '.join(SAMPLING_FIELDS)}")
    req = pb.GenerateRequest()
    if resumable:
        req.resumable = True
    if n is not None:
        req.n = n
    if request_id is not None:
        req.request_id = request_id
    if model is not None:
        req.model = model
    if priority is not None:
        req.priority = priority
    if prompt is not None:
        req.text = prompt
    elif prompt_token_ids is not None:
        req.token_ids.ids.extend(prompt_token_ids)
    else:
        req.messages.SetInParent()
        for m in messages:
            _add_message(req.messages.messages.add(), m)
    for t in tools or ():
        _add_tool(req.tools.add(), t)
    if tool_choice is not None:
        _set_tool_choice(req.tool_choice, tool_choice)
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls
    s = req.sampling
    s.SetInParent()
    for name, value in sampling.items():
        if value is None:
            continue
        if name == "stop":
            s.stop.extend([value] if isinstance(value, str) else value)
        elif name == "stop_token_ids":
            s.stop_token_ids.extend(value)
        elif name == "logit_bias":  # {token id: bias}
            for tok, bias in value.items():
                s.logit_bias[int(tok)] = bias
        elif name == "structured":
            kind, spec = structured_spec(value)
            s.structured.kind, s.structured.spec = kind, spec
        else:
            setattr(s, name, value)
    return req


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _add_message(msg: pb.ChatMessage, m: dict) -> None:
    """An OpenAI chat message (with an assistant's ``tool_calls`` or a tool's
    ``tool_call_id``) into ``msg``."""
    msg.role, msg.content = m["role"], m.get("content") or ""
    for c in m.get("tool_calls") or ():
        f = c.get("function", c)
        msg.tool_calls.add(id=c.get("id", ""), name=f["name"],
                           arguments=_arguments(f.get("arguments", {})))
    if m.get("tool_call_id") is not None:
        msg.tool_call_id = m["tool_call_id"]


def _add_tool(msg: pb.Tool, t: dict) -> None:
    """An OpenAI tool (``{"type": "function", "function": {...}}``) or a bare function
    definition (``{"name", "description", "parameters", "strict"}``) into ``msg``."""
    f = t.get("function", t) if t.get("type", "function") == "function" else None
    if not isinstance(f, dict) or "name" not in f:
        raise ValueError(f"tools: a function definition with a name, got {t!r}")
    msg.name, msg.description = f["name"], f.get("description") or ""
    if f.get("parameters") is not None:
        msg.parameters = _arguments(f["parameters"])
    msg.strict = bool(f.get("strict"))


def _set_tool_choice(msg: pb.ToolChoice, choice: str | dict) -> None:
    """"none" | "auto" | "required", or OpenAI's named form
    ``{"type": "function", "function": {"name": ...}}``."""
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError("tool_choice: \"none\", \"auto\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}, "
                             f"got {choice!r}")
        msg.mode = choice
        return
    try:
        msg.function = choice["function"]["name"]
    except (KeyError, TypeError):
        raise ValueError(f"tool_choice: a mode or {{'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {choice!r}") from None


_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def structured_spec(value: dict) -> tuple[str, str]:
    """The SDK's ``structured`` argument (one of ``{"json": schema}``, ``{"json_object":
    True}``, ``{"regex": str}``, ``{"choice": [str, ...]}``, ``{"grammar": lark_or_gbnf}``:
    vLLM's ``structured_outputs`` keys) as the wire's (kind, spec). Raises ValueError."""
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in _STRUCTURED_KEYS:
        raise ValueError(f"structured: one of {', '.join(_STRUCTURED_KEYS)} as a one-key dict, "
                         f"got {value!r}")
    (key, v), = value.items()
    if key == "json":
        return "json_schema", v if isinstance(v, str) else json.dumps(v)
    if key == "json_object":
        return "json_object", ""
    if key == "choice":
        return "choice", json.dumps(list(v))
    return key, v


def chunk_from_response(resp: pb.GenerateResponse) -> StreamChunk:
    """A chunk or complete message -> StreamChunk. Raises the mapped PdclusterError for an
    in-band error message."""
    kind = resp.WhichOneof("response")
    if kind == "chunk":
        lps = [TokenLogprob(lp.token_id, lp.logprob, lp.rank,
                            tuple((t.token_id, t.logprob) for t in lp.top))
               for lp in resp.chunk.logprobs]
        ch = resp.chunk
        return StreamChunk(resp.request_id, list(ch.token_ids), ch.text,
                           logprobs=lps or None, index=resp.index,
                           content=ch.content if ch.HasField("content") else None,
                           reasoning_content=(ch.reasoning_content
                                              if ch.HasField("reasoning_content") else None))
    if kind == "complete":
        c = resp.complete
        usage = (Usage(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens)
                 if c.HasField("usage") else None)
        calls = [ToolCall(t.id, t.name, t.arguments) for t in c.tool_calls]
        return StreamChunk(resp.request_id, [], "", True, c.finish_reason, usage,
                           c.ttft_s if c.HasField("ttft_s") else None, index=resp.index,
                           tool_calls=calls or None,
                           content=c.content if c.HasField("content") else None,
                           reasoning_content=(c.reasoning_content
                                              if c.HasField("reasoning_content") else None))
    if kind == "error":
        code = getattr(grpc.StatusCode, resp.error.code, grpc.StatusCode.UNKNOWN)
        raise error_from_code(code, resp.error.message)
    raise Internal(f"malformed response from the server (no payload): {resp!r}")


def model_info_from_proto(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(m.model_id, m.max_model_len, m.vocab_size, tuple(m.eos_token_ids), m.mode)


def served_models_from_proto(resp: pb.ListModelsResponse) -> list[ServedModel]:
    return [ServedModel(m.id, m.parent or None, m.root or None, m.lora_int_id or None)
            for m in resp.models]


def embed_request(inputs, model: str | None) -> pb.EmbedRequest:
    """``Client.embed``'s inputs (one text, one token-id list, or a list of either) as a
    request. ValueError for an empty input."""
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs
                                   and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("inputs: at least one text or token-id list")
    req = pb.EmbedRequest()
    for x in inputs:
        item = req.inputs.add()
        if isinstance(x, str):
            item.text = x
        else:
            item.token_ids.ids.extend(x)
    if model is not None:
        req.model = model
    return req


def embeddings_from_proto(resp: pb.EmbedResponse) -> list[list[float]]:
    return [list(e.values) for e in resp.embeddings]
