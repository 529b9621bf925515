"""A/B the prefill attention paths on whole prefills, interleaved in one engine.

    python -m bench.studies.prefill_ab [--model DIR] [--lengths 64,256,1024,1900] [--rounds 5]
                                       [--num-threads N]

One ``LLM`` (the host's kernel plans, as an engine starts), one prompt at a time with
``max_tokens=1`` (its prefill, the first token sampled), the torch backend's prefill attention
forced to torch's ``scaled_dot_product_attention`` and to ``engine.ops.cpu_ops.prefill_attention``
alternately, a fresh random prompt each call (no prefix-cache hits). Prints per prompt length
the median ms of each, sdpa / fused, and the layers' FLOP rate under the fused path.
``pdcluster bench ceilings`` prints the attention-alone timings the engine chose by; this is
what the choice is worth on a whole prefill.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillRow:
    length: int
    sdpa_ms: float
    fused_ms: float

    @property
    def speedup(self) -> float:
        return self.sdpa_ms / self.fused_ms


def measure(model: str | None, lengths: list[int], rounds: int, seed: int = 0,
            num_threads: int | None = None) -> list[PrefillRow]:
    """Median ms per whole prefill of each length under each path (round 0 untimed);
    ``num_threads``: the engine's torch threads (None: the engine's default)."""
    from engine import LLM, SamplingParams
    from engine.attention.torch_paged import PrefillPaths
    from engine.ops import cpu_ops

    if not cpu_ops.enabled():
        raise SystemExit("the fused CPU kernels are not built here: nothing to compare")
    threads = {} if num_threads is None else {"num_threads": num_threads}
    llm = LLM(model, max_num_seqs=1, max_model_len=max(lengths) + 8, **threads)
    backend = llm.engine.runner.attn_backend
    host = backend.prefill_paths
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rows = []
    try:
        for n in lengths:
            times: dict[str, list[float]] = {"sdpa": [], "fused": []}
            for r in range(rounds + 1):
                for path in times:
                    backend.prefill_paths = PrefillPaths.everywhere(path)
                    prompt = [rng.randrange(3, vocab) for _ in range(n)]
                    t0 = time.perf_counter()
                    llm.generate([prompt], params)
                    if r:
                        times[path].append(time.perf_counter() - t0)
            rows.append(PrefillRow(n, statistics.median(times["sdpa"]) * 1e3,
                                   statistics.median(times["fused"]) * 1e3))
    finally:
        backend.prefill_paths = host
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.studies.prefill_ab", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the default model)")
    p.add_argument("--lengths", type=_ints, default=[64, 256, 1024, 1900])
    p.add_argument("--rounds", type=int, default=5, help="timed prefills of each path per length")
    p.add_argument("--num-threads", type=int, default=None,
                   help="the engine's torch threads (default: the engine's own choice)")
    args = p.parse_args(argv)
    for row in measure(args.model, args.lengths, args.rounds, num_threads=args.num_threads):
        print(f"prompt {row.length}: sdpa {row.sdpa_ms:.1f} ms, fused {row.fused_ms:.1f} ms, "
              f"sdpa / fused {row.speedup:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
