"""llama.cpp's rows beside the engine's in ``pdcluster bench sweep --llama-cpp BIN_DIR``: the
default model's GGUF in the type each ``--quantization`` faces, run after the engine's rows,
and the batch-1 cells again in alternating rounds (``paired_batch_one``)."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.harness.report import ratio

# Alternating rounds of each batch-1 cell, ours then llama.cpp's. Batch 1 reads every weight
# once a step, so it runs at the minute's DRAM rate, which moves by up to 2x from one minute to
# the next on these shared hosts: rows timed minutes apart (the engine's, then all of llama.cpp's)
# compared two minutes as much as two programs (Zen 5, F32 at batch 1: 1.08x, 0.90x, 0.77x over
# three runs as the runs' DRAM rate fell).
PAIRED_ROUNDS = 3

# Which of llama.cpp's GGUF types each --quantization is compared with (the same blocks where
# the engine serves the file: gguf is the shipped Q4_1; int4 is our Q4_1-like layout made from
# the fp32 weights).
LLAMA_CPP_PEERS = {"none": "F32", "int8": "Q8_0", "int4": "Q4_1", "gguf": "Q4_1"}


def llama_cpp_comparison(args, quants: list[str], batch_sizes: list[int], output_len: int,
                         points: list) -> list[dict]:
    """llama.cpp (``--llama-cpp``: its build for this host) on the default model's GGUF in each
    type that ``quants`` face (``LLAMA_CPP_PEERS``), at the same batch sizes, prompt and
    output lengths and threads, run after the engine's rows (nothing else running), one row
    per (quantization, batch): our decode tok/s (batch / decode step) against its S_TG."""
    from bench.peers import llama_cpp

    bench_bin, ggufs, threads = _peer_files(args, quants)
    peer: dict[tuple[str, int], llama_cpp.LlamaCppRow] = {}
    for label in sorted({LLAMA_CPP_PEERS[q] for q in quants}):
        print(f"llama.cpp {label}: batch sizes {batch_sizes}...", flush=True)
        for r in llama_cpp.run_batched_bench(bench_bin, ggufs[label], label, batch_sizes,
                                             args.prompt_len, output_len, threads, 1800):
            peer[(label, r.batch)] = r
    rows = []
    for p in points:
        r = peer.get((LLAMA_CPP_PEERS.get(p.quantization, ""), p.batch_size))
        if r is None or p.tp != 1:
            continue
        ours = p.batch_size / p.decode_step_s
        rows.append({"quantization": p.quantization, "peer": r.quantization,
                     "batch_size": p.batch_size, "decode_tok_s": ours,
                     "peer_decode_tok_s": r.decode_tok_s, "decode_ratio": ratio(ours, r.decode_tok_s),
                     "peer_prefill_tok_s": r.prefill_tok_s, "peer_build": r.build})
    return rows


def paired_batch_one(args, quants: list[str], output_len: int, vocab_size: int,
                     kv_bytes_per_token: int, run_engine_point) -> list[dict]:
    """Per quantization, the batch-1 decode against llama.cpp's in ``PAIRED_ROUNDS``
    alternating rounds: a fresh engine's batch-1 point (``run_engine_point``: the sweep's own,
    passed in since the sweep imports this module; one warm-up, then ``requests_per_batch``
    requests in turn; its median decode step), then llama-batched-bench at ``-npl 1``. One row per quantization: each side's median tok/s, each round's ratio, and
    the ratio of the medians (what docs/benchmarks.md reports as the paired cell)."""
    from bench.harness.workload import make_prompts
    from bench.peers import llama_cpp

    bench_bin, ggufs, threads = _peer_files(args, quants)
    prompts = make_prompts(args.requests_per_batch, args.prompt_len, vocab_size, seed=args.seed + 1)
    out = []
    for q in quants:
        label, ours, theirs, at_threads = LLAMA_CPP_PEERS[q], [], [], []
        print(f"batch 1, {q} against llama.cpp {label}: {PAIRED_ROUNDS} alternating rounds...",
              flush=True)
        for _ in range(PAIRED_ROUNDS):
            point = run_engine_point(None, prompts, 1, output_len, kv_bytes_per_token,
                                     args.num_threads, False, 1, q)
            ours.append(1 / point.decode_step_s)
            at_threads.append(point.decode_threads)
            theirs.append(llama_cpp.run_batched_bench(bench_bin, ggufs[label], label, [1],
                                                      args.prompt_len, output_len, threads,
                                                      600)[0].decode_tok_s)
        out.append({"quantization": q, "peer": label, "rounds": PAIRED_ROUNDS,
                    "decode_tok_s": statistics.median(ours),
                    "peer_decode_tok_s": statistics.median(theirs),
                    "round_ratios": [ratio(a, b) for a, b in zip(ours, theirs, strict=True)],
                    # our steps per thread count each round (the governor's drops)
                    "round_threads": at_threads,
                    "decode_ratio": ratio(statistics.median(ours), statistics.median(theirs))})
    return out


def print_paired(rows: list[dict]) -> None:
    """One line per ``paired_batch_one`` row."""
    for r in rows:
        print(f"{r['quantization']} / llama.cpp {r['peer']} at batch 1, {r['rounds']} alternating "
              f"rounds: {r['decode_tok_s']:.1f} / {r['peer_decode_tok_s']:.1f} tok/s = "
              f"{r['decode_ratio']:.2f}x (rounds " + ", ".join(f"{x:.2f}" for x in r["round_ratios"])
              + "; our steps at threads " + ", ".join(
                  " ".join(f"{n}: {c}" for n, c in sorted(t.items(), reverse=True))
                  for t in r["round_threads"]) + ")")


def _peer_files(args, quants: list[str]):
    """llama-batched-bench, the GGUF per peer type (made once, kept under ``--out``) and the
    threads both sides run with."""
    import torch

    from bench.peers import llama_cpp
    from engine.weights.resolve import default_gguf_path

    if args.model is not None:
        raise ValueError("--llama-cpp compares on the default model only (its shipped GGUF)")
    bench_bin = llama_cpp.find_binary(Path(args.llama_cpp))
    quantize_bin = llama_cpp.find_binary(Path(args.llama_cpp), "llama-quantize")
    wanted = sorted({LLAMA_CPP_PEERS[q] for q in quants} - {"Q4_1"})
    ggufs = llama_cpp.prepare_ggufs(quantize_bin, default_gguf_path(),
                                    Path(args.out or "bench/results") / "llama_cpp_models",
                                    types=wanted)
    return bench_bin, ggufs, args.num_threads or torch.get_num_threads()
