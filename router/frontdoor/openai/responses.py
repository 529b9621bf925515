"""OpenAI's Responses API: ``POST /v1/responses`` and ``GET /v1/responses/{id}``.

A request is served as the chat completion it amounts to (``ChatCompletionRequest``: the same
checks, tool plans, structured outputs, priorities and limits): ``instructions`` as a system
message, then the conversation of ``previous_response_id`` (its inputs and outputs, without its
instructions, as OpenAI's), then ``input`` (text, or message / ``function_call`` /
``function_call_output`` items). ``text.format`` is ``response_format``; function ``tools`` and
``tool_choice`` keep their meaning; the output is a list of items: a ``reasoning`` item (with
``--reasoning-parser``), a ``message`` with ``output_text``, ``function_call`` items. Stored
responses (``store``, the default) go to the cluster store (Redis in production) for
``RESPONSE_TTL_S`` under the caller's tenant: another tenant's id is 404. ``stream: true`` sends
OpenAI's event sequence (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
..., ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, ``response.completed``; a reasoning item first, the same with
``reasoning_text`` parts and ``response.reasoning_text.*``), with ``sequence_number``s; a
failure after the stream began (the 200 sent) ends it with an ``error`` event and
``response.failed`` (``status: "failed"``, ``error: {code, message}``), and the failed response
is not stored. Fields OpenAI defines that are not served here are refused by name (400)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.contract import MAX_PRIORITY, MAX_TEMPERATURE, MIN_PRIORITY
from router.contract import (
    DeadlineExceededError,
    GenerationBackend,
    InvalidRequestError,
    ResponseNotFoundError,
)
from router.frontdoor.errors import map_error
from router.frontdoor.openai.reasoning import ReasoningStream, split_reasoning
from router.frontdoor.openai.responder import OpenAIResponder, deadline_at, error_response
from router.frontdoor.openai.schema import ChatCompletionRequest
from router.frontdoor.openai.tools import ToolCall, ToolCallStream, ToolPlan, parse_calls
from router.frontdoor.security import Gate

log = logging.getLogger(__name__)

RESPONSE_TTL_S = 7 * 24 * 3600.0  # how long a stored response can be continued or read


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # an output_text part replayed from an earlier output


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[_Part], Field(min_length=1)]
    id: str | None = None  # an output message replayed as input
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(
            p.text for p in self.content)


class _Reasoning(BaseModel):
    """An earlier output's reasoning item replayed as input: accepted and left out of the
    prompt (as the Qwen3 and DeepSeek-R1 templates leave earlier reasoning out)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict] = []
    content: list[dict] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class _FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class _FunctionCallOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class _FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class _TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: _Format | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: (Annotated[str, Field(min_length=1)]
            | Annotated[list[_FunctionCall | _FunctionCallOutput | _Reasoning | _Message],
                        Field(min_length=1)])
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    text: _TextConfig | None = None
    tools: Annotated[list[_FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | _NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    user: str | None = None
    priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] = 0

    def messages(self) -> list[dict]:
        """``input`` as chat messages (consecutive function calls: one assistant message)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        for item in self.input:
            if isinstance(item, _Reasoning):
                continue
            if isinstance(item, _Message):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, _FunctionCall):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": item.output})
        return out

    def as_chat(self, history: list[dict]) -> ChatCompletionRequest:
        """The chat completion this request amounts to, after ``history``. Raises
        InvalidRequestError naming a bad field."""
        fmt = self.text.format if self.text is not None else None
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": ([{"role": "system", "content": self.instructions}]
                         if self.instructions else []) + history + self.messages(),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user, "priority": self.priority, "stream": self.stream}
        if fmt is not None and fmt.type != "text":
            chat["response_format"] = ({"type": "json_object"} if fmt.type == "json_object"
                                       else {"type": "json_schema", "json_schema": {
                                           "name": fmt.name or "output", "schema": fmt.schema_,
                                           "strict": fmt.strict,
                                           "description": fmt.description}})
        if self.tools:
            chat["tools"] = [{"type": "function", "function": t.model_dump(
                exclude_none=True, exclude={"type"})} for t in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str) else
                                   {"type": "function",
                                    "function": {"name": self.tool_choice.name}})
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in chat.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise InvalidRequestError(f"{where}: {first.get('msg')}") from None


def add_responses_routes(app: FastAPI, backend: GenerationBackend, responder: OpenAIResponder,
                         gate: Gate, store, request_id, tool_call_parser: str | None = None,
                         reasoning_parser: str | None = None, deadline=None) -> None:
    """``store``: a ClusterStore (its ``response_put`` / ``response_get``); ``request_id``:
    the id a call runs under (``x-request-id`` or a new one); ``deadline(request)``: the
    seconds the caller waits (``x-request-timeout``; None: none), which ends the request
    once it passes (504, or ``error`` + ``response.failed`` in a stream)."""

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        tenant = request.state.tenant
        permit = None
        try:
            history: list[dict] = []
            if body.previous_response_id is not None:
                prev = store.response_get(gate.scoped(tenant, body.previous_response_id))
                if prev is None:
                    raise ResponseNotFoundError(
                        f"previous_response_id: no response {body.previous_response_id!r} "
                        "here (unknown, expired, or not stored)")
                history = prev["conversation"]
            chat = body.as_chat(history)
            info = backend.model_info()
            plan = chat.tool_plan(tool_call_parser or info.tool_call_parser)
            rid = request_id(request)
            request_deadline = deadline(request) if deadline is not None else None
            abort_at = deadline_at(request_deadline)  # the caller's own: ends the request
            inp = chat.to_inputs(gate.scoped(tenant, rid), info.max_model_len,
                                 backend.tokenize, plan)[0]
            permit = gate.admit(tenant)
            inp = dataclasses.replace(inp, public_id=rid, permit=permit,
                                      traceparent=request.headers.get("traceparent"),
                                      deadline_s=gate.deadline_for(tenant, request_deadline))
            resp = _Response(body, f"resp_{uuid.uuid4().hex}", info.model_id, plan,
                             reasoning_parser, history)
            if body.stream:
                stream = await responder.start_stream(inp, abort_at)
                permit = None  # the stream's now
                return StreamingResponse(resp.events(stream, store, gate.scoped(tenant, "")),
                                         media_type="text/event-stream")
            out = await responder.collect(inp, abort_at)
            permit = None
        except Exception as e:  # mapped once (router.frontdoor.errors)
            return error_response(e)
        finally:
            if permit is not None and not permit.adopted:
                permit.release()
        doc = resp.finish(out.text, out.finish_reason, out.prompt_tokens, out.completion_tokens)
        resp.save(store, gate.scoped(tenant, ""))
        return JSONResponse(doc)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        found = store.response_get(gate.scoped(request.state.tenant, response_id))
        if found is None:
            return error_response(ResponseNotFoundError(
                f"no response {response_id!r} here (unknown, expired, or not stored)"))
        return JSONResponse(found["response"])


class _Response:
    """One response being made: its items as the output arrives, its final document."""

    def __init__(self, body: ResponsesRequest, response_id: str, model_id: str,
                 plan: ToolPlan | None, reasoning: str | None, history: list[dict]) -> None:
        self.body, self.id, self.plan, self.reasoning = body, response_id, plan, reasoning
        self.model = body.model or model_id
        self.history = history
        self.created = int(time.time())
        self.doc: dict = {}

    def envelope(self, status: str, output: list, usage: dict | None) -> dict:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "temperature": b.temperature if b.temperature is not None else 1.0,
            "top_p": b.top_p if b.top_p is not None else 1.0,
            "tool_choice": (b.tool_choice.model_dump() if isinstance(b.tool_choice, BaseModel)
                            else b.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                     if fmt is not None else {"type": "text"}},
            "usage": usage, "store": b.store, "metadata": {}, "user": b.user}

    def items(self, text: str) -> tuple[list[dict], list[dict]]:
        """The output items of a whole output ``text``, and the chat messages they add to the
        conversation."""
        thought = None
        if self.reasoning is not None:
            thought, text = split_reasoning(self.reasoning, text)
            text = text or ""
        calls: list[ToolCall] = []
        if self.plan is not None:
            content, calls = parse_calls(self.plan, text)
            text = content or ""
        items: list[dict] = []
        if thought:
            items.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", thought))
        if text or not calls:
            items.append(_message_item(f"msg_{uuid.uuid4().hex}", text, "completed"))
        items += [_call_item(c) for c in calls]
        message: dict = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [c.to_json() for c in calls]
        return items, [message]

    def finish(self, text: str, reason: str | None, prompt_tokens: int,
               completion_tokens: int) -> dict:
        items, self.added = self.items(text)
        status = "incomplete" if reason == "length" else "completed"
        self.doc = self.envelope(status, items, {
            "input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens})
        return self.doc

    def save(self, store, scope: str) -> None:
        """Keep the response (and its conversation, for a continuation) unless store=false."""
        if self.body.store:
            store.response_put(scope + self.id, {
                "response": self.doc,
                "conversation": self.history + self.body.messages() + self.added},
                RESPONSE_TTL_S)

    async def events(self, stream, store, scope: str) -> AsyncIterator[str]:
        """The SSE body of a streamed response; the stream is closed however this ends."""
        seq = 0

        def event(kind: str, **fields) -> str:
            nonlocal seq
            seq += 1
            return (f"event: {kind}\ndata: "
                    f"{json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n")

        text_parts: list[str] = []
        msg_id, thought_id = f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}"
        started: dict[str, int] = {}  # item id -> output index, once announced
        thoughts = ReasoningStream(self.reasoning) if self.reasoning else None
        calls = (ToolCallStream(self.plan) if self.plan is not None and self.plan.mode != "named"
                 else None)
        thought_text = ""
        closed: set[str] = set()  # items whose done events went out
        last = None

        def reasoning_done(item: dict) -> list[str]:
            """The reasoning item's done events (before the answer's: one item at a time)."""
            closed.add(item["id"])
            index = started[item["id"]]
            return [event("response.reasoning_text.done", item_id=item["id"],
                          output_index=index, content_index=0, text=thought_text),
                    event("response.content_part.done", item_id=item["id"], output_index=index,
                          content_index=0, part=_reasoning_part(thought_text)),
                    event("response.output_item.done", output_index=index, item=item)]
        try:
            yield event("response.created", response=self.envelope("in_progress", [], None))
            yield event("response.in_progress", response=self.envelope("in_progress", [], None))
            async for c in stream:
                last = c
                text_parts.append(c.text)
                new, thought = c.text, ""
                if thoughts is not None:
                    thought, new = thoughts.feed(c.text)
                    if c.finished:
                        more, rest = thoughts.finish()
                        thought, new = thought + more, new + rest
                if thought:
                    if thought_id not in started:
                        started[thought_id] = len(started)
                        yield event("response.output_item.added",
                                    output_index=started[thought_id],
                                    item=_reasoning_item(thought_id, "", "in_progress"))
                        yield event("response.content_part.added", item_id=thought_id,
                                    output_index=started[thought_id], content_index=0,
                                    part=_reasoning_part(""))
                    thought_text += thought
                    yield event("response.reasoning_text.delta", item_id=thought_id,
                                output_index=started[thought_id], content_index=0,
                                delta=thought)
                if self.plan is not None and self.plan.mode == "named":
                    continue  # the text is the call's arguments: the call goes out whole
                if calls is not None:
                    new = calls.feed(new) + (calls.finish()[0] if c.finished else "")
                if new:
                    if thought_id in started and thought_id not in closed:
                        for e in reasoning_done(_reasoning_item(thought_id, thought_text)):
                            yield e
                    if msg_id not in started:
                        started[msg_id] = len(started)
                        yield event("response.output_item.added", output_index=started[msg_id],
                                    item=_message_item(msg_id, "", "in_progress", []))
                        yield event("response.content_part.added", item_id=msg_id,
                                    output_index=started[msg_id], content_index=0,
                                    part=_text_part(""))
                    yield event("response.output_text.delta", item_id=msg_id,
                                output_index=started[msg_id], content_index=0, delta=new,
                                logprobs=[])
        except Exception as e:  # after the 200: OpenAI's in-band error, then response.failed
            err = map_error(e)
            if isinstance(e, DeadlineExceededError):  # the caller's choice, not a fault
                log.info("response stream ended: %s", err.message)
            else:
                log.error("response stream failed: %s", err.message, exc_info=e)
            yield event("error", code=err.openai_code or err.openai_type, message=err.message,
                        param=None)
            failed = self.envelope("failed", [], None)
            failed["error"] = {"code": _failed_code(err.http_status), "message": err.message}
            yield event("response.failed", response=failed)
            return  # not stored: nothing to continue from
        finally:
            await stream.aclose()
        text = "".join(text_parts)
        doc = self.finish(text, last.finish_reason if last is not None else None,
                          last.prompt_tokens if last is not None else 0,
                          last.usage.completion_tokens if last is not None and last.usage
                          else 0)
        # the final items keep the ids the stream announced
        for item in doc["output"]:
            if item["type"] == "message":
                item["id"] = msg_id
            elif item["type"] == "reasoning":
                item["id"] = thought_id
        for item in doc["output"]:
            if item["id"] in closed:
                continue
            if item["type"] == "reasoning":
                for e in reasoning_done(item):
                    yield e
                continue
            if item["id"] not in started:
                started[item["id"]] = len(started)
                yield event("response.output_item.added", output_index=started[item["id"]],
                            item={**item, "status": "in_progress"})
            index = started[item["id"]]
            if item["type"] == "message":
                done = item["content"][0]["text"]
                yield event("response.output_text.done", item_id=item["id"], output_index=index,
                            content_index=0, text=done, logprobs=[])
                yield event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=_text_part(done))
            else:
                yield event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, arguments=item["arguments"], name=item["name"])
            yield event("response.output_item.done", output_index=index, item=item)
        self.save(store, scope)
        yield event("response.completed" if doc["status"] == "completed"
                    else "response.incomplete", response=doc)


def _failed_code(http_status: int) -> str:
    """A failed response's ``error.code``: OpenAI's list of them is closed (the ``error``
    event before it carries our own code)."""
    return {429: "rate_limit_exceeded", 400: "invalid_prompt"}.get(http_status, "server_error")


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _message_item(item_id: str, text: str, status: str, content: list | None = None) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content if content is not None else [_text_part(text)]}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [_reasoning_part(text)] if text else []}


def _call_item(call: ToolCall) -> dict:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}
