"""`pdcluster bench sweep`: throughput and latency of our engine over batch size.

For each batch size ``b`` the same kind of workload (``b x k`` distinct token-id prompts of
``--prompt-len`` tokens, ``--output-len`` greedy tokens each, ``ignore_eos``) runs through a
fresh engine with ``max_num_seqs = b``. Per batch size we record throughput, TTFT, ITL, E2E and
the median decode step (timed around the model runner, full batches only), beside the roofline
prediction from the ceilings measured at the start of the same run:

    step_s = max(weight_bytes / GEMV bandwidth, 2 x params x b / matmul rate)

GEMV bandwidth (not copy bandwidth) is the memory roof: a batch-1 decode step is a chain of
GEMVs, and that is what the floor must be achievable by. ``--baseline transformers`` runs the
identical prompts through transformers' static ``generate`` and its ``generate_batch``.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass, field
from typing import Any

from bench.engine import baseline_hf
from bench.engine.ceilings import format_ceilings, measure_ceilings, quick_ceilings
from bench.harness.engine_under_test import (
    ModelSize,
    StepRecorder,
    load_llm,
    model_config,
    model_size,
)
from bench.harness.report import machine_info, print_targets, ratio, target, write_json
from bench.harness.roofline import (
    Knee,
    RooflinePoint,
    find_knee,
    roofline_step_time,
    roofline_workload_throughput,
)
from bench.harness.stats import summarize
from bench.harness.workload import make_prompts
from bench.peers.sweep_rows import llama_cpp_comparison, paired_batch_one, print_paired

PROFILE_ROWS = 12


@dataclass
class SweepPoint:
    """Our engine at one batch size (seconds; throughput in output tokens per second)."""

    batch_size: int
    num_requests: int
    output_tokens: int
    elapsed_s: float
    throughput_tok_s: float
    ttft_mean_s: float
    ttft_p99_s: float
    itl_mean_s: float
    itl_p50_s: float  # robust to a noisy neighbour's stalls, unlike the mean
    itl_p99_s: float
    e2e_p99_s: float
    decode_step_s: float  # median of full-batch pure-decode steps
    num_steps: int
    roofline: RooflinePoint | None = None
    hf_static: baseline_hf.HFRunResult | None = None
    hf_generate_batch: baseline_hf.HFRunResult | None = None
    ratio_vs_hf_static: float | None = None
    ratio_vs_hf_generate_batch: float | None = None
    profile_top_ops: list[dict[str, Any]] = field(default_factory=list)
    tp: int = 1  # tensor-parallel ranks (each with its share of the cores)
    quantization: str = "none"  # the engine's --quantization
    linear_weight_bytes: int = 0  # bytes a pass over the linear layers reads (this layout)
    # decode_step_s's steps per torch thread count (the governor's drops under a neighbour)
    decode_threads: dict = field(default_factory=dict)
    # Greedy tokens per request (ignore_eos): what the quantization comparison matches.
    token_ids: list = field(default_factory=list, repr=False)


def _kv_budget_bytes(llm_kv_bytes_per_token: int, batch: int, tokens_per_seq: int) -> int:
    # Room for the whole batch plus slack for a partially filled block per sequence.
    return max(32 << 20, 2 * batch * (tokens_per_seq + 32) * llm_kv_bytes_per_token)


def profile_decode_step(llm: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """torch.profiler's top ops (by self CPU time) for one full-batch decode step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    reqs = [eng.add_request(p, params) for p in prompts]
    while any(not r.output_token_ids for r in reqs):  # prefill (possibly chunked)
        eng.step()
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.step()
    while eng.has_unfinished_requests:
        eng.step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1.0
    return [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "share": e.self_cpu_time_total / total} for e in rows[:PROFILE_ROWS]]


def run_engine_point(model: str | None, prompts: list[list[int]], batch: int, output_len: int,
                     kv_bytes_per_token: int, num_threads: int | None,
                     profile: bool, tp: int = 1, quantization: str = "none") -> SweepPoint:
    """Fresh engine at ``max_num_seqs=batch``; one warm-up call, then the timed workload.
    ``tp``: tensor-parallel ranks, ``num_threads`` each (None: the cores shared out);
    ``quantization``: the engine's weight layout."""
    from engine import SamplingParams
    from engine.quant.layouts import weight_bytes
    from engine.tuning.linear import model_linear_weights

    tokens_per_seq = len(prompts[0]) + output_len
    llm = load_llm(model, max_num_seqs=batch, num_threads=num_threads,
                   max_num_batched_tokens=max(2048, batch * len(prompts[0])),
                   kv_cache_memory_bytes=_kv_budget_bytes(kv_bytes_per_token, batch, tokens_per_seq),
                   tensor_parallel_size=tp, quantization=quantization)
    llm.generate(prompts[:batch], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    rec = StepRecorder(llm.engine)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    rec.close()
    n_tok = sum(len(o.token_ids) for o in outs)
    ttft = summarize([o.metrics.ttft_s for o in outs])
    itl = summarize([x for o in outs for x in o.metrics.itl_s])
    e2e = summarize([o.metrics.e2e_s for o in outs])
    steps = rec.decode_step_times(batch) or rec.decode_step_times()
    threads = rec.decode_threads(batch) if rec.decode_step_times(batch) else rec.decode_threads()
    point = SweepPoint(
        batch_size=batch, num_requests=len(prompts), output_tokens=n_tok, elapsed_s=elapsed,
        throughput_tok_s=n_tok / elapsed, ttft_mean_s=ttft.mean, ttft_p99_s=ttft.p99,
        itl_mean_s=itl.mean, itl_p50_s=itl.p50, itl_p99_s=itl.p99, e2e_p99_s=e2e.p99,
        decode_step_s=summarize(steps).p50, num_steps=len(rec.records), tp=tp,
        quantization=quantization,
        linear_weight_bytes=weight_bytes(model_linear_weights(llm.engine.model)),
        token_ids=[list(o.token_ids) for o in outs], decode_threads=threads)
    if profile:
        point.profile_top_ops = profile_decode_step(llm, prompts[:batch])
    llm.close()
    del llm
    gc.collect()
    return point


def sweep_targets(points: list[SweepPoint], floor_s: float,
                  roof_tok_s: float | None = None) -> list[dict[str, Any]]:
    """The sweep's targets (issue [7/7]'s), as ratios measured within this one run.
    ``roof_tok_s``: the throughput this host's roofs allow the last batch size on this
    workload, prefill included (``roofline_workload_throughput``), quoted beside the
    batch-scaling target: when it is below what the target asks, the CPU cannot meet it."""
    first, last = points[0], points[-1]
    out = []
    if first.batch_size == 1:
        out.append(target("batch-1 decode step / floor (weights / GEMV bandwidth)",
                          ratio(first.decode_step_s, floor_s), 1.2, higher_is_better=False))
    hf = [p.ratio_vs_hf_static for p in points]
    if all(r is not None for r in hf):
        out.append(target("min over batch sizes of ours / transformers static throughput",
                          min(hf), 1.0))
        if first.batch_size == 1:
            out.append(target("ours / transformers static throughput at batch 1", hf[0], 1.3))
        out.append(target(f"ours / transformers static throughput at batch {last.batch_size}",
                          hf[-1], 1.5))
    if len(points) > 1:
        out.append(target(f"throughput batch {last.batch_size} / batch {first.batch_size}",
                          ratio(last.throughput_tok_s, first.throughput_tok_s), 10.0,
                          reason="" if roof_tok_s is None else
                          f"batch {last.batch_size} would need "
                          f"{10 * first.throughput_tok_s:.0f} tok/s; this host's roofline for "
                          f"the workload, prefill included, is {roof_tok_s:.0f} tok/s"))
        out.append(target(f"latency per token (ITL) batch {last.batch_size} / batch "
                          f"{first.batch_size}", ratio(last.itl_mean_s, first.itl_mean_s), 4.0,
                          higher_is_better=False))
    return out


def plot_sweep(points: list[SweepPoint], knee: Knee, path: Any) -> None:
    """Dual-axis plot: throughput (left) and latency per token (right) over batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = [p.batch_size for p in points]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(bs, [p.throughput_tok_s for p in points], "o-", color="tab:blue",
            label="pdcluster throughput")
    if all(p.roofline for p in points):
        ax.plot(bs, [p.roofline.throughput_tok_s for p in points], "--", color="tab:blue",
                alpha=0.5, label="roofline prediction")
    if all(p.hf_static and not p.hf_static.error for p in points):
        ax.plot(bs, [p.hf_static.throughput_tok_s for p in points], "s-", color="tab:green",
                label="transformers generate (static)")
    if all(p.hf_generate_batch and not p.hf_generate_batch.error for p in points):
        ax.plot(bs, [p.hf_generate_batch.throughput_tok_s for p in points], "^-",
                color="tab:olive", label="transformers generate_batch")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("batch size (max_num_seqs)")
    ax.set_ylabel("throughput (output tok/s)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(bs, [p.itl_mean_s * 1e3 for p in points], "o-", color="tab:red",
             label="pdcluster latency per token (mean ITL)")
    if all(p.hf_static and p.hf_static.itl_mean_s for p in points):
        ax2.plot(bs, [p.hf_static.itl_mean_s * 1e3 for p in points], "s--", color="tab:red",
                 alpha=0.5, label="transformers static latency per token")
    ax2.set_ylabel("latency per token (ms)", color="tab:red")
    ax.axvline(knee.batch_size, color="gray", linestyle=":", label=f"knee (batch {knee.batch_size})")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax.set_title("Batching sweep: throughput vs latency per token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point of the ``sweep`` subcommand; returns the JSON payload it wrote."""
    batch_sizes = parse_batch_sizes(args.batch_sizes)
    if args.quick:
        batch_sizes = [b for b in batch_sizes if b <= 8] or batch_sizes[:1]
    output_len = min(args.output_len, 16) if args.quick else args.output_len
    k = 1 if args.quick else args.requests_per_batch
    print("measuring ceilings...", flush=True)
    ceil = quick_ceilings() if args.quick else measure_ceilings()
    print("  " + format_ceilings(ceil), flush=True)
    cfg = model_config(args.model)
    size = meta_model_size(cfg)
    hf_model = baseline_hf.load_hf_model(args.model) if args.baseline == "transformers" else None

    tps = parse_batch_sizes(args.tp, "--tp")
    quants = parse_quantizations(args.quantization)
    points: list[SweepPoint] = []
    tp_points: list[SweepPoint] = []  # at the other TP sizes
    q_points: list[SweepPoint] = []  # in the other quantizations (first TP size)
    runs = [(tps[0], quants[0], b) for b in batch_sizes]
    runs += [(tps[0], q, b) for q in quants[1:] for b in batch_sizes]
    runs += [(t, quants[0], b) for t in tps[1:] for b in batch_sizes]
    for tp, quant, b in runs:
        n = args.num_requests or b * k
        prompts = make_prompts(n, args.prompt_len, cfg.vocab_size, seed=args.seed + b)
        print(f"batch {b}, TP {tp}, quantization {quant}: {n} requests x {output_len} tokens "
              "(engine)...", flush=True)
        if tp != tps[0] or quant != quants[0]:
            (tp_points if tp != tps[0] else q_points).append(run_engine_point(
                args.model, prompts, b, output_len, cfg.kv_bytes_per_token, args.num_threads,
                False, tp, quant))
            q = (tp_points if tp != tps[0] else q_points)[-1]
            print(f"  {q.throughput_tok_s:.1f} tok/s, TTFT {q.ttft_mean_s * 1e3:.0f} ms, decode "
                  f"step {q.decode_step_s * 1e3:.1f} ms", flush=True)
            continue
        do_profile = not args.no_profile and b in (batch_sizes[0], batch_sizes[-1])
        p = run_engine_point(args.model, prompts, b, output_len, cfg.kv_bytes_per_token, args.num_threads,
                             do_profile, tp, quant)
        p.roofline = roofline_step_time(size.weight_bytes, size.num_params, b,
                                        ceil.gemv_bytes_per_s, ceil.matmul_flops_per_s)
        print(f"  {p.throughput_tok_s:.1f} tok/s, ITL {p.itl_mean_s * 1e3:.1f} ms, decode step "
              f"{p.decode_step_s * 1e3:.1f} ms (roofline {p.roofline.step_s * 1e3:.1f} ms)",
              flush=True)
        if hf_model is not None:
            print(f"batch {b}: transformers static generate...", flush=True)
            p.hf_static = baseline_hf.run_static(hf_model, prompts, [output_len] * n, b)
            p.ratio_vs_hf_static = ratio(p.throughput_tok_s, p.hf_static.throughput_tok_s)
            print(f"  {p.hf_static.throughput_tok_s:.1f} tok/s (ours/theirs "
                  f"{p.ratio_vs_hf_static:.2f}x)", flush=True)
            print(f"batch {b}: transformers generate_batch...", flush=True)
            p.hf_generate_batch = baseline_hf.run_generate_batch(hf_model, prompts, output_len, b)
            if p.hf_generate_batch.error:
                print(f"  failed: {p.hf_generate_batch.error}", flush=True)
            else:
                p.ratio_vs_hf_generate_batch = ratio(p.throughput_tok_s,
                                                     p.hf_generate_batch.throughput_tok_s)
                print(f"  {p.hf_generate_batch.throughput_tok_s:.1f} tok/s (ours/theirs "
                      f"{p.ratio_vs_hf_generate_batch:.2f}x)", flush=True)
        points.append(p)

    floor_gemv = size.weight_bytes / ceil.gemv_bytes_per_s
    floor_copy = size.weight_bytes / ceil.copy_bytes_per_s
    knee = find_knee([p.batch_size for p in points], [p.throughput_tok_s for p in points],
                     [p.itl_mean_s for p in points])
    embed_params = cfg.vocab_size * cfg.hidden_size
    roof_tok_s = [roofline_workload_throughput(
        size.weight_bytes, size.num_params, embed_params, p.batch_size, args.prompt_len,
        output_len, ceil.gemv_bytes_per_s, ceil.matmul_flops_per_s) for p in points]
    targets = sweep_targets(points, floor_gemv, roof_tok_s[-1])
    payload = {
        "benchmark": "sweep", "machine": machine_info(), "model": args.model or "default",
        "quick": args.quick, "prompt_len": args.prompt_len, "output_len": output_len,
        "seed": args.seed, "ceilings": ceil, "num_params": size.num_params,
        "weight_bytes": size.weight_bytes,
        "floor": {"decode_step_floor_s": floor_gemv, "basis": "weight_bytes / GEMV bandwidth",
                  "decode_step_floor_copy_bw_s": floor_copy},
        "batch_1_step_over_floor": ratio(points[0].decode_step_s, floor_gemv)
        if points[0].batch_size == 1 else None,
        "knee": knee, "points": points, "targets": targets,
        "roofline_workload_tok_s": roof_tok_s,
        "tensor_parallel": _tp_comparison(points, tp_points),
        "quantization": _quant_comparison(points, q_points, ceil.gemv_bytes_per_s),
        "quantization_text_agreement": (greedy_agreement(args.model, quants, args.num_threads)
                                        if len(quants) > 1 else {}),
        "llama_cpp": (llama_cpp_comparison(args, quants, batch_sizes, output_len,
                                           points + q_points)
                      if args.llama_cpp else []),
        "llama_cpp_paired_batch_1": (paired_batch_one(args, quants, output_len, cfg.vocab_size,
                                                      cfg.kv_bytes_per_token, run_engine_point)
                                     if args.llama_cpp and 1 in batch_sizes else []),
    }
    out_json = write_json(args.out, "sweep", payload)
    plot_sweep(points, knee, out_json.with_name("sweep.png"))
    _print_table(points + q_points + tp_points)
    for row in payload["quantization"]:
        print(f"{row['quantization']} / {row['base']} at batch {row['batch_size']}: decode "
              f"{row['decode_speedup']:.2f}x faster, throughput {row['throughput_ratio']:.2f}x; "
              f"step / floor {row['step_over_floor']:.2f} (base {row['base_step_over_floor']:.2f}); "
              f"greedy (random-token prompts): {row['requests_identical']:.0%} of requests "
              f"identical, {row['tokens_before_divergence']:.0%} of tokens before the first "
              "difference")
    for quant, row in payload["quantization_text_agreement"].items():
        print(f"{quant} / {row['base']}, {row['prompts']} text prompts x 32 greedy tokens: "
              f"{row['prompts_identical']:.0%} identical, {row['tokens_before_divergence']:.0%}"
              " of tokens before the first difference")
    for row in payload["llama_cpp"]:
        print(f"{row['quantization']} / llama.cpp {row['peer']} at batch {row['batch_size']}: "
              f"decode {row['decode_tok_s']:.1f} / {row['peer_decode_tok_s']:.1f} tok/s = "
              f"{row['decode_ratio']:.2f}x")
    print_paired(payload["llama_cpp_paired_batch_1"])
    print(f"knee at batch {knee.batch_size} (gain per doubling: "
          + ", ".join(f"{g:.2f}" for g in knee.gains_per_doubling) + ")")
    print_targets(targets)
    print(f"wrote {out_json} and {out_json.with_name('sweep.png')}")
    return payload


# Text prompts for the greedy-agreement check of --quantization (random token ids, the
# timed workload's prompts, leave the model near-uniform, where any perturbation flips the
# first token: agreement there says little about text).
AGREEMENT_PROMPTS = (
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
    "List three colors:", "Explain why the sky is blue in one sentence.",
    "Translate 'good morning' into Spanish:", "The three laws of motion are",
    "import numpy as np\n\ndef normalize(v):", "Once upon a time, in a small village,",
    "Q: What is 12 times 7?\nA:", "The best way to learn a new language is",
    "Here is a short poem about autumn:", "SELECT name FROM users WHERE",
    "A good breakfast includes", "The main causes of the French Revolution were",
    "To make a cup of tea, first")


def greedy_agreement(model: str | None, quants: list[str], num_threads: int | None,
                     max_tokens: int = 32) -> dict[str, dict]:
    """Greedy tokens (``ignore_eos``) of ``AGREEMENT_PROMPTS`` under each quantization,
    against the first: per quantization the share of prompts whose tokens are all equal and
    of tokens generated before a prompt's first difference."""
    from engine import SamplingParams

    tokens = {}
    for quant in quants:
        llm = load_llm(model, max_num_seqs=len(AGREEMENT_PROMPTS), num_threads=num_threads,
                       kv_cache_memory_bytes=64 << 20, quantization=quant)
        prompts = [llm.engine.tokenizer.encode(p) for p in AGREEMENT_PROMPTS]
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                    ignore_eos=True))
        tokens[quant] = [list(o.token_ids) for o in outs]
        llm.close()
        del llm
        gc.collect()
    base = tokens[quants[0]]
    out = {}
    for quant in quants[1:]:
        same = before = 0
        for mine, theirs in zip(tokens[quant], base, strict=True):
            same += mine == theirs
            before += next((i for i, (x, y) in enumerate(zip(mine, theirs, strict=False))
                            if x != y), len(theirs))
        out[quant] = {"base": quants[0], "prompts": len(base),
                      "prompts_identical": same / len(base),
                      "tokens_before_divergence": before / sum(len(t) for t in base)}
    return out


def parse_quantizations(text: str) -> list[str]:
    """"none,int8,int4" -> the list; each one of ``engine.config.QUANTIZATION_CHOICES``, no repeats."""
    from engine.config import QUANTIZATION_CHOICES as CHOICES

    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or len(set(names)) != len(names) or any(n not in CHOICES for n in names):
        raise ValueError(f"--quantization must be distinct names from {', '.join(CHOICES)}, "
                         f"got {text!r}")
    return names


def _quant_comparison(points: list[SweepPoint], q_points: list[SweepPoint],
                      gemv_bytes_per_s: float) -> list[dict]:
    """Each other quantization against the first, batch by batch, measured in this one run:
    decode-step speed-up, throughput ratio, each one's step over its own floor (its linear
    weights' bytes / the run's GEMV bandwidth), and how far greedy outputs agree (same
    prompts, ``ignore_eos``): the share of requests whose tokens are all equal, and of
    tokens generated before a request's first difference."""
    base = {p.batch_size: p for p in points}
    rows = []
    for q in q_points:
        b = base[q.batch_size]
        same, before, total = 0, 0, 0
        for mine, theirs in zip(q.token_ids, b.token_ids, strict=True):
            agree = next((i for i, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y),
                         min(len(mine), len(theirs)))
            same += mine == theirs
            before += agree
            total += len(theirs)
        rows.append({
            "batch_size": q.batch_size, "quantization": q.quantization, "base": b.quantization,
            "decode_speedup": ratio(b.decode_step_s, q.decode_step_s),
            "throughput_ratio": ratio(q.throughput_tok_s, b.throughput_tok_s),
            "step_over_floor": ratio(q.decode_step_s, q.linear_weight_bytes / gemv_bytes_per_s),
            "base_step_over_floor": ratio(b.decode_step_s,
                                          b.linear_weight_bytes / gemv_bytes_per_s),
            "linear_weight_bytes": q.linear_weight_bytes,
            "base_linear_weight_bytes": b.linear_weight_bytes,
            "requests_identical": same / max(1, len(q.token_ids)),
            "tokens_before_divergence": before / max(1, total)})
    return rows


def _tp_comparison(points: list[SweepPoint], tp_points: list[SweepPoint]) -> list[dict]:
    """Each other TP size against the first, batch by batch: decode step and TTFT ratios
    measured in this one run."""
    base = {p.batch_size: p for p in points}
    return [{"batch_size": q.batch_size, "tp": q.tp, "base_tp": base[q.batch_size].tp,
             "decode_step_ratio": ratio(q.decode_step_s, base[q.batch_size].decode_step_s),
             "ttft_ratio": ratio(q.ttft_mean_s, base[q.batch_size].ttft_mean_s),
             "throughput_ratio": ratio(q.throughput_tok_s, base[q.batch_size].throughput_tok_s)}
            for q in tp_points]


def _print_table(points: list[SweepPoint]) -> None:
    print(f"{'TP':>2} {'quant':>5} {'batch':>5} {'tok/s':>8} {'TTFT ms':>8} {'ITL ms':>7} {'ITL p99':>7} "
          f"{'E2E p99 s':>9} {'step ms':>8} {'roof ms':>8} {'HF tok/s':>8} {'ratio':>6}  steps at threads")
    for p in points:
        hf = p.hf_static.throughput_tok_s if p.hf_static else float("nan")
        r = p.ratio_vs_hf_static if p.ratio_vs_hf_static is not None else float("nan")
        roof = p.roofline.step_s * 1e3 if p.roofline else float("nan")
        print(f"{p.tp:>2} {p.quantization:>5} {p.batch_size:>5} {p.throughput_tok_s:>8.1f} {p.ttft_mean_s * 1e3:>8.0f} "
              f"{p.itl_mean_s * 1e3:>7.1f} {p.itl_p99_s * 1e3:>7.1f} {p.e2e_p99_s:>9.2f} "
              f"{p.decode_step_s * 1e3:>8.1f} {roof:>8.1f} {hf:>8.1f} {r:>6.2f}  "
              + " ".join(f"{n}: {c}" for n, c in sorted(p.decode_threads.items(), reverse=True)))


def meta_model_size(cfg: Any) -> ModelSize:
    """Parameter count and bytes of our model, built on the meta device (no weights loaded)."""
    import torch

    from engine.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        m = LlamaForCausalLM(cfg, 16)
    return model_size(m)


def parse_batch_sizes(text: str, flag: str = "--batch-sizes") -> list[int]:
    """"1,4,8" -> [1, 4, 8]; must be positive and strictly increasing."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from e
    if not sizes or any(b <= 0 for b in sizes) or sizes != sorted(set(sizes)):
        raise ValueError(f"{flag} must be positive and strictly increasing, got {text!r}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,4,8,16,32",
                   help="comma-separated max_num_seqs values (default 1,4,8,16,32)")
    p.add_argument("--tp", default="1",
                   help="comma-separated tensor-parallel sizes (e.g. 1,2): the first runs the "
                        "whole sweep, the others each batch size beside it (default 1)")
    p.add_argument("--quantization", default="none",
                   help="comma-separated engine weight layouts (none,int8,int4): the first runs "
                        "the whole sweep, the others each batch size beside it, compared for "
                        "speed and greedy agreement (default none)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--requests-per-batch", type=int, default=2,
                   help="requests per batch size = batch size x this (default 2)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="a fixed request count for every batch size (overrides the above)")
    p.add_argument("--llama-cpp", default=None, metavar="BIN_DIR",
                   help="also run llama.cpp's llama-batched-bench from BIN_DIR (built for this "
                        "host: bench/peers/README.md) on the same weights, after the engine's "
                        "rows: F32 beside none, Q8_0 beside int8, Q4_1 (the shipped file) beside "
                        "int4 and gguf")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the torch.profiler decode-step profile at the first/last batch size")
