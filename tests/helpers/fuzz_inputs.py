"""Random requests for the front doors' fuzz tests: plausible values mixed with every kind of
bad one (wrong types, out of range, too many, too long, outside the vocabulary), and a
background greedy stream that must come through them untouched.

Generation sizes are kept small (``max_tokens`` is either tiny or refused) so an example
costs a few decode steps, not a whole context.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hypothesis import strategies as st

SAMPLING_FIELDS = ("seed", "temperature", "top_p", "top_k", "min_tokens", "max_tokens", "stop",
                   "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_p", "logit_bias")

_ints = st.one_of(st.integers(-3, 40), st.sampled_from([2**31, 2**32, 2**62, -2**62, 10**30]))
_floats = st.one_of(st.floats(-2, 3), st.floats(-1e6, 1e6), st.sampled_from([0.0, 1.0, 1e30]))
_stop_strings = st.builds(lambda c, n: c * n, st.sampled_from(["a", ".", "the", "\n"]),
                          st.integers(0, 300))


def _token_ids(vocab: int):
    return st.integers(-5, vocab + 5) | st.sampled_from([vocab - 1, vocab, 10**9])


def json_bodies(vocab: int):
    """A /v1/completions body: a text or token-id prompt, and up to 4 sampling fields whose
    values may be of any JSON type. No NaN/Infinity: JSON has none (that is malformed-JSON
    territory, tested on its own)."""
    anything = st.one_of(st.none(), st.booleans(), _ints, _floats, st.text(max_size=4))
    values = {
        "seed": _ints | anything,
        "temperature": _floats | anything,
        "top_p": _floats | anything,
        "top_k": _ints | anything,
        "min_tokens": st.integers(-2, 8) | anything,
        "max_tokens": st.integers(-2, 6) | st.sampled_from([10**7, 2.5, "4"]),
        "stop": _stop_strings | st.lists(_stop_strings, max_size=20) | anything,
        "stop_token_ids": st.lists(_token_ids(vocab), max_size=4)
        | st.just(list(range(300))) | anything,
        "ignore_eos": st.booleans() | anything,
        **{name: _floats | anything for name in ("presence_penalty", "frequency_penalty",
                                                   "repetition_penalty", "min_p")},
        "logit_bias": st.dictionaries(_token_ids(vocab).map(str) | st.text(max_size=3),
                                      _floats | anything, max_size=3) | anything,
    }
    prompt = st.one_of(st.text(max_size=24), st.lists(_token_ids(vocab), max_size=6),
                       st.just([1] * 20_000))
    fields = st.lists(st.sampled_from(SAMPLING_FIELDS), max_size=4, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: values[n] for n in names}))
    return st.builds(lambda p, f: {"prompt": p, **f}, prompt, fields)


def proto_fields(vocab: int):
    """(prompt, sampling kwargs) for the gRPC request, within each proto field's wire type
    (int32, int64, float32 with NaN and infinities, uint32 lists)."""
    int32 = st.integers(-3, 40) | st.sampled_from([-2**31, 2**31 - 1])
    float32 = st.floats(width=32) | st.sampled_from([0.0, 1.0, 0.5])
    values = {
        "seed": st.integers(-2**63, 2**63 - 1) | st.integers(0, 100),
        "temperature": float32,
        "top_p": float32,
        "top_k": int32,
        "min_tokens": st.integers(-2, 8) | int32,
        "max_tokens": st.integers(-2, 6) | st.just(2**31 - 1),
        "stop": st.lists(_stop_strings, max_size=20),
        "stop_token_ids": st.lists(st.integers(0, vocab + 5) | st.just(2**32 - 1), max_size=4)
        | st.just(list(range(300))),
        "ignore_eos": st.booleans(),
        **{name: float32 for name in ("presence_penalty", "frequency_penalty",
                                      "repetition_penalty", "min_p")},
        "logit_bias": st.dictionaries(st.integers(0, vocab + 5) | st.just(2**32 - 1), float32,
                                      max_size=3),
    }
    prompt = st.one_of(st.text(max_size=24), st.lists(st.integers(0, vocab + 5), max_size=6))
    fields = st.lists(st.sampled_from(SAMPLING_FIELDS), max_size=4, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: values[n] for n in names}))
    return st.tuples(prompt, fields)


def names_a_field(message: str, given: dict) -> bool:
    """Whether a refusal names what was wrong: one of the fields the request set, or its
    prompt (empty, outside the vocabulary, longer than the context)."""
    return any(name in message for name in (*given, "prompt"))


class BackgroundStream:
    """Runs ``produce()`` (a good request) on a thread while the fuzz runs; ``result()`` is
    what it returned, or re-raises what it raised."""

    def __init__(self, produce: Callable[[], object]) -> None:
        self._produce = produce
        self._result: object = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="fuzz-bystander")
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._produce()
        except BaseException as e:  # handed to the test thread by result()
            self._error = e

    def running(self) -> bool:
        return self._thread.is_alive()

    def result(self, timeout_s: float):
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the good request did not finish in {timeout_s} s"
        if self._error is not None:
            raise self._error
        return self._result
