"""`pdcluster bench lora`: many LoRA adapters in one batch against the base model alone.

One engine of the model (``--model``; default: the default model as ``LLM()`` serves it) with
LoRA on. B requests at once (``--batch``, default 32; 64-token prompts, ``--output-len``
greedy tokens each, EOS ignored) run under 0 (the base alone), 1, 4 or 16 distinct adapters
(the requests spread over them in turn), at each ``--ranks`` rank. The adapters are random,
written here in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``;
``--targets``: the projections they adapt, default all seven, PEFT's "all-linear"), so no
``peft`` is needed to run it.

Per cell: decode TPOT (a request's last token time minus its first, over its tokens after
the first; the mean over the cell's requests) and output tokens per second (all output tokens
over the cell's wall time, prefill included), and their ratios to the base's. Every cell has
prompts of its own (none found in the prefix cache). The base runs
first and last (these hosts drift by 10-40% within minutes) and each ratio takes the mean of
the two. Adapter load time: ``LLMEngine.load_lora`` of one adapter not held (read, checked and
laid out), per rank. Every cell is reported, the misses too."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.engine_under_test import load_llm
from bench.harness.report import machine_info, print_targets, ratio, write_json
from bench.harness.report import target as make_target

NAME = "lora"
HELP = "LoRA adapters mixed in one batch vs the base alone: TPOT, tokens/s, load time"
ADAPTER_COUNTS = (1, 4, 16)
TARGET_RANK, TARGET_ADAPTERS, TPOT_TARGET = 16, 16, 1.3  # 16 adapters of rank 16 <= 1.3x TPOT
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT_LEN = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=None, help="requests at once (default 32; "
                   "--quick 8)")
    p.add_argument("--ranks", default=None, help="comma-separated ranks (default 8,16,64; "
                   "--quick 8)")
    p.add_argument("--adapters", default=None, help="comma-separated distinct adapter counts "
                   "(default 1,4,16; --quick 1,4)")
    p.add_argument("--output-len", type=int, default=None,
                   help="tokens each request generates (default 32; --quick 8)")
    p.add_argument("--targets", default=",".join(ALL_TARGETS),
                   help="comma-separated PEFT modules the adapters adapt (default all seven)")
    p.add_argument("--quantization", default="auto", help="the base model's --quantization "
                   "(default auto: the default model's Q4_1 blocks)")
    p.add_argument("--lora-dtype", default="auto", help="the adapters' dtype as held "
                   "(default auto: fp32 on the CPU; float16: half the bytes; int8: a quarter)")


def write_adapter(cfg, out: Path, rank: int, targets: list[str], seed: int) -> Path:
    """A random LoRA adapter of rank ``rank`` for a base of ``cfg`` (``ModelConfig``) in
    PEFT's format: A ~ N(0, 1/in), B ~ N(0, 0.02), lora_alpha = 2 rank."""
    import torch
    from safetensors.torch import save_file

    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    e, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (e, q), "k_proj": (e, kv), "v_proj": (e, kv), "o_proj": (q, e),
              "gate_proj": (e, i), "up_proj": (e, i), "down_proj": (i, e)}
    where = {m: "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
             for m in shapes}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m in targets:
            k, n = shapes[m]
            name = f"base_model.model.model.layers.{layer}.{where[m]}.{m}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, k, generator=g) / k ** 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(n, rank, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))
    return out


def _cell(llm, prompts: list[list[int]], loras: list, output_len: int) -> dict[str, Any]:
    from engine import SamplingParams

    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0,
                                                ignore_eos=True), lora_request=loras)
    wall = time.perf_counter() - t0
    tpots = [(o.metrics.token_times[-1] - o.metrics.first_token_time) / (len(o.token_ids) - 1)
             for o in outs if len(o.token_ids) > 1]
    return {"tpot_s": sum(tpots) / len(tpots), "wall_s": wall,
            "tokens_per_s": sum(len(o.token_ids) for o in outs) / wall}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every cell; writes ``lora.json``."""
    from engine import LoRARequest

    batch = args.batch or (8 if args.quick else 32)
    ranks = [int(r) for r in (args.ranks or ("8" if args.quick else "8,16,64")).split(",")]
    counts = [int(c) for c in (args.adapters or ("1,4" if args.quick else
                                                  ",".join(map(str, ADAPTER_COUNTS)))).split(",")]
    output_len = args.output_len or (8 if args.quick else 32)
    targets = [t for t in args.targets.split(",") if t]
    bad = [t for t in targets if t not in ALL_TARGETS]
    if bad or not targets:
        raise ValueError(f"--targets: choose among {', '.join(ALL_TARGETS)}, got {args.targets!r}")
    if batch < 1 or output_len < 2 or min(ranks) < 1 or min(counts) < 1:
        raise ValueError("--batch, --ranks and --adapters must be >= 1, --output-len >= 2")
    t0 = time.perf_counter()
    most = max(counts)
    llm = load_llm(args.model, max_num_seqs=batch, num_threads=args.num_threads,
                   quantization=args.quantization, enable_lora=True, max_loras=most,
                   lora_dtype=args.lora_dtype,
                   max_lora_rank=max(ranks), max_cpu_loras=most * len(ranks) + 1)
    engine = llm.engine
    cfg = engine.model_config
    g = random.Random(args.seed)

    def fresh() -> list[list[int]]:
        """New prompts for each cell: no cell finds another's in the prefix cache (an
        adapter's requests never do, since its key roots their block hashes)."""
        return [[g.randrange(10, cfg.vocab_size - 10) for _ in range(PROMPT_LEN)]
                for _ in range(batch)]

    tmp = Path(tempfile.mkdtemp(prefix="pdcluster-bench-lora-"))
    adapters: dict[int, list] = {}
    load_s: dict[int, float] = {}
    for rank in ranks:
        reqs = []
        for j in range(most):
            path = write_adapter(cfg, tmp / f"r{rank}-{j}", rank, targets, seed=1000 * rank + j)
            reqs.append(LoRARequest(f"r{rank}-{j}", len(load_s) * 1000 + j + 1, str(path)))
        t1 = time.perf_counter()
        engine.load_lora(reqs[0])  # one adapter not held: read, checked, laid out
        load_s[rank] = time.perf_counter() - t1
        adapters[rank] = reqs
    _cell(llm, fresh()[:2], [None, None], 4)  # the first forward's one-off costs, untimed
    for rank in ranks:  # and each rank's adapters read once
        _cell(llm, fresh()[:most], adapters[rank][:most], 2)
    base_first = _cell(llm, fresh(), [None] * batch, output_len)
    cells = []
    for rank in ranks:
        for n in counts:
            loras = [adapters[rank][i % n] for i in range(batch)]
            on = _cell(llm, fresh(), loras, output_len)
            cells.append({"rank": rank, "adapters": n, **on})
            print(f"rank {rank:3d}, {n:2d} adapters: TPOT {on['tpot_s'] * 1e3:.1f} ms, "
                  f"{on['tokens_per_s']:.1f} tok/s", flush=True)
    base_last = _cell(llm, fresh(), [None] * batch, output_len)
    base = {k: (base_first[k] + base_last[k]) / 2 for k in ("tpot_s", "tokens_per_s")}
    print(f"base alone: TPOT {base_first['tpot_s'] * 1e3:.1f} / {base_last['tpot_s'] * 1e3:.1f} "
          f"ms (first / last), {base['tokens_per_s']:.1f} tok/s", flush=True)
    for c in cells:
        c["tpot_over_base"] = ratio(c["tpot_s"], base["tpot_s"])
        c["throughput_over_base"] = ratio(c["tokens_per_s"], base["tokens_per_s"])
        print(f"rank {c['rank']:3d}, {c['adapters']:2d} adapters: TPOT "
              f"{c['tpot_over_base']:.2f}x the base's, tokens/s "
              f"{c['throughput_over_base']:.2f}x", flush=True)
    for rank, s in load_s.items():
        print(f"adapter load, rank {rank}: {s * 1e3:.0f} ms", flush=True)
    llm.close()
    key = next((c["tpot_over_base"] for c in cells
                if (c["rank"], c["adapters"]) == (TARGET_RANK, TARGET_ADAPTERS)), None)
    targets_out = [make_target(f"batch {batch}: TPOT with {TARGET_ADAPTERS} adapters of rank "
                               f"{TARGET_RANK} / the base's", key, TPOT_TARGET, higher_is_better=False,
                               reason="" if key is not None else "cell not measured")]
    result = {"benchmark": NAME,
              "config": {"model": args.model or "default", "quantization": args.quantization,
                         "lora_dtype": args.lora_dtype, "batch": batch, "ranks": ranks, "adapters": counts,
                         "output_len": output_len, "prompt_len": PROMPT_LEN,
                         "targets": targets, "num_threads": args.num_threads},
              "base": {"first": base_first, "last": base_last, **base},
              "cells": cells, "load_s": {str(k): v for k, v in load_s.items()},
              "targets": targets_out, "wall_s": time.perf_counter() - t0,
              "machine": machine_info()}
    path = write_json(Path(args.out), NAME, result)
    print_targets(targets_out)
    print(f"wrote {path}")
    return result
