"""`pdcluster bench kernels`: does this host's linear-kernel plan pay? Decode steps, one process.

The engine picks, per weight shape and batch size, ``F.linear`` or ``mm(W, x.T)`` by timing
them on this host at start-up (``engine.tuning.linear``). This benchmark runs real decode steps of
the model at each batch size under three plans, interleaved round by round in one process so
drift and noisy neighbours hit all three alike, each round starting with the next plan:

- ``host plan``: what the engine chose on this host (cached per host), with the fused C
  kernels of ``engine.ops.cpu_ops`` (norms, rotary, SiLU-gate, paged decode attention) where built,
  and the whole-step decode kernel at the batch sizes where it timed faster (``engine.executor.fused_decode``);
- ``layer by layer``: the host plan without the whole-step kernel;
- ``no wide tiles``: the host plan without the wide tiles (``engine.ops.cpu_ops.wide_linear`` and
  ``decode_layers``' wide projections): each weight shape and bucket that chose ``cwide`` takes
  its runner-up from the same tuning, each fused bucket on wide tiles the dot tiles;
- ``mm_t < 128 rows``: the rule hard-coded before (tuned on one AMD EPYC) (this and the two
  below layer by layer: they compare linear kernels);
- ``F.linear``: torch's default everywhere;
- ``oneDNN``: oneDNN's inner product everywhere (where this torch has it);
- ``no C kernels``: the host plan with the fused kernels off (their torch twins, and the
  decode attention path the host timed best among the torch ones).

Each figure is the median over rounds of the mean of ``--steps`` consecutive decode steps.
Then, under the host plan, where a step goes (``bench.engine.step_split``): GEMMs, the fused C
kernels, the rest of the model, and the scheduler and Python outside the model.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.engine.step_split import StepSplit, measure_step_split
from bench.harness.report import machine_info, write_json

NAME = "kernels"
HELP = "decode step time under this host's linear-kernel plan vs fixed kernel choices"
SPLIT_STEPS = 10
PLANS = ("host plan", "layer by layer", "no wide tiles", "mm_t < 128 rows", "F.linear", "oneDNN",
         "no C kernels")


def _plans(tuned):
    from engine.ops.linear import FP, LINEAR_BUCKETS, M_BUCKETS, LinearPlan

    # The fp set-ups below are for fp weights (a quantized model's keys keep the host plan's).
    shapes = {(t.n, t.k) for t in tuned.timings if t.kind == FP}
    no_wide = LinearPlan({(t.n, t.k, t.m, t.kind): min((p for p in t.seconds if p != "cwide"),
                                                       key=t.seconds.get)
                          for t in tuned.timings})
    return {"host plan": tuned,
            "layer by layer": tuned,
            "no wide tiles": no_wide,
            "mm_t < 128 rows": LinearPlan({(n, k, m, FP): "mm_t" for n, k in shapes
                                           for m in M_BUCKETS}),
            "F.linear": LinearPlan({}),
            "oneDNN": LinearPlan({(n, k, m, FP): "onednn" for n, k in shapes
                                  for m in LINEAR_BUCKETS}),
            "no C kernels": tuned}


def _without_wide(fused):
    """``fused`` with each bucket on wide tiles moved to the dot tiles. (Not to the layers
    where those timed faster than the dot tiles: the layers were timed under a linear plan
    with ``cwide`` in it, which this set-up takes away.)"""
    from engine.executor.fused_decode import FusedDecodePlan

    return FusedDecodePlan({m: "fused" if c == "wide" else c for m, c in fused.choices.items()})


def measure(model: str | None, batch: int, rounds: int, steps: int, seed: int,
            prompt_len: int = 64) -> tuple[dict[str, float], StepSplit]:
    """Median ms per decode step at ``batch`` under each plan (see the module docstring), and
    where a step goes under the host plan (``bench.engine.step_split``)."""
    import engine.ops.linear as linear_ops
    from engine import LLM, SamplingParams
    from engine.attention.torch_paged import DecodePaths
    from engine.executor.fused_decode import FusedDecodePlan
    from engine.ops import cpu_ops

    llm = LLM(model, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * prompt_len))
    eng = llm.engine
    tuned = linear_ops.linear_plan()
    plans = _plans(tuned)
    fused_on = cpu_ops.enabled()
    backend = eng.runner.attn_backend
    decode_paths = backend.decode_paths
    fused_plan = eng.runner.fused_decode
    fused_plans = {"host plan": fused_plan, "no wide tiles": _without_wide(fused_plan)}
    # Without the kernels, decode attention takes the torch path the host timed best.
    torch_paths = DecodePaths({key: min((p for p in t.seconds if p != "fused"), key=t.seconds.get)
                               for t in decode_paths.timings for key in [(t.m, t.n)]})
    rng = random.Random(seed)
    vocab = eng.model_config.vocab_size
    budget = (rounds * len(plans) * (steps + 1)) + 4 + 2 * SPLIT_STEPS
    sp = SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True)
    for _ in range(batch):
        eng.add_request([rng.randrange(3, vocab) for _ in range(prompt_len)], sp)
    while eng.scheduler.num_waiting:  # prefill everyone: only decode steps are timed
        eng.step()
    times: dict[str, list[float]] = {name: [] for name in plans}
    try:
        order = list(plans)
        for r in range(rounds):
            # Each round starts with the next plan: the plan timed right after another one
            # runs measurably slower (seen: ~20% at batch 1 with identical plans), so every
            # plan takes every position equally often.
            for name in order[r % len(order):] + order[:r % len(order)]:
                plan = plans[name]
                linear_ops.set_linear_plan(plan)
                cpu_ops.set_enabled(fused_on and name != "no C kernels")
                backend.decode_paths = torch_paths if name == "no C kernels" else decode_paths
                eng.runner.fused_decode = fused_plans.get(name, FusedDecodePlan())
                eng.step()  # one untimed step: the switch's first calls
                t0 = time.perf_counter()
                for _ in range(steps):
                    eng.step()
                times[name].append((time.perf_counter() - t0) / steps * 1e3)
    finally:
        linear_ops.set_linear_plan(tuned)
        cpu_ops.set_enabled(fused_on)
        backend.decode_paths = decode_paths
        eng.runner.fused_decode = fused_plan
    return {name: statistics.median(v) for name, v in times.items()}, measure_step_split(eng, SPLIT_STEPS)


def run(args: argparse.Namespace) -> dict:
    """Entry point of the ``kernels`` subcommand; returns the JSON payload it wrote."""
    import torch

    import engine.ops.linear as linear_ops

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    sizes = [int(b) for b in (args.batch_sizes or ("1,8" if args.quick else "1,8,32")).split(",")]
    rounds = args.rounds or (3 if args.quick else 9)
    rows, splits = [], []
    print(f"{'batch':>5} " + " ".join(f"{p:>16}" for p in PLANS) + f" {'fixed/host':>11}"
          + f" {'layers/host':>11} {'nowide/host':>11} {'noC/host':>10}")
    for b in sizes:
        ms, split = measure(args.model, b, rounds, args.steps, args.seed)
        splits.append((b, split))
        best_fixed = min(ms["mm_t < 128 rows"], ms["F.linear"], ms["oneDNN"])
        rows.append({"batch": b, "step_ms": ms, "best_fixed_over_host": best_fixed / ms["host plan"],
                     "layers_over_host": ms["layer by layer"] / ms["host plan"],
                     "no_wide_over_host": ms["no wide tiles"] / ms["host plan"],
                     "no_c_kernels_over_host": ms["no C kernels"] / ms["host plan"],
                     "step_split": split, "outside_model_share": split.outside_model_share})
        print(f"{b:>5} " + " ".join(f"{ms[p]:>13.1f} ms" for p in PLANS)
              + f" {best_fixed / ms['host plan']:>10.2f}x"
              + f" {ms['layer by layer'] / ms['host plan']:>10.2f}x"
              + f" {ms['no wide tiles'] / ms['host plan']:>10.2f}x"
              + f" {ms['no C kernels'] / ms['host plan']:>10.2f}x", flush=True)
    print(f"where a decode step goes under the host plan ({SPLIT_STEPS} steps):")
    for b, split in splits:
        print(f"  batch {b}: {split.line()}")
    plan = linear_ops.linear_plan()
    print("host plan (path per batch bucket, and by how much it beat the other in tuning):")
    for line in plan.summary():
        print("  " + line)
    payload = {"benchmark": NAME, "machine": machine_info(), "rounds": rounds,
               "steps": args.steps, "rows": rows,
               "plan": {"host_key": plan.key, "summary": plan.summary()}}
    path = write_json(args.out, NAME, payload)
    print(f"wrote {path}")
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8,32; --quick 1,8)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the set-ups (default 9; --quick 3)")
    p.add_argument("--steps", type=int, default=3, help="timed decode steps per plan and round")
