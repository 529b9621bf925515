"""`pdcluster bench prefix` without ``--sweep``: routing policies on two prefix-heavy chat
workloads, 2 prefill + 2 decode.

Two seeded workloads, each run once per routing policy (``kv_aware``, ``load``,
``round_robin``) on a fresh cluster of the same shape, in one invocation:

- ``multi_turn``: ``--conversations`` chats run concurrently; each opens with its own
  ``--doc-len``-token context (a pasted document) and goes on for ``--turns`` turns; turn t's
  prompt is the whole conversation so far (every earlier prompt and answer) plus a new
  ``--user-len``-token message. Each chat sends its next turn a seeded random 0 to
  ``--think-s`` seconds after the last answer ends (users do not type in lockstep).
- ``shared_prefix``: ``--system-prompts`` system prompts of ``--system-len`` tokens shared by
  ``--users`` requests (system prompt + a ``--question-len``-token question), at most
  ``--concurrency`` in flight, in a seeded random order.

Every worker's KV pool holds ``--cache-fraction`` (default 0.6) of the workload's working
set (every distinct prompt token it will see): enough for a worker's share when each prefix
stays on one worker (half of it, plus the requests running), not enough for all of it,
which is what each worker needs when requests land anywhere. That is the regime
prefix-heavy serving lives in; with pools larger than the working set every policy finds
everything everywhere and routing stops mattering. (With 2 decode workers, round_robin
still lands a conversation's next turn on the worker that served its last one about half
the time: that sets how far apart the policies can get.)

Per run: TTFT p50/p99 (client side), ITL p99, prompt tokens computed by the workers, KV bytes
moved prefill -> decode, and hit rates (prompt tokens served from a prefix cache, decode and
prefill side). Targets (``multi_turn``): kv_aware vs round_robin TTFT p50 >= 3x better and
KV bytes moved >= 3x fewer. Each worker is pinned to one core with one torch thread
(prefill-i and decode-i share core i), the same for every policy.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.cluster.prefix.runs import (
    POLICIES,
    PolicyRun,
    Request,
    Shape,
    check_prefill_chunk,
    cluster_config,
    generate,
    names,
    pool_tokens,
    run_on_cluster,
    send_all,
    summary,
    tokens,
    working_set,
)
from bench.cluster.ttft_breakdown import ray_session
from bench.harness.engine_under_test import model_config
from bench.harness.report import machine_info, print_targets, ratio, write_json
from bench.harness.report import target as make_target

NAME = "prefix"  # the benchmark's name and its results: prefix.json, prefix.png
WORKLOADS = ("multi_turn", "shared_prefix")
TTFT_TARGET = 3.0  # round_robin TTFT p50 / kv_aware TTFT p50, multi_turn
BYTES_TARGET = 3.0  # round_robin KV bytes moved / kv_aware, multi_turn


def _shape(args: argparse.Namespace) -> Shape:
    q = args.quick
    s = Shape(args.conversations or (4 if q else 8), args.turns or (3 if q else 12),
              args.doc_len or (128 if q else 512), args.user_len, _given(args.output_len, 16),
              args.system_prompts or (3 if q else 8), args.system_len or (192 if q else 1024),
              args.users or (8 if q else 40), _given(args.question_len, 48), args.concurrency,
              args.cache_fraction, args.think_s)
    for name, v in asdict(s).items():
        if v < 0 or (v == 0 and name != "think_s"):
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v}")
    if s.cache_fraction > 4:
        raise ValueError(f"--cache-fraction must be <= 4, got {s.cache_fraction}")
    return s


def _given(value: int | None, default: int) -> int:
    return default if value is None else value


# ---- workloads ----------------------------------------------------------------------------------
async def _multi_turn(cluster, s: Shape, vocab: int, seed: int, tag: str) -> list[Request]:
    rng = random.Random(seed)
    docs = [tokens(rng, s.doc_len, vocab) for _ in range(s.conversations)]
    messages = [[tokens(rng, s.user_len, vocab) for _ in range(s.turns)]
                for _ in range(s.conversations)]

    pauses = [[rng.uniform(0, s.think_s) for _ in range(s.turns)] for _ in range(s.conversations)]

    async def chat(c: int) -> list[Request]:
        out, prompt = [], docs[c]
        for t in range(s.turns):
            await asyncio.sleep(pauses[c][t])
            req, answer = await generate(cluster, prompt, s.output_len, f"{tag}-c{c}-t{t}", t)
            out.append(req)
            prompt = prompt + answer + messages[c][t]
        return out

    per_chat = await asyncio.gather(*(chat(c) for c in range(s.conversations)))
    return [r for chat_reqs in per_chat for r in chat_reqs]


async def _shared_prefix(cluster, s: Shape, vocab: int, seed: int, tag: str) -> list[Request]:
    rng = random.Random(seed)
    systems = [tokens(rng, s.system_len, vocab) for _ in range(s.system_prompts)]
    prompts = [systems[rng.randrange(s.system_prompts)] + tokens(rng, s.question_len, vocab)
               for _ in range(s.users)]
    return await send_all(cluster, prompts, s.concurrency, s.output_len, tag)


async def _run_policy(model: str | None, workload: str, policy: str, s: Shape, vocab: int,
                      seed: int, pool_bytes: int, max_len: int,
                      prefill_chunk: int | None) -> PolicyRun:
    body = _multi_turn if workload == "multi_turn" else _shared_prefix
    config = cluster_config(model, policy, pool_bytes, max_len, prefill_chunk=prefill_chunk)
    return await run_on_cluster(config, workload,
                                 policy, vocab, seed,
                                 lambda cluster, tag: body(cluster, s, vocab, seed, tag))


def run_workloads(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (workload, policy) on one Ray; write ``prefix.json`` and ``prefix.png``."""
    check_prefill_chunk(args.prefill_chunk)
    s = _shape(args)
    policies = names(args.policies, POLICIES, "--policies")
    workloads = names(args.workloads, WORKLOADS, "--workloads")
    cfg = model_config(args.model)
    vocab, per_token = cfg.vocab_size, cfg.kv_bytes_per_token
    t_start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    sizing: dict[str, Any] = {}
    with ray_session(num_workers=4):
        for k, workload in enumerate(workloads):
            working, longest = working_set(workload, s)
            pool = pool_tokens(s.cache_fraction, working, longest)
            sizing[workload] = {"working_set_tokens": working, "pool_tokens": pool}
            results[workload] = {}
            for policy in policies:  # the same seed: every policy sees the same requests
                r = asyncio.run(_run_policy(args.model, workload, policy, s, vocab,
                                            args.seed + 1000 * k, pool * per_token,
                                            longest + 16, args.prefill_chunk))
                results[workload][policy] = summary(r)
                print(f"  {workload}/{policy}: done ({time.perf_counter() - t_start:.0f} s)")
    mt = results.get("multi_turn", {})
    ratios = {
        "multi_turn_ttft_p50_round_robin_over_kv_aware": ratio(
            mt.get("round_robin", {}).get("ttft_p50_s"), mt.get("kv_aware", {}).get("ttft_p50_s")),
        "multi_turn_kv_bytes_round_robin_over_kv_aware": ratio(
            mt.get("round_robin", {}).get("kv_bytes_moved"),
            mt.get("kv_aware", {}).get("kv_bytes_moved")),
    }
    sp = results.get("shared_prefix", {})
    ratios["shared_prefix_ttft_p50_round_robin_over_kv_aware"] = ratio(
        sp.get("round_robin", {}).get("ttft_p50_s"), sp.get("kv_aware", {}).get("ttft_p50_s"))
    targets = [
        make_target("multi_turn TTFT p50 round_robin / kv_aware",
                    ratios["multi_turn_ttft_p50_round_robin_over_kv_aware"], TTFT_TARGET),
        make_target("multi_turn KV bytes moved round_robin / kv_aware",
                    ratios["multi_turn_kv_bytes_round_robin_over_kv_aware"], BYTES_TARGET),
    ]
    result = {
        "benchmark": NAME,
        "config": {"model": args.model or "default", **asdict(s), "seed": args.seed,
                   "shape": "2 prefill + 2 decode, block size 16; prefill-i and decode-i "
                            "pinned to core i, 1 torch thread each",
                   "pools": sizing},
        "results": results,
        "ratios": ratios,
        "targets": targets,
        "wall_s": time.perf_counter() - t_start,
        "machine": machine_info(),
    }
    path = write_json(Path(args.out), NAME, result)
    _plot(results, Path(args.out) / f"{NAME}.png")
    for workload, by_policy in results.items():
        for policy, m in by_policy.items():
            print(f"  {workload:13s} {policy:11s} TTFT p50 {m['ttft_p50_s'] * 1e3:7.0f} ms "
                  f"p99 {m['ttft_p99_s'] * 1e3:7.0f} ms  ITL p99 {m['itl_p99_s'] * 1e3:6.0f} ms"
                  f"  computed {m['computed_prompt_tokens']:7d}/{m['prompt_tokens']} tok"
                  f"  KV moved {m['kv_bytes_moved'] / 1e6:8.1f} MB  hit decode "
                  f"{m['decode_hit_rate']:.0%} prefill {m['prefill_hit_rate']:.0%}")
    print_targets(targets)
    print(f"wrote {path}")
    return result


def _plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Per workload: TTFT p50 / p99 and KV moved, one bar per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(9, 2.6 * len(results) + 0.4),
                             squeeze=False)
    for row, (workload, by_policy) in zip(axes, results.items(), strict=True):
        names = list(by_policy)
        xs = range(len(names))
        p50 = [by_policy[n]["ttft_p50_s"] for n in names]
        p99 = [by_policy[n]["ttft_p99_s"] for n in names]
        row[0].bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
        row[0].bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
        row[0].set_ylabel("TTFT (s)")
        row[0].legend(fontsize=7)
        row[1].bar(xs, [by_policy[n]["kv_bytes_moved"] / 1e6 for n in names], color="#55a868")
        row[1].set_ylabel("KV moved (MB)")
        for ax in row:
            ax.set_xticks(list(xs), names, fontsize=8)
            ax.set_title(workload, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
