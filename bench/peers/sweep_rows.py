"""llama.cpp's rows beside the engine's in ``pdcluster bench sweep --llama-cpp BIN_DIR``: the
default model's GGUF in the type each ``--quantization`` faces, run after the engine's rows."""

from __future__ import annotations

from pathlib import Path

from bench.harness.report import ratio

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
    threads = args.num_threads or torch.get_num_threads()
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
