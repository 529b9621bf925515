"""Tokenizer, chat template and incremental (streaming) detokenization.

``Tokenizer`` wraps a model directory's Hugging Face fast tokenizer (local files only) and adds
what serving needs: chat-template rendering to token ids with input validation, and the full
set of end-of-sequence ids. ``IncrementalDetokenizer`` turns one request's output tokens into
text deltas as they are generated, handling UTF-8 characters split across tokens and stop
strings, without ever streaming a partial stop string.

Decoding never applies ``clean_up_tokenization_spaces`` (a WordPiece-era rewrite of spaces that
corrupts BPE output and is not prefix-consistent, so it cannot be streamed).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Tokenizer:
    """A model's tokenizer. Build with :meth:`from_dir`; thread-safe for reads."""

    def __init__(self, hf_tokenizer: Any, extra_eos_token_ids: Sequence[int] = ()) -> None:
        self.hf_tokenizer = hf_tokenizer
        # The Rust tokenizer: decoding through it directly skips per-call Python overhead.
        self._backend = hf_tokenizer.backend_tokenizer
        eos = [] if hf_tokenizer.eos_token_id is None else [hf_tokenizer.eos_token_id]
        eos += [i for i in extra_eos_token_ids if i not in eos]
        self._eos_token_ids = tuple(int(i) for i in eos)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load the fast tokenizer saved in ``model_dir`` (never downloads).

        EOS ids are the tokenizer's ``eos_token_id`` plus every ``eos_token_id`` in
        ``generation_config.json`` / ``config.json``. Raises ValueError if there is no tokenizer.
        """
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        try:
            hf_tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"cannot load a tokenizer from {str(model_dir)!r}: {e}") from e
        if not getattr(hf_tok, "is_fast", False):
            raise ValueError(f"tokenizer in {str(model_dir)!r} is not a fast tokenizer")
        return cls(hf_tok, _config_eos_ids(model_dir))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (tokenizer EOS first, then generation_config ones)."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included.

        May be smaller than the model's (padded) embedding ``vocab_size``.
        """
        return len(self.hf_tokenizer)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf_tokenizer, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS etc. only if the model does."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def tool_call_format(self) -> str | None:
        """The tool-call format the chat template teaches its model: "hermes"
        (``<tool_call>{...}</tool_call>``), "llama3_json" (a bare ``{"name", "parameters"}``
        after ``<|python_tag|>``), or None (the template knows no tools)."""
        template = self.hf_tokenizer.chat_template if self.has_chat_template else None
        if not isinstance(template, str):
            return None
        if "<tool_call>" in template:
            return "hermes"
        if "<|python_tag|>" in template:
            return "llama3_json"
        return None

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            add_special_tokens: bool = False,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Render ``messages`` ([{"role": str, "content": str}, ...]) with the model's template.

        The rendered text already holds any BOS the template wants, so it is encoded without
        adding special tokens unless ``add_special_tokens`` (vLLM's /tokenize flag: the
        tokenizer's own on top of the template's); ``template_kwargs``: more variables the
        template sees (OpenAI-compatible servers' ``chat_template_kwargs``, e.g. Qwen3's
        ``enable_thinking``; they cannot replace the ones above). Raises ValueError if the
        model has no chat
        template, the messages are malformed, or the template rejects them (e.g. roles that do
        not alternate).
        """
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        _validate_messages(messages)
        try:
            extra = {k: v for k, v in (template_kwargs or {}).items()
                     if k not in ("tokenize", "add_generation_prompt", "tools", "messages",
                                  "conversation", "chat_template")}
            text = self.hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                tools=tools, **extra)
        except Exception as e:  # jinja2 TemplateError from raise_exception() in the template
            raise ValueError(f"chat template rejected the messages: {e}") from e
        return self.encode(text, add_special_tokens=add_special_tokens)


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a non-empty string 'role'")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}] needs a string 'content', got {type(content).__name__}")


@dataclass(frozen=True)
class DetokenizerUpdate:
    """What one ``update`` produced: text safe to stream now, and whether the output stopped
    (``stop_str``: the stop string that hit; None when a stop token id ended it)."""

    delta_text: str
    stopped: bool
    stop_str: str | None


class IncrementalDetokenizer:
    """Streams one request's output tokens as text. One instance per request; not thread-safe.

    Invariant: after all tokens are fed and :meth:`flush` is called, ``text`` equals
    ``tokenizer.decode(output_ids, skip_special_tokens)`` (truncated at the first stop string,
    if any), and the concatenated ``delta_text``s plus ``flush()`` equal ``text``, however the
    ids were chunked.

    A token of ``stop_token_ids`` ends the output where it stands (the engine stops on it):
    vLLM's rule, its text is left out unless ``include_stop_str_in_output``, as a stop
    string's is; ``output_token_ids`` still holds it (it was generated, and usage counts it).

    Per token it decodes only a short window (prefix_offset..end), so the cost does not grow
    with the output length. A window whose text ends in U+FFFD (an incomplete UTF-8 character)
    is not emitted until a later token completes it.

    ``prompt_token_ids`` is kept for callers (e.g. logging); output text is decoded from output
    tokens alone so it matches ``decode(output_ids)`` exactly.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, stop_token_ids: Sequence[int] = ()) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self._decode = tokenizer._backend.decode
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # window start: a boundary where decoding may restart exactly
        self._read_offset = 0  # tokens before this are already in self._text
        self._text = ""
        self._emitted = 0  # chars of self._text already returned as delta_text
        self._checked = 0  # stop strings cannot start before self._checked - max_stop_len + 1
        self._stopped = False
        self._stop_str: str | None = None

    @property
    def text(self) -> str:
        """All output text decoded so far, including text still held back from the stream."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def stop_str(self) -> str | None:
        return self._stop_str

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Feed newly generated ids; returns the text that is now safe to stream.

        A stop token among them ends the output: the update is stopped (``stop_str`` None)
        and carries everything held back, as ``flush`` would. After a stop, further calls
        return an empty, stopped update.
        """
        if self._stopped:
            return DetokenizerUpdate("", True, self._stop_str)
        at = next((i for i, t in enumerate(new_token_ids) if t in self.stop_token_ids), None)
        if at is None:
            return self._feed(new_token_ids)
        keep = at + 1 if self.include_stop_str_in_output else at
        delta = self._feed(new_token_ids[:keep]).delta_text
        if not self._stopped:  # no stop string came first: the stop token ends the output
            delta += self.flush()
            self._stopped = True
        # Kept as generated, never decoded: the text was cut before it (or includes it).
        self._token_ids.extend(new_token_ids[keep:at + 1])
        return DetokenizerUpdate(delta, True, self._stop_str)

    def _feed(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        if self._stopped:
            return DetokenizerUpdate("", True, self._stop_str)
        self._token_ids.extend(new_token_ids)
        ids, skip = self._token_ids, self.skip_special_tokens
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        new_text = self._decode(ids[self._prefix_offset:], skip_special_tokens=skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._text += new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
        return self._advance(final=False)

    def update_each(self, new_token_ids: Sequence[int]) -> tuple[DetokenizerUpdate, int]:
        """``update``, a token at a time when several arrive together (speculative
        decoding's accepted drafts): a stop string ends the output at the token that
        completes it, as it would have had they come one by one. Returns the update and how
        many of the tokens it used: the caller drops the rest (they came after the stop)."""
        if len(new_token_ids) <= 1 or not self.stop or self._stopped:
            return self.update(new_token_ids), len(new_token_ids)
        delta = ""
        for i in range(len(new_token_ids)):
            upd = self.update(new_token_ids[i:i + 1])
            delta += upd.delta_text
            if upd.stopped:
                return DetokenizerUpdate(delta, True, upd.stop_str), i + 1
        return DetokenizerUpdate(delta, False, None), len(new_token_ids)

    def flush(self) -> str:
        """End of generation: returns the text still held back (partial stop-string prefixes,
        a trailing incomplete character); afterwards ``text`` is final."""
        if not self._stopped and self._read_offset < len(self._token_ids):
            ids, skip = self._token_ids, self.skip_special_tokens
            prefix_text = self._decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
            new_text = self._decode(ids[self._prefix_offset:], skip_special_tokens=skip)
            self._text += new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset = len(ids)
        return self._advance(final=True).delta_text

    def _advance(self, final: bool) -> DetokenizerUpdate:
        text = self._text
        if self.stop and not self._stopped:
            start = max(0, self._checked - self._max_stop_len + 1)
            hit_at, hit = -1, None
            for s in self.stop:
                i = text.find(s, start)
                if i != -1 and (hit_at == -1 or i < hit_at):
                    hit_at, hit = i, s
            self._checked = len(text)
            if hit is not None:
                self._stopped, self._stop_str = True, hit
                end = hit_at + len(hit) if self.include_stop_str_in_output else hit_at
                self._text = text = text[:end]
                final = True
        end = len(text) if final else len(text) - self._held_back(text)
        delta = text[self._emitted:end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return DetokenizerUpdate(delta, self._stopped, self._stop_str)

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that could begin a stop string."""
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held


class LazyTokenizer(Tokenizer):
    """A ``Tokenizer`` that loads the Hugging Face tokenizer on first use (a grammar, a chat
    template, text in or out), for engines that are given token ids and never detokenize
    (the workers): loading it imports ``transformers``, ~2 s of CPU at every worker start,
    which a restarted worker would take from the survivors absorbing its streams. What every
    engine needs at start, the end-of-sequence ids, is read off the files the eager path reads
    (``tokenizer_config.json``'s ``eos_token`` looked up in ``tokenizer.json``, plus the
    config files' ``eos_token_id``); a model directory without ``tokenizer.json`` loads at
    once. Thread-safe."""

    def __init__(self, model_dir: Path) -> None:
        import threading

        self._dir = model_dir
        self._lock = threading.Lock()
        self._loaded: Tokenizer | None = None
        eos = _eos_from_files(model_dir)
        if eos is None:  # no tokenizer.json, or an eos the files do not name plainly
            eos = self._load().eos_token_ids
        self._eos_token_ids = eos

    def _load(self) -> Tokenizer:
        with self._lock:
            if self._loaded is None:
                self._loaded = Tokenizer.from_dir(self._dir)
            return self._loaded

    @property
    def loaded(self) -> bool:
        return self._loaded is not None

    def warm(self) -> None:
        """Load now (an idle engine does: ``LLMEngine.idle_warmup``). Never raises: a tokenizer
        that cannot load fails the first request that needs it instead."""
        try:
            self._load()
        except Exception as e:
            log.warning("tokenizer of %s did not load: %r", self._dir, e)

    @property
    def hf_tokenizer(self) -> Any:  # type: ignore[override]
        return self._load().hf_tokenizer

    @property
    def _backend(self) -> Any:  # type: ignore[override]
        return self._load()._backend


def _eos_from_files(model_dir: Path) -> tuple[int, ...] | None:
    """The eager ``Tokenizer``'s ``eos_token_ids`` from the files alone, or None when they do
    not say it plainly (then the caller loads the tokenizer)."""
    import tokenizers

    tok_file, cfg_file = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    if not tok_file.is_file() or not cfg_file.is_file():
        return None
    with cfg_file.open() as f:
        token = json.load(f).get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    eos: list[int] = []
    if token is not None:
        if not isinstance(token, str):
            return None
        tid = tokenizers.Tokenizer.from_file(str(tok_file)).token_to_id(token)
        if tid is None:
            return None
        eos.append(tid)
    eos += [i for i in _config_eos_ids(model_dir) if i not in eos]
    return tuple(int(i) for i in eos)


def _config_eos_ids(model_dir: Path) -> list[int]:
    """Every ``eos_token_id`` in ``generation_config.json`` / ``config.json``, in that order."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            with path.open() as f:
                eos = json.load(f).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return ids


def load_tokenizer(model_dir: str | Path, lazy: bool = False) -> Tokenizer | None:
    """The model's tokenizer, or None for a directory without one (tiny test models are
    driven by token ids only). ``lazy``: a ``LazyTokenizer`` (engines that never touch text
    unless a request asks for a grammar)."""
    d = Path(model_dir)
    if not any((d / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    return LazyTokenizer(d) if lazy else Tokenizer.from_dir(d)
