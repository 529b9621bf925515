"""The requests a plan is made for: a JSONL trace, or a named synthetic workload.

A trace line is one request: its arrival (``arrival_s`` seconds, or ``timestamp`` in
milliseconds as in the Mooncake traces), its prompt length (``prompt_tokens`` or
``input_length``) and its output length (``output_tokens`` or ``output_length``); other
fields (``hash_ids``, ...) are ignored. Arrivals are made relative to the first.

Named workloads (seeded, Poisson arrivals at ``rate`` per second for ``duration_s``):
``chat`` (prompts ~256 tokens, answers ~128: decode-heavy), ``rag`` (prompts ~1024, answers
~32: prefill-heavy), ``mixed`` (half each).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NAMED_WORKLOADS", "TraceRequest", "load_workload", "named_workload", "read_trace"]

# name -> (prompt mean, output mean); lengths vary +-50% (uniform)
NAMED_WORKLOADS = {"chat": (256, 128), "rag": (1024, 32), "mixed": None}


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def read_trace(path: str | Path) -> list[TraceRequest]:
    """The requests of a JSONL trace, by arrival; ValueError naming the line for a bad one."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            at = float(d["arrival_s"]) if "arrival_s" in d else float(d["timestamp"]) / 1000
            prompt = int(d.get("prompt_tokens", d.get("input_length")))
            output = int(d.get("output_tokens", d.get("output_length")))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path}:{i}: not a trace request ({e!r}); need arrival_s or "
                             "timestamp (ms), prompt_tokens or input_length, output_tokens or "
                             "output_length") from None
        if prompt < 1 or output < 1 or at < 0:
            raise ValueError(f"{path}:{i}: lengths must be >= 1 and the arrival >= 0")
        out.append(TraceRequest(at, prompt, output))
    if not out:
        raise ValueError(f"{path}: no requests")
    out.sort(key=lambda r: r.arrival_s)
    t0 = out[0].arrival_s
    return [TraceRequest(r.arrival_s - t0, r.prompt_tokens, r.output_tokens) for r in out]


def named_workload(name: str, rate: float, duration_s: float, seed: int = 0,
                   max_len: int | None = None) -> list[TraceRequest]:
    """Seeded Poisson arrivals of the named shape (``NAMED_WORKLOADS``); prompts + outputs
    capped at ``max_len`` tokens when given."""
    if name not in NAMED_WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose {', '.join(NAMED_WORKLOADS)} or "
                         "give a JSONL trace file")
    if rate <= 0 or duration_s <= 0:
        raise ValueError("--rate and --duration must be > 0")
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        shape = NAMED_WORKLOADS[name] or NAMED_WORKLOADS[rng.choice(("chat", "rag"))]
        prompt, output = (max(1, round(m * rng.uniform(0.5, 1.5))) for m in shape)
        if max_len is not None and prompt + output > max_len:
            prompt = max(1, max_len - output)
        out.append(TraceRequest(t, prompt, output))


def load_workload(spec: str, rate: float, duration_s: float, seed: int = 0,
                  max_len: int | None = None) -> list[TraceRequest]:
    """A trace file path (``.jsonl`` or any existing file) or a named workload."""
    if spec in NAMED_WORKLOADS:
        return named_workload(spec, rate, duration_s, seed, max_len)
    if not Path(spec).exists():
        raise ValueError(f"--workload {spec!r}: no such file, and not one of "
                         f"{', '.join(NAMED_WORKLOADS)}")
    return read_trace(spec)
