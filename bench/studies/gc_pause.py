"""How long Python's full garbage collection stops a worker-like process, before and after
``worker_protocol.freeze_startup_heap`` (what workers and the router call after start-up).

    python -m bench.studies.gc_pause [--repeats 3]

Loads what a decode worker loads (Ray, the default model's engine), runs one request, then
times ``gc.collect()`` (a generation-2 pass, as Python runs one on its own once enough
objects have survived) with the start-up heap tracked, and again after freezing it.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time


def _collect_ms(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import ray  # noqa: F401 - a worker process has it loaded

    from engine import LLM, SamplingParams
    from worker_protocol import freeze_startup_heap

    llm = LLM(max_num_seqs=8)
    llm.generate([[11 + j for j in range(64)]], SamplingParams(max_tokens=8, temperature=0,
                                                               ignore_eos=True))
    tracked = len(gc.get_objects())
    before = _collect_ms(args.repeats)
    frozen = freeze_startup_heap()
    after = _collect_ms(args.repeats)
    print(f"full collection: {before:.1f} ms with {tracked} objects tracked; "
          f"{after:.2f} ms after freezing {frozen}")


if __name__ == "__main__":
    main()
