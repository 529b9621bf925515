"""Tool calls for ``/v1/chat/completions``: how each ``tool_choice`` becomes a generation, and
how its output becomes OpenAI's ``tool_calls``.

- ``required`` and a named function are enforced by structured outputs, so they work for any
  model, with or without a tool format in its chat template: ``required`` generates a JSON
  array of ``{"name", "parameters"}`` objects (one schema per tool, ``anyOf``; one call only
  when ``parallel_tool_calls`` is false), a named function generates its ``parameters``
  object itself.
- ``auto`` lets the model write freely and parses its own tool-call format: ``hermes``
  (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Qwen / Hermes / many
  fine-tunes) or ``llama3_json`` (a bare ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``). Which one: read off the chat template
  (``engine.text.tokenizer.Tokenizer.tool_call_format``), or the
  server's ``--tool-call-parser``. A model with neither refuses ``auto`` (a 400 saying so)
  rather than returning prose where the client expects calls.
- ``none``: the template still sees the tools; nothing is parsed.

Pure: no I/O. ``ToolCallStream`` is the streaming side of ``auto``: content streams until
the model opens a tool call, which is held back until it is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.core.grammar import StructuredOutput
from router.contract import InvalidRequestError

__all__ = ["PARSERS", "ToolCall", "ToolCallStream", "ToolPlan", "new_call_id", "parse_calls",
           "plan_tools", "tool_constraint"]

PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI reports it: ``arguments`` is the JSON text of the arguments."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {} if index is None else {"index": index}
        out |= {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return out


@dataclass(frozen=True)
class ToolPlan:
    """How one request's ``tool_choice`` is served. ``mode``: "named" | "required" | "auto";
    ``name``: the named function; ``parser``: auto's format; ``parallel``: False keeps one
    call (``parallel_tool_calls``: the schema enforces it for required, the parse for auto)."""

    mode: str
    name: str | None = None
    parser: str | None = None
    parallel: bool = True

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "tool_calls" when the model chose to call, "stop" for a forced name."""
        return "stop" if self.mode == "named" else "tool_calls"


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of ``tool_choice: required``: an array of one or more calls (exactly
    one when not ``parallel``), each a tool's name and its parameters."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t["name"]},
                             "parameters": t.get("parameters") or {"type": "object"}}}
             for t in tools]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tool: dict) -> dict:
    """The JSON schema of a named ``tool_choice``: the function's parameters object."""
    return tool.get("parameters") or {"type": "object"}


def plan_tools(functions: list[dict] | None, choice: str | None, named: str | None = None, *,
               parallel: bool | None = None, parser: str | None = None,
               resumable: bool = False, constrained: bool = False) -> ToolPlan | None:
    """How a request's tools are served, for both front doors (None: no tool calls to
    produce). ``functions``: the tools' function definitions (``name``, ``parameters``,
    ``strict``...); ``choice``: "none" | "auto" | "required" (None: auto once tools are
    given, OpenAI's default), or ``named``: the function to call; ``parser``: the model's
    tool-call format, for auto; ``constrained``: the request also asked for a structured
    output. Raises InvalidRequestError naming the field."""
    if named is not None and choice is not None:
        raise InvalidRequestError("tool_choice: a mode or a function name, not both")
    if not functions:
        if choice not in (None, "none") or named is not None:
            raise InvalidRequestError("tool_choice: needs tools")
        if parallel is not None:
            raise InvalidRequestError("parallel_tool_calls: needs tools")
        return None
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: function names must be unique")
    choice = "named" if named is not None else choice or "auto"
    if choice not in ("none", "auto", "required", "named"):
        raise InvalidRequestError(f"tool_choice: none, auto, required or a function name, "
                                  f"got {choice!r}")
    if choice == "none":
        return None
    if resumable:
        raise InvalidRequestError("tools: not with a resumable request")
    if choice == "auto":
        if parser is None:
            raise InvalidRequestError(
                "tool_choice: auto needs the model's tool-call format, and this model's "
                "chat template has none; ask for tool_choice \"required\" or a named "
                "function (enforced for any model), or start the server with "
                f"--tool-call-parser ({' / '.join(PARSERS)})")
        if any(f.get("strict") for f in functions):
            # Arguments are enforced only where the output is a call; auto's is free text.
            raise InvalidRequestError("tools: strict arguments need tool_choice "
                                      "\"required\" or a named function (with auto the "
                                      "model writes its calls freely)")
        return ToolPlan("auto", parser=parser, parallel=parallel is not False)
    if constrained:
        raise InvalidRequestError("tool_choice: a required or named tool call is itself a "
                                  "structured output; not with another structured output")
    if choice == "required":
        return ToolPlan("required", parallel=parallel is not False)
    if named not in names:
        raise InvalidRequestError(f"tool_choice: no tool named {named!r}")
    return ToolPlan("named", name=named)


def tool_constraint(plan: ToolPlan | None, functions: list[dict]) -> StructuredOutput | None:
    """The structured output that enforces ``plan`` (None for auto / no plan). Raises
    InvalidRequestError naming ``tools`` when a function's parameters do not compile."""
    if plan is None or plan.mode == "auto":
        return None
    schema = (required_schema(functions, plan.parallel) if plan.mode == "required"
              else named_schema(next(f for f in functions if f["name"] == plan.name)))
    try:
        return StructuredOutput("json_schema", json.dumps(schema))
    except ValueError as e:
        raise InvalidRequestError(f"tools: {e}") from None


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output as (content, tool calls). A call that does not parse stays content;
    without ``plan.parallel`` only the first call is kept."""
    content, calls = _parse(plan, text)
    return content, calls if plan.parallel else calls[:1]


def _parse(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    if plan.mode == "named":
        return None, [ToolCall(plan.name, text)]
    if plan.mode == "required":
        try:
            calls = [_call(c, "parameters") for c in json.loads(text)]
        except (json.JSONDecodeError, TypeError):  # cut by max_tokens: nothing to call
            return text, []
        return None, [c for c in calls if c is not None]
    if plan.parser == "hermes":
        calls, kept = [], text
        for m in _HERMES_CALL.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
                kept = kept.replace(m.group(0), "", 1)
        return (kept.strip() or None) if calls else text, calls
    body = text.strip()
    body = body[len(_PYTHON_TAG):] if body.startswith(_PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in body.split(";"):
        try:
            call = _call(json.loads(part), "parameters")
        except json.JSONDecodeError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


class ToolCallStream:
    """``required`` / ``auto`` while streaming: ``feed`` returns the content safe to send now
    (``auto``: text before any tool call, minus a tail that may be the start of one;
    ``required``: nothing, the output is the calls); ``finish`` parses what was held back,
    returning (content still to send, calls)."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._held = ""
        self._in_call = plan.mode == "required"

    def feed(self, delta: str) -> str:
        if self._in_call:
            self._held += delta
            return ""
        text = self._held + delta
        opener = _HERMES_OPEN if self._plan.parser == "hermes" else None
        if opener is None:  # llama3_json: a call is the whole output, "{" or the tag first
            if not text.strip():
                self._held = text
                return ""
            if text.lstrip().startswith(("{", _PYTHON_TAG[:len(text.lstrip())])):
                self._in_call, self._held = True, text
                return ""
            self._held = ""
            return text
        at = text.find(opener)
        if at >= 0:
            self._in_call, self._held = True, text[at:]
            return text[:at]
        keep = next((k for k in range(min(len(opener) - 1, len(text)), 0, -1)
                     if opener.startswith(text[-k:])), 0)  # a tag may be arriving
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if not self._in_call:
            return held, []
        content, calls = parse_calls(self._plan, held)
        return content or "", calls
