"""`pdcluster bench policies`: static vs dynamic vs continuous batching on one workload.

The workload: ``--num-requests`` short token-id prompts whose output lengths are drawn from a
seeded lognormal clipped to ``[--min-output, --max-output]`` (most short, a few long; each
request runs exactly its length: ``ignore_eos`` with ``max_tokens`` = length), arriving as a
seeded Poisson stream at ``--arrival-rate`` per second (0: all at once). Every policy gets a
fresh engine with the same ``max_num_seqs`` and replays the identical arrivals.

Slot utilization = tokens generated / (max_num_seqs x working engine steps): the share of the
batch's slots that produced a token, counted from the engine's own steps (idle polls excluded).
The head-of-line example (outputs of 10, 50 and 1000 tokens in 3 slots) is printed both as
arithmetic and as measured through the engine under the static policy.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from typing import Any

from bench.engine import baseline_hf
from bench.harness.batching import BatchingSimulation, simulate_batching, slot_utilization
from bench.harness.engine_under_test import load_llm, model_config
from bench.harness.report import machine_info, print_targets, ratio, target, write_json
from bench.harness.stats import summarize
from bench.harness.workload import heavy_tailed_lengths, make_prompts, poisson_arrivals

POLICIES = ("static", "dynamic", "continuous")
HOL_OUTPUT_LENS = (10, 50, 1000)
HOL_QUICK_SCALE = 10  # --quick divides the head-of-line lengths by this (same 35.3%)


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrival_s: list[float]  # offsets from the start

    @property
    def num_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class PolicyResult:
    """One policy on the workload (seconds; throughput in generated tokens per second)."""

    policy: str
    num_requests: int
    num_tokens: int
    elapsed_s: float  # first arrival to last finish
    throughput_tok_s: float
    mean_latency_s: float  # arrival to finish, averaged over requests
    p99_latency_s: float
    ttft_mean_s: float
    num_steps: int  # working engine steps (or generate steps for the baseline)
    num_slots: int
    slot_utilization: float
    # The same ratio over steps that began with requests waiting (slots could all be filled):
    # excludes the drain at the end, where no policy has work for every slot.
    slot_utilization_while_queued: float | None = None


def make_workload(num_requests: int, prompt_len: int, vocab_size: int, seed: int,
                  min_output: int, max_output: int, arrival_rate: float | None) -> Workload:
    return Workload(
        prompts=make_prompts(num_requests, prompt_len, vocab_size, seed=seed),
        output_lens=heavy_tailed_lengths(num_requests, seed=seed, low=min_output, high=max_output),
        arrival_s=poisson_arrivals(num_requests, arrival_rate, seed=seed))


def run_policy(model: str | None, workload: Workload, policy: str, max_num_seqs: int,
               dynamic_window_s: float, num_threads: int | None) -> PolicyResult:
    """Replay the workload's arrivals into a fresh engine under ``policy``, stepping it by hand."""
    from engine import SamplingParams

    llm = load_llm(model, max_num_seqs=max_num_seqs, batching=policy,
                   dynamic_window_s=dynamic_window_s, num_threads=num_threads)
    llm.generate(workload.prompts[:1], SamplingParams(max_tokens=2, temperature=0,
                                                      ignore_eos=True))  # warm-up
    eng = llm.engine
    n = len(workload.prompts)
    finished: dict[str, Any] = {}
    num_steps = tokens = next_i = 0
    queued_steps = queued_tokens = 0
    t0 = eng.clock()
    while len(finished) < n:
        now = eng.clock()
        while next_i < n and t0 + workload.arrival_s[next_i] <= now:
            params = SamplingParams(max_tokens=workload.output_lens[next_i], temperature=0,
                                    ignore_eos=True)
            eng.add_request(workload.prompts[next_i], params, request_id=f"r{next_i}",
                            arrival_time=t0 + workload.arrival_s[next_i])
            next_i += 1
        had_waiting = eng.scheduler.num_waiting > 0
        outs = eng.step()
        if eng.last_step_idle:
            # Nothing runnable: wait for the next arrival or the dynamic window, without
            # spinning a core the engine of a neighbour could use.
            wait = (t0 + workload.arrival_s[next_i] - eng.clock()) if next_i < n else 0.0
            time.sleep(min(max(wait, 0.0), 0.002) if policy == "dynamic" else max(wait, 0.0005))
            continue
        num_steps += 1
        step_tokens = sum(len(o.new_token_ids) for o in outs)
        tokens += step_tokens
        if had_waiting:
            queued_steps += 1
            queued_tokens += step_tokens
        for o in outs:
            if o.finished:
                finished[o.request_id] = o
    outs = list(finished.values())
    end = max(o.metrics.finished_time for o in outs)
    lat = summarize([o.metrics.e2e_s for o in outs])
    result = PolicyResult(
        policy=policy, num_requests=n, num_tokens=tokens, elapsed_s=end - t0,
        throughput_tok_s=tokens / (end - t0), mean_latency_s=lat.mean, p99_latency_s=lat.p99,
        ttft_mean_s=summarize([o.metrics.ttft_s for o in outs]).mean, num_steps=num_steps,
        num_slots=max_num_seqs, slot_utilization=slot_utilization(tokens, max_num_seqs, num_steps),
        slot_utilization_while_queued=slot_utilization(queued_tokens, max_num_seqs, queued_steps)
        if queued_steps else None)
    del llm
    gc.collect()
    return result


def baseline_static(hf_model: Any, workload: Workload, max_num_seqs: int) -> PolicyResult:
    """transformers static ``generate`` in arrival order (arrival gaps ignored: all at t=0)."""
    r = baseline_hf.run_static(hf_model, workload.prompts, workload.output_lens, max_num_seqs)
    return PolicyResult(
        policy="transformers_static", num_requests=r.num_requests, num_tokens=r.useful_tokens,
        elapsed_s=r.elapsed_s, throughput_tok_s=r.throughput_tok_s,
        mean_latency_s=r.mean_latency_s, p99_latency_s=r.e2e_p99_s,
        ttft_mean_s=float("nan"), num_steps=r.num_steps, num_slots=max_num_seqs,
        slot_utilization=slot_utilization(r.useful_tokens, max_num_seqs, r.num_steps))


def head_of_line_example(model: str | None, quick: bool,
                         num_threads: int | None) -> dict[str, Any]:
    """The 10/50/1000-token example in 3 slots: arithmetic, then measured under static."""
    cfg = model_config(model)
    prompt_len = 8
    scale = HOL_QUICK_SCALE if quick else 1
    while max(HOL_OUTPUT_LENS) // scale + prompt_len > cfg.max_model_len:
        scale *= 2  # a small-context model: keep the 10:50:1000 shape, shrink the lengths
    lens = [max(1, n // scale) for n in HOL_OUTPUT_LENS]
    static = simulate_batching(lens, 3, "static")
    print(f"head-of-line example, outputs {lens} in 3 slots:")
    print(f"  computed static utilization = {static.useful_token_steps}/"
          f"{static.num_slots * static.num_steps} = {static.utilization:.1%}", flush=True)
    wl = Workload(make_prompts(3, prompt_len, cfg.vocab_size, seed=7), lens, [0.0, 0.0, 0.0])
    measured = run_policy(model, wl, "static", 3, 0.0, num_threads)
    print(f"  measured static utilization = {measured.num_tokens}/"
          f"{measured.num_slots * measured.num_steps} = {measured.slot_utilization:.1%} "
          f"({measured.num_steps} engine steps)", flush=True)
    return {"output_lens": lens, "num_slots": 3, "computed_static": static,
            "measured_static": measured}


def policy_targets(results: dict[str, PolicyResult]) -> list[dict[str, Any]]:
    c, s = results["continuous"], results["static"]
    return [
        target("continuous / static throughput", ratio(c.throughput_tok_s, s.throughput_tok_s), 2.0),
        target("continuous slot utilization", c.slot_utilization, 0.9,
               reason="the drain at the end (last long requests, queue empty) leaves slots idle "
                      "under any policy; see slot_utilization_while_queued"),
        target("continuous slot utilization while requests wait", c.slot_utilization_while_queued,
               0.9),
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point of the ``policies`` subcommand; returns the JSON payload it wrote."""
    n = min(args.num_requests, 8) if args.quick else args.num_requests
    max_out = min(args.max_output, 32) if args.quick else args.max_output
    slots = min(args.max_num_seqs, 4) if args.quick else args.max_num_seqs
    vocab = model_config(args.model).vocab_size
    wl = make_workload(n, args.prompt_len, vocab, args.seed, args.min_output, max_out,
                       args.arrival_rate)
    lens = sorted(wl.output_lens)
    print(f"workload: {n} requests, {wl.num_tokens} output tokens, lengths min {lens[0]} "
          f"median {lens[len(lens) // 2]} max {lens[-1]}, {slots} slots, arrival rate "
          f"{args.arrival_rate or 'all at once'}/s", flush=True)
    sims: dict[str, BatchingSimulation] = {p: simulate_batching(wl.output_lens, slots, p)
                                           for p in ("static", "continuous")}
    results: dict[str, PolicyResult] = {}
    for policy in POLICIES:
        print(f"{policy}...", flush=True)
        r = run_policy(args.model, wl, policy, slots, args.dynamic_window_s, args.num_threads)
        results[policy] = r
        print(f"  {r.throughput_tok_s:.1f} tok/s, mean latency {r.mean_latency_s:.2f} s, "
              f"slot utilization {r.slot_utilization:.1%} ({r.num_steps} steps; "
              f"{_pct(r.slot_utilization_while_queued)} while requests waited)", flush=True)
    baseline = None
    if args.baseline == "transformers":
        print("transformers static generate...", flush=True)
        baseline = baseline_static(baseline_hf.load_hf_model(args.model), wl, slots)
        print(f"  {baseline.throughput_tok_s:.1f} tok/s, mean latency "
              f"{baseline.mean_latency_s:.2f} s, slot utilization "
              f"{baseline.slot_utilization:.1%}", flush=True)
    hol = None if args.skip_head_of_line else head_of_line_example(args.model, args.quick,
                                                                    args.num_threads)
    targets = policy_targets(results)
    payload: dict[str, Any] = {
        "benchmark": "policies", "machine": machine_info(), "model": args.model or "default",
        "quick": args.quick, "seed": args.seed, "num_requests": n, "max_num_seqs": slots,
        "prompt_len": args.prompt_len, "output_lens": wl.output_lens,
        "arrival_rate_per_s": args.arrival_rate, "dynamic_window_s": args.dynamic_window_s,
        **results,
        "simulated_all_at_once": sims,
        "transformers_static": baseline,
        "continuous_over_transformers_static": ratio(
            results["continuous"].throughput_tok_s, baseline.throughput_tok_s) if baseline else None,
        "head_of_line": hol, "targets": targets,
    }
    out_json = write_json(args.out, "policies", payload)
    plot_policies(results, baseline, out_json.with_name("policies.png"))
    print_targets(targets)
    print(f"wrote {out_json} and {out_json.with_name('policies.png')}")
    return payload


def plot_policies(results: dict[str, PolicyResult], baseline: PolicyResult | None,
                  path: Any) -> None:
    """Bars: throughput, mean latency and slot utilization per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(results.values()) + ([baseline] if baseline else [])
    names = [r.policy.replace("transformers_", "HF ") for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
    for ax, attr, label in zip(axes, ("throughput_tok_s", "mean_latency_s", "slot_utilization"),
                               ("throughput (tok/s)", "mean latency (s)", "slot utilization"),
                               strict=True):
        ax.bar(names, [getattr(r, attr) for r in rows],
               color=["tab:gray", "tab:orange", "tab:blue", "tab:green"][:len(rows)])
        ax.set_title(label)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("Batching policies on one heavy-tailed workload")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--min-output", type=int, default=8)
    p.add_argument("--max-output", type=int, default=512)
    p.add_argument("--arrival-rate", type=float, default=16.0,
                   help="Poisson arrivals per second; 0 = all requests at once")
    p.add_argument("--dynamic-window-s", type=float, default=0.5,
                   help="dynamic policy: launch a partial batch after its oldest waited this long")
    p.add_argument("--skip-head-of-line", action="store_true",
                   help="skip the measured 10/50/1000-token head-of-line example")
