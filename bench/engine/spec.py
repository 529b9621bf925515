"""`pdcluster bench spec`: speculative decoding against none, one run, every cell reported.

Two engines of the same model (``--model``; default: the default model as ``LLM()`` serves
it), one without speculation and one per method, serve two workloads at batch 1 / 4 / 16 / 32
(B chat requests at once, greedy, each stopping at its end-of-sequence or ``--output-len``):

- **rewrite**: "rewrite / edit this paragraph" prompts, whose answers repeat much of their
  input (what prompt-lookup drafts are for);
- **chat**: free questions, whose answers rarely repeat their input.

Per cell: the time per output token (TPOT: a request's last token time minus its first, over
its tokens after the first; the mean over the cell's requests), output tokens per second (all
the cell's output tokens over its wall time, prefill included), how many of the greedy streams
equal those without speculation (the fewer of the two rounds' counts; every engine has run the
cell's prompts once before, so every round finds them in its prefix cache), the drafts proposed and accepted, and the mean accepted length
(tokens per verifying sequence-step, the step's own token included). Each cell runs in the
order off, method, method, off (these hosts drift by 10-40% within minutes; a drift then weighs
on both alike) and each figure is the mean of its two rounds. Methods: ``ngram`` and
``self_draft`` (the served model's weights in int4), and ``draft_model`` with ``--draft-model``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench.harness.engine_under_test import load_llm
from bench.harness.report import machine_info, print_targets, ratio, write_json
from bench.harness.report import target as make_target

NAME = "spec"
HELP = "speculative decoding vs none: TPOT, tokens/s, acceptance by batch and workload"
BATCHES = (1, 4, 16, 32)
METHODS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
           "self_draft": {"method": "self_draft", "num_speculative_tokens": 4}}
# draft_model needs a smaller model sharing the served model's tokenizer: none ships beside
# the default model (a --draft-model adds the method)
REWRITE_B1_TARGET = 2.0  # TPOT off / ngram at batch 1 on the rewrite workload
CHAT_B1_TARGET = 1.3  # ... on free chat, by a draft model or self-draft
FLOOR_TARGET = 1.0  # every cell: speculation never slower

PARAGRAPHS = (
    "The color of the theater curtains was analyzed by the organization's program director, "
    "who realized that the gray fabric had been favored by the neighbors for many years.",
    "Our quarterly report shows that revenue grew by twelve percent while costs stayed flat, "
    "and the team expects the same trend to continue through the end of the year.",
    "To install the package, download the archive, unpack it into a new folder, and run the "
    "setup script from that folder; the script checks every dependency before it starts.",
    "The committee met on Tuesday to review the proposal. After a long discussion, the members "
    "agreed to postpone the vote until the budget numbers had been checked by the auditors.",
    "def add_numbers(a, b):\n    result = a + b\n    return result\n\n"
    "def multiply_numbers(a, b):\n    result = a * b\n    return result\n",
    "Please remember that the library closes at six o'clock on weekdays and at noon on "
    "Saturdays, and that all borrowed books must be returned before the closing time.",
)
EDITS = ("Rewrite the following text with British spelling, changing nothing else:",
         "Fix any typos in the following text and return it in full:",
         "Repeat the following text exactly, then stop:",
         "Rewrite the following text, replacing the word 'the' with 'THE':")
QUESTIONS = (
    "Why is the sky blue?", "Write a short poem about the sea.",
    "What are three tips for learning a new language?", "Explain how a bicycle works.",
    "Tell me a fun fact about octopuses.", "What should I cook for dinner tonight?",
    "Describe a sunset in a few sentences.", "How do plants make food?",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated batch sizes (default 1,4,16,32; --quick 1,4)")
    p.add_argument("--output-len", type=int, default=None,
                   help="most tokens a request generates (default 96; --quick 32)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="drafts per step at most, for every method (default 4)")
    p.add_argument("--quantization", default="auto",
                   help="the served model's --quantization (default auto: the default model's "
                        "Q4_1 blocks; none: fp32, where a 4-bit self-draft is 4-7x cheaper)")
    p.add_argument("--methods", default="ngram,self_draft",
                   help="comma-separated methods to measure (default ngram,self_draft; "
                        "draft_model comes with --draft-model)")
    p.add_argument("--workloads", default="rewrite,chat",
                   help="comma-separated workloads to measure (default rewrite,chat)")
    p.add_argument("--draft-model", default=None,
                   help="also measure method draft_model with this draft (a directory or GGUF "
                        "sharing the served model's tokenizer)")


def workload(kind: str, n: int) -> list[list[dict]]:
    """``n`` chat conversations of ``kind`` (rewrite | chat), cycling its prompts."""
    if kind == "rewrite":
        texts = [f"{EDITS[i % len(EDITS)]}\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}"
                 for i in range(n)]
    else:
        texts = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    return [[{"role": "user", "content": t}] for t in texts]


def _cell(llm, convs: list[list[dict]], output_len: int) -> dict[str, Any]:
    from engine import SamplingParams

    spec = llm.engine.spec
    before = spec.stats.snapshot() if spec is not None else None
    t0 = time.perf_counter()
    outs = llm.chat(convs, SamplingParams(max_tokens=output_len, temperature=0))
    wall = time.perf_counter() - t0
    tpots = [(o.metrics.token_times[-1] - o.metrics.first_token_time) / (len(o.token_ids) - 1)
             for o in outs if len(o.token_ids) > 1]
    out = {"tpot_s": sum(tpots) / len(tpots) if tpots else None,
           "tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
           "output_tokens": sum(len(o.token_ids) for o in outs), "wall_s": wall,
           "token_ids": [list(o.token_ids) for o in outs]}
    if spec is not None:
        after = spec.stats.snapshot()
        d = {k: after[k] - before[k] for k in ("proposed", "accepted", "verified_seqs", "emitted")}
        out.update(d)
        out["acceptance_rate"] = d["accepted"] / d["proposed"] if d["proposed"] else None
        out["mean_accepted_length"] = (d["emitted"] / d["verified_seqs"]
                                       if d["verified_seqs"] else None)
    return out


def _mean(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rounds[1])
    for key in ("tpot_s", "tokens_per_s"):
        vals = [r[key] for r in rounds if r[key] is not None]
        out[key] = sum(vals) / len(vals) if vals else None
    for key in ("proposed", "accepted", "verified_seqs", "emitted", "output_tokens"):
        if key in out:
            out[key] = sum(r[key] for r in rounds)
    if "proposed" in out:
        out["acceptance_rate"] = out["accepted"] / out["proposed"] if out["proposed"] else None
        out["mean_accepted_length"] = (out["emitted"] / out["verified_seqs"]
                                       if out["verified_seqs"] else None)
    out["rounds"] = [{k: v for k, v in r.items() if k != "token_ids"} for r in rounds]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every cell, both workloads; writes ``spec.json``."""
    batches = [int(b) for b in (args.batch_sizes or ("1,4" if args.quick else
                                                       ",".join(map(str, BATCHES)))).split(",")]
    output_len = args.output_len or (32 if args.quick else 96)
    if min(batches) <= 0 or output_len <= 1:
        raise ValueError("batch sizes must be > 0 and --output-len > 1")
    k = args.num_speculative_tokens
    t0 = time.perf_counter()
    # Threads pinned: each engine's thread governor (engine/runtime/cpu_threads.py) keeps its
    # own count, and one that a neighbour's burst moved to 1 thread stays there for a while,
    # so the two engines of a cell would differ by their governors, not by speculation.
    kw = dict(max_num_seqs=max(batches), num_threads=args.num_threads,
              quantization=args.quantization, adaptive_threads=False)
    kinds = [w for w in args.workloads.split(",") if w]
    if not kinds or any(w not in ("rewrite", "chat") for w in kinds):
        raise ValueError(f"--workloads: choose among rewrite, chat, got {args.workloads!r}")
    names = [m for m in args.methods.split(",") if m]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise ValueError(f"--methods: choose among {', '.join(METHODS)}, got {args.methods!r}")
    methods = {m: METHODS[m] for m in names}
    if args.draft_model:
        methods["draft_model"] = {"method": "draft_model", "model": args.draft_model}
    base = load_llm(args.model, **kw)
    engines = {m: load_llm(args.model, speculative_config={**c, "num_speculative_tokens": k},
                           **kw) for m, c in methods.items()}
    for llm in (base, *engines.values()):  # the first forward's one-off costs, untimed
        _cell(llm, workload("chat", 2), 4)
    cells: list[dict[str, Any]] = []
    for kind in kinds:
        for b in batches:
            convs = workload(kind, b)
            # every engine warm for the cell's prompts first (their prefill cached alike):
            # rounds then compare runs with the same prefix-cache state, whatever the order
            # (a prefix hit computes a prompt's first token from a shorter chunk, which can
            # flip a near-tie)
            for llm in (base, *engines.values()):
                _cell(llm, convs, 1)
            for method, llm in engines.items():
                off_r, on_r = [], []
                for who in ("off", "on", "on", "off"):  # ABBA (module docstring)
                    (off_r if who == "off" else on_r).append(
                        _cell(base if who == "off" else llm, convs, output_len))
                off, on = _mean(off_r), _mean(on_r)
                same = min(sum(a == b for a, b in zip(x["token_ids"], y["token_ids"],
                                                      strict=True))
                           for x, y in zip(off_r, on_r, strict=True))
                cell = {"workload": kind, "batch": b, "method": method,
                        "off": {x: y for x, y in off.items() if x != "token_ids"},
                        "on": {x: y for x, y in on.items() if x != "token_ids"},
                        "tpot_speedup": ratio(off["tpot_s"], on["tpot_s"]),
                        "throughput_speedup": ratio(on["tokens_per_s"], off["tokens_per_s"]),
                        "identical_streams": same, "streams": b}
                cells.append(cell)
                print(f"{kind:7s} b{b:<3d} {method}: TPOT {off['tpot_s'] * 1e3:.1f} -> "
                      f"{on['tpot_s'] * 1e3:.1f} ms ({cell['tpot_speedup']:.2f}x), tok/s "
                      f"{off['tokens_per_s']:.1f} -> {on['tokens_per_s']:.1f} "
                      f"({cell['throughput_speedup']:.2f}x), acceptance "
                      f"{_fmt(on['acceptance_rate'])}, mean accepted length "
                      f"{_fmt(on['mean_accepted_length'])}, {same}/{b} streams identical",
                      flush=True)
    for llm in (base, *engines.values()):
        llm.close()

    def at(kind: str, b: int, method: str, key: str = "tpot_speedup"):
        return next((c[key] for c in cells if (c["workload"], c["batch"], c["method"])
                     == (kind, b, method)), None)

    floor = min((min(c["tpot_speedup"] or 0, c["throughput_speedup"] or 0) for c in cells),
                default=None)
    chat = [v for m in ("self_draft", "draft_model") if (v := at("chat", 1, m)) is not None]
    targets = [
        make_target("rewrite, batch 1: TPOT off / ngram", at("rewrite", 1, "ngram"),
                    REWRITE_B1_TARGET),
        make_target("chat, batch 1: TPOT off / the better of draft_model and self_draft",
                    max(chat, default=None), CHAT_B1_TARGET,
                    reason="" if chat else "batch 1 not measured"),
        make_target("every cell: min of TPOT and tokens/s speedups (never slower)", floor,
                    FLOOR_TARGET),
    ]
    result = {"benchmark": NAME,
              "config": {"model": args.model or "default", "quantization": args.quantization,
                         "adaptive_threads": False,
                         "batches": batches, "workloads": kinds, "output_len": output_len,
                         "num_speculative_tokens": k,
                         "methods": {m: {**c, "num_speculative_tokens": k}
                                     for m, c in methods.items()},
                         "num_threads": args.num_threads},
              "cells": cells, "targets": targets, "wall_s": time.perf_counter() - t0,
              "machine": machine_info()}
    path = write_json(Path(args.out), NAME, result)
    print_targets(targets)
    print(f"wrote {path}")
    return result


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
