"""Structured outputs: a request's generated text constrained to a grammar (a JSON schema, any
JSON object, a regex, one of a list of strings, or a Lark / GBNF grammar).

At every sampling step a constrained row's logits keep only the tokens its grammar allows next
(a bitmask from llguidance, applied before the sampler's own adjustments); after the token is
sampled, the grammar state consumes it. Whichever engine samples does this: the prefill worker
for a request's first token, the decode worker for the rest, the colocated engine for all.

Why llguidance (``python -m bench.studies.grammar_mask``, docs/benchmarks.md): on this CPU and
the default model's 49k-token vocabulary its mask costs 3-5 us per token (xgrammar's 2-4 us),
applying it to a logits row 29 us (xgrammar's CPU path 200 us on a sparse mask), compiling a
schema 1-2 ms (xgrammar 6-7 ms, outlines-core 72 ms, and 6.7 s for "any JSON object"); it is
one wheel with no dependencies (xgrammar brings triton and a TVM runtime), and it takes Lark
grammars with regex lexemes and converts GBNF.

Who owns what: ``StructuredOutput`` is the request's spec (a frozen value in
``SamplingParams``; validated where the request is built, so a grammar that does not compile
is refused at the door, naming the problem). ``Grammars`` belongs to one engine (its tokenizer
as llguidance sees it); it makes one ``GrammarState`` per constrained request, which the
request owns. A request that migrates or resumes elsewhere arrives with the tokens it already
generated at the end of its prompt (``SamplingParams.sample_index_offset`` of them): its new
state consumes them first, so the grammar continues where it was.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the request side (SamplingParams, the scheduler) stays free of torch
    import torch

__all__ = ["STRUCTURED_KINDS", "GrammarState", "Grammars", "StructuredOutput", "choice_spec",
           "mask_logits"]

# json_object: any JSON object; json_schema: ``spec`` is the schema (JSON text); regex: a
# regular expression the whole output matches; choice: ``spec`` is a JSON list of strings, the
# output is one of them; grammar: a Lark grammar (llguidance's dialect), or GBNF (``::=``).
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # what a request may send; a bigger grammar is refused at the door
# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): llguidance's default allows any run of
# whitespace between tokens, and a sampled model then fills documents with newlines until
# max_tokens. A schema may choose otherwise in its "x-guidance" (applied after these).
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. Raises ValueError naming the problem when the
    kind is unknown or the spec does not compile (llguidance's own message)."""

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

    def grammar(self) -> str:
        """The llguidance grammar (cached per spec)."""
        return _grammar(self.kind, self.spec)


def choice_spec(choices: Sequence[str]) -> str:
    """The ``spec`` of a ``choice`` output: the strings as a JSON list."""
    return json.dumps(list(choices))


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, spec: str) -> str:
    """``kind`` + ``spec`` as an llguidance grammar, checked to compile (ValueError if not)."""
    try:
        import llguidance
    except ImportError as e:  # a declared dependency; only a broken install lacks it
        raise ValueError(f"structured output needs the llguidance package: {e}") from None
    M = llguidance.LLMatcher
    if kind == "json_object":
        grammar = M.grammar_from_json_schema({"type": "object"}, defaults=_JSON_LAYOUT)
    elif kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured output: the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("structured output: a JSON schema must be an object")
        grammar = M.grammar_from_json_schema(schema, defaults=_JSON_LAYOUT)
    elif kind == "regex":
        grammar = M.grammar_from_regex(spec)
    elif kind == "choice":
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError:
            choices = None
        if not isinstance(choices, list) or not choices \
                or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("structured output: choice must be a non-empty list of "
                             "non-empty strings")
        lark = "start: " + " | ".join(json.dumps(c) for c in choices)
        grammar = M.grammar_from_lark(lark)
    else:
        from llguidance.gbnf_to_lark import any_to_lark

        try:  # Lark as it is; GBNF (llama.cpp's, xgrammar's EBNF) converted
            lark = any_to_lark(spec)
        except Exception as e:
            raise ValueError(f"structured output: the grammar is neither Lark nor GBNF: "
                             f"{e}") from None
        grammar = M.grammar_from_lark(lark)
    err = M.validate_grammar(grammar)
    if err:
        raise ValueError(f"structured output: the {kind.replace('_', ' ')} does not compile: "
                         f"{err.strip()}")
    return grammar


class GrammarState:
    """One request's position in its grammar. Owned by the request; the engine loop alone
    touches it (sampling fills its mask, the scheduler feeds it each sampled token)."""

    def __init__(self, matcher) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        """Consume a sampled token; False (and ``error`` set) when the grammar refuses it."""
        return self._m.consume_token(token_id)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits no further token (the request ends)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (one bit per token)."""
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(self._m, bitmask, row)


class Grammars:
    """One engine's grammar machinery: its tokenizer as llguidance sees it (built on first
    use: engines that never see a constrained request pay nothing)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf = hf_tokenizer
        self._vocab = vocab_size
        self._eos = list(eos_token_ids)
        self._tok = None

    def _tokenizer(self):
        if self._tok is None:
            import llguidance.hf

            self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab,
                                                     eos_token=self._eos[0] if self._eos else None)
        return self._tok

    def start(self, structured: StructuredOutput, generated: Sequence[int] = ()) -> GrammarState:
        """A state at the grammar's start, after ``generated`` (tokens this request generated
        before, elsewhere). Raises ValueError when the grammar does not build for this
        tokenizer or refuses those tokens."""
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer(), structured.grammar(), log_level=0)
        if m.is_error():
            raise ValueError(f"structured output: {m.get_error()}")
        if generated and not m.consume_tokens(list(generated)):
            raise ValueError(f"structured output: the tokens generated so far do not match "
                             f"the grammar: {m.get_error()}")
        return GrammarState(m)


def mask_logits(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Keep, in each row ``rows[i]`` of ``logits [N, vocab]``, only the tokens ``states[i]``
    allows next (in place; the others become -inf)."""
    import torch

    from engine import cpu_ops

    # Our own apply: llguidance's is a torch.compile'd function (seconds of compiling on the
    # first constrained request; 29 us a row after), ours a C loop that skips all-ones words.
    bitmask = torch.full((len(rows), (logits.shape[1] + 31) // 32), -1, dtype=torch.int32)
    for i, s in enumerate(states):
        s.fill_mask(bitmask, i)
    cpu_ops.apply_bitmask(logits, rows, bitmask)
