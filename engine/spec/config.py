"""``SpeculativeConfig``: what ``--speculative-config`` / ``LLM(speculative_config=...)`` ask for,
in vLLM's names, checked before any weight loads (no torch here: the router parses it too).

Methods:

- ``ngram`` (prompt lookup): the last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens are
  looked up earlier in the sequence (prompt and output) and the ``num_speculative_tokens``
  tokens that followed their latest earlier occurrence are proposed. No second model; wins
  where the output repeats its input (rewriting, editing, code, extraction).

- ``draft_model``: a smaller model (``model``: a directory or a GGUF, as ``--model`` takes)
  sharing the served model's vocabulary proposes greedily, ``num_speculative_tokens`` forward
  passes a step (``quantization``: as ``--quantization`` for the draft; default ``auto``).
- ``self_draft``: the served model's own weights, quantized (``quantization``: ``int4``, the
  default, or ``int8``), are the draft: no second model to find, and drafts a quantized copy of
  the target agrees with most of the time. It pays where the target is served unquantized
  (fp32 / bf16); for a target already served in 4-bit blocks (the default model's GGUF) the
  draft costs what the target does.

EAGLE, Medusa and MTP heads are refused by name: a config is never accepted and then ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "self_draft")
NOT_YET = ("eagle", "eagle3", "medusa", "mtp")
DRAFT_QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
MAX_SPECULATIVE_TOKENS = 16  # a verification step's rows per sequence stay a small chunk
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "adaptive", "model", "quantization"}
_METHOD_KEYS = {"ngram": {"prompt_lookup_max", "prompt_lookup_min"},
                "draft_model": {"model", "quantization"}, "self_draft": {"quantization"}}


@dataclass(frozen=True)
class SpeculativeConfig:
    """One engine's speculative decoding (module docstring).

    ``num_speculative_tokens`` is the most drafts a sequence gets in one step; with
    ``adaptive`` (the default) the engine proposes fewer, down to none, where the measured
    acceptance and the step's cost say more would not pay (``engine.spec.controller``)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    adaptive: bool = True
    model: str | None = None  # draft_model: the draft's directory or GGUF
    quantization: str | None = None  # draft_model (default auto), self_draft (default int4)

    def __post_init__(self) -> None:
        if self.method in NOT_YET:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported yet "
                             f"(supported: {', '.join(METHODS)})")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r} "
                             f"(supported: {', '.join(METHODS)})")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer "
                             f"in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, "
                                 f"got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) is greater than "
                             f"prompt_lookup_max ({hi})")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, "
                             f"got {self.adaptive!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the "
                             "draft's directory or GGUF)")
        q = self.quantization
        if q is not None:
            allowed = ("int4", "int8") if self.method == "self_draft" else DRAFT_QUANTIZATIONS
            if q not in allowed:
                raise ValueError(f"speculative_config: quantization for {self.method} must be "
                                 f"one of {', '.join(allowed)}, got {q!r}")

    @property
    def draft_quantization(self) -> str:
        """The draft's ``--quantization`` (draft_model, self_draft)."""
        return self.quantization or ("int4" if self.method == "self_draft" else "auto")

    def to_dict(self) -> dict[str, Any]:
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
               "adaptive": self.adaptive}
        if self.method == "ngram":
            out.update(prompt_lookup_max=self.prompt_lookup_max,
                       prompt_lookup_min=self.prompt_lookup_min)
        if self.model is not None:
            out["model"] = self.model
        if self.method != "ngram":
            out["quantization"] = self.draft_quantization
        return out


def parse_speculative_config(value: SpeculativeConfig | dict | str | None
                             ) -> SpeculativeConfig | None:
    """``value`` as given on a command line (JSON text), in a config file or by a caller (a
    dict), or already parsed -> a checked config, or None (off). Raises ValueError naming
    what is wrong: bad JSON, an unknown key, a missing or unsupported method, a bad value."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config: expected a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(sorted(_KEYS))})")
    if "method" not in value:
        raise ValueError("speculative_config: 'method' is required "
                         f"(supported: {', '.join(METHODS)})")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config: 'num_speculative_tokens' is required")
    method = value["method"]
    stray = sorted(set(value) - {"method", "num_speculative_tokens", "adaptive"}
                   - _METHOD_KEYS.get(method, set()))
    if method in _METHOD_KEYS and stray:
        raise ValueError(f"speculative_config: {', '.join(map(repr, stray))} do(es) not apply "
                         f"to method {method!r}")
    return SpeculativeConfig(**value)
