"""The OpenAI request bodies the HTTP front door accepts, and their translation to ``GenerateInput``.

Pydantic models for ``/v1/completions`` and ``/v1/chat/completions``: OpenAI's fields plus vLLM's
extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``), and pdcluster's ``resumable``. A field
that is not declared here is refused (``extra="forbid"``: a 400 naming it), never accepted and
ignored. Shape errors are pydantic's (the app maps them to 400); semantic ones (a declared field
this server does not implement yet, batch prompt, bad sampling value) raise ValueError /
InvalidRequestError from ``to_input``.

The request models carry no docstrings on purpose: FastAPI publishes a model's docstring as its
description in ``/openapi.json``, which would change what that endpoint serves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from engine.request import SamplingParams
from router.contract import GenerateInput, InvalidRequestError

__all__ = ["ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "TokenizeRequest"]


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """OpenAI sampling fields plus vLLM's extensions; None means "server default"."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    # pdcluster: keep generating if the client goes away; resume with GET /v1/streams/{id}
    resumable: bool = False

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage-only chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling(self, default_max_tokens: int | None) -> SamplingParams:
        """Raises ValueError naming an unsupported or bad field."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed with stream=true")
        if self.n != 1:
            raise InvalidRequestError(f"n must be 1 (got {self.n}): one choice per request")
        if self.logprobs:
            raise InvalidRequestError("logprobs are not supported")
        kw: dict[str, Any] = {k: getattr(self, k) for k in (
            "max_tokens", "temperature", "top_p", "seed", "top_k", "min_tokens", "ignore_eos",
            "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "min_p",
            "repetition_penalty") if getattr(self, k) is not None}
        if self.logit_bias:
            kw["logit_bias"] = dict(self.logit_bias)  # SamplingParams checks the keys are ids
        if "max_tokens" not in kw and default_max_tokens is not None:
            kw["max_tokens"] = default_max_tokens
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids is not None:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        return SamplingParams(**kw)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False

    def to_input(self, request_id: str) -> GenerateInput:
        """Raises ValueError naming an unsupported or bad field."""
        if self.echo:
            raise InvalidRequestError("echo is not supported")
        prompt = self._single_prompt()
        sampling = self.to_sampling(default_max_tokens=None)
        common = dict(request_id=request_id, model=self.model, resumable=self.resumable)
        if isinstance(prompt, str):
            return GenerateInput(sampling, text=prompt, **common)
        return GenerateInput(sampling, token_ids=list(prompt), **common)

    def _single_prompt(self) -> str | list[int]:
        """The one prompt: text or token ids. A list of strings is OpenAI's batch form, of
        which only a batch of one is accepted (one choice per request)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise InvalidRequestError("prompt: one prompt per request (got a batch of "
                                          f"{len(prompt)})")
            return prompt[0]
        return prompt


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    text: str | None = None


class _ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[_ContentPart] | None = None

    def to_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise InvalidRequestError("only text content parts are supported")
            content = "\n".join(p.text or "" for p in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[_ChatMessage]
    max_completion_tokens: int | None = None

    def to_input(self, request_id: str, max_model_len: int,
                 chat_template: Callable[[list[dict]], list[int]]) -> GenerateInput:
        """Raises ValueError naming an unsupported or bad field. ``chat_template`` (the
        backend's) is only called when no max_tokens is given, to size the default."""
        messages = [m.to_dict() for m in self.messages]
        if not messages:
            raise InvalidRequestError("messages: at least one message is required")
        # max_completion_tokens is OpenAI's newer name; max_tokens wins when both are given.
        default_max = self.max_completion_tokens
        if self.max_tokens is None and default_max is None:
            # OpenAI's default: generate until the context is full (or a stop).
            default_max = max(1, max_model_len - len(chat_template(messages)))
        sampling = self.to_sampling(default_max_tokens=default_max)
        return GenerateInput(sampling, messages=messages, request_id=request_id, model=self.model,
                             resumable=self.resumable)


# ---- vLLM's /tokenize and /detokenize ------------------------------------------------------

class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[_ChatMessage] | None = None

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
    tokens: list[int]
