"""Prompt validation and encoding, shared by the engine and the router (one set of rules).

A prompt is text, token ids, or chat messages. Every refusal is a ValueError whose message
names the problem; the router maps it to INVALID_ARGUMENT / HTTP 400.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.contract import SamplingParams
from engine.text.tokenizer import Tokenizer

Prompt = str | list[int] | list[dict]


@dataclass(frozen=True)
class EncodedPrompt:
    token_ids: list[int]
    text: str | None  # the prompt text when it was given as text


class InputProcessor:
    """Encodes prompts and checks they fit the model (context length, vocabulary, KV pool)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 max_kv_tokens: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # The most tokens one request may hold in a worker's KV pool (None: unchecked).
        self.max_kv_tokens = max_kv_tokens

    def encode(self, prompt: Prompt, tools: list[dict] | None = None,
               add_special_tokens: bool | None = None,
               chat_template_kwargs: dict | None = None) -> EncodedPrompt:
        """``prompt`` as token ids; chat messages through the template, which also sees
        ``tools`` (OpenAI's tool definitions). ``add_special_tokens``: whether the tokenizer
        adds its special tokens (BOS, ...); None: as a generation does (text: yes; messages:
        no, the template holds them); ``chat_template_kwargs``: more template variables
        (messages only). Raises ValueError for a bad prompt."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return EncodedPrompt(self._require_tokenizer().encode(
                prompt, add_special_tokens=add_special_tokens is not False), prompt)
        if isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict) for m in prompt):
            return EncodedPrompt(self._require_tokenizer().apply_chat_template(
                list(prompt), tools=tools, add_special_tokens=bool(add_special_tokens),
                template_kwargs=chat_template_kwargs), None)
        if isinstance(prompt, list | tuple):
            if not prompt:
                raise ValueError("prompt is empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("prompt must be a string, a list of token ids, or chat messages")
            self._check_in_vocabulary("prompt", prompt)
            return EncodedPrompt(list(prompt), None)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def decode(self, token_ids: list[int]) -> str:
        """Token ids -> text, special tokens kept (the inverse of ``encode`` for text).
        ValueError for an id outside the vocabulary or a model without a tokenizer."""
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise ValueError("tokens must be a list of token ids")
        self._check_in_vocabulary("tokens", token_ids)
        return self._require_tokenizer().decode(token_ids, skip_special_tokens=False)

    def _check_in_vocabulary(self, name: str, token_ids) -> None:
        """ValueError naming ``name`` and the first id outside [0, vocab_size)."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")

    def validate(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError when the request cannot fit the model's context or KV pool."""
        params.validate()
        self._check_in_vocabulary("stop_token_ids", params.stop_token_ids)
        self._check_in_vocabulary("logit_bias", params.logit_bias)
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens, but the model's context is "
                             f"{self.max_model_len} tokens")
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the model's context ({self.max_model_len} tokens)")
        if self.max_kv_tokens is not None and total > self.max_kv_tokens:
            raise ValueError(f"prompt + max_tokens: the request needs KV for {total} tokens but "
                             f"a worker's cache holds only {self.max_kv_tokens}; raise the KV "
                             f"cache memory")

    def process(self, prompt: Prompt, params: SamplingParams) -> EncodedPrompt:
        enc = self.encode(prompt)
        self.validate(len(enc.token_ids), params)
        return enc

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer: pass prompts as token ids")
        return self.tokenizer
