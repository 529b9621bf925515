"""Engine steps in fp32 and in bf16 on this CPU: what the opt-in ``--dtype bfloat16`` buys.

    python -m bench.studies.dtype_steps [--batches 1,32] [--rounds 2] [--model DIR] [--out DIR]

Per round, per batch size, each dtype in turn (the order alternating round by round), a fresh
process starts the engine (``LLM(model, dtype=...)``, the host's kernel plans for that dtype),
prefills ``batch`` seeded 64-token prompts in one step, runs 3 decode steps to warm up and
times 12: the prefill step and the median decode step. Whether bf16 wins depends on the CPU
(AMX tile GEMMs, AVX512_BF16 dot products only, or neither) and on the batch: the weights are
half the bytes, but the fused C kernels are fp32-only, so bf16 runs their torch twins. fp32
stays the default and the dtype of the equality tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16")
PROMPT_LEN, WARM_STEPS, TIMED_STEPS = 64, 3, 12
ROOT = Path(__file__).resolve().parents[2]


def child(model: str | None, dtype: str, batch: int, seed: int) -> dict[str, Any]:
    """One engine in this process: its prefill step and median decode step, in seconds."""
    import random

    from engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_num_seqs=batch,
              max_num_batched_tokens=max(2048, batch * PROMPT_LEN))
    eng = llm.engine
    rng = random.Random(seed)
    vocab = eng.model_config.vocab_size
    params = SamplingParams(max_tokens=WARM_STEPS + TIMED_STEPS + 2, temperature=0,
                            ignore_eos=True)
    for _ in range(batch):
        eng.add_request([rng.randrange(3, vocab) for _ in range(PROMPT_LEN)], params)
    t0 = time.perf_counter()
    eng.step()  # every prompt in one prefill step (the budget holds them all)
    prefill = time.perf_counter() - t0
    for _ in range(WARM_STEPS):
        eng.step()
    times = []
    for _ in range(TIMED_STEPS):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return {"dtype": dtype, "batch": batch, "prefill_step_s": prefill,
            "decode_step_s": statistics.median(times)}


def _run_child(model: str | None, dtype: str, batch: int, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.studies.dtype_steps", "--child", dtype, str(batch),
           "--seed", str(seed)] + (["--model", model] if model else [])
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{dtype} batch {batch} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(model: str | None, batches: list[int], rounds: int, seed: int = 0) -> dict[str, Any]:
    runs = []
    for r in range(rounds):
        order = DTYPES if r % 2 == 0 else DTYPES[::-1]
        for b in batches:
            for dtype in order:
                res = _run_child(model, dtype, b, seed)
                runs.append({"round": r + 1, **res})
                print(f"round {r + 1}: {dtype:8s} batch {b:3d}: prefill step "
                      f"{res['prefill_step_s'] * 1e3:7.1f} ms, decode step "
                      f"{res['decode_step_s'] * 1e3:6.1f} ms", flush=True)
    median = {}
    for b in batches:
        for dtype in DTYPES:
            mine = [x for x in runs if x["batch"] == b and x["dtype"] == dtype]
            median[f"{dtype}/{b}"] = {
                k: statistics.median(x[k] for x in mine) for k in ("prefill_step_s", "decode_step_s")}
    ratios = {f"batch {b}": {k: median[f"bfloat16/{b}"][k] / median[f"float32/{b}"][k]
                             for k in ("prefill_step_s", "decode_step_s")} for b in batches}
    return {"model": model or "default", "prompt_len": PROMPT_LEN, "runs": runs,
            "median": median, "bf16_over_fp32": ratios}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.studies.dtype_steps",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--child", nargs=2, metavar=("DTYPE", "BATCH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.child[0], int(args.child[1]), args.seed)))
        return 0
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batches or min(batches) < 1 or args.rounds < 1:
        raise SystemExit("--batches: positive integers; --rounds >= 1")
    from bench.harness.report import machine_info, write_json

    result = {**run(args.model, batches, args.rounds, args.seed), "machine": machine_info()}
    for b, r in result["bf16_over_fp32"].items():
        print(f"bf16 / fp32, {b}: prefill step {r['prefill_step_s']:.2f}x, "
              f"decode step {r['decode_step_s']:.2f}x (medians)")
    print(f"wrote {write_json(Path(args.out), 'dtype_steps', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
