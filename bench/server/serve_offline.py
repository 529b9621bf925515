"""The engine alone, one stream at a time: what `bench serve --offline-threads N` sets the served
time per token against.

``offline_one_stream`` runs the same prompts through an in-process ``LLMEngine`` (same model,
``N`` torch threads: give it the served worker's), one request at a time, greedy with
``ignore_eos`` and ``output_len`` tokens each as the load asks, and times every output token as
the engine hands it over. No router, Ray, gRPC, HTTP or client in the path: the served/offline
ratio of TPOT is what the serving path costs a stream (vLLM's and llama.cpp's servers pay
1.15-1.2x over their own engines on a 2-core box). Run it with the server idle (after the load)
so both sides had the same machine.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from bench.harness.stats import percentile


@dataclass(frozen=True)
class OfflineRun:
    num_threads: int
    num_requests: int
    ttft_p50_s: float
    tpot_p50_s: float
    tpot_mean_s: float
    itl_p99_s: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def offline_one_stream(model: str | None, prompts: list[list[int]], output_len: int,
                       num_threads: int, warmup: int = 2) -> OfflineRun:
    """Each prompt alone through the engine; TPOT per request = (last token - first token) /
    (tokens - 1), as `bench serve` computes it from the stream. The first ``warmup`` requests
    run untimed (first-call allocations and kernel plans)."""
    from engine import EngineArgs, LLMEngine, SamplingParams

    if output_len < 2:
        raise ValueError("--output-len must be >= 2 for a time per output token")
    engine = LLMEngine(EngineArgs(model=model, num_threads=num_threads, max_num_seqs=1))
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    ttfts, tpots, itls = [], [], []
    try:
        for i, prompt in enumerate(prompts[:warmup] + prompts):
            t0 = time.perf_counter()
            engine.add_request(list(prompt), params, f"offline-{i}")
            stamps: list[float] = []
            while engine.has_unfinished_requests:
                for out in engine.step():
                    stamps += [time.perf_counter()] * len(out.new_token_ids)
            if i < warmup:
                continue
            ttfts.append(stamps[0] - t0)
            tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
            itls += [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    finally:
        engine.close()
    return OfflineRun(num_threads, len(prompts), percentile(ttfts, 50), percentile(tpots, 50),
                      sum(tpots) / len(tpots), percentile(itls, 99))
