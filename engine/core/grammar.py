"""Structured outputs' grammar bookkeeping: a request's spec, its compiled grammar, and where
its output stands in that grammar.

A spec (``StructuredOutput``) holds a request's generated text to a JSON schema, any JSON
object, a regex, one of a list of strings, or an EBNF / GBNF grammar. At every sampling step
the executor keeps only the tokens a constrained row's ``GrammarState`` allows next
(``engine/executor/grammar_mask.py``); after the token is sampled, the scheduler feeds it to
the state. Whichever engine samples does this: the prefill worker for a request's first
token, the decode worker for the rest, the colocated engine for all.

Why xgrammar (``python -m bench.studies.grammar_mask``, docs/benchmarks.md): on this CPU and
the default model's 49k-token vocabulary, walking JSON documents token by token, its mask
costs 4-16 us per token inside strings as well as between them; llguidance's is as cheap
between strings but up to 120-230 us inside bounded (``maxLength``) strings, 5-7 ms a step at
32 constrained rows; outlines-core needs seconds to index "any JSON object".

Who owns what: ``StructuredOutput`` is the request's spec (a frozen value in
``SamplingParams``; validated where the request is built, so a grammar that does not compile
is refused at the door, naming the problem). ``Grammars`` belongs to one engine (its tokenizer
as xgrammar sees it, and a compiler with a cache); it makes one ``GrammarState`` per
constrained request, which the request owns. A request that migrates or resumes elsewhere
arrives with the tokens it already generated at the end of its prompt
(``SamplingParams.sample_index_offset`` of them): its new state consumes them first, so the
grammar continues where it was. Nothing here imports torch or xgrammar at module level: the
request side (``SamplingParams``, the scheduler) loads without them.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the request side (SamplingParams, the scheduler) stays free of torch
    import torch

__all__ = ["STRUCTURED_KINDS", "GrammarState", "Grammars", "StructuredOutput", "choice_spec"]

# json_object: any JSON object; json_schema: ``spec`` is the schema (JSON text); regex: a
# regular expression the whole output matches; choice: ``spec`` is a JSON list of strings, the
# output is one of them; grammar: EBNF in xgrammar's dialect (GBNF's: ``root ::= ...``).
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # what a request may send; a bigger grammar is refused at the door
# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): xgrammar's default allows any run of
# whitespace between tokens, and a sampled model then fills documents with newlines until
# max_tokens.
_JSON_LAYOUT = {"any_whitespace": False, "separators": (", ", ": ")}


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. Raises ValueError naming the problem when the
    kind is unknown or the spec does not compile (xgrammar's own message)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output: kind must be one of "
                             f"{', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output: {self.kind} spec must be a string")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured output: the {self.kind} is {len(self.spec)} "
                             f"characters, more than {MAX_SPEC_CHARS}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured output: {self.kind} needs a spec")
        _grammar(self.kind, self.spec)  # compiles (cached) or raises ValueError

    def grammar(self):
        """The xgrammar ``Grammar`` (cached per spec)."""
        return _grammar(self.kind, self.spec)


def preload() -> None:
    """Import the grammar library now (about a second) rather than inside the first
    constrained request, which would stall the thread that validates it (a router's event
    loop). Quiet when the library is missing: the first constrained request says so."""
    with contextlib.suppress(ImportError):
        import xgrammar  # noqa: F401


def choice_spec(choices: Sequence[str]) -> str:
    """The ``spec`` of a ``choice`` output: the strings as a JSON list."""
    return json.dumps(list(choices))


def _clean(e: Exception) -> str:
    """xgrammar's error message without its "[time] /path/file.cc:line: " prefix."""
    text = str(e).strip()
    return text.split(": ", 1)[1].strip() if text.startswith("[") and ": " in text else text


def _ebnf_string(s: str) -> str:
    """``s`` as an EBNF string literal (JSON's escapes, which xgrammar's parser reads)."""
    return json.dumps(s, ensure_ascii=False)


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, spec: str):
    """``kind`` + ``spec`` as an xgrammar ``Grammar`` (tokenizer-free), checked to build
    (ValueError naming the problem if not)."""
    try:
        import xgrammar as xgr
    except ImportError as e:  # a declared dependency; only a broken install lacks it
        raise ValueError(f"structured output needs the xgrammar package: {e}") from None
    what = kind.replace("_", " ")
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured output: the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("structured output: a JSON schema must be an object")
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError:
            choices = None
        if not isinstance(choices, list) or not choices \
                or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("structured output: choice must be a non-empty list of "
                             "non-empty strings")
    try:
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), **_JSON_LAYOUT)
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec, **_JSON_LAYOUT)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(map(_ebnf_string, choices)))
        return xgr.Grammar.from_ebnf(spec)
    except RuntimeError as e:
        raise ValueError(f"structured output: the {what} does not compile: {_clean(e)}") from None


class GrammarState:
    """One request's position in its grammar. Owned by the request; the engine loop alone
    touches it (sampling fills its mask, the scheduler feeds it each sampled token)."""

    def __init__(self, matcher, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._m = matcher
        self._vocab = vocab_size
        self._stops = list(stop_token_ids)
        self._stopped = False
        self.error = ""

    def accept(self, token_id: int) -> bool:
        """Consume a sampled token; False (and ``error`` set) when the grammar refuses it."""
        if not self._m.accept_token(token_id):
            self.error = f"token {token_id} does not continue the grammar"
            return False
        # Complete, and nothing but a stop token could follow: the request ends here rather
        # than spending a step on the one token left (a complete "[0-9]+" can still grow).
        self._stopped = self._m.is_terminated() or (self._m.is_completed()
                                                    and self._only_stops_left())
        return True

    def try_advance(self, token_id: int) -> bool:
        """Take a draft token tentatively (``rollback`` undoes it); False if refused.
        Leaves ``stopped`` and ``error`` alone: only ``accept`` settles a token."""
        return bool(self._m.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` ``try_advance``s."""
        if num_tokens:
            self._m.rollback(num_tokens)

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading ``token_ids`` the grammar would take in turn (the state is left
        where it was): drafts past that could never be accepted."""
        n = 0
        for t in token_ids:
            if not self._m.accept_token(t):
                break
            n += 1
        self.rollback(n)
        return n

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits no further token (the request ends)."""
        return self._stopped

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (one bit per token)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def _only_stops_left(self) -> bool:
        import torch

        words = torch.full((1, (self._vocab + 31) // 32), -1, dtype=torch.int32)
        self._m.fill_next_token_bitmask(words, 0)
        for t in self._stops:  # clear the stop tokens' bits: is anything else allowed?
            words[0, t // 32] &= ~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF
        return not bool(words.any())


class Grammars:
    """One engine's grammar machinery: its tokenizer as xgrammar sees it and a compiler that
    caches compiled grammars (built on first use: engines that never see a constrained
    request pay nothing)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """``tokenizer``: an ``engine.text.tokenizer.Tokenizer`` (its Hugging Face tokenizer is
        asked for at the first compile: a lazy one loads then)."""
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._eos = list(eos_token_ids)
        self._compiler = None

    def _compile(self, structured: StructuredOutput):
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer.hf_tokenizer,
                                                      vocab_size=self._vocab,
                                                      stop_token_ids=self._eos or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        return self._compiler.compile_grammar(structured.grammar())

    def start(self, structured: StructuredOutput, generated: Sequence[int] = ()) -> GrammarState:
        """A state at the grammar's start, after ``generated`` (tokens this request generated
        before, elsewhere). Raises ValueError when the grammar refuses those tokens."""
        import xgrammar as xgr

        try:
            compiled = self._compile(structured)
        except RuntimeError as e:
            raise ValueError(f"structured output: {_clean(e)}") from None
        state = GrammarState(xgr.GrammarMatcher(compiled), self._vocab, self._eos)
        for t in generated:
            if not state.accept(t):
                raise ValueError(f"structured output: the tokens generated so far do not "
                                 f"match the grammar ({state.error})")
        return state
