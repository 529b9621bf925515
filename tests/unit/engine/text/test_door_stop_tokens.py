"""A stop token id ends the output as vLLM's does: its text is left out of the output unless
``include_stop_str_in_output``, however the ids arrive (one by one, in chunks, with tokens
after it in the same chunk), and a stop string that comes first still wins. Pure: the
default model's tokenizer and ``IncrementalDetokenizer`` only (no engine, no server)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.text.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.weights.resolve import resolve_model

BODY = "The capital of France is Paris. It is a big city."


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    # Same cache path as test_tokenizer.py, so the default model is converted once per session.
    cache: Path = tmp_path_factory.getbasetemp() / "pdcluster-model-cache"
    return Tokenizer.from_dir(resolve_model(None, cache_dir=cache).model_dir)


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> str:
    """Feed ``ids`` in random chunks until the detokenizer stops; every delta, flush last."""
    out, i = "", 0
    while i < len(ids) and not detok.stopped:
        k = rng.randrange(1, 4)
        out += detok.update(ids[i:i + k]).delta_text
        i += k
    return out + detok.flush()


def _stop_at(tok: Tokenizer, ids: list[int], piece: str) -> int:
    """Index of the first token of ``ids`` whose text is ``piece``."""
    return next(i for i, t in enumerate(ids) if tok.decode([t]) == piece)


@pytest.mark.parametrize("include", [False, True], ids=["excluded", "included"])
def test_a_stop_token_ends_the_text_before_it_unless_asked_to_include_it(tok, include):
    ids = tok.encode(BODY)
    at = _stop_at(tok, ids, ".")
    stop_id = ids[at]
    want = tok.decode(ids[:at + 1] if include else ids[:at])
    rng = random.Random(0)
    for _ in range(20):
        detok = IncrementalDetokenizer(tok, [], include_stop_str_in_output=include,
                                       stop_token_ids=[stop_id])
        assert _stream(detok, ids, rng) == want == detok.text
        assert detok.stopped and detok.stop_str is None
        # The stop token was generated (usage counts it); nothing after it is kept.
        assert detok.output_token_ids[-1] == stop_id and len(detok.output_token_ids) <= len(ids)
        assert detok.output_token_ids == ids[:at + 1]
        after = detok.update(tok.encode(" more"))
        assert after.stopped and after.delta_text == "" and detok.text == want


def test_the_stop_tokens_update_releases_what_a_stop_string_prefix_held_back(tok):
    """" Par" could begin the stop string " Paris!": held back until the stop token
    (" Par" then "is" ...) shows it never will; the stopping update carries it."""
    ids = tok.encode(" Paris.")
    detok = IncrementalDetokenizer(tok, [], stop=[" Paris!"], stop_token_ids=[ids[-1]])
    first = detok.update(ids[:-1])
    assert first.delta_text == "" and not first.stopped
    last = detok.update(ids[-1:])
    assert last.stopped and last.delta_text == " Paris" and detok.flush() == ""


def test_a_stop_string_before_the_stop_token_wins(tok):
    ids = tok.encode(BODY)
    stop_id = ids[_stop_at(tok, ids, ".")]
    detok = IncrementalDetokenizer(tok, [], stop=["France"], stop_token_ids=[stop_id])
    out = detok.update(ids).delta_text + detok.flush()
    assert out == "The capital of " and detok.stop_str == "France"


def test_without_stop_token_ids_the_text_is_the_whole_decode(tok):
    ids = tok.encode(BODY)
    detok = IncrementalDetokenizer(tok, [])
    assert _stream(detok, ids, random.Random(1)) == BODY and not detok.stopped
