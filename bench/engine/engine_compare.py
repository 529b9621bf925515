"""Offline engines side by side on the issue's workload: ours against vLLM-CPU (and transformers'
static ``generate``), same weights, same prompts, runs alternating between systems.

    python -m bench.engine.engine_compare --vllm-python /path/to/vllm-venv/bin/python [--rounds 3]

Workload (issue [7/7]): the default model's exact weights in fp32 (the converted checkpoint
our workers load, which vLLM reads as it is), 64-token seeded random prompts, 32 forced new
tokens, greedy; batch 1 = 3 requests one after another (``max_num_seqs=1``), batch 32 = 32
requests at once (``max_num_seqs=32``; ``--batches 1,8,32`` adds sizes, b requests at once);
tokens/s = new tokens / wall time, prefill included, after one warm-up request. Every
(system, batch) run is a fresh process, so no system warms
another's caches, and the order alternates round by round. vLLM runs eager (no torch.compile
graphs), fp32, in its own virtual environment (``--vllm-python``); its CPU back end binds its
OpenMP threads itself. Prints a table of medians and writes ``engine_compare.json``.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # Run as a file (the children, in another system's venv): this folder on sys.path would
    # shadow real modules with ours (torch imports a top-level "kernels", this folder has one).
    sys.path[:] = [p for p in sys.path if p and not p.rstrip("/").endswith("/bench/engine")]

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

INPUT_LEN, OUTPUT_LEN, SEED = 64, 32, 0
BATCHES = (1, 32)  # the issue's; --batches adds others


def num_requests(batch: int) -> int:
    """Batch 1: 3 requests one after another (the issue's); batch b > 1: b at once."""
    return 3 if batch == 1 else batch
_HERE = Path(__file__).resolve()


def prompts(model: str, n: int) -> list[list[int]]:
    """``n`` seeded random prompts within the model's vocabulary (its ``config.json``)."""
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(SEED)
    # Skip the first ids (special tokens) so no prompt holds an EOS or a chat marker.
    low = min(100, vocab // 2)
    return [[rng.randrange(low, vocab) for _ in range(INPUT_LEN)] for _ in range(n)]


def _waves(ps: list, batch: int) -> list[list]:
    """Batch 1: each request alone, one after another; batch 32: all at once."""
    return [ps[i:i + batch] for i in range(0, len(ps), batch)]


# ---- one run, in the system's own process ----------------------------------------------
def _run_ours(model: str, batch: int, n: int, threads: int | None) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=batch, num_threads=threads)
    sp = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)
    ps = prompts(model, n)
    llm.generate(ps[:1], sp)  # warm-up
    t = time.perf_counter()
    outs = [o for wave in _waves(ps, batch) for o in llm.generate(wave, sp)]
    dt = time.perf_counter() - t
    assert all(len(o.token_ids) == OUTPUT_LEN for o in outs)
    return n * OUTPUT_LEN / dt


def _run_vllm(model: str, batch: int, n: int, threads: int | None) -> float:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_num_seqs=batch,
              max_model_len=512, seed=SEED)
    sp = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)
    ps = [{"prompt_token_ids": p} for p in prompts(model, n)]
    llm.generate(ps[:1], sp, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = [o for wave in _waves(ps, batch) for o in llm.generate(wave, sp, use_tqdm=False)]
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == OUTPUT_LEN for o in outs)
    return n * OUTPUT_LEN / dt


def _run_hf(model: str, batch: int, n: int, threads: int | None) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ps = prompts(model, n)
    kw = dict(max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, do_sample=False)
    with torch.inference_mode():
        m.generate(torch.tensor(ps[:1]), **kw)  # warm-up
        t = time.perf_counter()
        for wave in _waves(ps, batch):
            m.generate(torch.tensor(wave), attention_mask=torch.ones(
                len(wave), INPUT_LEN, dtype=torch.long), **kw)
        dt = time.perf_counter() - t
    return n * OUTPUT_LEN / dt


RUNNERS = {"ours": _run_ours, "vllm": _run_vllm, "transformers": _run_hf}


def _child(args: argparse.Namespace) -> None:
    tok_s = RUNNERS[args.child](args.model, args.batch, num_requests(args.batch), args.threads)
    print("RESULT " + json.dumps({"system": args.child, "batch": args.batch, "tok_s": tok_s}))


# ---- the comparison ---------------------------------------------------------------------
def _default_model() -> str:
    from engine.weights.resolve import resolve_model

    return str(resolve_model(None).model_dir)


def _once(python: str, system: str, model: str, batch: int, threads: int | None,
          timeout_s: float) -> float:
    cmd = [python, str(_HERE), "--child", system, "--model", model, "--batch", str(batch)]
    if threads:
        cmd += ["--threads", str(threads)]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for 32 x 96 tokens
    # Local files only, nothing reported anywhere.
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    out = subprocess.run(cmd, env=env, cwd=_HERE.parents[2], capture_output=True, text=True,
                         timeout=timeout_s)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{system} batch {batch} failed (exit {out.returncode}):\n"
                           f"{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", help="python of a virtual environment with vllm-cpu")
    ap.add_argument("--transformers", action="store_true", help="also transformers' generate")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="batch sizes (default 1,32: the issue's table)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for ours and transformers (default: torch's)")
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the default model)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--child", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    model = args.model or _default_model()
    systems = [("ours", sys.executable)]
    if args.vllm_python:
        systems.append(("vllm", args.vllm_python))
    if args.transformers:
        systems.append(("transformers", sys.executable))
    batches = sorted({int(b) for b in args.batches.split(",")})
    if not batches or batches[0] < 1:
        raise SystemExit(f"--batches: sizes >= 1, got {args.batches!r}")
    runs: dict[str, dict[int, list[float]]] = {s: {b: [] for b in batches} for s, _ in systems}
    for r in range(args.rounds):
        order = systems if r % 2 == 0 else systems[::-1]
        for batch in batches:
            for system, python in order:
                tok_s = _once(python, system, model, batch, args.threads, args.timeout_s)
                runs[system][batch].append(tok_s)
                print(f"round {r + 1}: {system:12s} batch {batch:2d}: {tok_s:7.1f} tok/s", flush=True)
    med = {s: {b: statistics.median(v) for b, v in by.items()} for s, by in runs.items()}
    first, last = batches[0], batches[-1]
    spread = f" {last} / {first} |" if last != first else ""
    print(f"\n| system | {' | '.join(f'batch {b} tok/s' for b in batches)} |{spread}"
          f"  (median of {args.rounds})")
    for s, by in med.items():
        ratio = f" {by[last] / by[first]:.1f}x |" if last != first else ""
        print(f"| {s} | {' | '.join(f'{by[b]:.1f}' for b in batches)} |{ratio}")
    for s in med:
        if s != "ours":
            print(f"ours / {s}: " + ", ".join(f"batch {b} {med['ours'][b] / med[s][b]:.2f}x"
                                              for b in batches))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_compare.json").write_text(json.dumps(
        {"model": model, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "runs": runs,
         "median": med, "rounds": args.rounds}, indent=1))
    print(f"wrote {out / 'engine_compare.json'}")


if __name__ == "__main__":
    main()
