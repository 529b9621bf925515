"""An engine's decode step with OpenMP's default wait policy against ``OMP_WAIT_POLICY=PASSIVE``
(``router/cluster/threads.py`` sets PASSIVE for prefill workers only; this is why not for decode).

    python -m bench.studies.omp_wait [--rounds 3] [--threads 2]

Each measurement runs in a fresh process (the OpenMP runtime reads the policy when torch
loads it), alternating policies round by round, on an idle box and beside a process that uses
~17% of a core in short bursts (a router's pattern). Prints one JSON line per run and the
medians: the mean decode step at batch 1 and 8 of the default model (64-token prompts, 32
tokens each, timed by the engine's own step counters).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_NOISE = """
import time
while True:
    time.sleep(0.004)
    t = time.perf_counter()
    while time.perf_counter() - t < 0.0008:
        pass
"""


def _one(threads: int, noise: bool) -> dict[str, float]:
    """In this (fresh) process: the engine's mean decode step per batch size, in ms."""
    from engine import LLM, SamplingParams

    llm = LLM(max_num_seqs=8, num_threads=threads)
    sp = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    bursts = subprocess.Popen([sys.executable, "-c", _NOISE]) if noise else None
    out = {}
    try:
        for batch in (1, 8):
            llm.generate([[11 + i + j for j in range(64)] for i in range(batch)], sp)  # warm
            before = {b: (n, s) for b, n, s in llm.engine.stats().decode_steps}
            llm.generate([[11 + i + j for j in range(64)] for i in range(batch)], sp)
            after = {b: (n, s) for b, n, s in llm.engine.stats().decode_steps}
            n0, s0 = before.get(batch, (0, 0.0))
            out[f"b{batch}_ms"] = (after[batch][1] - s0) / (after[batch][0] - n0) * 1e3
    finally:
        if bursts is not None:
            bursts.kill()
            bursts.wait()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=["noise", "quiet"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_one(args.threads, args.child == "noise")))
        return
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for policy in ("default", "PASSIVE"):
            env = dict(os.environ)
            env.pop("OMP_WAIT_POLICY", None)
            if policy == "PASSIVE":
                env["OMP_WAIT_POLICY"] = "PASSIVE"
            for load in ("quiet", "noise"):
                line = subprocess.run(
                    [sys.executable, "-m", "bench.studies.omp_wait", "--child", load,
                     "--threads", str(args.threads)], env=env, check=True,
                    capture_output=True, text=True).stdout.strip().splitlines()[-1]
                r = json.loads(line)
                runs.setdefault((policy, load), []).append(r)
                print(json.dumps({"policy": policy, "load": load, **r}), flush=True)
    for (policy, load), rs in sorted(runs.items()):
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{policy:8s} {load:6s} " + "  ".join(f"{k} {v:.1f}" for k, v in med.items()))


if __name__ == "__main__":
    main()
