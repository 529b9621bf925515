"""OpenAI's response JSON for one request's choices: the whole body of a non-streamed response
and the payload of each streamed (SSE) chunk, for ``/v1/completions`` and
``/v1/chat/completions``. A choice is one generation; a request has ``n`` per prompt.

Pure: no I/O and no backend. A ``Renderer`` is made per request (it carries the response id,
creation time and model id every payload repeats); the two endpoints differ only in how one
choice looks, so each subclass supplies just that. Key order is part of the wire format (clients
diff responses and tests compare bytes), so dicts are built in OpenAI's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from engine.contract import TokenLogprob
from router.contract import GenerationChunk, Usage
from router.frontdoor.openai.logprobs import CompletionLogprobs, TokenNames, chat_logprobs
from router.frontdoor.openai.reasoning import ReasoningStream, split_reasoning
from router.frontdoor.openai.tools import (
    ToolCall,
    ToolCallStream,
    ToolPlan,
    new_call_id,
    parse_calls,
)

__all__ = ["ChatRenderer", "Collected", "CompletionRenderer", "Renderer", "usage_json"]


@dataclass
class Collected:
    """A whole (non-streamed) generation: one choice."""

    request_id: str
    index: int = 0  # the choice's place in OpenAI's order
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # echo with logprobs: the prompt's

    def add(self, c: GenerationChunk) -> None:
        """Append one chunk of this choice's stream."""
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        if c.prompt_logprobs is not None:
            self.prompt_logprobs = list(c.prompt_logprobs)
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(c.logprobs)
        if c.finished:
            self.finish_reason = c.finish_reason
            if c.usage is not None:
                self.prompt_tokens = c.usage.prompt_tokens
                self.completion_tokens = c.usage.completion_tokens


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Renderer:
    """The envelope every payload shares; subclasses say what one choice looks like."""

    response_id: str
    created: int  # unix seconds
    model_id: str
    # How logprobs name tokens; None when the request asked for no logprobs.
    names: TokenNames | None = None

    whole_object: ClassVar[str]  # OpenAI's "object" of a non-streamed response
    chunk_object: ClassVar[str]  # ... and of each streamed chunk

    def whole(self, outs: list[Collected], usage: Usage) -> dict:
        """The non-streamed response body: every choice, by index."""
        return self._envelope(self.whole_object,
                              [self._whole_choice(o) for o in sorted(outs, key=lambda o: o.index)],
                              usage=usage_json(usage.prompt_tokens, usage.completion_tokens))

    def chunk(self, c: GenerationChunk, index: int = 0) -> dict | None:
        """One SSE payload of choice ``index``, or None for a chunk that adds nothing a client
        sees (no text, no logprobs, not the last)."""
        if not c.text and not c.finished and not self._has_more(index) \
                and not (self.names is not None and c.token_ids):
            return None
        choice = self._chunk_choice(c, index)
        if choice is None:  # held back (a tool call being assembled)
            return None
        return self._envelope(self.chunk_object, [choice])

    def _has_more(self, index: int) -> bool:
        """Whether choice ``index`` has text of the renderer's own to send (an echo)."""
        return False

    def usage_chunk(self, usage: Usage) -> dict:
        """The trailing choice-less chunk of ``stream_options.include_usage``."""
        return self._envelope(self.chunk_object, [],
                              usage=usage_json(usage.prompt_tokens, usage.completion_tokens))

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.model_id, "choices": choices, **extra}

    def _whole_choice(self, out: Collected) -> dict:
        raise NotImplementedError

    def _chunk_choice(self, c: GenerationChunk, index: int) -> dict | None:
        raise NotImplementedError


@dataclass
class CompletionRenderer(Renderer):
    whole_object: ClassVar[str] = "text_completion"
    chunk_object: ClassVar[str] = "text_completion"

    # ``echo``: choice index -> its prompt's text, which that choice's text starts with (sent
    # with its first streamed chunk).
    echo: dict[int, str] = field(default_factory=dict)
    _echoed: set[int] = field(default_factory=set, init=False)
    _logprobs: dict[int, CompletionLogprobs] = field(default_factory=dict, init=False)

    def _logprobs_json(self, index: int, lps: list[TokenLogprob] | None,
                       prompt: list[TokenLogprob] | None = None) -> dict | None:
        """A choice's logprobs for ``lps`` (its new tokens), the echoed prompt's entries
        first when ``prompt`` is given (its first chunk, with echo)."""
        if self.names is None or (lps is None and prompt is None):
            return None
        if index not in self._logprobs:  # offsets count from the choice's first character
            self._logprobs[index] = CompletionLogprobs(self.names, 0)
        return self._logprobs[index].render(list(prompt or []) + list(lps or []))

    def _whole_choice(self, out: Collected) -> dict:
        return {"index": out.index, "text": self.echo.get(out.index, "") + out.text,
                "logprobs": self._logprobs_json(out.index, out.logprobs or [],
                                                out.prompt_logprobs if self.echo else None),
                "finish_reason": out.finish_reason}

    def _has_more(self, index: int) -> bool:
        return index in self.echo and index not in self._echoed

    def _chunk_choice(self, c: GenerationChunk, index: int) -> dict:
        text = c.text
        if self._has_more(index):
            text = self.echo[index] + text
            self._echoed.add(index)
        prompt = c.prompt_logprobs if index in self.echo else None
        return {"index": index, "text": text,
                "logprobs": self._logprobs_json(index, c.logprobs, prompt),
                "finish_reason": c.finish_reason if c.finished else None}


@dataclass
class ChatRenderer(Renderer):
    whole_object: ClassVar[str] = "chat.completion"
    chunk_object: ClassVar[str] = "chat.completion.chunk"

    # How tool calls come out of the text (None: the request produces none).
    tools: ToolPlan | None = None
    # How reasoning comes out of the text (router.frontdoor.openai.reasoning; None: off).
    reasoning: str | None = None
    _thoughts: dict[int, ReasoningStream] = field(default_factory=dict, init=False)
    # OpenAI names the role once per choice, in the first delta a client sees of it.
    _sent_role: set[int] = field(default_factory=set, init=False)
    _calls: dict[int, ToolCallStream] = field(default_factory=dict, init=False)
    _named_ids: dict[int, str] = field(default_factory=dict, init=False)  # choice -> call id

    def _whole_choice(self, out: Collected) -> dict:
        text, message = out.text, {"role": "assistant"}
        if self.reasoning is not None:
            thought, content = split_reasoning(self.reasoning, out.text)
            text, message["reasoning_content"] = content or "", thought
        message["content"] = text
        reason = out.finish_reason
        if self.tools is not None:
            content, calls = parse_calls(self.tools, text)
            if calls:
                message = {**message, "content": content,
                           "tool_calls": [c.to_json() for c in calls]}
                reason = self.tools.finish_reason if reason == "stop" else reason
        return {"index": out.index, "message": message,
                "logprobs": self._logprobs_json(out.logprobs or []), "finish_reason": reason}

    def _logprobs_json(self, lps: list[TokenLogprob] | None) -> dict | None:
        if self.names is None or lps is None:
            return None
        return chat_logprobs(lps, self.names)

    def _chunk_choice(self, c: GenerationChunk, index: int) -> dict | None:
        reason = c.finish_reason if c.finished else None
        delta: dict = {}
        new = c.text
        if self.reasoning is not None:  # the thinking goes out as reasoning_content
            thoughts = self._thoughts.setdefault(index, ReasoningStream(self.reasoning))
            thought, new = thoughts.feed(c.text)
            if c.finished:
                more, rest = thoughts.finish()
                thought, new = thought + more, new + rest
            if thought:
                delta["reasoning_content"] = thought
        if self.tools is None:
            # The final chunk carries only the finish_reason unless it also brought text.
            if new or (not c.finished and self.reasoning is None):
                delta["content"] = new
        elif self.tools.mode == "named":  # the text is the arguments: stream it as such
            call: dict = {"index": 0, "function": {"arguments": new}}
            if index not in self._named_ids:  # the first delta names the call
                self._named_ids[index] = new_call_id()
                call = ToolCall(self.tools.name, new, self._named_ids[index]).to_json(0)
            delta["tool_calls"] = [call]
        else:  # required / auto: content streams, calls go out whole once complete
            stream = self._calls.setdefault(index, ToolCallStream(self.tools))
            text = stream.feed(new)
            calls: list[ToolCall] = []
            if c.finished:
                rest, calls = stream.finish()
                text += rest
                if calls and reason == "stop":
                    reason = self.tools.finish_reason
            if text or (c.finished and not calls):
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [call.to_json(i) for i, call in enumerate(calls)]
        if not delta and not c.finished and (self.tools is not None or self.reasoning):
            return None  # held back (a tag or a tool call being assembled)
        if index not in self._sent_role:
            delta = {"role": "assistant", **delta}
            self._sent_role.add(index)
        return {"index": index, "delta": delta, "logprobs": self._logprobs_json(c.logprobs),
                "finish_reason": reason}
