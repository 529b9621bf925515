"""Tokenizer of the default model: chat template, EOS ids, validation; and the incremental
detokenizer: equal to a full decode for any chunking, stop strings never leak."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.text.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.weights.resolve import resolve_model


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    # Same cache path as test_weights.py, so the default model is converted once per session.
    cache: Path = tmp_path_factory.getbasetemp() / "pdcluster-model-cache"
    return Tokenizer.from_dir(resolve_model(None, cache_dir=cache).model_dir)


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feed ``ids`` in random chunks (including empty ones); returns every delta, flush last."""
    deltas, i = [], 0
    while i < len(ids):
        k = rng.randrange(0, 5)
        deltas.append(detok.update(ids[i:i + k]).delta_text)
        i += k
    deltas.append(detok.flush())
    return deltas


def test_chat_template_renders_chatml(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert ids[-1] != 2  # the generation prompt is open, not closed with <|im_end|>
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                        add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False).endswith("What is 2+2?<|im_end|>\n")


def test_special_ids_and_encode(tok):
    assert 2 in tok.eos_token_ids
    assert tok.decode([2], skip_special_tokens=False) == "<|im_end|>"
    assert tok.bos_token_id == 1 and tok.vocab_size == 49152
    ids = tok.encode("Hello, wörld! 你好 🎉")
    assert ids[0] != tok.bos_token_id  # SmolLM2 does not add a BOS
    assert tok.decode(ids) == "Hello, wörld! 你好 🎉"
    assert tok.decode(ids + [2]) == "Hello, wörld! 你好 🎉"  # special tokens skipped by default


@pytest.mark.parametrize("messages", [
    "hello",
    [],
    ["hello"],
    [{"content": "no role"}],
    [{"role": "user"}],
    [{"role": "user", "content": 5}],
])
def test_bad_chat_messages_raise(tok, messages):
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(messages)


def test_incremental_detokenizer_equals_full_decode(tok):
    rng = random.Random(1234)
    # Multi-byte characters that byte-level BPE splits across tokens, plus ordinary text.
    corpus = ["héllo wörld", "你好，世界", "🎉🚀 emoji ✓", "naïve café — “quotes”", " plain ascii. "]
    for trial in range(150):
        if trial % 2:
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        else:
            text = "".join(rng.choice(corpus) for _ in range(rng.randrange(1, 5)))
            ids = tok.encode(text)
            ids.insert(rng.randrange(len(ids) + 1), 2)  # a special token in the middle
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens=skip)
        deltas = _stream(detok, ids, rng)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == expected == detok.text, (ids, skip)
        if "\ufffd" not in expected:
            # A character split across tokens never surfaces as U+FFFD mid-stream.
            assert all("\ufffd" not in d for d in deltas)


def test_stop_strings_truncate_and_never_leak(tok):
    rng = random.Random(7)
    body = "The answer is 42. END of story, and STOP here."
    ids = tok.encode(body)
    for stops, include, expected in [
        (["END"], False, "The answer is 42. "),
        (["END"], True, "The answer is 42. END"),
        (["STOP", " is 4"], False, "The answer"),
        (["not there"], False, body),
        (["story, and STOP"], False, "The answer is 42. END of "),
    ]:
        for _ in range(20):
            detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
            streamed, i = "", 0
            while i < len(ids) and not detok.stopped:
                k = rng.randrange(1, 4)
                streamed += detok.update(ids[i:i + k]).delta_text
                i += k
                # What a client has seen is never retracted: no partial stop string leaks.
                assert expected.startswith(streamed), (stops, streamed)
            streamed += detok.flush()
            assert streamed == expected == detok.text, stops
            assert detok.stopped == (expected != body)
            first_hit = min(stops, key=lambda s: body.find(s) if s in body else len(body))
            assert detok.stop_str == (first_hit if detok.stopped else None)
        # After stopping, more tokens change nothing.
        if detok.stopped:
            after = detok.update(tok.encode(" more"))
            assert after.stopped and after.delta_text == "" and detok.text == expected


def test_partial_stop_prefix_is_held_back_then_released(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["<END>"])
    # Feed "a <EN" then "X": the held-back "<EN" is released once it cannot be a stop string.
    first = detok.update(tok.encode("a <EN"))
    assert first.delta_text == "a " and not first.stopped
    second = detok.update(tok.encode("X"))
    assert second.delta_text == "<ENX" and not second.stopped
    third = detok.update(tok.encode(" <E"))
    assert third.delta_text == " "
    assert detok.flush() == "<E"  # end of generation: the held-back tail belongs to the text
    assert detok.text == "a <ENX <E"


def test_invalid_stop_strings_raise(tok):
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tok, [], stop=[""])


def test_a_lazy_tokenizer_knows_the_eos_ids_at_once_and_loads_on_first_use(
        tok, tmp_path_factory, tmp_path):
    """A worker's engine (token ids only) starts without loading the Hugging Face tokenizer:
    the EOS ids come from the files and equal the eager tokenizer's; everything else loads on
    first use and answers as the eager one does."""
    import json
    import shutil

    from engine.text.tokenizer import LazyTokenizer, load_tokenizer

    cache: Path = tmp_path_factory.getbasetemp() / "pdcluster-model-cache"
    d = Path(resolve_model(None, cache_dir=cache).model_dir)
    lazy = load_tokenizer(d, lazy=True)
    assert isinstance(lazy, LazyTokenizer)
    assert lazy.eos_token_ids == tok.eos_token_ids and lazy._loaded is None
    text = "The capital of France is Paris. <|im_end|>"
    assert lazy.encode(text) == tok.encode(text) and lazy._loaded is not None
    ids = tok.encode(text)
    assert lazy.decode(ids) == tok.decode(ids)
    assert (lazy.vocab_size, lazy.bos_token_id, lazy.has_chat_template) == (
        tok.vocab_size, tok.bos_token_id, tok.has_chat_template)
    msgs = [{"role": "user", "content": "hi"}]
    assert lazy.apply_chat_template(msgs) == tok.apply_chat_template(msgs)

    # The eos token written as an AddedToken dict reads the same.
    other = tmp_path / "model"
    shutil.copytree(d, other, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = other / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data["eos_token"] = {"content": data["eos_token"], "special": True}
    cfg.write_text(json.dumps(data))
    lazy = LazyTokenizer(other)
    assert lazy.eos_token_ids == tok.eos_token_ids and lazy._loaded is None
    # One the vocabulary does not hold: the files do not say it plainly, so it loads at once.
    data["eos_token"] = "<no such token>"
    cfg.write_text(json.dumps(data))
    assert LazyTokenizer(other)._loaded is not None


def test_template_kwargs_reach_the_template_and_cannot_replace_its_own(tok):
    """``chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``) are variables the template
    sees; the ones the renderer sets itself (``add_generation_prompt``, ...) stay its own."""
    import copy

    t = copy.copy(tok)
    t.hf_tokenizer = copy.deepcopy(tok.hf_tokenizer)
    t.hf_tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    plain = t.decode(t.apply_chat_template(msgs))
    off = t.decode(t.apply_chat_template(msgs, template_kwargs={"enable_thinking": False}))
    assert (plain, off) == ("hi\n>", "hi\n><think></think>")
    kept = t.decode(t.apply_chat_template(msgs, template_kwargs={"add_generation_prompt": False}))
    assert kept == "hi\n>"
