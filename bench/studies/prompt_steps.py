"""What a prefill step of fewer prompts costs a prompt: the price of
``yield_step_prefill_tokens`` (engine/core/prompt_budget.py), which computes at most that many
prompt tokens a step of the priorities below one seen lately.

One engine (the default model, one thread, no adaptive threads, the yield off so that every
batch is one step) computes 1, 2, 3, 4, 5, 6 and 8 prompts of ``--prompt-len`` random tokens
together, one output token each, in turn for ``--rounds`` rounds (the first dropped as a
warm-up); per batch it prints the median step and the time per prompt.

    python -m bench.studies.prompt_steps [--prompt-len 64] [--rounds 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

BATCHES = (1, 2, 3, 4, 5, 6, 8)


def main() -> None:
    from engine import EngineArgs
    from engine.contract import SamplingParams
    from engine.runtime.llm_engine import LLMEngine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    engine = LLMEngine(EngineArgs(num_threads=1, max_num_seqs=max(BATCHES),
                                  adaptive_threads=False, yield_step_prefill_tokens=None))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    times: dict[int, list[float]] = {n: [] for n in BATCHES}
    for _ in range(args.rounds):
        for n in BATCHES:
            for _ in range(n):  # fresh tokens: no prefix-cache hit
                engine.add_request([rng.randrange(100, 40000) for _ in range(args.prompt_len)],
                                   params)
            t0 = time.perf_counter()
            while engine.has_unfinished_requests:
                engine.step()
            times[n].append(time.perf_counter() - t0)
    for n, ts in times.items():
        step = statistics.median(ts[1:] or ts)
        print(f"{n} prompts ({n * args.prompt_len} tokens): step {step * 1e3:.0f} ms, "
              f"{step * 1e3 / n:.0f} ms a prompt")


if __name__ == "__main__":
    main()
