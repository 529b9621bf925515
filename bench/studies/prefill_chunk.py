"""What ``--max-prefill-chunk`` buys and costs: short prompts arriving behind a long one.

One engine (the default model, one thread, a 2048-token step budget) computes a long prompt
(``--long-len`` tokens, one output token) while short prompts (``--short-len`` tokens, one
output token) arrive behind it: the first as its first step starts, then every ``--gap-ms``. The engine loop is the workers': a request
that arrives while a step runs is admitted at the next step. Each cap is run ``--repeats``
times in turn; per cap it reports the medians of the short prompts' TTFT (mean and max over
them), the long prompt's TTFT and the wall time until everything is done.

    python -m bench.studies.prefill_chunk [--caps none,512,256,128] [--repeats 3] [--out F.json]

Without a cap the long prompt is one step and every short prompt that arrives during it waits
for the whole of it; with a cap the long one takes several steps and each short prompt joins
the next one. What that costs: the long prompt's own TTFT (several smaller steps, each
re-reading the weights) and the steps' total.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class CapRun:
    cap: int | None
    short_ttft_mean_ms: float
    short_ttft_max_ms: float
    long_ttft_ms: float
    wall_ms: float
    steps: int


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def run_once(engine, long_prompt: list[int], shorts: list[list[int]], gap_s: float,
             tag: str) -> tuple[list[float], float, float, int]:
    """Short prompts' TTFTs, the long one's TTFT, the wall time and the steps (seconds)."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request(long_prompt, params, request_id=f"{tag}-long")
    # The first short prompt arrives as the long one's first step starts (the case a cap is
    # for), the others every gap_s after it: each is admitted at the first step after it.
    t0 = time.perf_counter()
    arrivals = {f"{tag}-s{i}": t0 + i * gap_s for i in range(len(shorts))}
    pending = list(zip(arrivals, shorts, strict=True))
    first: dict[str, float] = {}
    steps = 0
    started = False
    while engine.has_unfinished_requests or pending:
        now = time.perf_counter()
        while started and pending and arrivals[pending[0][0]] <= now:
            rid, prompt = pending.pop(0)
            engine.add_request(prompt, params, request_id=rid)
        if not engine.has_unfinished_requests:
            time.sleep(max(0.0, arrivals[pending[0][0]] - now))
            continue
        outs = engine.step()
        started = True
        steps += 1
        end = time.perf_counter()
        for out in outs:
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = end
    wall = time.perf_counter() - t0
    short = [first[rid] - arrivals[rid] for rid in arrivals]
    return short, first[f"{tag}-long"] - t0, wall, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--caps", default="none,512,256,128")
    ap.add_argument("--long-len", type=int, default=1536)
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--shorts", type=int, default=4)
    ap.add_argument("--gap-ms", type=float, default=150.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    caps = [None if c.strip() == "none" else int(c) for c in args.caps.split(",") if c.strip()]
    if any(c is not None and c <= 0 for c in caps) or args.repeats <= 0:
        raise SystemExit("--caps: 'none' or sizes > 0; --repeats > 0")

    from engine import EngineArgs, LLMEngine

    engines = {c: LLMEngine(EngineArgs(model=args.model, num_threads=args.threads,
                                       max_num_batched_tokens=2048, max_prefill_chunk=c,
                                       max_num_seqs=16, detokenize=False,
                                       enable_prefix_caching=False))
               for c in caps}
    vocab = next(iter(engines.values())).model_config.vocab_size
    rng = random.Random(0)
    samples: dict[int | None, list[tuple]] = {c: [] for c in caps}
    for c, eng in engines.items():  # warm-up: every step size once
        run_once(eng, _prompt(rng, args.long_len, vocab),
                 [_prompt(rng, args.short_len, vocab) for _ in range(args.shorts)],
                 args.gap_ms / 1e3, f"warm{c}")
    for r in range(args.repeats):  # caps interleaved: the host's drift hits them alike
        long_prompt = _prompt(rng, args.long_len, vocab)
        shorts = [_prompt(rng, args.short_len, vocab) for _ in range(args.shorts)]
        for c, eng in engines.items():
            samples[c].append(run_once(eng, long_prompt, shorts, args.gap_ms / 1e3, f"r{r}c{c}"))

    rows = []
    for c in caps:
        s = samples[c]
        rows.append(CapRun(
            c, 1e3 * statistics.median(statistics.mean(x[0]) for x in s),
            1e3 * statistics.median(max(x[0]) for x in s),
            1e3 * statistics.median(x[1] for x in s), 1e3 * statistics.median(x[2] for x in s),
            int(statistics.median(x[3] for x in s))))
    base = rows[0]
    print(f"long {args.long_len} tokens, {args.shorts} x {args.short_len}-token prompts from "
          f"its first step on, every {args.gap_ms:g} ms, budget 2048, {args.threads} thread(s); medians of "
          f"{args.repeats}")
    print(f"{'cap':>6} {'short TTFT mean':>16} {'short max':>10} {'long TTFT':>10} "
          f"{'wall':>8} {'steps':>6}")
    for row in rows:
        print(f"{str(row.cap):>6} {row.short_ttft_mean_ms:13.0f} ms {row.short_ttft_max_ms:7.0f} ms "
              f"{row.long_ttft_ms:7.0f} ms {row.wall_ms:5.0f} ms {row.steps:6d}"
              f"   short x{base.short_ttft_mean_ms / row.short_ttft_mean_ms:.2f}, "
              f"long x{row.long_ttft_ms / base.long_ttft_ms:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"study": "prefill_chunk", "config": vars(args) | {
            "out": str(args.out)}, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
