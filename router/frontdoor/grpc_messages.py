"""Protobuf <-> backend types for the gRPC front door: a ``GenerateRequest`` becomes a
``GrpcGeneration`` (one ``GenerateInput`` per choice, plus how its tool calls come out),
a backend chunk becomes ``GenerateResponse`` messages.

Tools: a request with ``tools`` must prompt with chat messages; the template renders them
with the tools (``tokenize``) and the generation runs on those token ids. ``required`` and
named choices are enforced by a grammar (``router.frontdoor.openai.tools``, shared with the
HTTP API); the stream carries the model's raw output and the ``complete`` message the calls
parsed from it (``ToolCallCollector``).

Reasoning (the server's ``--reasoning-parser``, chat-messages prompts only, as HTTP's chat and
not its completions): each chunk's text is split by the parser the HTTP door uses
(``router.frontdoor.openai.reasoning``) into ``reasoning_content`` / ``content``, and the
complete carries the whole split (``ReasoningSplitter``); tool calls are parsed from the
content only.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.contract import MAX_SEED, SamplingParams, check_priority
from engine.core.grammar import StructuredOutput
from proto.pdcluster.v1 import generation_pb2 as pb
from router.contract import GenerateInput, GenerationChunk, InvalidRequestError, as_invalid_request
from router.frontdoor.openai.reasoning import ReasoningStream
from router.frontdoor.openai.tools import ToolPlan, parse_calls, plan_tools, tool_constraint

__all__ = ["MAX_CHOICES", "GrpcGeneration", "ReasoningSplitter", "ToolCallCollector",
           "chunk_to_responses", "request_to_generation", "sampling_from_proto"]

MAX_CHOICES = 64
_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos",
                             "min_tokens", "include_stop_str_in_output", "presence_penalty",
                             "frequency_penalty", "repetition_penalty", "min_p", "logprobs")
# float32 on the wire: 0.7 arrives as 0.699999988; these are rounded back to what the caller wrote.
_FLOAT_SAMPLING_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                          "repetition_penalty", "min_p")
_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

# The backend's tokenize: (messages, tools=...) -> the chat template's token ids.
Tokenize = Callable[..., list[int]]


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults. Raises ValueError for bad values."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    for name in _FLOAT_SAMPLING_FIELDS:
        if name in kwargs:
            kwargs[name] = round(kwargs[name], 6)
    bias = {int(t): round(v, 6) for t, v in msg.logit_bias.items()}
    if msg.HasField("structured"):
        kwargs["structured"] = StructuredOutput(msg.structured.kind, msg.structured.spec)
    return SamplingParams(**kwargs, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                          logit_bias=bias)


@dataclass(frozen=True)
class GrpcGeneration:
    """One Generate call as the backend runs it: an input per choice, and the tool plan
    (None: no calls to parse). ``chat``: the prompt was chat messages (a reasoning parser
    applies to chat output only, as on the HTTP door)."""

    inputs: list[GenerateInput]
    tools: ToolPlan | None = None
    chat: bool = False


def _functions(req: pb.GenerateRequest) -> list[dict] | None:
    """The request's tools as OpenAI function definitions (None: no tools)."""
    if not req.tools:
        return None
    out = []
    for t in req.tools:
        if not _FUNCTION_NAME.match(t.name):
            raise InvalidRequestError(f"tools: a function name is 1-64 of [a-zA-Z0-9_-], "
                                      f"got {t.name!r}")
        f: dict = {"name": t.name}
        if t.description:
            f["description"] = t.description
        if t.parameters:
            try:
                f["parameters"] = json.loads(t.parameters)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"tools: {t.name}'s parameters are not JSON: {e}"
                                          ) from None
            if not isinstance(f["parameters"], dict):
                raise InvalidRequestError(f"tools: {t.name}'s parameters are not a JSON "
                                          "schema object")
        if t.strict:
            f["strict"] = True
        out.append(f)
    return out


def _message(m: pb.ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        if m.role != "assistant":
            raise InvalidRequestError("messages: tool_calls only on an assistant message")
        calls = []
        for c in m.tool_calls:
            try:  # templates index the arguments as a mapping (rendered with tojson)
                args = json.loads(c.arguments)
            except json.JSONDecodeError:
                args = c.arguments
            calls.append({"id": c.id, "type": "function",
                          "function": {"name": c.name, "arguments": args}})
        out["tool_calls"] = calls
    if m.HasField("tool_call_id"):
        if m.role != "tool":
            raise InvalidRequestError("messages: tool_call_id only on a tool message")
        out["tool_call_id"] = m.tool_call_id
    return out


def _tool_plan(req: pb.GenerateRequest, functions: list[dict] | None,
               sampling: SamplingParams, parser: str | None) -> ToolPlan | None:
    choice = req.tool_choice.WhichOneof("choice") if req.HasField("tool_choice") else None
    if functions is not None and req.WhichOneof("prompt") != "messages":
        raise InvalidRequestError("tools: only with a messages prompt (the chat template "
                                  "shows the model its tools)")
    plan = plan_tools(functions, req.tool_choice.mode if choice == "mode" else None,
                      req.tool_choice.function if choice == "function" else None,
                      parallel=(req.parallel_tool_calls if req.HasField("parallel_tool_calls")
                                else None),
                      parser=parser, resumable=req.resumable,
                      constrained=sampling.structured is not None)
    if plan is not None and sampling.logprobs is not None:
        raise InvalidRequestError("logprobs: not with tool calls")
    return plan


def request_to_generation(req: pb.GenerateRequest, request_id: str,
                          tokenize: Tokenize | None = None,
                          tool_call_parser: str | None = None) -> GrpcGeneration:
    """Proto request -> the backend's inputs, one per choice (``n``): choice k's id is
    ``{request_id}-{k}`` (k > 0), a seeded choice j samples with ``seed + j``.
    ``tokenize``: renders messages with tools (needed when the request has tools);
    ``tool_call_parser``: the model's tool-call format, for tool_choice auto. Raises
    InvalidRequestError / ValueError for bad input."""
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("request has no prompt: set text, token_ids or messages")
    sampling = sampling_from_proto(req.sampling)
    if sampling.logprobs is not None and req.resumable:
        # A resumed stream is replayed from its log, which keeps token ids only.
        raise InvalidRequestError("logprobs: not available on a resumable request")
    functions = _functions(req)
    plan = _tool_plan(req, functions, sampling, tool_call_parser)
    constraint = tool_constraint(plan, functions or [])
    if constraint is not None:
        sampling = dataclasses.replace(sampling, structured=constraint)
    model = req.model if req.HasField("model") and req.model else None
    priority = req.priority if req.HasField("priority") else 0
    common = dict(request_id=request_id, model=model, resumable=req.resumable,
                  priority=as_invalid_request(check_priority, priority))
    if kind == "text":
        inp = GenerateInput(sampling, text=req.text, **common)
    elif kind == "token_ids":
        inp = GenerateInput(sampling, token_ids=list(req.token_ids.ids), **common)
    else:
        messages = [_message(m) for m in req.messages.messages]
        if not messages:
            raise InvalidRequestError("prompt is empty: messages has no entries")
        if functions is None:
            inp = GenerateInput(sampling, messages=messages, **common)
        else:
            if tokenize is None:
                raise InvalidRequestError("tools: not served by this front door")
            ids = tokenize(messages, tools=[{"type": "function", "function": f}
                                            for f in functions])
            inp = GenerateInput(sampling, token_ids=ids, **common)
    return GrpcGeneration(_choices(req, inp), plan, chat=kind == "messages")


def _choices(req: pb.GenerateRequest, inp: GenerateInput) -> list[GenerateInput]:
    n = req.n if req.HasField("n") else 1
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequestError(f"n must be in [1, {MAX_CHOICES}], got {n}")
    if n > 1 and inp.resumable:
        raise InvalidRequestError("resumable: only for one choice (n = 1)")
    out = [inp]
    for j in range(1, n):
        params = inp.sampling if inp.sampling.seed is None else dataclasses.replace(
            inp.sampling, seed=(inp.sampling.seed + j) % (MAX_SEED + 1))
        out.append(dataclasses.replace(inp, sampling=params,
                                       request_id=f"{inp.request_id}-{j}"))
    return out


@dataclass
class ToolCallCollector:
    """Joins each choice's text and, at its ``complete``, adds the calls parsed from it."""

    plan: ToolPlan
    _texts: dict[int, list[str]] = field(default_factory=dict)

    def add(self, index: int, resp: pb.GenerateResponse) -> None:
        """Feed every response of choice ``index``, in order; a complete gains the calls."""
        kind = resp.WhichOneof("response")
        if kind == "chunk":  # after a ReasoningSplitter: the calls are in the content only
            self._texts.setdefault(index, []).append(
                resp.chunk.content if resp.chunk.HasField("content") else resp.chunk.text)
        elif kind == "complete":
            content, calls = parse_calls(self.plan, "".join(self._texts.pop(index, ())))
            c = resp.complete
            c.tool_calls.extend(pb.ToolCall(id=x.id, name=x.name, arguments=x.arguments)
                                for x in calls)
            c.ClearField("content")
            if content is not None:
                c.content = content
            if calls and c.finish_reason == "stop":
                c.finish_reason = self.plan.finish_reason


@dataclass
class ReasoningSplitter:
    """Splits each choice's streamed text into reasoning and content with ``parser``
    (router.frontdoor.openai.reasoning, the HTTP door's), chunk by chunk as HTTP's chat
    deltas, and gives the complete the whole split."""

    parser: str
    _streams: dict[int, ReasoningStream] = field(default_factory=dict)
    _parts: dict[int, tuple[list[str], list[str]]] = field(default_factory=dict)

    def split(self, index: int, responses: list[pb.GenerateResponse]
              ) -> list[pb.GenerateResponse]:
        """The responses of one backend chunk of choice ``index`` (``chunk_to_responses``'),
        with the split filled in; what was held back at the end goes with the last chunk,
        or a chunk without tokens when none came with the complete."""
        stream = self._streams.setdefault(index, ReasoningStream(self.parser))
        out: list[pb.GenerateResponse] = []
        for resp in responses:
            kind = resp.WhichOneof("response")
            if kind == "chunk":
                resp.chunk.reasoning_content, resp.chunk.content = stream.feed(resp.chunk.text)
            elif kind == "complete":
                more, rest = stream.finish()
                if (more or rest) and not (out and out[-1].WhichOneof("response") == "chunk"):
                    out.append(pb.GenerateResponse(
                        request_id=resp.request_id, index=resp.index,
                        chunk=pb.GenerateChunk(reasoning_content="", content="")))
                if more or rest:
                    out[-1].chunk.reasoning_content += more
                    out[-1].chunk.content += rest
            out.append(resp)
        thoughts, contents = self._parts.setdefault(index, ([], []))
        for resp in out:
            if resp.WhichOneof("response") == "chunk":
                thoughts.append(resp.chunk.reasoning_content)
                contents.append(resp.chunk.content)
            elif resp.WhichOneof("response") == "complete":
                content = "".join(contents)
                if stream.had_reasoning:
                    resp.complete.reasoning_content = "".join(thoughts)
                if content:
                    resp.complete.content = content
                del self._streams[index], self._parts[index]
        return out


def chunk_to_responses(chunk: GenerationChunk, request_id: str | None = None
                       ) -> list[pb.GenerateResponse]:
    """One backend chunk -> a token chunk (if it carries tokens or text) and/or the complete,
    under ``request_id`` (the id the client knows; default: the chunk's)."""
    rid = chunk.request_id if request_id is None else request_id
    out = []
    if chunk.token_ids or chunk.text:
        out.append(pb.GenerateResponse(request_id=rid, chunk=pb.GenerateChunk(
            token_ids=chunk.token_ids, text=chunk.text,
            logprobs=[pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                                      top=[pb.TopLogprob(token_id=t, logprob=x)
                                           for t, x in lp.top])
                      for lp in chunk.logprobs or ()])))
    if chunk.finished:
        usage = chunk.usage
        complete = pb.GenerateComplete(finish_reason=chunk.finish_reason or "stop")
        if usage is not None:
            complete.usage.CopyFrom(pb.Usage(prompt_tokens=usage.prompt_tokens,
                                             completion_tokens=usage.completion_tokens,
                                             total_tokens=usage.total_tokens))
        if chunk.ttft_s is not None:
            complete.ttft_s = chunk.ttft_s
        out.append(pb.GenerateResponse(request_id=rid, complete=complete))
    return out
