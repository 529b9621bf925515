"""Structured outputs in the engine: the grammar mask is applied at every sampling step, the
request ends when its grammar is complete, a continued request (its generated tokens at the
end of its prompt, ``sample_index_offset`` of them) resumes the grammar where it was, and a
spec that does not compile is refused naming the problem. On the default model (a real
tokenizer: grammars are over its vocabulary)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.core.grammar import StructuredOutput, choice_spec
from tests.helpers.schemas import SCIENTIST

PROMPT = ("<|im_start|>user\nDescribe one famous scientist.<|im_end|>\n"
          "<|im_start|>assistant\n")
SCHEMA = SCIENTIST


@pytest.fixture(scope="module")
def llm():
    # fp32: test_a_continued_request_resumes_its_grammar compares a request re-prefilled from
    # its own output with one decoded throughout, equal only where prompt and decode steps
    # multiply alike (the default's decode steps may take int8 activations, its prompts fp32)
    return LLM(quantization="none")


def _schema(schema=SCHEMA) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


def test_greedy_and_sampled_outputs_match_their_schema(llm):
    greedy = SamplingParams(max_tokens=120, temperature=0, structured=_schema())
    # Room for a document of escapes (a sampled model writes "\\u00e9"s: 6 characters each).
    sampled = [SamplingParams(max_tokens=400, temperature=1.2, seed=s, structured=_schema())
               for s in range(4)]
    free = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0))[0]
    with pytest.raises(json.JSONDecodeError):  # the model left alone writes prose
        json.loads(free.text)
    for out in llm.generate([PROMPT] * 5, [greedy, *sampled]):
        assert out.finish_reason == "stop", out.text  # ended by the grammar, not by length
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.token_ids[-1] not in llm.engine.eos_token_ids  # ends as the grammar does


@pytest.mark.parametrize("kind,spec,check", [
    ("json_object", "", lambda t: isinstance(json.loads(t), dict)),
    ("choice", choice_spec(["Marie Curie", "Isaac Newton", "Ada Lovelace"]),
     lambda t: t in {"Marie Curie", "Isaac Newton", "Ada Lovelace"}),
    ("regex", r"[A-Z][a-z]+ [A-Z][a-z]+, born [0-9]{4}",
     lambda t: re.fullmatch(r"[A-Z][a-z]+ [A-Z][a-z]+, born [0-9]{4}", t)),
    ("grammar", 'root ::= "yes" | "no"', lambda t: t in {"yes", "no"}),  # GBNF
    ("grammar", 'root ::= answer "!"\nanswer ::= [yY] "es" | [nN] "o"',
     lambda t: t in {"yes!", "Yes!", "no!", "No!"}),
    ("choice", choice_spec(['say "hi"', "back\\slash"]), lambda t: t in {'say "hi"', "back\\slash"}),
], ids=["json_object", "choice", "regex", "gbnf", "gbnf-rules", "choice-escapes"])
def test_each_kind_constrains_the_output(llm, kind, spec, check):
    # (At temperature 1 this small model fills "any JSON object" with \\u escapes until
    # max_tokens: valid so far, never complete. The schema test above samples hotter.)
    for params in (SamplingParams(max_tokens=300, temperature=0),
                   SamplingParams(max_tokens=300, temperature=0.5, seed=7)):
        params.structured = StructuredOutput(kind, spec)
        out = llm.generate([PROMPT], params)[0]
        assert out.finish_reason == "stop", out.text
        assert check(out.text), out.text


def test_a_continued_request_resumes_its_grammar(llm):
    """What a migration or a resume does: the prompt carries the k tokens generated so far,
    ``sample_index_offset`` says so; the rest equals an undisturbed run's and the whole is
    still valid for the schema (without the replay the grammar would start over at ``{``)."""
    whole = llm.generate([PROMPT], SamplingParams(max_tokens=120, temperature=0,
                                                  structured=_schema()))[0]
    prompt = llm.engine.inputs.encode(PROMPT).token_ids
    for k in (1, 5, len(whole.token_ids) // 2):
        rest = llm.generate([prompt + whole.token_ids[:k]], SamplingParams(
            max_tokens=120 - k, temperature=0, structured=_schema(),
            sample_index_offset=k))[0]
        assert whole.token_ids[:k] + rest.token_ids == whole.token_ids
    restart = llm.generate([prompt + whole.token_ids[:5]], SamplingParams(
        max_tokens=115, temperature=0, structured=_schema()))[0]
    assert restart.text.startswith("{")  # no offset: a new document, the old one broken


@pytest.mark.parametrize("kind,spec,message", [
    ("json_schema", "{", "not JSON"),
    ("json_schema", json.dumps({"type": "objekt"}), "objekt"),
    ("regex", "((", "parenthesis is not closed"),
    ("grammar", "root ::= nowhere", 'Rule "nowhere" is not defined'),
    ("choice", "[]", "non-empty list"),
    ("xml", "<a/>", "kind must be one of"),
])
def test_a_spec_that_does_not_compile_is_refused_naming_the_problem(kind, spec, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured=StructuredOutput(kind, spec))


def test_a_batch_mixes_constrained_and_free_rows(llm):
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = llm.generate([PROMPT], free)[0]
    outs = llm.generate([PROMPT] * 3, [free, SamplingParams(max_tokens=120, temperature=0,
                                                            structured=_schema()), free])
    assert outs[0].token_ids == outs[2].token_ids == alone.token_ids  # masks only their row
    jsonschema.validate(json.loads(outs[1].text), SCHEMA)
