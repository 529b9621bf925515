"""The OpenAI request bodies the HTTP front door accepts, and their translation to ``GenerateInput``.

Pydantic models for ``/v1/completions`` and ``/v1/chat/completions``: OpenAI's fields plus vLLM's
extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``), and pdcluster's ``resumable``. A field
that is not declared here is refused (``extra="forbid"``: a 400 naming it), never accepted and
ignored; the fields of OpenAI's own API refused on purpose are listed, with why, in
``router.frontdoor.openai.refused``. Shape errors are pydantic's (the app maps them to 400);
semantic ones (a declared field this server does not implement yet, batch prompt, bad sampling
value) raise ValueError / InvalidRequestError from ``to_inputs``, which makes one
``GenerateInput`` per choice (``n`` for each prompt of a batch).

The request models carry no docstrings on purpose: FastAPI publishes a model's docstring as its
description in ``/openapi.json``, which would change what that endpoint serves.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.contract import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_PRIORITY,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MIN_PRIORITY,
    SamplingParams,
)
from engine.core.grammar import StructuredOutput, choice_spec
from router.contract import GenerateInput, InvalidRequestError
from router.frontdoor.openai.tools import ToolPlan, plan_tools, tool_constraint

__all__ = ["ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "DrainRequest",
           "MAX_USER_CHARS", "TokenizeRequest"]

# The published schema (/openapi.json) states the ranges SamplingParams enforces, so a
# schema-valid body is one the server takes (checked by a schema fuzzer in the tests).
_TokenId = Annotated[int, Field(ge=0)]
_StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
_Penalty = Annotated[float, Field(ge=-2, le=2)]
_MaxTokens = Annotated[int, Field(ge=1)]
# Choices one request may ask for (n x prompts): each is a generation of its own.
MAX_CHOICES = 64
# OpenAI's ``user`` states no limit; this bounds what one request writes into its trace.
MAX_USER_CHARS = 512


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    # OpenAI's field is "schema"; pydantic reserves the name, hence the alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always matches the schema, strict or not


class _ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchemaFormat | None = None

    def to_structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.json_schema is None:
            raise InvalidRequestError("response_format: type json_schema needs json_schema")
        return StructuredOutput("json_schema", json.dumps(self.json_schema.schema_ or {}))


class _StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its constraints."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None

    def to_structured(self) -> StructuredOutput:
        given = [k for k in ("json_", "json_object", "regex", "choice", "grammar")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs: give exactly one of json, "
                                      "json_object, regex, choice, grammar")
        kind = given[0]
        if kind == "json_":
            spec = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return StructuredOutput("json_schema", spec)
        if kind == "json_object":
            return StructuredOutput("json_object")
        if kind == "choice":
            return StructuredOutput("choice", choice_spec(self.choice))
        return StructuredOutput(kind, getattr(self, kind))


class _SamplingFields(BaseModel):
    """OpenAI sampling fields plus vLLM's extensions; None means "server default"."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: _MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    stop: _StopString | Annotated[list[_StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]+$")],
                               Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[_TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool | None = None
    # vLLM's: each token in logprobs as "token_id:<id>" rather than its text
    return_tokens_as_token_ids: bool = False
    # vLLM's: lower runs first (router/contract.py GenerateInput.priority)
    priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] = 0
    # The output matches a JSON schema / any JSON object (OpenAI's; vLLM takes it on
    # completions too), or vLLM's structured_outputs (json, regex, choice, grammar)
    response_format: _ResponseFormat | None = None
    structured_outputs: _StructuredOutputs | None = None
    # pdcluster: keep generating if the client goes away; resume with GET /v1/streams/{id}
    resumable: bool = False
    # OpenAI's end-user id: on every generation's trace (enduser.id) and in the front door's
    # recent-requests log (/v1/cluster's slowest_recent); nothing else acts on it.
    user: Annotated[str, Field(max_length=MAX_USER_CHARS)] | None = None

    def top_logprobs_k(self) -> int | None:
        """How many alternatives each token's logprobs list (0: the token alone), or None
        when the request asked for no logprobs; each endpoint spells it its own way."""
        raise NotImplementedError

    def structured_output(self) -> StructuredOutput | None:
        """What the output must match (``response_format`` or ``structured_outputs``, not
        both). Raises InvalidRequestError naming the field and the problem."""
        fmt = self.response_format.to_structured if self.response_format is not None else None
        so = self.structured_outputs.to_structured if self.structured_outputs is not None \
            else None
        if fmt is not None and so is not None and self.response_format.type != "text":
            raise InvalidRequestError("structured_outputs: not together with a "
                                      "response_format other than text")
        for name, make in (("response_format", fmt), ("structured_outputs", so)):
            if make is None:
                continue
            try:
                out = make()
            except InvalidRequestError:
                raise
            except ValueError as e:  # the spec does not compile: say which field and why
                raise InvalidRequestError(f"{name}: {e}") from None
            if out is not None:
                return out
        return None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage-only chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far (vLLM's
        ``stream_options.continuous_usage_stats``, with ``include_usage``)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def generations_per_prompt(self) -> int:
        """Generations run per prompt: ``n`` (completions' ``best_of`` runs more, keeps n)."""
        return self.n

    def expand(self, prompts: list[dict], request_id: str, sampling: SamplingParams
               ) -> list[GenerateInput]:
        """One GenerateInput per generation, in OpenAI's order (prompt by prompt,
        ``generations_per_prompt`` each): ``prompts`` are GenerateInput's prompt fields.
        Generation 0 keeps ``request_id``, generation k is ``{request_id}-{k}``; a seeded
        request's generation j of a prompt samples with ``seed + j``, so they differ and each
        is reproducible."""
        per = self.generations_per_prompt
        name = "best_of" if per != self.n else "n"
        if len(prompts) * per > MAX_CHOICES:
            raise InvalidRequestError(f"{name}: {per} generations of {len(prompts)} prompts is "
                                      f"more than {MAX_CHOICES}")
        if self.resumable and len(prompts) * per > 1:
            raise InvalidRequestError("resumable: only for one choice of one prompt")
        out = []
        for p, prompt in enumerate(prompts):
            for j in range(per):
                k = p * per + j
                params = sampling if sampling.seed is None or j == 0 else dataclasses.replace(
                    sampling, seed=(sampling.seed + j) % (MAX_SEED + 1))
                out.append(GenerateInput(params, request_id=request_id if k == 0
                                         else f"{request_id}-{k}", model=self.model,
                                         resumable=self.resumable, user=self.user,
                                         priority=self.priority, **prompt))
        return out

    def to_sampling(self, default_max_tokens: int | None) -> SamplingParams:
        """Raises ValueError naming an unsupported or bad field."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed with stream=true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats \
                and not self.stream_options.include_usage:
            raise InvalidRequestError("stream_options.continuous_usage_stats: needs "
                                      "include_usage=true")
        k = self.top_logprobs_k()
        if k is not None and self.resumable:
            # A resumed stream is replayed from its log, which keeps token ids only.
            raise InvalidRequestError("logprobs: not available on a resumable request")
        kw: dict[str, Any] = {k: getattr(self, k) for k in (
            "max_tokens", "temperature", "top_p", "seed", "top_k", "min_tokens", "ignore_eos",
            "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "min_p",
            "repetition_penalty") if getattr(self, k) is not None}
        if self.logit_bias:
            kw["logit_bias"] = dict(self.logit_bias)  # SamplingParams checks the keys are ids
        if k is not None:
            kw["logprobs"] = k
        structured = self.structured_output()
        if structured is not None:
            kw["structured"] = structured
        if "max_tokens" not in kw and default_max_tokens is not None:
            kw["max_tokens"] = default_max_tokens
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids is not None:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        return SamplingParams(**kw)


class CompletionRequest(_SamplingFields):
    # A text, token ids, or a batch: several texts or several token-id lists.
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[_TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_CHOICES)]
             | Annotated[list[Annotated[list[_TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_CHOICES)])
    echo: bool = False  # each choice's text starts with its prompt
    # best_of generations per prompt, the n with the highest mean token logprob returned
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    # OpenAI's legacy shape: an int, the alternatives per token (OpenAI allows 5, vLLM 20)
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    @property
    def generations_per_prompt(self) -> int:
        return self.best_of or self.n

    def to_inputs(self, request_id: str) -> list[GenerateInput]:
        """One input per choice (``expand``). Raises ValueError naming a bad field."""
        if self.best_of is not None:
            if self.best_of < self.n:
                raise InvalidRequestError(f"best_of: must be >= n ({self.n}), got {self.best_of}")
            if self.stream:  # OpenAI's rule: the best is known only at the end
                raise InvalidRequestError("best_of: not with stream=true")
        sampling = self.to_sampling(default_max_tokens=None)
        if self.best_of is not None and self.best_of > self.n and sampling.logprobs is None:
            sampling = dataclasses.replace(sampling, logprobs=0)  # to rank (not returned)
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs too
            sampling = dataclasses.replace(sampling, prompt_logprobs=self.logprobs)
        return self.expand(self._prompts(), request_id, sampling)

    def _prompts(self) -> list[dict]:
        """The batch as GenerateInput prompt fields (one prompt is a batch of one)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [{"text": prompt}]
        if isinstance(prompt[0], int):
            return [{"token_ids": list(prompt)}]
        return [{"text": p} if isinstance(p, str) else {"token_ids": list(p)} for p in prompt]


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]  # images and audio: not served by a text model
    text: str | None = None


class _CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class _MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: _CalledFunction

    def to_dict(self) -> dict:
        # Chat templates index the arguments as a mapping (Hermes / Qwen / Llama render them
        # with tojson), so they get the parsed object where the text is JSON.
        try:
            args: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            args = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": args}}


class _ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[_ContentPart] | None = None
    tool_calls: list[_MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def to_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text or "" for p in content)
        out = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            if self.role != "assistant":
                raise InvalidRequestError("messages: tool_calls only on an assistant message")
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            if self.role != "tool":
                raise InvalidRequestError("messages: tool_call_id only on a tool message")
            out["tool_call_id"] = self.tool_call_id
        return out


_FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class _FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: _FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # the arguments always match the schema when it is enforced


class _Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _FunctionDef


class _ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: _FunctionName


class _NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _ChosenFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[_ChatMessage], Field(min_length=1)]
    max_completion_tokens: _MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[_Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | _NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: more variables the chat template sees (e.g. Qwen3's {"enable_thinking": false})
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=32)] | None = None

    def _functions(self) -> list[dict]:
        return [t.function.model_dump(exclude_none=True) for t in self.tools or ()]

    def tool_plan(self, parser: str | None) -> ToolPlan | None:
        """How ``tool_choice`` is served (None: no tool calls to produce). ``parser``: the
        model's tool-call format, for ``auto``. Raises InvalidRequestError naming the field."""
        choice = self.tool_choice
        named = choice.function.name if isinstance(choice, _NamedToolChoice) else None
        constrained = (self.response_format is not None and self.response_format.type != "text"
                       or self.structured_outputs is not None)
        return plan_tools(self._functions() if self.tools is not None else None,
                          None if named is not None else choice, named,
                          parallel=self.parallel_tool_calls, parser=parser,
                          resumable=bool(self.resumable), constrained=constrained)

    def top_logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_inputs(self, request_id: str, max_model_len: int,
                  chat_template: Callable[..., list[int]],
                  plan: ToolPlan | None = None) -> list[GenerateInput]:
        """One input per choice (``expand``). Raises ValueError naming a bad field.
        ``chat_template(messages, tools=..., chat_template_kwargs=...)`` (the backend's
        tokenize) renders the prompt when tools or template variables are given (the template
        must see them) and sizes the default max_tokens;
        ``plan``: ``tool_plan``'s answer."""
        messages = [m.to_dict() for m in self.messages]
        if not messages:
            raise InvalidRequestError("messages: at least one message is required")
        tools = ([{"type": "function", "function": t.function.model_dump(exclude_none=True)}
                  for t in self.tools] if self.tools else None)
        kwargs = self.chat_template_kwargs or None
        rendered = bool(tools or kwargs)  # the prompt goes as the ids the template made
        ids = chat_template(messages, tools=tools, chat_template_kwargs=kwargs) if rendered or (
            self.max_tokens is None and self.max_completion_tokens is None) else None
        # max_completion_tokens is OpenAI's newer name; max_tokens wins when both are given.
        default_max = self.max_completion_tokens
        if self.max_tokens is None and default_max is None:
            # OpenAI's default: generate until the context is full (or a stop).
            default_max = max(1, max_model_len - len(ids))
        sampling = self.to_sampling(default_max_tokens=default_max)
        constraint = tool_constraint(plan, self._functions())
        if constraint is not None:
            sampling = dataclasses.replace(sampling, structured=constraint)
        # With tools (or template variables) the prompt goes as the ids the template made.
        prompt = {"token_ids": ids} if rendered else {"messages": messages}
        return self.expand([prompt], request_id, sampling)


# ---- vLLM's /tokenize and /detokenize ------------------------------------------------------

class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[_ChatMessage], Field(min_length=1)] | None = None
    # vLLM's: the tokenizer's special tokens (BOS, ...) added or not; unset: as a generation
    # does (a prompt: added; messages: not, the chat template holds its own)
    add_special_tokens: bool | None = None

    def to_prompt(self) -> str | list[dict]:
        """The text, or the messages as the chat template takes them; exactly one is given."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("prompt / messages: give exactly one")
        if self.messages is not None:
            if not self.messages:
                raise InvalidRequestError("messages: at least one message is required")
            return [m.to_dict() for m in self.messages]
        return self.prompt


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[_TokenId]


class DrainRequest(BaseModel):
    """``POST /v1/cluster/workers/{id}/drain`` (an empty body: the defaults)."""

    model_config = ConfigDict(extra="forbid")
    # A decode worker's streams still running this long after the start move elsewhere
    # (None: router.control.drain.DEFAULT_MIGRATE_AFTER_S).
    migrate_after_s: float | None = Field(default=None, ge=0, le=86_400)
    wait: bool = False  # answer once the worker is drained (200), not at once (202)
